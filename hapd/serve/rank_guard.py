"""A rank's guard: the rank dies with the daemon that started it.

    python -m hapd.serve.rank_guard DAEMON_PID -- COMMAND...

The daemon starts every rank through this guard, in a session of its own (the guard
leads the rank's process group). The guard runs ``COMMAND`` as its child, in that
group, and waits for it; it exits with the rank's exit status. Should the daemon die
first (``SIGKILL``, a crash: nothing of its own can clean up), the guard sees it —
the daemon's pid descriptor becomes readable (``pidfd_open``), or, where the kernel
has none, the guard's parent is no longer the daemon — and kills the whole process
group: the rank and every child it started in it, and every process that carries the
job's ``HAPD_JOB_TOKEN`` (children the rank started in a session of their own).
Another rank's guard carries the token too and is spared: were the guards of a job to
kill each other, the first to be killed would leave its own group running (each
guard's scan meets the other guards first, their pids being the lowest).

Why not ``PR_SET_PDEATHSIG``: the kernel sends that signal when the *thread* that
forked the child ends, and the daemon starts ranks from short-lived threads (a
delayed start), so a rank would be killed when its starting thread returns. A guard
process watches the daemon itself. The guard imports nothing beyond the standard
library and :mod:`hapd.serve.leftovers` (it starts in tens of milliseconds) and handles no signal: a cancel's
``killpg`` reaches it and the rank alike.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence

from hapd.serve.leftovers import MARKER_ENV, marked_processes
from hapd.wire.contract import PARK_FD_ENV
from hapd.wire.standby import READY_FD_ENV

GUARD_MODULE = "hapd.serve.rank_guard"
"""The guard's module, as the daemon starts it (``python -m``)."""

POLL_S = 0.5
"""How often the guard looks at the daemon and the rank when it cannot watch both by
pid descriptor."""


def _daemon_gone(daemon_pid: int) -> bool:
    """Whether the daemon has ended: the guard was reparented, or no such process is left."""
    if os.getppid() != daemon_pid:
        return True
    try:
        os.kill(daemon_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (None without
    ``pidfd_open``: kernels before 5.3, or the process already gone)."""
    try:
        return os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except OSError:
        return None


def guard(daemon_pid: int, command: Sequence[str]) -> int:
    """Run ``command`` until it ends (its exit status) or the daemon does (the process
    group is killed; the guard never returns then)."""
    if _daemon_gone(daemon_pid):
        return 125  # the daemon died before the rank could start: start nothing
    child = subprocess.Popen(list(command), pass_fds=_passed_fds())
    fds = [fd for fd in (_pidfd(daemon_pid), _pidfd(child.pid)) if fd is not None]
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    waiting = None if len(fds) == 2 else POLL_S * 1000  # both watched: sleep until one ends
    while True:
        if _daemon_gone(daemon_pid):  # first: a rank another guard killed leaves its children here
            break
        if child.poll() is not None:
            return _status(child.returncode)
        poller.poll(waiting)
    token = os.environ.get(MARKER_ENV)
    if token:  # the job's processes outside this group (their own session)
        for pid in victims(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the rank, its children and the guard
    return 137  # not reached


def _passed_fds() -> tuple[int, ...]:
    """The descriptors the daemon gave the rank that the guard passes on: an in-place
    job's park pipe (:data:`hapd.wire.contract.PARK_FD_ENV`), a standby's ready pipe
    (:data:`hapd.wire.standby.READY_FD_ENV`)."""
    fds = []
    for name in (PARK_FD_ENV, READY_FD_ENV):
        try:
            fd = int(os.environ.get(name) or "")
            os.fstat(fd)
        except (ValueError, OSError):
            continue
        fds.append(fd)
    return tuple(fds)


def victims(token: str) -> list[int]:
    """The job's marked processes a guard kills besides its own group: all but itself and
    the other ranks' guards (each kills its own group; see the module's docstring)."""
    found = marked_processes({token}, exclude={os.getpid()}).get(token, [])
    return [pid for pid in found if not _is_guard(pid)]


def _is_guard(pid: int) -> bool:
    """Whether process ``pid`` runs this module (a rank's guard)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return GUARD_MODULE.encode() in argv


def _status(returncode: int) -> int:
    """A child's return code as a shell would report it (128 + signal when killed)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -m hapd.serve.rank_guard DAEMON_PID -- COMMAND...", file=sys.stderr)
        return 2
    return guard(int(args[0]), args[2:])


if __name__ == "__main__":
    sys.exit(main())
