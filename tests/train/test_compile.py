"""``parallelize(..., compile=True)`` and ``worker.py --compile``: each rank's program
runs under ``torch.compile`` (collectives between the compiled graphs) with the values
of the uncompiled program, hence of the single device. The tests compile with the
``aot_eager`` backend (dynamo and AOTAutograd, no code generation: seconds, not
minutes, on a CPU); the default backend is what ``bench/gpu_step.py`` times."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import hapd
from hapd.errors import OptionsError
from hapd.models import zoo
from hapd.profile.schema import estimated_profile

pytestmark = pytest.mark.filterwarnings(
    # torch 2.9's dynamo instantiates the autograd Functions it traces (the collectives')
    # and warns about it itself
    "ignore:.*should not be instantiated:DeprecationWarning")

BACKEND = {"backend": "aot_eager"}
STEPS = 3


def _train(module: torch.nn.Module, inputs, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of ``steps`` Adam steps (this rank's parts) and the first gradients."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    losses, grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        loss = module(*inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, grads


def _pair(rank: int, world: int) -> tuple[list[float], list[float], float]:
    """On each rank: zoo GPT-2 (its default dropout 0.1) parallelized uncompiled and
    compiled on uneven ranks, trained alike: (losses, compiled losses, worst gradient
    difference)."""
    torch.manual_seed(0)
    profile = estimated_profile(world, flops=[2e10, 1e10][:world])
    runs = []
    for compile_with in (False, BACKEND):
        model, inputs = zoo.make("gpt2", batch=6)
        module = hapd.parallelize(model, inputs, profile=profile, use_daemon=False, verbose=False,
                                  compile=compile_with)
        runs.append(_train(module, module.shard_inputs(*inputs)))
    (plain, plain_grads), (compiled, compiled_grads) = runs
    assert plain_grads.keys() == compiled_grads.keys()
    worst = max(float((plain_grads[n] - compiled_grads[n]).abs().max()) for n in plain_grads)
    return plain, compiled, worst


def test_a_compiled_program_trains_as_the_uncompiled_one() -> None:
    plain, compiled, worst = _pair(0, 1)
    assert plain == pytest.approx(compiled, rel=1e-6, abs=1e-7) and worst <= 1e-6


@pytest.mark.distributed
def test_compiled_programs_on_uneven_ranks() -> None:
    for plain, compiled, worst in run_ranks(2, _pair, timeout=300):
        assert plain == pytest.approx(compiled, rel=1e-6, abs=1e-7) and worst <= 1e-6


def test_compile_takes_a_bool_or_torch_compile_arguments() -> None:
    model, inputs = zoo.make("gpt2", batch=2, dropout=0.0)
    with pytest.raises(OptionsError, match="compile"):
        hapd.parallelize(model, inputs, use_daemon=False, verbose=False, compile="yes")
