"""hapd.parallelize returns a pipeline when the search picks one, with ParallelModule's
surface: a train_gpt2-style loop (hapd.loader, AdamW, clipping, accumulation over two
batches) on 2 hosts x (1 + 2) uneven ranks equals the single-device loop step by step,
and its checkpoints load under an SPMD plan on another world size, and the reverse."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hapd
from _dist import run_ranks
from hapd.models.zoo import TextConfig, build_gpt2
from hapd.profile.schema import Link, estimated_profile

pytestmark = pytest.mark.timeout(600)

BATCH = 8
SAMPLES = 96  # twelve global batches: six steps of two, one epoch
LR = 3e-3


def _profile(world: int):
    """Host a (one fast rank) and host b (the others) behind a slow link: a pipeline
    beats every SPMD plan (world 3); world 2: one host of two."""
    if world == 3:
        hosts, flops = ["a", "b", "b"], [2e10, 1e10, 1e10]
    else:
        hosts, flops = ["a"] * world, [2e10] + [1e10] * (world - 1)
    profile = estimated_profile(world, flops=flops, hosts=hosts, alpha=1e-5, beta=1e6)
    links = {n: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name=f"two-hosts-{world}")


def _model():
    torch.manual_seed(0)
    config = dataclasses.replace(TextConfig.tiny(), dropout=0.0)
    return build_gpt2(config), config


def _dataset(config):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab, (SAMPLES, config.seq), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100  # a mean over counted targets: the last position of each row ignored
    return torch.utils.data.TensorDataset(ids, labels)


def _loop(module, optimizer, batches, steps: int, global_loss) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(2):  # accumulation over two batches
            ids, labels = next(batches)
            loss = module(ids, labels)
            (loss / 2).backward()
            total += global_loss(loss) / 2
        module.clip_grad_norm_(0.5)
        optimizer.step()
        losses.append(total)
    return losses


def _single_device(steps: int) -> list[float]:
    model, config = _model()
    data = _dataset(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    batches = iter(loader)

    class _Clip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *a):
            return self.inner(*a)

        def clip_grad_norm_(self, n):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), n)

    return _loop(_Clip(), optimizer, batches, steps, lambda t: float(t.detach()))


def _rank(rank: int, world: int, technique: str, steps: int, load: str | None, save: str | None):
    from hapd.runtime.pipeline_module import PipelineModule

    model, config = _model()
    data = _dataset(config)
    example = tuple(t[:BATCH] for t in data.tensors)
    options = None if technique == "pipeline" else {"pipeline": "off"}
    module = hapd.parallelize(model, example, profile=_profile(world), options=options, use_daemon=False,
                              verbose=False)
    assert isinstance(module, PipelineModule) == (technique == "pipeline"), type(module).__name__
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    loader = hapd.loader(data, module, shuffle=False)
    if load is not None:
        hapd.load_checkpoint(load, module, optimizer, sampler=loader)
    batches = iter(loader)  # from the loaded position on a resume
    losses = _loop(module, optimizer, batches, steps, module.global_loss)
    if save is not None:
        hapd.save_checkpoint(save, module, optimizer, sampler=loader, step=steps)
    state = module.full_state_dict()
    return {"losses": losses, "technique": technique, "stage": getattr(module, "stage_index", None),
            "norm": float(sum(v.double().square().sum() for v in state.values()))}


def test_a_pipelined_training_loop_is_the_single_device_one_and_resumes_under_spmd(tmp_path):
    reference = _single_device(6)
    ckpt = str(tmp_path / "pipe")
    first = run_ranks(3, _rank, "pipeline", 3, None, ckpt, timeout=500)
    assert sorted(r["stage"] for r in first) == [0, 1, 1]  # host a one stage, host b the other
    for r in first:
        assert r["losses"] == pytest.approx(reference[:3], abs=1e-5)
    # the checkpoint of the pipeline, resumed under an SPMD plan on 2 ranks of one host
    second = run_ranks(2, _rank, "spmd", 3, ckpt, str(tmp_path / "spmd"), timeout=500)
    for r in second:
        assert r["losses"] == pytest.approx(reference[3:6], abs=1e-5)
