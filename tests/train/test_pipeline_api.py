"""hapd.parallelize returns a pipeline when the search picks one, with ParallelModule's
surface: a train_gpt2-style loop (hapd.loader, AdamW, clipping, accumulation over two
batches) on 2 hosts x (1 + 2) uneven ranks equals the single-device loop step by step
for 10 steps, and its checkpoint resumes under an SPMD plan on the same ranks for 10
more (tests/examples/test_example.py resumes an SPMD checkpoint as a pipeline on another world
size)."""

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
SAMPLES = 320  # forty global batches: twenty steps of two, one epoch
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


def _single_device(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, config = _model()
    data = _dataset(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False))

    class _Clipped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *a):
            return self.inner(*a)

        def clip_grad_norm_(self, n):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), n)

    losses = _loop(_Clipped(), optimizer, batches, steps, lambda t: float(t.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, world: int, technique: str, steps: int, load: str | None, save: str | None):
    from hapd.train.pipeline_module import PipelineModule

    model, config = _model()
    data = _dataset(config)
    example = tuple(t[:BATCH] for t in data.tensors)
    options = {"pipeline": None, "spmd": {"pipeline": "off"}, "overlap": {"overlap": True}}[technique]
    module = hapd.parallelize(model, example, profile=_profile(world), options=options, use_daemon=False,
                              verbose=False,
                              overlap="always" if technique == "overlap" else "auto")
    assert isinstance(module, PipelineModule) == (technique == "pipeline"), type(module).__name__
    if technique == "overlap":
        assert module.inner.hapd_duplicas == 2  # two interleaved duplicas of half the batch
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    loader = hapd.loader(data, module, shuffle=False)
    if load is not None:
        hapd.load_checkpoint(load, module, optimizer, sampler=loader)
    batches = iter(loader)  # from the loaded position on a resume
    losses = _loop(module, optimizer, batches, steps, module.global_loss)
    if save is not None:
        hapd.save_checkpoint(save, module, optimizer, sampler=loader, step=steps)
    return {"losses": losses, "stage": getattr(module, "stage_index", None), "state": {k: v.numpy() for k, v in module.full_state_dict().items()}}  # tensors do not outlive the rank


def test_a_pipelined_loop_is_the_single_device_one_and_resumes_under_spmd(tmp_path):
    reference, final = _single_device(20)
    pipe = str(tmp_path / "pipe")
    # steps 1-10: the pipeline the search picks on 2 hosts x (1 + 2) ranks
    first = run_ranks(3, _rank, "pipeline", 10, None, pipe, timeout=500)
    assert sorted(r["stage"] for r in first) == [0, 1, 1]  # host a one stage, host b the other
    # steps 11-20: an SPMD plan on the same ranks, from the pipeline's checkpoint
    second = run_ranks(3, _rank, "spmd", 10, pipe, None, timeout=500)
    for results, steps in ((first, reference[:10]), (second, reference[10:])):
        for r in results:
            assert r["losses"] == pytest.approx(steps, abs=1e-5)
    for r in first + second:
        assert sorted(r["state"]) == sorted(final)  # the single-device names, tied lm_head.weight included
    for key, value in final.items():
        assert (first[0]["state"][key] == first[2]["state"][key]).all()  # every rank gets the whole dict
        # after 20 AdamW steps: Adam's normalized updates carry rounding differences of the
        # gradients (1e-8) into the weights at up to lr-sized steps where a gradient is near 0
        assert (torch.from_numpy(second[0]["state"][key]) - value).abs().max() <= 5e-5, key


def test_an_overlapped_loop_is_the_single_device_one_and_resumes_under_spmd(tmp_path):
    """The same loop on two interleaved duplicas (overlap), and its checkpoint resumed by
    an SPMD plan."""
    reference, _ = _single_device(4)
    ckpt = str(tmp_path / "overlap")
    first = run_ranks(2, _rank, "overlap", 2, None, ckpt, timeout=500)
    second = run_ranks(2, _rank, "spmd", 2, ckpt, None, timeout=500)
    for results, steps in ((first, reference[:2]), (second, reference[2:])):
        for r in results:
            assert r["losses"] == pytest.approx(steps, abs=1e-5)
