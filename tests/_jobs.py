"""The processes of a launched job, found by the ``HAPD_JOB`` every rank's environment
carries (ranks and the children they start), for tests that check nothing is left."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def job_processes(job: str) -> list[int]:
    """Pids of live processes whose environment has ``HAPD_JOB=job`` (ranks and children)."""
    needle = b"\0HAPD_JOB=" + job.encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = b"\0" + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in data and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill_job(job: str) -> None:
    """SIGKILL every process of ``job`` (test clean-up)."""
    for pid in job_processes(job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
