"""``python -m launcher.serve_child LAUNCHER_PID serve --state DIR ...``: ``hapd serve``
that stops with the launcher which started it (:class:`launcher.job.LocalDaemon`).

On Linux the process asks the kernel for SIGTERM (a clean stop) when its parent dies;
if the parent is no longer ``LAUNCHER_PID`` when it starts, the launcher is already gone
and it exits at once. The rest of the arguments are ``hapd``'s. When the daemon has
stopped because the launcher died (the launcher could not remove the daemon's temporary
state folder), it removes that folder itself; only a ``hapd-launcher-*`` folder (the
launcher's temporary state), never any other ``--state``.

This is a child-process entry module: it imports :mod:`hapd.cli` (and, through the
daemon, the compiler) only in :func:`main`; nothing in :mod:`launcher` imports it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
"""prctl option: the signal this process gets when its parent dies."""


def die_with_parent() -> None:
    """Linux: SIGTERM when the parent process dies (elsewhere: nothing)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:  # noqa: BLE001 - no prctl here: the launcher stops the daemon itself
        pass


def state_dir(args: Sequence[str]) -> Path | None:
    """The ``--state DIR`` of ``hapd serve`` arguments when it is a launcher's temporary
    folder, else None."""
    from launcher.job import LAUNCHER_DIR_PREFIX  # here, not before the parent-death signal is set

    for flag, value in zip(args, args[1:]):
        if flag == "--state" and Path(value).name.startswith(LAUNCHER_DIR_PREFIX):
            return Path(value)
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``hapd ARGS`` (``argv`` = ``LAUNCHER_PID ARGS...``, default this process's
    arguments) while the launcher with that pid is this process's parent."""
    args = list(sys.argv[1:] if argv is None else argv)
    launcher = int(args[0])
    die_with_parent()
    if os.getppid() != launcher:
        sys.exit("the launcher is gone")
    from hapd.cli import main as hapd_main

    try:
        hapd_main(args=args[1:], prog_name="hapd")
    finally:
        state = state_dir(args[1:])
        if state is not None and os.getppid() != launcher:  # orphaned: nobody else removes it
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
