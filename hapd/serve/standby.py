"""Warm rank processes a daemon keeps for elastic launches (``hapd serve --standby N``).

A host that joins a running elastic job, or a generation whose ranks restart, starts
its ranks as new processes: each imports torch, hapd and the model's library before
its script gets anywhere (~3.5 s of CPU; tens of seconds on a slow host's share of a
core) while the job waits for it. The pool keeps ``count`` processes of
:mod:`hapd.elastic.standby` ready instead, each under its own rank guard (so it dies
with the daemon) in a session of its own, its park pipe open (:data:`PARK_FD_ENV`),
having imported all that and warmed torch's exporter. They warm in Linux's idle
scheduling class (:mod:`hapd.elastic.standby`), so their imports take only CPU nothing
else on the host wants — several warming at once in the normal class took the CPU of
the host's running ranks and of the daemon itself —, and each says when it is warm
(:data:`READY_FD_ENV`). An in-place launch
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
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hapd.wire.standby import READY_FD_ENV, STANDBY_MODULE, fits
from hapd.errors import OptionsError
from hapd.serve.leftovers import MARKER_ENV
from hapd.serve.rank_guard import GUARD_MODULE
from hapd.wire.contract import PARK_FD_ENV

log = logging.getLogger("hapd.standby")

MAX_STANDBY = 256
"""Most standby processes one daemon keeps."""
WARM_TIMEOUT_S = 600.0
"""How long the pool waits for one standby to say it is warm before it starts the next."""


@dataclass
class Standby:
    """One warm process: its guard (the process the daemon started), its token and the
    write end of its park pipe."""

    proc: subprocess.Popen
    token: str
    park_fd: int
    env: dict[str, str]
    """The environment it started with."""
    ready_fd: int | None = None
    """The read end of its ready pipe, closed by :meth:`await_warm` alone (the pool
    awaits every standby it starts; one stopped closes its end, which ends the wait)."""
    started: float = field(default_factory=time.time)
    warm_s: float | None = None
    """Seconds it took to say it is warm (None: not yet)."""

    def await_warm(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait until it says it is warm (its ready pipe), ends, ``timeout_s`` passes or
        ``stop`` is set; whether it is warm."""
        fd = self.ready_fd
        if fd is None:
            return self.warm_s is not None
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                if not poller.poll(500):
                    continue
                data = os.read(fd, 64)
                if data.startswith(b"ready"):
                    self.warm_s = time.time() - self.started
                return self.warm_s is not None  # said it, or the pipe closed (ended, or handed over first)
            return False
        finally:
            self.ready_fd = None
            os.close(fd)

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
        """SIGKILL its process group (the guard and the warm process) and close its pipes
        (its ready pipe: :meth:`await_warm`)."""
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


def import_name_ok(name: str) -> bool:
    """Whether ``name`` is what a standby imports: a dotted module name, optionally
    ``:`` and comma-separated attribute names (:func:`hapd.elastic.standby.import_named`)."""
    module, colon, attributes = name.partition(":")
    if not module or not all(part.isidentifier() for part in module.split(".")):
        return False
    names = [a.strip() for a in attributes.split(",")] if colon else []
    return all(a.isidentifier() for a in names) and (not colon or bool(names))


class StandbyPool:
    """Up to ``count`` warm processes for this daemon's in-place launches (thread-safe)."""

    def __init__(self, count: int, *, imports: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        if not 0 <= count <= MAX_STANDBY:
            raise OptionsError(f"standby {count} must be in 0..{MAX_STANDBY}", field="standby")
        for name in imports:
            if not import_name_ok(name):
                raise OptionsError(f"standby import {name!r} is not a module name (MODULE or MODULE:ATTR[,ATTR…])",
                                   field="standby_imports")
        self.count = count
        self.imports = tuple(imports)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd or os.getcwd()
        self._ready: list[Standby] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._held = threading.Event()
        """Set when a launch took a standby: the pool warms no more until :meth:`fill`
        (a job ended), so a warm-up never takes the CPU of the ranks just handed over."""
        self._filler: threading.Thread | None = None

    def _spawn(self) -> Standby:
        token = secrets.token_hex(16)
        park_read, park_write = os.pipe()
        ready_read, ready_write = os.pipe()
        os.set_blocking(park_write, False)  # as a rank's: a standby that reads none never blocks the daemon
        env = {**self.env, "PYTHONUNBUFFERED": "1", MARKER_ENV: token, PARK_FD_ENV: str(park_read),
               READY_FD_ENV: str(ready_write)}
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as the daemon gives the ranks of a launch of several; set again at hand-over
        command = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), "--", sys.executable, "-u", "-m",
                   STANDBY_MODULE, *[a for name in self.imports for a in ("--import", name)]]
        try:
            proc = subprocess.Popen(command, cwd=self.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=(park_read, ready_write))
        except OSError:
            os.close(park_write)
            os.close(ready_read)
            raise
        finally:
            os.close(park_read)
            os.close(ready_write)
        return Standby(proc, token, park_write, env, ready_fd=ready_read)

    def fill(self) -> None:
        """Start standbys until ``count`` are alive, and wait for them to be warm on a
        thread (a start that fails is logged: launches then start new processes)."""
        self._held.clear()
        with self._lock:
            if self._closed.is_set() or (self._filler is not None and self._filler.is_alive()):
                return
            self._filler = threading.Thread(target=self._fill, name="hapd-standby", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        started = []
        with self._lock:
            for dead in [s for s in self._ready if not s.alive()]:
                self._ready.remove(dead)
                log.warning("standby process %d ended by itself (exit %s): replaced", dead.proc.pid, dead.proc.returncode)
                dead.stop()
            while len(self._ready) < self.count and not self._closed.is_set() and not self._held.is_set():
                try:
                    standby = self._spawn()
                except OSError as exc:
                    log.warning("cannot start a standby process: %s", exc)
                    break
                self._ready.append(standby)
                started.append(standby)
        for standby in started:
            if standby.await_warm(WARM_TIMEOUT_S, self._closed):
                log.info("standby process %d warm in %.1f s (%s)", standby.proc.pid, standby.warm_s,
                         ", ".join(["torch", "hapd", *self.imports]))

    def take(self, launch_env: Mapping[str, str]) -> Standby | None:
        """A live standby that can run a rank of ``launch_env`` (removed from the pool),
        or None."""
        with self._lock:
            for s in sorted(self._ready, key=lambda s: s.warm_s is None):  # the warm ones first
                if not s.alive():
                    continue
                why = fits(s.env, launch_env)
                if why is not None:
                    log.info("a launch's rank starts a new process rather than a standby: %s", why)
                    return None
                self._ready.remove(s)
                self._held.set()
                return s
        return None

    def ready(self) -> int:
        """Standbys alive and warm now."""
        with self._lock:
            return sum(s.alive() and s.warm_s is not None for s in self._ready)

    def close(self) -> None:
        """Stop every standby; the pool starts none after this."""
        self._closed.set()
        with self._lock:
            ready, self._ready = self._ready, []
            filler = self._filler
        if filler is not None:
            filler.join(timeout=2.0)
        for s in ready:
            s.stop()
