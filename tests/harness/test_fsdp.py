"""The FSDP baseline (hapd/harness/fsdp.py): its units, its flags, and its training on 2
Gloo ranks against single-device training of the same model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist import run_ranks
from _exact import relative_norm
from hapd import models
from hapd.harness import fsdp
from hapd.harness.training import TrainArgs, local_batch, parse_train_args, train
from hapd.spmd.distributed import init_distributed
from hapd.state.weights import init_on_meta, materialize, module_init

MODEL, BATCH, LR = "llama_block", 8, 1e-3
LENGTHS = [5, 3]
"""An uneven split of the batch: FSDP's gradient must still be the global batch's."""


def _args() -> TrainArgs:
    return TrainArgs(model=MODEL, batch=BATCH, lr=LR)


def _single_device(init: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses of two full-batch iterations on one device (the second after one Adam
    step), the first one's gradients and the parameters after both, with the weights
    ``--init`` gives."""
    args = _args()
    if init == "eager":
        model, config = args.build()
    else:
        with init_on_meta():
            model, config = args.build()
        materialize(model, module_init(model, args.seed, init=models.module_init_of(model)))
    inputs = models.get(MODEL).example_inputs(config, BATCH)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fsdp_rank(rank: int, world: int) -> dict[str, tuple[list[float], dict[str, Any], dict[str, Any]]]:
    """Per ``--init``: the global loss of two FSDP iterations on ``LENGTHS``, the first
    one's gradients and every parameter after both, gathered whole (as numpy arrays:
    pickled by value, not as shared memory the exiting rank would take with it)."""
    env = init_distributed()  # joins run_ranks's group
    out = {}
    for init in ("eager", "meta"):
        args = _args()
        model, config = fsdp.build(args, init, env)
        inputs = local_batch(models.get(MODEL), config, LENGTHS, rank, 0, env.device, torch.float32)
        step = fsdp.FSDPStep(model, inputs, world)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        step()  # the first iteration by hand, to see its gradients (Adam's step hides their scale)
        grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
        optimizer.step()
        losses = [step.last_loss]
        train(step, optimizer, env, iterations=1, warmup=0)
        losses.append(step.last_loss)
        totals = torch.stack(losses).reshape(2)
        torch.distributed.all_reduce(totals)
        out[init] = (totals.tolist(), grads, {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()})
    return out


@pytest.mark.distributed
def test_fsdp_trains_as_one_device():
    """FULL_SHARD on 2 Gloo ranks, the batch split [5, 3]: the loss before and after one
    Adam step, the first gradients and every parameter after two steps equal
    single-device training's (relative
    error ≤ 1e-5), with the whole model built on each rank and with each rank
    initializing only its shards from the meta device."""
    results = run_ranks(2, _fsdp_rank, timeout=180)
    for init in ("eager", "meta"):
        ref_losses, ref_grads, ref_params = _single_device(init)
        for rank, result in enumerate(results):
            losses, grads, params = result[init]
            for i, (got, want) in enumerate(zip(losses, ref_losses)):
                assert abs(got - want) <= 1e-5 * abs(want), f"--init {init} rank {rank} iteration {i}: {got} != {want}"
            for what, got_all, want_all in (("gradient", grads, ref_grads), ("after 2 steps", params, ref_params)):
                assert got_all.keys() == want_all.keys()
                for name, value in got_all.items():
                    err = relative_norm(torch.from_numpy(value), want_all[name])
                    assert err <= 1e-5, f"--init {init} rank {rank}: {name} {what}: relative error {err:.2e}"


def test_units_are_the_blocks():
    model, config = models.build(MODEL)
    assert list(fsdp.units(model)) == list(model.blocks)
    assert len(model.blocks) == config.layers


def test_flags():
    args, ns = parse_train_args(fsdp.build_parser(), ["--model", MODEL, "--set", "hidden=64", "--set", "ffn=96",
                                                      "--init", "meta"])
    assert args.overrides == {"hidden": 64, "ffn": 96} and ns.init == "meta" and ns.split == "even"
    assert args.build()[1].hidden == 64


def test_flops_split_needs_a_profile(capsys):
    with pytest.raises(SystemExit) as exc:
        fsdp.main(["--model", MODEL, "--split", "flops"])
    assert exc.value.code == 2
    assert "--split flops needs --profile" in capsys.readouterr().err
