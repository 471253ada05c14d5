"""Jobs the daemon launches: this host's ranks of an SPMD job, as subprocesses.

Each local rank runs ``python -u -m hapd.spmd.script SCRIPT ARGS…`` (``SCRIPT`` as ``python SCRIPT``
would run it) with exactly the environment torchrun
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``; ``OMP_NUM_THREADS=1`` unless set), so a script that runs
under torchrun runs here unchanged, plus ``HAPD_DAEMON`` (this daemon's address),
``HAPD_KEY_FILE`` (the key it authenticates with, so rank 0 can ask it for plans wherever
that key lies), ``HAPD_CACHE`` (its plan cache), ``HAPD_JOB`` and ``HAPD_JOB_TOKEN`` (a
random token of this launch, inherited by every process a rank starts). Every rank runs
under a guard that leads its own process group; cancelling signals every group and
every process that carries the job's token, even one that left the group or session
(SIGTERM, then SIGKILL after a grace period); and when a job ends, what its ranks left
running is stopped the same way. While a job runs its ranks are recorded in the state
directory (:mod:`hapd.serve.leftovers`), so that a daemon started after this one was
killed stops them. Output is captured line by line as the job's events, with a sequence number
per event; a rank's exit is an event too. The daemon keeps only a bounded tail of them
in memory and spills every one to ``JOBS_DIR/JOB/events.spill`` (:mod:`hapd.serve.events`),
so what a job prints costs the daemon disk, not memory. As torchrun does, when one local rank
fails the others on this host are stopped; the launcher stops the other hosts.

A job is **leased**: every ``job_events`` poll about it renews the lease, and a job whose
lease runs out (no poll for ``lease_s``: its launcher was killed, hung up, or lost this
daemon) is cancelled as a ``cancel`` request would, with ``lease expired: launcher silent
for N s`` as its reason; so no rank outlives the launcher that started it by more than
the lease plus the SIGKILL grace. Each finished job keeps a reason (``job_status``).

Every job has a folder ``JOBS_DIR/JOB/`` (its spill file, and the script a launch
ships); those folders are pruned
when the manager starts and whenever a job ends: those of the last
:data:`DEFAULT_KEEP_JOB_DIRS` jobs to finish (or launch) within
:data:`DEFAULT_JOB_DIR_MAX_AGE_S` are kept, and always those of unfinished jobs.

No torch import here.
"""

from __future__ import annotations

import codecs
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from hapd.errors import OptionsError
from hapd.wire.contract import JOB_ID, MAX_LEASE_S, MIN_LEASE_S, PARK_FD_ENV, STARTED_ENV
from hapd.serve.events import SPILL_FILE, EventLog
from hapd.serve.leftovers import MARKER_ENV, RankRecords, marked_processes, signal_marked
from hapd.serve.rank_guard import GUARD_MODULE
from hapd.serve.standby import StandbyPool
from hapd.util import private_folder

IN_PLACE_MODULE = "hapd.elastic.in_place"
"""What an in-place launch's ranks run the script under (``python -m`` it)."""
SCRIPT_MODULE = "hapd.spmd.script"
"""What a plain launch's ranks run the script under (``python -m`` it): the script as
``python SCRIPT`` runs it, the process ended without the interpreter's finalization."""

log = logging.getLogger("hapd.jobs")

MAX_LINE = 64 * 1024
"""Longer output lines are split into several events."""
MAX_NPROC = 1024
"""Most ranks one launch may start on this host."""
MAX_EVENTS_PER_REPLY = 2000
"""Most output events one ``job_events`` reply carries."""
MAX_EVENT_REPLY_BYTES = 2**20
"""Most bytes of output text one ``job_events`` reply carries (beyond its first event)."""
MAX_START_DELAY_S = 3600.0
"""Latest ``start_at`` a launch may ask for, in seconds from now."""
MAX_START_LATE_S = 60
"""Earliest ``start_at`` a launch may ask for, in seconds before now (a late launch)."""
DEFAULT_GRACE_S = 5.0
"""Seconds between a cancel's SIGTERM and its SIGKILL."""
DEFAULT_KEEP_FINISHED = 64
"""Finished jobs kept for their status and events (older ones are forgotten)."""
READER_JOIN_S = 2.0
"""After a rank exits, how long to wait for its output readers (a grandchild holding the
pipe must not hold the exit back)."""
SHUTDOWN_TIMEOUT_S = 10.0
"""How long the daemon's stop waits for every rank to exit before SIGKILL."""
DEFAULT_LEASE_S = 60.0
"""Lease of a job whose launch names none: how long it runs without a ``job_events``
poll about it (the launcher sends its own, shorter, ``--lease``)."""
DEFAULT_KEEP_JOB_DIRS = DEFAULT_KEEP_FINISHED
"""Job folders (shipped scripts) kept besides those of unfinished jobs, newest first."""
DEFAULT_JOB_DIR_MAX_AGE_S = 7 * 86400.0
"""Job folders of finished jobs older than this are removed whatever their number."""

REASON_CANCELLED = "cancelled by a cancel request"
REASON_STOPPING = "the daemon is stopping"


def _bad(message: str, fieldname: str) -> OptionsError:
    return OptionsError(f"launch: {message}", field=fieldname)


def _check_place(body: Mapping[str, Any], nproc: int, request: str) -> None:
    """The fields that place a host's ``nproc`` ranks in a job (a launch's or a
    switch's): hosts, ranks, rendezvous, environment; OptionsError naming the field."""
    nnodes, node_rank = body["nnodes"], body["node_rank"]
    world, offset, port = body["world_size"], body["rank_offset"], body["master_port"]
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise OptionsError(f"{request}: node_rank {node_rank} must be in 0..{nnodes - 1} (nnodes {nnodes})",
                           field="node_rank")
    if offset < 0 or offset + nproc > world:
        raise OptionsError(f"{request}: ranks {offset}..{offset + nproc - 1} do not fit world_size {world}",
                           field="rank_offset")
    if not 1 <= port <= 65535:
        raise OptionsError(f"{request}: master_port {port} is not a port", field="master_port")
    if not body["master_addr"]:
        raise OptionsError(f"{request}: master_addr is empty", field="master_addr")
    for k, v in body["env"].items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise OptionsError(f"{request}: environment variable {k!r} is not a valid name/value", field="env")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a host's ranks stand in a job (a launch's or a switch's): hosts, ranks,
    rendezvous, environment."""

    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    env: Mapping[str, str]

    @staticmethod
    def checked(body: Mapping[str, Any], nproc: int, request: str) -> dict[str, Any]:
        """The placement fields of a ``request``'s ``body`` placing a host's ``nproc``
        ranks, checked (OptionsError naming the field)."""
        _check_place(body, nproc, request)
        return {name: body[name] for name in PLACEMENT_FIELDS} | {"env": dict(body["env"])}

    def placement(self) -> dict[str, Any]:
        """The placement fields, for a reply."""
        return {name: getattr(self, name) for name in PLACEMENT_FIELDS} | {"env": dict(self.env)}


PLACEMENT_FIELDS = tuple(f.name for f in fields(Placement))
"""The fields of :class:`Placement`, in order."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(Placement):
    """A validated ``launch`` request (fields as in ``docs/protocol.md``)."""

    job: str
    script: str
    script_bytes: bytes | None
    args: tuple[str, ...]
    nproc: int
    start_at: float | None
    cwd: str | None
    lease_s: float = DEFAULT_LEASE_S
    in_place: bool = False
    """The ranks run under :mod:`hapd.elastic.in_place`: a rank whose peer went away waits
    for a ``switch`` and runs the script again in its own process."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any], *, now: float | None = None) -> "LaunchSpec":
        """Check the fields' values (their types are checked by the protocol layer)."""
        now = time.time() if now is None else now
        job = body["job"]
        if not JOB_ID.fullmatch(job):
            raise _bad(f"job id {job!r} must be 1-64 letters, digits, '.', '_' or '-'", "job")
        nproc = body["nproc"]
        if not 1 <= nproc <= MAX_NPROC:
            raise _bad(f"nproc {nproc} must be in 1..{MAX_NPROC}", "nproc")
        place = Placement.checked(body, nproc, "launch")
        if any("\0" in a for a in body["args"]):
            raise _bad("an argument contains a NUL byte", "args")
        script = body["script"]
        if not script or "\0" in script:
            raise _bad("script is empty", "script")
        if body.get("script_bytes") is not None and (Path(script).name != script or script in (".", "..")):
            raise _bad(f"with script_bytes, script {script!r} must be a plain file name", "script")
        if body.get("script_bytes") == b"":
            raise _bad("script_bytes is empty (0 bytes): there is no script to run", "script_bytes")
        start_at = body.get("start_at")
        if start_at is not None and not now - MAX_START_LATE_S <= start_at <= now + MAX_START_DELAY_S:
            raise _bad(f"start_at is {start_at - now:+.1f} s from now; allowed -{MAX_START_LATE_S}..+{MAX_START_DELAY_S:.0f} s",
                       "start_at")
        cwd = body.get("cwd")
        if cwd is not None and not Path(cwd).is_dir():
            raise _bad(f"cwd {cwd} is not a directory on this host", "cwd")
        lease_s = body.get("lease_s")
        lease_s = DEFAULT_LEASE_S if lease_s is None else lease_s
        if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
            raise _bad(f"lease_s {lease_s:g} must be in {MIN_LEASE_S:g}..{MAX_LEASE_S:g} s", "lease_s")
        return cls(
            **place,
            job=job,
            script=script,
            script_bytes=body.get("script_bytes"),
            args=tuple(body["args"]),
            nproc=nproc,
            start_at=start_at,
            cwd=cwd,
            lease_s=float(lease_s),
            in_place=bool(body.get("in_place", False)),
        )


@dataclass(frozen=True, kw_only=True)
class SwitchOrder(Placement):
    """A validated ``switch`` request: where this host's ranks of an in-place job go on
    (the next generation of an elastic job, on the hosts left)."""

    generation: int
    time: float
    nproc: int
    """This host's ranks in the generation: all it runs, or fewer when some were killed
    (each goes on as local rank ``kept.index(its local rank)``)."""
    kept: tuple[int, ...] = ()
    """The local ranks (before the switch) that go on, in order; filled by
    :meth:`JobManager.switch` from the ranks still running."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any], nproc: int) -> "SwitchOrder":
        """``nproc``: the ranks of the job still running here (the order's own ``nproc``,
        when it has one, must be that)."""
        gen = body["generation"]
        if gen < 1:
            raise OptionsError(f"switch: generation {gen} must be ≥ 1", field="generation")
        asked = body.get("nproc")
        if asked is not None and asked != nproc:
            raise OptionsError(f"switch: nproc {asked}, but {nproc} rank(s) of the job are running on this host",
                               field="nproc")
        return cls(generation=gen, **Placement.checked(body, nproc, "switch"), time=time.time(), nproc=nproc)

    def describe(self) -> dict[str, Any]:
        return {"generation": self.generation, **self.placement(), "nproc": self.nproc, "kept": list(self.kept),
                "time": self.time}


def killed_by_signal(code: int) -> bool:
    """Whether a rank's exit status says a signal killed it (``128 + N`` from its guard,
    ``-N`` when the guard itself was killed)."""
    return code < 0 or code > 128


def goes_on_without(job: "HostJob", code: int) -> bool:
    """Whether the job's other ranks go on after one exited with ``code``: an in-place
    job's rank killed by a signal (kill -9, the OOM killer) is a fault the others park
    on and are switched past (an elastic launcher drops its slot); any other failure, or
    a job being cancelled, stops this host's ranks as torchrun does."""
    return job.spec.in_place and killed_by_signal(code) and not job.cancelled.is_set()


def script_argv(command: list[str]) -> list[str]:
    """The script and its arguments in a rank's command (what follows the runner's module)."""
    return command[command.index(IN_PLACE_MODULE) + 1:] if IN_PLACE_MODULE in command else command[-1:]


def torchrun_env(spec: LaunchSpec, local_rank: int) -> dict[str, str]:
    """The torchrun variables of one local rank."""
    rank = spec.rank_offset + local_rank
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.nproc),
        "GROUP_RANK": str(spec.node_rank),
        "GROUP_WORLD_SIZE": str(spec.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        "TORCHELASTIC_RUN_ID": spec.job,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


@dataclass
class Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen | None = None
    returncode: int | None = None
    park_fd: int | None = None
    """The write end of the rank's park pipe (an in-place job's, :data:`PARK_FD_ENV`)."""
    dropped: bool = False
    """Killed by a signal in an in-place job and left out of the generations after it
    (a ``switch`` with fewer ranks): its exit no longer decides how the job ended."""

    def summary(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": self.proc.pid if self.proc is not None else None,
            "returncode": self.returncode,
        }


@dataclass
class HostJob:
    """This host's share of a job: its ranks and their events (the launcher's
    :class:`launcher.job.Job` is the whole job, over every host)."""

    spec: LaunchSpec
    command: list[str]
    ranks: list[Rank]
    events: EventLog
    state: str = "starting"
    started: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    renewed: float = field(default_factory=time.monotonic)
    """When the lease was last renewed (monotonic clock)."""
    reason: str | None = None
    """Why the job ended, or is ending (the first cause wins)."""
    rank_failed: bool = False
    """A rank exited non-zero before any cancel: the job ends ``failed`` even when the
    cancel its launcher sends on seeing that exit arrives before the other ranks end."""
    pause_requested: bool = False
    """A ``pause`` request came: the job's ranks stop at their next step boundary (they
    read it in ``job_status``)."""
    switch: SwitchOrder | None = None
    """The last ``switch`` request: where the ranks go on in place (they read it in
    ``job_status``); their global ranks are renumbered from its ``rank_offset``."""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    """This launch's mark (``HAPD_JOB_TOKEN``), inherited by every process of the job."""
    adopted: list[tuple[str, int]] = field(default_factory=list)
    """(token, guard pid) of each warm standby process this launch took as a rank
    (:mod:`hapd.serve.standby`): it keeps its own token, which marks the job's processes too."""

    @property
    def tokens(self) -> set[str]:
        """Every mark the job's processes carry: the launch's and its adopted standbys'."""
        return {self.token, *(t for t, _ in self.adopted)}

    @property
    def finished(self) -> bool:
        return self.state in ("exited", "failed", "cancelled")

    @property
    def seq(self) -> int:
        """The number of the job's last event."""
        return self.events.seq

    def renew(self) -> None:
        """Its launcher is there: the lease runs ``lease_s`` from now."""
        self.renewed = time.monotonic()

    def silent_s(self, now: float | None = None) -> float:
        """Seconds since the lease was last renewed."""
        return (time.monotonic() if now is None else now) - self.renewed

    def set_reason(self, reason: str) -> None:
        with self.lock:
            if self.reason is None:
                self.reason = reason

    def add_event(self, rank: int, stream: str, line: str, *, more: bool = False) -> None:
        """One event; ``more``: ``line`` is a piece of a longer line that the next event
        of this rank and stream continues."""
        event: dict[str, Any] = {"rank": rank, "stream": stream, "line": line, "time": time.time()}
        if more:
            event["more"] = True
        with self.lock:
            self.events.append(event)

    def events_after(self, after: int, limit: int = MAX_EVENTS_PER_REPLY,
                     max_bytes: int = MAX_EVENT_REPLY_BYTES) -> tuple[list[dict[str, Any]], bool]:
        """The events numbered above ``after`` (from memory or the spill file; events
        lost stand as one drop marker) and whether the job is done after them."""
        with self.lock:
            out = self.events.after(after, limit, max_bytes)
            last = out[-1]["seq"] if out else after
            done = self.finished and last >= self.events.seq
        return out, done

    def release_events(self) -> None:
        """The job has finished: keep a small tail of its events in memory."""
        with self.lock:
            self.events.finish()

    def summary(self) -> dict[str, Any]:
        s = self.spec
        return {"job": s.job, "state": self.state, "nproc": s.nproc, "world_size": s.world_size, "rank_offset": s.rank_offset, "started": self.started}

    def status(self) -> dict[str, Any]:
        out = {"job": self.spec.job, "state": self.state, "ranks": [r.summary() for r in self.ranks]}
        if self.reason is not None:
            out["reason"] = self.reason
        if self.pause_requested:
            out["pause"] = True
        if self.switch is not None:
            out["switch"] = self.switch.describe()
        return out


class JobManager:
    """Starts, watches and stops jobs (thread-safe)."""

    def __init__(self, *, jobs_dir: Path, daemon_address: str, cache_dir: Path, key_file: Path | None = None,
                 grace_s: float = DEFAULT_GRACE_S, slots: int | None = None,
                 keep_finished: int = DEFAULT_KEEP_FINISHED, keep_job_dirs: int = DEFAULT_KEEP_JOB_DIRS,
                 job_dir_max_age_s: float = DEFAULT_JOB_DIR_MAX_AGE_S, records_dir: Path | None = None,
                 standby: StandbyPool | None = None) -> None:
        """``records_dir``: where running jobs are recorded (default: ``ranks/`` beside
        ``jobs_dir``); what a killed predecessor recorded there is stopped now.
        ``standby``: warm processes an in-place launch's ranks are handed to (filled now,
        and again whenever a job ends)."""
        if keep_job_dirs < 1 or not job_dir_max_age_s > 0:
            raise OptionsError(f"keep_job_dirs {keep_job_dirs} must be ≥ 1 and job_dir_max_age_s {job_dir_max_age_s} > 0",
                               field="keep_job_dirs")
        self.jobs_dir = Path(jobs_dir)
        self.daemon_address = daemon_address
        self.cache_dir = Path(cache_dir)
        self.key_file = Path(key_file) if key_file is not None else None
        """The daemon's key file, given to every rank as ``HAPD_KEY_FILE`` (None: not set)."""
        self.grace_s = grace_s
        self.slots = slots
        """Ranks this host runs at once (None: no limit); a launch past it is refused."""
        self.keep_finished = keep_finished
        self.keep_job_dirs = keep_job_dirs
        self.job_dir_max_age_s = job_dir_max_age_s
        self._jobs: dict[str, HostJob] = {}
        self._lock = threading.Lock()
        self._dirs_lock = threading.Lock()
        """Held while a job folder is written and its job registered, and while pruning."""
        self.records = RankRecords(Path(records_dir) if records_dir is not None else self.jobs_dir.parent / "ranks")
        self.records.stop_leftovers()
        self.prune_job_dirs()
        self.standby = standby
        if standby is not None:
            standby.fill()

    # -- queries

    def get(self, job_id: str) -> HostJob:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise OptionsError(f"no job {job_id!r} on this daemon", field="job")
        return job

    def summaries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.summary() for j in self._jobs.values()]

    def active(self) -> int:
        with self._lock:
            return sum(not j.finished for j in self._jobs.values())

    def running_ranks(self) -> int:
        with self._lock:
            return sum(j.spec.nproc for j in self._jobs.values() if not j.finished)

    # -- launch

    def launch(self, body: Mapping[str, Any]) -> HostJob:
        spec = LaunchSpec.from_body(body)
        with self._lock:
            old = self._jobs.get(spec.job)
            if old is not None and not old.finished:
                raise _bad(f"job {spec.job!r} is already {old.state}", "job")
        cwd = Path(spec.cwd) if spec.cwd else Path.cwd()
        with self._dirs_lock:  # a prune never removes the folder of a job being launched
            script = self._script_path(spec, cwd)
            # every rank runs under a guard that kills its process group should the daemon die
            runner = ["-m", IN_PLACE_MODULE if spec.in_place else SCRIPT_MODULE]
            command = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), "--",
                       sys.executable, "-u", *runner, str(script), *spec.args]
            with self._lock:  # the slots counted and taken at once: concurrent launches cannot both pass
                busy = sum(j.spec.nproc for j in self._jobs.values() if not j.finished)
                if self.slots is not None and busy + spec.nproc > self.slots:
                    raise _bad(f"this host has {self.slots} rank slot(s), {busy} in use: no room for {spec.nproc} "
                               "more rank(s)", "nproc")
                events = EventLog(self.jobs_dir / spec.job / SPILL_FILE, rank=spec.rank_offset)
                job = HostJob(spec, command, [Rank(spec.rank_offset + i, i) for i in range(spec.nproc)], events)
                self._jobs[spec.job] = job
                self._trim()
        delay = spec.start_at - time.time() if spec.start_at is not None else 0.0
        if delay > 0:
            log.info("job %s: %d ranks (%d..%d of %d) start in %.2f s", spec.job, spec.nproc, spec.rank_offset, spec.rank_offset + spec.nproc - 1, spec.world_size, delay)
            threading.Thread(target=self._delayed_start, args=(job, delay), name=f"hapd-job-{spec.job}", daemon=True).start()
        else:
            self._start(job, cwd)
        return job

    def _script_path(self, spec: LaunchSpec, cwd: Path) -> Path:
        """The script the ranks run: the shipped bytes written to the job's folder, or
        the named file, which must exist here."""
        if spec.script_bytes is not None:
            folder = private_folder(self.jobs_dir / spec.job)
            script = folder / spec.script
            script.write_bytes(spec.script_bytes)
            os.utime(folder)  # the newest folder: kept by the prune
            return script
        script = Path(spec.script) if Path(spec.script).is_absolute() else cwd / spec.script
        if not script.is_file():
            raise _bad(f"script {spec.script} is not a file on this host (looked at {script})", "script")
        return script

    def _delayed_start(self, job: HostJob, delay: float) -> None:
        if job.cancelled.wait(delay):
            return
        try:
            self._start(job, Path(job.spec.cwd) if job.spec.cwd else Path.cwd())
        except OSError as exc:
            job.add_event(job.spec.rank_offset, "stderr", f"hapd: cannot start the ranks: {exc}")
            job.set_reason(f"cannot start the ranks: {exc}")
            job.state = "failed"
            self._ended(job)

    def _start(self, job: HostJob, cwd: Path) -> None:
        spec = job.spec
        base = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", "HAPD_DAEMON": self.daemon_address,
                "HAPD_CACHE": str(self.cache_dir), "HAPD_JOB": spec.job, MARKER_ENV: job.token,
                STARTED_ENV: f"{time.time():.6f}"}
        if self.key_file is not None:
            base["HAPD_KEY_FILE"] = str(self.key_file)
        if spec.nproc > 1 and "OMP_NUM_THREADS" not in spec.env and "OMP_NUM_THREADS" not in os.environ:
            base["OMP_NUM_THREADS"] = "1"
        with job.lock:
            if job.cancelled.is_set():
                return
            try:
                for r in job.ranks:
                    if self._adopt(job, r, base, cwd, script_argv(job.command)):
                        continue
                    park: dict[str, Any] = {}
                    read_end = None
                    if spec.in_place:  # the park pipe: the rank reads it on a thread
                        read_end, r.park_fd = os.pipe()
                        os.set_blocking(r.park_fd, False)  # a rank that reads none never blocks the daemon
                        park = {"pass_fds": (read_end,)}
                    try:
                        r.proc = subprocess.Popen(
                            job.command,
                            cwd=cwd,
                            env={**base, **torchrun_env(spec, r.local_rank),
                                 **({PARK_FD_ENV: str(read_end)} if read_end is not None else {})},
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            start_new_session=True,  # its own process group: cancel kills the tree
                            **park,
                        )
                    finally:
                        if read_end is not None:
                            os.close(read_end)
            except OSError as exc:
                for r in job.ranks:
                    if r.park_fd is not None and r.proc is None:
                        os.close(r.park_fd)
                        r.park_fd = None
                self._kill(job, signal.SIGKILL)
                job.state = "failed"
                job.reason = job.reason or f"cannot start the ranks: {exc}"
                job.events.finish()
                raise
            self.records.write(spec.job, job.token, [r.proc.pid for r in job.ranks])
            for token, pid in job.adopted:
                self.records.write(spec.job, token, [pid])
            job.state = "running"
        warm = f" ({len(job.adopted)} from warm standbys)" if job.adopted else ""
        log.info("job %s: started ranks %d..%d of %d, pids %s%s", spec.job, spec.rank_offset, spec.rank_offset + spec.nproc - 1, spec.world_size, [r.proc.pid for r in job.ranks], warm)
        for r in job.ranks:
            threading.Thread(target=self._watch_rank, args=(job, r), name=f"hapd-rank-{r.rank}", daemon=True).start()

    def _adopt(self, job: HostJob, r: Rank, base: Mapping[str, str], cwd: Path, argv: list[str]) -> bool:
        """Hand rank ``r`` of an in-place launch to a warm standby process, if the pool
        has one that fits its environment; whether it did."""
        if self.standby is None or not job.spec.in_place:
            return False
        env = {**base, **torchrun_env(job.spec, r.local_rank)}
        while (standby := self.standby.take(env)) is not None:
            try:
                standby.hand_over(env, str(cwd), argv)
            except OSError as exc:
                log.warning("job %s: standby process %d could not take rank %d (%s): trying another", job.spec.job,
                            standby.proc.pid, r.rank, exc)
                standby.stop()
                continue
            r.proc, r.park_fd = standby.proc, standby.park_fd
            job.adopted.append((standby.token, standby.proc.pid))
            return True
        return False

    def _watch_rank(self, job: HostJob, r: Rank) -> None:
        proc = r.proc
        readers = [
            threading.Thread(target=self._read, args=(job, r, proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._read, args=(job, r, proc.stderr, "stderr"), daemon=True),
        ]
        for t in readers:
            t.start()
        code = proc.wait()
        for t in readers:
            t.join(timeout=READER_JOIN_S)
        with job.lock:
            if r.park_fd is not None:
                os.close(r.park_fd)
                r.park_fd = None
        r.returncode = code
        if goes_on_without(job, code):
            # an in-place job's rank killed by a signal: the others on this host go on (they park
            # and are switched to the next generation without it); what is left of its process
            # group goes, as its guard would have taken it along had the guard been killed
            log.info("job %s: rank %d killed (exit %d); the other local ranks go on", job.spec.job, r.rank, code)
            self._kill_rank(r)
            job.add_event(r.rank, "exit", str(code))
            self._finish_if_done(job)
            return
        # decided before the exit is published: a launcher that sees it cancels the job
        # everywhere, and that cancel must not turn this host's failure into "cancelled"
        failed_first = code != 0 and not job.cancelled.is_set()
        if failed_first:
            job.set_reason(f"rank {r.rank} exited with code {code}")
            with job.lock:
                job.rank_failed = True
        job.add_event(r.rank, "exit", str(code))
        log.info("job %s: rank %d exited with %d", job.spec.job, r.rank, code)
        if failed_first:
            others = [o for o in job.ranks if o is not r and o.returncode is None]
            if others:
                log.info("job %s: rank %d failed; stopping the other local ranks", job.spec.job, r.rank)
                self._stop(job)
        self._finish_if_done(job)

    def _finish_if_done(self, job: HostJob) -> None:
        """Once every rank has exited: the job's end state (the ranks dropped by a switch
        do not count, unless none went on)."""
        ended_now = False
        with job.lock:
            if all(x.returncode is not None for x in job.ranks) and not job.finished:
                counted = [x for x in job.ranks if not x.dropped] or job.ranks
                if job.cancelled.is_set() and not job.rank_failed:
                    job.state = "cancelled"
                else:
                    job.state = "exited" if all(x.returncode == 0 for x in counted) else "failed"
                ended_now = True
        if ended_now:
            log.info("job %s: %s%s", job.spec.job, job.state, f" ({job.reason})" if job.reason else "")
            self._ended(job)

    @staticmethod
    def _read(job: HostJob, rank: Rank, stream: Any, name: str) -> None:
        """A rank's output as events of at most :data:`MAX_LINE` bytes: a longer line in
        pieces marked ``more`` (the launcher joins them), decoded across the cuts, so a
        multi-byte character split by one arrives whole. Each event carries the rank's
        global rank when it was read (a ``switch`` renumbers it)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = False
        with stream:
            for raw in iter(lambda: stream.readline(MAX_LINE), b""):
                whole = raw.endswith(b"\n")
                text = decoder.decode(raw, final=whole)
                job.add_event(rank.rank, name, text.rstrip("\r\n") if whole else text, more=not whole)
                pending = not whole
        if pending:  # the output ended inside a line
            job.add_event(rank.rank, name, decoder.decode(b"", final=True))

    # -- stopping

    def cancel(self, job_id: str, reason: str = REASON_CANCELLED) -> HostJob:
        job = self.get(job_id)
        if job.finished:
            return job
        job.set_reason(reason)
        job.cancelled.set()
        log.info("job %s: cancelling (%s)", job_id, job.reason)
        with job.lock:  # _start spawns all ranks under this lock, or none once cancelled
            never_started = all(r.proc is None for r in job.ranks)
            if never_started:
                job.state = "cancelled"  # a delayed start that never started
        if never_started:
            self._ended(job)
        else:
            self._stop(job)
        return job

    def park(self, job_id: str, generation: int) -> int:
        """Tell an in-place job's running ranks that the ranks of ``generation`` park
        now (a line on each one's park pipe, :data:`PARK_FD_ENV`); how many were told."""
        job = self.get(job_id)
        told = 0
        with job.lock:
            if not job.spec.in_place:
                raise OptionsError(f"park: job {job_id!r} was not launched in place", field="job")
            for r in job.ranks:
                if r.park_fd is None or r.returncode is not None:
                    continue
                try:
                    os.write(r.park_fd, f"{generation}\n".encode())
                    told += 1
                except OSError:  # ended meanwhile (its end closed), or its pipe full of earlier requests
                    pass
        log.info("job %s: asked %d rank(s) of generation %d to park", job_id, told, generation)
        return told

    def switch(self, job_id: str, body: Mapping[str, Any]) -> HostJob:
        """Record where an in-place job's ranks go on (``switch``): the local ranks still
        running (every one but those killed by a signal, :func:`goes_on_without`, which
        are dropped) go on as local ranks 0…, in order; an order's ``nproc`` must count
        them. From now on their events carry their new global ranks, and a pause asked
        of the generation before is forgotten."""
        job = self.get(job_id)
        with job.lock:
            going = [r for r in job.ranks if not r.dropped and r.returncode is None and r.proc is not None]
            killed = [r for r in job.ranks if not r.dropped and r.returncode is not None and goes_on_without(job, r.returncode)]
            ended = [r.rank for r in job.ranks if not r.dropped and r not in going and r not in killed]
        order = SwitchOrder.from_body(body, len(going))
        with job.lock:
            if not job.spec.in_place:
                raise OptionsError(f"switch: job {job_id!r} was not launched in place", field="job")
            if job.finished or job.cancelled.is_set() or not going:
                raise OptionsError(f"switch: job {job_id!r} is {job.state}{' (cancelled)' if job.cancelled.is_set() else ''}",
                                   field="job")
            if ended:
                raise OptionsError(f"switch: rank(s) {ended} of job {job_id!r} are not running", field="job")
            if job.switch is not None and order.generation <= job.switch.generation:
                raise OptionsError(f"switch: job {job_id!r} already went to generation {job.switch.generation}",
                                   field="generation")
            job.switch = dataclasses.replace(order, kept=tuple(r.local_rank for r in going))
            job.pause_requested = False
            for r in killed:
                r.dropped = True
            for i, r in enumerate(going):
                r.local_rank = i
                r.rank = order.rank_offset + i
        log.info("job %s: switching in place to generation %d, ranks %d..%d of %d%s", job_id, order.generation,
                 order.rank_offset, order.rank_offset + order.nproc - 1, order.world_size,
                 f" (rank(s) {[r.rank for r in killed]} killed, left out)" if killed else "")
        return job

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Cancel every unfinished job whose launcher has been silent longer than its
        lease; the ids of the jobs cancelled now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [j for j in self._jobs.values()
                       if not j.finished and not j.cancelled.is_set() and j.silent_s(now) > j.spec.lease_s]
        for job in expired:
            reason = f"lease expired: launcher silent for {job.silent_s(now):.1f} s (lease {job.spec.lease_s:g} s)"
            log.warning("job %s: %s; stopping its ranks", job.spec.job, reason)
            job.add_event(job.spec.rank_offset, "stderr", f"hapd: {reason}; stopping this host's ranks")
            self.cancel(job.spec.job, reason)
        return [j.spec.job for j in expired]

    # -- job folders

    def _ended(self, job: HostJob) -> None:
        """A job has finished: its events leave memory but a small tail; its folder
        counts from now (the last finished are kept); forget old folders; stop what
        its ranks left running."""
        job.release_events()
        self._stop_left(job)
        if self.standby is not None and not self.active():
            self.standby.fill()  # not while a job runs: a new standby's imports take the ranks' CPU
        try:
            if (self.jobs_dir / job.spec.job).is_dir():
                os.utime(self.jobs_dir / job.spec.job)
            self.prune_job_dirs()
        except OSError as exc:  # a folder we cannot list or remove must not stop a job's watcher
            log.warning("cannot prune the job folders in %s: %s", self.jobs_dir, exc)

    def prune_job_dirs(self, now: float | None = None) -> list[str]:
        """Remove the folders of finished (or forgotten) jobs beyond the newest
        ``keep_job_dirs``, and those older than ``job_dir_max_age_s``; the names removed."""
        now = time.time() if now is None else now
        removed = []
        with self._dirs_lock:
            with self._lock:
                active = {k for k, j in self._jobs.items() if not j.finished}
            try:
                entries = list(self.jobs_dir.iterdir())
            except FileNotFoundError:
                return removed
            folders = []
            for entry in entries:
                try:
                    if entry.name not in active and entry.is_dir() and not entry.is_symlink():
                        folders.append((entry.stat().st_mtime, entry))
                except OSError:
                    continue
            folders.sort(key=lambda mf: mf[0], reverse=True)
            for kept, (mtime, folder) in enumerate(folders):
                if kept < self.keep_job_dirs and now - mtime <= self.job_dir_max_age_s:
                    continue
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
        if removed:
            log.info("removed %d old job folder(s) from %s", len(removed), self.jobs_dir)
        return removed

    def _stop(self, job: HostJob) -> None:
        """SIGTERM to every rank's process group and every process of the job; SIGKILL
        to those still there after the grace period."""
        self._kill(job, signal.SIGTERM)
        signal_marked(job.tokens, signal.SIGTERM)
        self._later(self._kill_rest, job)

    def _kill_rest(self, job: HostJob) -> None:
        """The end of a stop's grace period."""
        self._kill(job, signal.SIGKILL, True)
        signal_marked(job.tokens, signal.SIGKILL)
        if job.finished:
            self._remove_records(job)

    def _stop_left(self, job: HostJob) -> None:
        """A job has ended: what its ranks started and left running (in their own
        session, say) gets SIGTERM, then SIGKILL after the grace period; the job's
        record goes once nothing of it is left."""
        left = [pid for pids in marked_processes(job.tokens).values() for pid in pids]
        if not left:
            self._remove_records(job)
            return
        log.info("job %s: stopping %d process(es) its ranks left running: %s", job.spec.job, len(left), left[:8])
        signal_marked(job.tokens, signal.SIGTERM)
        self._later(self._kill_rest, job)

    def _remove_records(self, job: HostJob) -> None:
        for token in job.tokens:
            self.records.remove(token)

    def _later(self, action: Any, job: HostJob) -> None:
        timer = threading.Timer(self.grace_s, action, args=(job,))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _kill_rank(r: Rank) -> None:
        """SIGKILL what is left of one rank's process group (its guard or its script, when
        the other was killed)."""
        if r.proc is None:
            return
        try:
            os.killpg(r.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _kill(job: HostJob, sig: int, only_running: bool = False) -> None:
        """Signal every rank's process group (``only_running``: whose leader has not
        exited, so a recycled process group id is never signalled)."""
        for r in job.ranks:
            if r.proc is None or (only_running and r.returncode is not None):
                continue
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the standbys, cancel every job and wait for its ranks to exit (up to ``timeout_s``)."""
        if self.standby is not None:
            self.standby.close()
        with self._lock:
            jobs = [j for j in self._jobs.values() if not j.finished]
        for job in jobs:
            self.cancel(job.spec.job, REASON_STOPPING)
        deadline = time.monotonic() + timeout_s
        for job in jobs:
            for r in job.ranks:
                if r.proc is not None:
                    try:
                        r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        self._kill(job, signal.SIGKILL)
        with self._lock:  # what ranks left, of every job: the daemon's timers do not outlive it
            known = list(self._jobs.values())
        signal_marked({t for j in known for t in j.tokens}, signal.SIGKILL)
        for job in known:
            self._remove_records(job)
            with job.lock:
                job.events.close()  # its spill file: a stopped daemon keeps no job's output

    def kill_all(self) -> None:
        """SIGKILL every rank of every unfinished job, without waiting: the daemon's
        last act when its orderly :meth:`shutdown` was interrupted."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if not j.finished]
        for job in jobs:
            job.set_reason(REASON_STOPPING)
            job.cancelled.set()
            self._kill(job, signal.SIGKILL)
            signal_marked(job.tokens, signal.SIGKILL)
        if self.standby is not None:
            self.standby.close()

    def _trim(self) -> None:
        finished = [k for k, j in self._jobs.items() if j.finished]
        for k in finished[: max(0, len(finished) - self.keep_finished)]:
            job = self._jobs.pop(k)
            with job.lock:
                job.events.close()
