"""The processes of a launched job, found by the ``HAPD_JOB`` every rank's environment
carries (ranks and the children they start), for tests that check nothing is left, and
the launcher run as a process that takes its job down with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def describe_processes(pids: list[int]) -> str:
    """Each pid's state, parent and command line, for a test's failure message."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            out.append(f"{pid} (gone)")
            continue
        out.append(f"{pid} state {stat[0]} parent {stat[1]} group {stat[2]}: {command[:160]}")
    return "; ".join(out)


def kill_job(job: str) -> None:
    """SIGKILL every process of ``job`` (test clean-up)."""
    for pid in job_processes(job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_launcher(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``python -m launcher ARGS`` from the repository root, its output piped."""
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)


@contextlib.contextmanager
def launched(args: list[str], env: dict[str, str], job: str) -> Iterator[subprocess.Popen]:
    """The launcher running ``args``; on the way out it is killed if still running, and
    so is every process of ``job`` left behind."""
    proc = start_launcher(args, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pipe in (proc.stdout, proc.stderr):  # a launcher that ended by itself leaves them open
            if pipe is not None:
                pipe.close()
        kill_job(job)
