"""Issue 31, item 7: a rank out of step makes the job fail within the collective
timeout, with a message naming the step and the rank, which the launcher prints. Two
Gloo ranks through the launcher (its own daemon), ``HAPD_COLLECTIVE_TIMEOUT=4``; and the
check-in diagnosis and the timeout setting on their own."""

from __future__ import annotations

import json
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
BOUND_S = 2 * TIMEOUT_S
"""How long a job may run once its ranks are up: the fault comes at step 3, a few
all-reduces of 8 floats after the ranks' first line, so a job that ends by the timeout
ends about ``TIMEOUT_S`` later, plus the failing rank's diagnosis and exit and the
launcher stopping the other rank and exiting (about 1 s here); the second
``TIMEOUT_S`` is room for that on a loaded 2-core machine. A job that waited for rank 1
(asleep 60 s) or for a second timeout would take at least ``BOUND_S``. Process start
(the launcher's daemon, two ranks importing torch: seconds, more under load) is left
out of the measure, not allowed for."""
HANG_GUARD_S = 120.0
"""Only so that a hung job cannot hang the suite: no bound of the test."""


def _run(tmp_path: Path, mode: str) -> tuple[str, float]:
    """The job's output, and the seconds from its ranks' first line (the launcher's
    report: the ``[Gloo] Rank i is connected`` line once the process group is up, or
    the error itself) until the launcher has stopped every rank and exited."""
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env.update(HAPD_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path), HAPD_COLLECTIVE_TIMEOUT=str(TIMEOUT_S))
    job = f"oos-{mode}-{os.getpid()}"
    with launched(["run", str(SCRIPT), mode, "-n", "2", "--job-id", job], env, job) as proc:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    ended = time.time()  # the report stamps a rank's first line in unix seconds (its daemon's, this machine's)
    assert proc.returncode != 0
    report = json.loads((tmp_path / "home" / "runs" / f"{job}.json").read_text())
    first = report["start"]["first_output"]
    assert sorted(first) == ["0", "1"], report["start"]
    return out + err, ended - min(first.values())


def test_a_late_rank_is_named_and_the_job_fails_within_the_timeout(tmp_path):
    """Rank 1 is stuck before step 3: rank 0's collective of step 3 fails after 4 s,
    saying rank 1 did not arrive; the launcher stops the job and prints it."""
    output, ran = _run(tmp_path, "late")
    assert ran < BOUND_S, f"the job ran {ran:.1f} s after its ranks were up (timeout {TIMEOUT_S} s)"
    assert ("CollectiveError: rank 0: a collective of step 3 failed after 4.0 s (timeout 4 s, HAPD_COLLECTIVE_TIMEOUT): "
            "rank(s) 1 out of step: rank 1 did not arrive (it is at step 2)") in output, output[-3000:]
    assert "hapd launcher: job" in output and "failed: rank 0" in output


def test_a_rank_cutting_a_batch_of_another_size_ends_the_job_at_once(tmp_path):
    """Rank 1 all-reduces 6 rows at step 3 where it had 4: Gloo aborts rank 0 at once
    with its own size-mismatch message (a C++ abort: no Python error to add to), and
    rank 1's error names itself when it reports before the launcher stops it (a race)."""
    output, ran = _run(tmp_path, "batch")
    assert ran < BOUND_S, f"the job ran {ran:.1f} s after its ranks were up (timeout {TIMEOUT_S} s)"
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
