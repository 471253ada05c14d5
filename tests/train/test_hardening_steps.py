"""Issue 51: a rank fed a batch of another size, or out of step, is named at once.

Every forward of a :class:`~hapd.train.parallel_module.ParallelModule` on several ranks
is checked against the other ranks' before its first collective
(:class:`~hapd.spmd.stepwatch.StepCheck`). Before, a rank that cut a batch of another
size alone built a program (collective) while the others ran their step's collectives:
the job hung until the collective timeout (300 s); a rank that ran one forward and
backward more than the others had its step summed with their next, silently.
Through the launcher (as users run it) and on 2 Gloo ranks (:func:`_dist.run_ranks`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _jobs import launched
from torch.utils.data import TensorDataset

import hapd
from hapd import models
from hapd.errors import CollectiveError, PlanError

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "wrong_batch.py"
BOUND_S = 10.0
"""The issue's bound: from the bad forward until every rank has stopped."""
HANG_GUARD_S = 120.0
"""Only so that a hung job cannot hang the suite: no bound of the test."""


def _mlp(world_batch: int = 8):
    torch.manual_seed(0)
    model, config = models.build("mlp")
    x, y = models.get("mlp").example_inputs(config, world_batch)
    module = hapd.parallelize(model, (x, y), use_daemon=False, verbose=False)
    return module, x, y


def _caught(run) -> tuple[str, str, float]:
    """(error class, message, seconds) of what ``run()`` raised (the test fails without one)."""
    started = time.monotonic()
    try:
        run()
    except (PlanError, CollectiveError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    raise AssertionError("no error raised")


NAMED = {
    "direct": "PlanError: rank 1: this rank was given a batch of another size at step 2: rank 1 input 0 (x): "
              "expected shape [4, 32], given [6, 32]",
    "cut": "the ranks run different programs at step 2: rank 0: step 2, forward 1 of it, training, global batch "
           "shapes [[8, 32], [8]]; rank 1: step 2, building a program for forward 1 of it, training, global batch "
           "shapes [[6, 32], [6]]",
}
"""What the job's output says, by how rank 1 got its batch of another size."""


@pytest.mark.daemon
@pytest.mark.parametrize("mode", ["direct", "cut"])
def test_a_rank_given_a_batch_of_another_size_ends_the_launched_job_at_once(tmp_path, mode):
    """Rank 1 passes 6 samples straight to forward where the plan runs 4 on it
    (``direct``), or cuts a global batch of 6 alone (``cut``: the job hung until the
    collective timeout): the ranks raise at that forward, naming rank 1 and the
    shapes, and the launcher ends the job well within the bound."""
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env.update(HAPD_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    job = f"wrong-batch-{mode}-{os.getpid()}"
    with launched(["run", str(SCRIPT), mode, "-n", "2", "--job-id", job], env, job) as proc:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    ended = time.time()
    output = out + err
    assert proc.returncode != 0, output[-3000:]
    bad = float(re.search(r"bad forward at ([\d.]+)", output).group(1))
    assert ended - bad <= BOUND_S, f"the job ended {ended - bad:.1f} s after the bad forward"
    assert NAMED[mode] in output, output[-3000:]
    assert re.search(r"hapd launcher: job \S+ failed: rank [01] on \S+ exited with code 1: PlanError: ", output)


def _cut_alone(rank: int, world: int) -> tuple[str, str, float]:
    """Rank 1 cuts a global batch of 6 with shard_inputs alone at step 2 (a program
    only it would build): both ranks raise before any collective of the step."""
    module, x, y = _mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(*module.shard_inputs(x, y)).backward()
    optimizer.step()

    def second_step():
        inputs = module.shard_inputs(x[:6], y[:6]) if rank == 1 else module.shard_inputs(x, y)
        module(*inputs).backward()

    return _caught(second_step)


def test_a_rank_cutting_a_batch_of_another_size_alone_is_named_at_once():
    for rank, (kind, message, seconds) in enumerate(run_ranks(2, _cut_alone)):
        assert kind == "PlanError", message
        assert seconds <= BOUND_S, f"rank {rank} raised after {seconds:.1f} s"
        assert message.startswith(f"rank {rank}: the ranks run different programs at step 2: ")
        assert ("rank 0: step 2, forward 1 of it, training, global batch shapes [[8, 32], [8]]; rank 1: step 2, "
                "building a program for forward 1 of it, training, global batch shapes [[6, 32], [6]]") in message


def _extra_forward(rank: int, world: int) -> list:
    """Three steps; rank 1 runs one forward and backward more in step 2."""
    module, x, y = _mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for step in (1, 2, 3):
        def one_step():
            module(*module.shard_inputs(x, y)).backward()
            if rank == 1 and step == 2:
                module(*module.shard_inputs(x, y)).backward()  # the extra one
            optimizer.step()
            optimizer.zero_grad()
        try:
            one_step()
        except CollectiveError as exc:
            seen.append((step, str(exc)))
            break
    return seen


def test_a_rank_running_an_extra_forward_is_refused_at_that_step():
    """Rank 1's extra forward of step 2 meets rank 0's first forward of step 3: both
    raise there, naming each rank's step, instead of summing the two."""
    for rank, seen in enumerate(run_ranks(2, _extra_forward)):
        assert len(seen) == 1, seen
        step, message = seen[0]
        assert step == (3 if rank == 0 else 2), seen
        assert message.startswith(f"rank {rank}: ranks out of step: rank 0: step 3, forward 1 of it, training, "
                                  "global batch shapes [[8, 32], [8]]; rank 1: step 2, forward 2 of it, training")


def _skipped_batch(rank: int, world: int) -> list:
    """The loader over 32 samples; rank 1 skips its second batch (a ``next`` too many)."""
    module, x, y = _mlp()
    data = hapd.loader(TensorDataset(*models.get("mlp").example_inputs(models.build("mlp")[1], 32)), module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    batches = iter(data)
    seen = []
    for step in (1, 2, 3):
        if rank == 1 and step == 2:
            next(batches)
        try:
            module(*next(batches)).backward()
        except CollectiveError as exc:
            seen.append((step, str(exc)))
            break
        optimizer.step()
        optimizer.zero_grad()
    return seen


def test_a_rank_skipping_a_batch_of_the_loader_is_refused_at_that_step():
    for rank, seen in enumerate(run_ranks(2, _skipped_batch)):
        assert [s for s, _ in seen] == [2], seen
        assert ("rank 0: step 2, forward 1 of it, training, the loader's batch 1 of epoch 0, global batch shapes "
                "[[8, 32], [8]]; rank 1: step 2, forward 1 of it, training, the loader's batch 2 of epoch 0") in seen[0][1]


def test_the_step_check_is_on_unless_turned_off_alike() -> None:
    """``HAPD_STEP_CHECK``: on by default and for 1/true/on, off for 0/false/off, and a
    value that is neither names the variable (a typo must not leave one rank without the
    check its peers run)."""
    from hapd.errors import HapdError
    from hapd.spmd.stepwatch import STEP_CHECK_ENV, step_check_enabled

    assert step_check_enabled({}) and step_check_enabled({STEP_CHECK_ENV: "1"})
    assert step_check_enabled({STEP_CHECK_ENV: " On "})
    assert not step_check_enabled({STEP_CHECK_ENV: "0"}) and not step_check_enabled({STEP_CHECK_ENV: "off"})
    with pytest.raises(HapdError, match="HAPD_STEP_CHECK='maybe' must be 1 or 0"):
        step_check_enabled({STEP_CHECK_ENV: "maybe"})
