"""Warm rank processes a daemon keeps for elastic launches (``hapd serve --standby N``).

A host that joins a running elastic job, or a generation whose ranks restart, starts
its ranks as new processes: each imports torch, hapd and the model's library before
its script gets anywhere (~3.5 s of CPU; tens of seconds on a slow host's share of a
core) while the job waits for it. The pool keeps ``count`` processes of
:mod:`hapd.elastic.standby` ready instead, each under its own rank guard (so it dies
with the daemon) in a session of its own, its park pipe open (:data:`PARK_FD_ENV`),
having imported all that and warmed torch's exporter. An in-place launch
(:class:`~hapd.serve.jobs.LaunchSpec` ``in_place``) takes one per local rank
(:meth:`StandbyPool.take`): the daemon writes the rank's environment, folder and script
to its standard input and adopts the process as that rank, whose output and exit it
reads as a new rank's. A launch whose environment sets something a process reads at
start differently from the standby's (:func:`hapd.wire.standby.fits`), or a standby
that died, gets a new process. The pool fills up again when it is made and when a job of
this host ends — not while one runs: a new standby's imports would take CPU from the
ranks it was just handed to.

Each standby carries a token of its own (``HAPD_JOB_TOKEN``); the job that adopts it
adds that token to its own, so cancelling the job reaches whatever the adopted rank
started. No torch import here.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hapd.wire.standby import STANDBY_MODULE, fits
from hapd.errors import OptionsError
from hapd.serve.leftovers import MARKER_ENV
from hapd.serve.rank_guard import GUARD_MODULE
from hapd.wire.contract import PARK_FD_ENV

log = logging.getLogger("hapd.standby")

MAX_STANDBY = 256
"""Most standby processes one daemon keeps."""


@dataclass
class Standby:
    """One warm process: its guard (the process the daemon started), its token and the
    write end of its park pipe."""

    proc: subprocess.Popen
    token: str
    park_fd: int
    env: dict[str, str]
    """The environment it started with."""
    started: float = field(default_factory=time.time)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand_over(self, env: Mapping[str, str], cwd: str, argv: Sequence[str]) -> None:
        """Send the rank's launch (:class:`OSError` when the process is gone); its
        environment keeps the standby's token and park pipe."""
        order = {"env": {**env, MARKER_ENV: self.token, PARK_FD_ENV: self.env[PARK_FD_ENV]}, "cwd": cwd,
                 "argv": list(argv), "runner": "in_place"}
        stdin = self.proc.stdin
        if stdin is None:
            raise OSError("the standby's input is closed")
        stdin.write((json.dumps(order) + "\n").encode())
        stdin.close()

    def stop(self) -> None:
        """SIGKILL its process group (the guard and the warm process) and close its pipes."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        try:
            os.close(self.park_fd)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class StandbyPool:
    """Up to ``count`` warm processes for this daemon's in-place launches (thread-safe)."""

    def __init__(self, count: int, *, imports: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        if not 0 <= count <= MAX_STANDBY:
            raise OptionsError(f"standby {count} must be in 0..{MAX_STANDBY}", field="standby")
        for name in imports:
            if not name or not all(part.isidentifier() for part in name.split(".")):
                raise OptionsError(f"standby import {name!r} is not a module name", field="standby_imports")
        self.count = count
        self.imports = tuple(imports)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd or os.getcwd()
        self._ready: list[Standby] = []
        self._lock = threading.Lock()
        self._closed = False

    def _spawn(self) -> Standby:
        token = secrets.token_hex(16)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # as a rank's: a standby that reads none never blocks the daemon
        env = {**self.env, "PYTHONUNBUFFERED": "1", MARKER_ENV: token, PARK_FD_ENV: str(read_end)}
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as the daemon gives the ranks of a launch of several; set again at hand-over
        command = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), "--", sys.executable, "-u", "-m",
                   STANDBY_MODULE, *[a for name in self.imports for a in ("--import", name)]]
        try:
            proc = subprocess.Popen(command, cwd=self.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=(read_end,))
        except OSError:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        return Standby(proc, token, write_end, env)

    def fill(self) -> int:
        """Start standbys until ``count`` are alive; how many were started (a start that
        fails is logged: launches then start new processes)."""
        started = 0
        with self._lock:
            if self._closed:
                return 0
            for dead in [s for s in self._ready if not s.alive()]:
                self._ready.remove(dead)
                log.warning("standby process %d ended by itself (exit %s): replaced", dead.proc.pid, dead.proc.returncode)
                dead.stop()
            while len(self._ready) < self.count:
                try:
                    self._ready.append(self._spawn())
                except OSError as exc:
                    log.warning("cannot start a standby process: %s", exc)
                    break
                started += 1
        if started:
            log.info("started %d standby process(es) (%s)", started, ", ".join(["torch", "hapd", *self.imports]))
        return started

    def take(self, launch_env: Mapping[str, str]) -> Standby | None:
        """A live standby that can run a rank of ``launch_env`` (removed from the pool),
        or None."""
        with self._lock:
            for s in list(self._ready):
                if not s.alive():
                    continue
                why = fits(s.env, launch_env)
                if why is not None:
                    log.info("a launch's rank starts a new process rather than a standby: %s", why)
                    return None
                self._ready.remove(s)
                return s
        return None

    def ready(self) -> int:
        """Standbys alive now."""
        with self._lock:
            return sum(s.alive() for s in self._ready)

    def close(self) -> None:
        """Stop every standby; the pool starts none after this."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
        for s in ready:
            s.stop()


def describe(pool: StandbyPool | None) -> dict[str, Any]:
    """What ``ping`` says of the pool."""
    if pool is None:
        return {"standby": 0, "standby_ready": 0}
    return {"standby": pool.count, "standby_ready": pool.ready()}
