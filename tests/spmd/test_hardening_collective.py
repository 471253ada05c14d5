"""Issue 31, item 7: a rank out of step makes the job fail within the collective
timeout, with a message naming the step and the rank, which the launcher prints. Two
Gloo ranks through the launcher (its own daemon), ``HAPD_COLLECTIVE_TIMEOUT=4``; and the
check-in diagnosis and the timeout setting on their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from _jobs import launched

from hapd.errors import HapdError
from hapd.spmd.stepwatch import DEFAULT_COLLECTIVE_TIMEOUT_S, CheckIn, _where, collective_timeout_s

pytestmark = pytest.mark.daemon

TIMEOUT_S = 4
SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "out_of_step.py"
MAX_WALL_S = 60.0
"""Launcher start (its daemon, two ranks importing torch) plus the timeout, generously."""


def _run(tmp_path: Path, mode: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env.update(HAPD_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path), HAPD_COLLECTIVE_TIMEOUT=str(TIMEOUT_S))
    job = f"oos-{mode}-{os.getpid()}"
    start = time.monotonic()
    with launched(["run", str(SCRIPT), mode, "-n", "2", "--job-id", job], env, job) as proc:
        out, err = proc.communicate(timeout=MAX_WALL_S)
    assert proc.returncode != 0
    return out + err, time.monotonic() - start


def test_a_late_rank_is_named_and_the_job_fails_within_the_timeout(tmp_path):
    """Rank 1 is stuck before step 3: rank 0's collective of step 3 fails after 4 s,
    saying rank 1 did not arrive; the launcher stops the job and prints it."""
    output, wall = _run(tmp_path, "late")
    assert wall < MAX_WALL_S
    assert ("CollectiveError: rank 0: a collective of step 3 failed after 4.0 s (timeout 4 s, HAPD_COLLECTIVE_TIMEOUT): "
            "rank(s) 1 out of step: rank 1 did not arrive (it is at step 2)") in output, output[-3000:]
    assert "hapd launcher: job" in output and "failed: rank 0" in output


def test_a_rank_cutting_a_batch_of_another_size_ends_the_job_at_once(tmp_path):
    """Rank 1 all-reduces 6 rows at step 3 where it had 4: Gloo aborts rank 0 at once
    with its own size-mismatch message (a C++ abort: no Python error to add to), and
    rank 1's error names itself when it reports before the launcher stops it (a race)."""
    output, wall = _run(tmp_path, "batch")
    assert wall < MAX_WALL_S
    named = "rank 1 cut a batch of another size at step 3: inputs [[6, 2]], [[4, 2]] at its step before" in output
    assert named or "Received data size doesn't match expected size" in output, output[-3000:]


def test_the_diagnosis_names_each_rank_out_of_step():
    own = CheckIn(5, [[4, 2]], [[4, 2]])
    others = {0: CheckIn(5, [[4, 2]], [[4, 2]]), 2: CheckIn(4), 3: CheckIn(6), 4: None, 5: CheckIn(5, [[3, 2]], [[4, 2]])}
    missing, where = _where(own, 1, others)
    assert missing == [2, 3, 4, 5]
    assert where == ("rank 2 did not arrive (it is at step 4); rank 3 is at step 6 (it skipped step 5?); "
                     "rank 4 never checked in; rank 5 cut a batch of another size at step 5: inputs [[3, 2]], "
                     "[[4, 2]] at its step before")
    assert _where(own, 1, {0: CheckIn(5)}) == ([], "every rank checked in at step 5; they wait in different "
                                                    "collectives or with inputs of different shapes")


def test_the_collective_timeout_comes_from_the_environment():
    assert collective_timeout_s({}) == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert collective_timeout_s({"HAPD_COLLECTIVE_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "abc", "inf", "nan"):
        with pytest.raises(HapdError, match="HAPD_COLLECTIVE_TIMEOUT"):
            collective_timeout_s({"HAPD_COLLECTIVE_TIMEOUT": bad})
