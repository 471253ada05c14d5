"""The hapd daemon: a drop folder, a plan cache and an authenticated ZeroMQ API.

Threads and who owns what:

- the **main loop** (:meth:`Daemon.run`) owns the ROUTER socket: it authenticates and
  dispatches every request, answers cheap ones at once (ping, status, job messages,
  snapshot messages, compile requests the cache can serve) and never waits on a
  compile, so ``ping`` and the ranks' snapshots stay answerable while a big graph
  compiles; training snapshots live in its :class:`~hapd.serve.snapshots.SnapshotStore`;
- one **compile worker** takes drops and compile requests from a FIFO queue, one at a
  time (compiles are CPU-heavy), and sends compile replies back through an inproc PAIR
  socket that the main loop forwards to the ROUTER;
- the **drop watcher** (:mod:`hapd.serve.watch`) hands over files once completely written;
  the worker compiles them with a :class:`~hapd.serve.drops.DropProcessor`;
- each launched rank has a watcher thread and two output readers (:mod:`hapd.serve.jobs`).

Errors are caught in one place per thread: the dispatch loop answers with an ``error``
reply, the worker writes an ``.error`` file; the daemon keeps serving. A drop is done
only when its plan is in ``out/`` or its error in ``failed/``; only then is the dropped
file moved to ``done/`` (or ``failed/``), so a daemon killed mid-compile compiles the
file again at its next start. The daemon installs no signal handlers: ``hapd serve``
turns SIGTERM/SIGINT into the ``stop`` event given to :class:`Daemon`.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import queue
import secrets
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import msgpack
import zmq

from hapd import __version__
from hapd.compiler.options import CompileOptions
from hapd.serve.cache import DEFAULT_MAX_CACHE_BYTES, PlanCache
from hapd.errors import GraphFormatError, HapdError, OptionsError, ProtocolError
from hapd.serve.jobs import JobManager
from hapd.serve.standby import MAX_STANDBY, StandbyPool
from hapd.wire.keys import home_dir, load_or_create_key
from hapd.profile.schema import Profile, load_profile
from hapd.wire.protocol import (DEFAULT_ADDRESS, PART_BYTES, PART_SLACK_BYTES, PROTOCOL_VERSION, Limits, Message,
                                 PartedMessages, Session, split_envelope)
from hapd.serve.drops import SUBFOLDERS, DropProcessor
from hapd.serve.snapshots import (DEFAULT_SNAPSHOT_KEEP, DEFAULT_SNAPSHOT_MAX_BYTES, DEFAULT_SNAPSHOT_TTL_S,
                                  SnapshotStore)
from hapd.serve.guard import MAX_LOGGED_CHARS, MAX_REPLY_ERROR_CHARS, ConnectionGate, RateLimitedLog, shorten, source_fd
from hapd.serve.watch import DEFAULT_RESCAN_S, DEFAULT_SETTLE_S, Drop
from hapd.util import atomic_write, private_folder

log = logging.getLogger("hapd.daemon")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
"""Largest request body by default (a compile request carries the whole graph; one
longer than :data:`~hapd.wire.protocol.PART_BYTES` arrives in parts)."""
DEFAULT_STOP_TIMEOUT_S = 30.0
"""How long a stop waits for the compile in progress by default."""
ROUTER_LINGER_MS = 2000
"""How long closing the ROUTER socket may wait to send the replies still queued."""
FRAME_SLACK_BYTES = 64 * 1024
"""The ROUTER's largest frame (``ZMQ_MAXMSGSIZE``) is the largest message body
(:func:`message_body_bytes`) plus this: libzmq refuses a larger frame as soon as its
size is read, before buffering any of it, and disconnects the peer; frames just over
the body limit reach the session's checks and are logged (the largest header is 64 KiB,
less than any body limit)."""
LOWER_COPY_PREFIX = "hapd-lower-"
"""Name prefix of the private copy of a .pt2 being lowered."""
DEFAULT_MAX_CONNECTIONS = 32
"""Peers connected at once by default (each launcher holds two per daemon); more are
refused as they connect."""
HANDSHAKE_SLACK_BYTES = 4096
"""Bytes of a connection's ZMTP greeting, handshake and frame headers, beyond its frames."""


def message_body_bytes(max_body_bytes: int) -> int:
    """The largest body of one message (the frame limit): a whole request of
    ``max_body_bytes`` when that is small, else one ``part`` of a request sent in parts."""
    return min(max_body_bytes, PART_BYTES + PART_SLACK_BYTES)


def preauth_bytes(max_body_bytes: int) -> int:
    """Most bytes a connection may send before a message of it is authenticated: one
    whole message of the largest size (its body, a header, the small frames): about a
    megabyte by default, whatever the largest request (those come in parts)."""
    return message_body_bytes(max_body_bytes) + FRAME_SLACK_BYTES + Limits().max_header_bytes + HANDSHAKE_SLACK_BYTES
SERVE_POLL_MS = 100
"""Longest wait of the main loop for a request or a worker reply (how soon it sees ``stop``)."""
MAX_REQUESTS_PER_WAKE = 64
"""Requests the main loop takes from the ROUTER before it looks at the worker's replies again."""
STOP_POLL_MS = 50
"""While stopping, how often the worker's replies are forwarded."""
WORKER_LINGER_MS = 1000
"""How long closing the worker's reply socket may wait to pass on its last replies."""
LEASE_CHECK_S = 0.5
"""How often the main loop cancels the jobs whose launcher has been silent past their lease."""


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything a daemon needs; :meth:`defaults` fills the state-directory layout."""

    home: Path
    """State directory: key, logs, jobs, lock and address files."""
    watch: Path
    """Drop folder (``out/``, ``failed/``, ``done/`` are created inside it)."""
    cache: Path
    """Plan cache folder."""
    profile: str | Path | Mapping[str, Any]
    """Cluster profile the drops are compiled for: a JSON file, a bundled name, or a map."""
    key_file: Path
    """Shared key (created 0600 on first start)."""
    bind: str = DEFAULT_ADDRESS
    """ZeroMQ endpoint of the control API (``tcp://host:port``; port ``*``: any free one)."""
    allow_remote: bool = False
    """Allow a bind address other than loopback (``hapd serve --bind`` sets it)."""
    max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES
    """Plan cache size bound (least recently used entries are evicted)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body (a compile request carries the whole graph)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """CompileOptions fields for drops and for requests that give none."""
    settle_s: float = DEFAULT_SETTLE_S
    """A file written in place must be unchanged this long after its last write."""
    rescan_s: float = DEFAULT_RESCAN_S
    """Period of the drop folder rescan (for events lost in a burst)."""
    slots: int = os.cpu_count() or 1
    """Rank slots this host offers (reported by ping)."""
    relp: bool = True
    """Serve a graph cached for another profile by re-solving only the LP."""
    preload: bool = True
    """Import the compiler (and torch) when the daemon starts, so the first compile does
    not wait for them (~2 s of CPU and ~500 MB); off, they are imported by the first
    compile (``hapd serve --no-preload``: a host that only runs ranks or serves cached
    plans)."""
    imports: tuple[str, ...] = ()
    """Modules the compile worker imports first: they register custom ops that dropped
    programs use (``hapd serve --import``)."""
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    """How long a stop waits for the compile in progress before abandoning it."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Peers connected to the control API at once; a connection beyond is refused."""
    snapshot_max_bytes: int = DEFAULT_SNAPSHOT_MAX_BYTES
    """Bytes of training snapshots held in memory at most (``hapd serve --snapshot-mb``)."""
    snapshot_ttl_s: float = DEFAULT_SNAPSHOT_TTL_S
    """A run's snapshots untouched (no put, get or list) this long are dropped."""
    snapshot_keep: int = DEFAULT_SNAPSHOT_KEEP
    """Most recent distinct steps of a run whose snapshots are kept."""
    standby: int = 0
    """Warm rank processes kept for elastic launches (``hapd serve --standby``,
    :mod:`hapd.serve.standby`); 0: every rank starts a new process."""
    standby_imports: tuple[str, ...] = ()
    """Modules each standby imports besides torch and hapd (the model's library)."""

    def __post_init__(self) -> None:
        if self.max_cache_bytes < 1:
            raise OptionsError(f"max_cache_bytes {self.max_cache_bytes} must be ≥ 1", field="max_cache_bytes")
        if self.max_body_bytes < 1024:
            raise OptionsError(f"max_body_bytes {self.max_body_bytes} must be ≥ 1024", field="max_body_bytes")
        if self.settle_s < 0 or self.rescan_s <= 0:
            raise OptionsError(f"settle_s {self.settle_s} must be ≥ 0 and rescan_s {self.rescan_s} > 0", field="settle_s")
        if self.slots < 0:
            raise OptionsError(f"slots {self.slots} must be ≥ 0", field="slots")
        if self.max_connections < 1:
            raise OptionsError(f"max_connections {self.max_connections} must be ≥ 1", field="max_connections")
        if self.snapshot_max_bytes < 0:
            raise OptionsError(f"snapshot_max_bytes {self.snapshot_max_bytes} must be ≥ 0", field="snapshot_max_bytes")
        if not self.snapshot_ttl_s > 0:
            raise OptionsError(f"snapshot_ttl_s {self.snapshot_ttl_s} must be > 0", field="snapshot_ttl_s")
        if not 0 <= self.standby <= MAX_STANDBY:
            raise OptionsError(f"standby {self.standby} must be in 0..{MAX_STANDBY}", field="standby")
        if self.snapshot_keep < 1:
            raise OptionsError(f"snapshot_keep {self.snapshot_keep} must be ≥ 1", field="snapshot_keep")
        if not is_loopback(self.bind) and not self.allow_remote:
            raise OptionsError(
                f"refusing to bind {self.bind}: not a loopback address (a daemon starts processes); "
                "pass it explicitly with --bind to listen on the network",
                field="bind",
            )

    @classmethod
    def defaults(
        cls,
        *,
        profile: str | Path | Mapping[str, Any],
        home: Path | None = None,
        watch: Path | None = None,
        cache: Path | None = None,
        key_file: Path | None = None,
        **rest: Any,
    ) -> "DaemonConfig":
        """A config whose unset folders lie in the state directory (``$HAPD_HOME`` or
        ``~/.hapd``): ``watch/``, ``cache/``, ``key``."""
        home = (Path(home) if home is not None else home_dir()).expanduser().absolute()
        return cls(
            home=home,
            watch=Path(watch).expanduser().absolute() if watch is not None else home / "watch",
            cache=Path(cache).expanduser().absolute() if cache is not None else home / "cache",
            key_file=Path(key_file).expanduser().absolute() if key_file is not None else home / "key",
            profile=profile,
            **rest,
        )


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable only from this host."""
    transport, _, rest = address.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass
class _Request:
    """A compile request waiting for the worker."""

    ids: list[bytes]
    message: Message
    graph: bytes
    kind: str
    profile: Profile
    options: CompileOptions
    received: float


LOCK_FILE = ".hapd.lock"
"""In a daemon's cache and drop folders: the file it holds an exclusive flock on."""


def folder_holder(folder: Path) -> str | None:
    """The pid (as the lock file names it, ``"?"`` when it names none) of the daemon that
    holds ``folder``'s lock, or None when no daemon uses the folder. Only looks: it takes
    the lock for an instant when it is free, and creates nothing."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (or no folder): never used by a daemon
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class _DirLock:
    """An exclusive flock on ``folder/.hapd.lock`` naming the holder's pid."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise OptionsError(f"another hapd daemon (pid {holder}) is using {folder}", field=str(folder)) from None
        os.ftruncate(self.fd, 0)
        try:
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full file system: the lock holds without the pid
            log.warning("cannot write the pid into %s: %s", self.path, exc.strerror)

    def release(self) -> None:
        os.close(self.fd)


class Daemon:
    """One daemon. ``run()`` serves until ``stop`` is set (or a ``shutdown`` request)."""

    def __init__(self, config: DaemonConfig, *, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.ready = threading.Event()
        """Set once the socket is bound and the drop folder watched."""
        self.address: str | None = None
        """The bound endpoint (with the real port)."""
        self.started = time.time()
        self.counters = {"rejected": 0, "requests": 0}
        self._tasks: queue.Queue[_Request | Drop | None] = queue.Queue()
        self._busy: str | None = None
        self._locks: list[_DirLock] = []
        self._inproc = f"inproc://hapd-replies-{secrets.token_hex(4)}"
        self._torch_version = ""
        self.ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.gate: ConnectionGate | None = None
        self._rejections = RateLimitedLog(log, "rejected messages and refused connections")
        self.replies: zmq.Socket | None = None
        self.worker: threading.Thread | None = None
        self.drops: DropProcessor | None = None
        self.jobs: JobManager | None = None
        self.snapshots = SnapshotStore(keep=config.snapshot_keep, max_bytes=config.snapshot_max_bytes,
                                       ttl_s=config.snapshot_ttl_s)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Serve until stopped; in-flight work is finished or abandoned cleanly."""
        try:
            self._setup()
            self._serve()
        finally:
            try:
                self._teardown()
            except BaseException:  # stopped hard (a second signal): ranks still never outlive the daemon
                if self.jobs is not None:
                    self.jobs.kill_all()
                raise

    def _setup(self) -> None:
        cfg = self.config
        for folder in (cfg.home, cfg.cache, cfg.home / "tmp"):  # the daemon's own state: its user's alone
            private_folder(folder)
        for folder in (cfg.watch, *(cfg.watch / sub for sub in SUBFOLDERS)):
            folder.mkdir(parents=True, exist_ok=True)
        self._locks = [_DirLock(cfg.cache)]
        if cfg.watch.resolve() != cfg.cache.resolve():
            self._locks.append(_DirLock(cfg.watch))
        for stale in (cfg.home / "tmp").glob("*.pt2"):  # private copies a killed daemon left
            stale.unlink(missing_ok=True)
        self.profile = load_profile(cfg.profile)
        self.options = CompileOptions.from_mapping(cfg.options)
        key = load_or_create_key(cfg.key_file)
        limits = Limits(max_body_bytes=message_body_bytes(cfg.max_body_bytes))
        self.session = Session(key, limits=limits)
        self.parts = PartedMessages(cfg.max_body_bytes, window_s=limits.window_s)
        self.cache = PlanCache(cfg.cache, cfg.max_cache_bytes, clean_tmp=True)
        try:
            self._torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            self._torch_version = "?"

        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, ROUTER_LINGER_MS)
        # before authentication: libzmq refuses a frame over the limit before buffering
        # it, and the gate bounds the peers and what each sends until authenticated
        self.router.setsockopt(zmq.MAXMSGSIZE, message_body_bytes(cfg.max_body_bytes) + FRAME_SLACK_BYTES)
        try:
            self.router.bind(cfg.bind)
        except zmq.ZMQError as exc:
            raise OptionsError(f"cannot bind {cfg.bind}: {exc} (is another daemon listening there?)", field="bind") from exc
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.gate = ConnectionGate(self.ctx, self.router, self.address, max_connections=cfg.max_connections,
                                   preauth_bytes=preauth_bytes(cfg.max_body_bytes), refusals=self._rejections)
        self.gate.start()
        self.replies = self.ctx.socket(zmq.PAIR)
        self.replies.bind(self._inproc)
        local = self.address.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")
        standby = StandbyPool(cfg.standby, imports=cfg.standby_imports) if cfg.standby else None
        self.jobs = JobManager(jobs_dir=cfg.home / "jobs", daemon_address=local, cache_dir=cfg.cache, key_file=cfg.key_file,
                               slots=cfg.slots, records_dir=cfg.home / "ranks", standby=standby)

        self.worker = threading.Thread(target=self._work, name="hapd-compile", daemon=True)
        self.worker.start()
        self.drops = DropProcessor(
            cfg.watch, cache=self.cache, profile=self.profile, options=self.options, relp=cfg.relp,
            lower=lambda data: self._lower_for(data, self.options),
            on_ready=self._tasks.put, settle_s=cfg.settle_s, rescan_s=cfg.rescan_s,
        )
        self.drops.start()
        atomic_write(
            cfg.home / "daemon.json",
            json.dumps({"address": self.address, "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL_VERSION, "started": self.started}).encode(),
            mode=0o644,
        )
        remote = "" if is_loopback(self.address) else " (reachable from the network)"
        log.info(
            "serving on %s%s; drop folder %s; cache %s; profile %s (%d devices, %s…); key %s",
            self.address, remote, cfg.watch, cfg.cache, self.profile.name, self.profile.world, self.profile.profile_id[:12], cfg.key_file,
        )
        self.ready.set()

    def _teardown(self) -> None:
        if self.drops is not None:
            self.drops.stop()
        if self.worker is not None:
            self._tasks.put(None)
            deadline = time.monotonic() + self.config.stop_timeout_s
            while self.worker.is_alive() and time.monotonic() < deadline:
                if self.replies.poll(STOP_POLL_MS):
                    self._forward_replies()
            self._forward_replies()
            if self.worker.is_alive():
                log.warning("stop: abandoning %s; a drop is compiled again at the next start", self._busy or "the compile in progress")
        if self.jobs is not None:
            self.jobs.shutdown()
        if self.gate is not None:
            self.gate.close()
        for sock in (self.replies, self.router):
            if sock is not None:
                sock.close()
        if self.ctx is not None and not (self.worker is not None and self.worker.is_alive()):
            self.ctx.term()
        if self.address is not None:
            (self.config.home / "daemon.json").unlink(missing_ok=True)
        for lock in self._locks:
            lock.release()
        if self.address is not None:
            log.info("stopped")

    # ------------------------------------------------------------------ the main loop

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        next_lease_check = time.monotonic() + LEASE_CHECK_S
        while not self.stop.is_set():
            events = dict(poller.poll(SERVE_POLL_MS))
            if time.monotonic() >= next_lease_check:
                # before the requests that waited: a daemon that was itself stopped past a
                # job's lease cancels it, whatever stale poll is queued
                self.jobs.expire_leases()
                next_lease_check = time.monotonic() + LEASE_CHECK_S
            self._rejections.flush()
            if self.replies in events:
                self._forward_replies()
            if self.router in events:
                for _ in range(MAX_REQUESTS_PER_WAKE):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
                    if self.stop.is_set():
                        break
        log.info("stopping")

    def _forward_replies(self) -> None:
        while True:
            try:
                frames = self.replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.router.send_multipart(frames)

    def _on_frames(self, raw: list[zmq.Frame]) -> None:
        peer = _peer(raw[0]) if raw else "?"
        frames = [f.buffer for f in raw]  # views: nothing is copied before it is authenticated
        fd = source_fd(raw[-1]) if raw else None
        if not self.gate.admits(fd):  # a connection over --max-connections, being closed
            self.counters["rejected"] += 1
            self._rejections.warning("refused connection", f"dropped a message from {peer}: its connection was refused")
            return
        try:
            routing, rest = split_envelope(frames)
            ids = [bytes(i) for i in routing]
            if not ids:
                raise ProtocolError("no routing identity")
            message = self.session.open(rest)
            self.gate.trust(fd)
        except ProtocolError as exc:  # AuthError included: dropped, never answered
            self.counters["rejected"] += 1
            self._rejections.warning(_rejection_kind(exc), f"rejected a message from {peer}: {type(exc).__name__}: {exc}")
            return
        self.counters["requests"] += 1
        try:
            self.session.check(message)
            whole = self.parts.add(message) if message.type == "part" else message
            if whole is None:  # a part before the last
                reply = ("ok", {})
            else:
                message = whole
                self.session.check(message)
                reply = getattr(self, f"_on_{message.type}")(ids, message)
        except HapdError as exc:
            log.warning("%s request from %s failed: %s: %s", message.type, peer, type(exc).__name__, shorten(str(exc), MAX_LOGGED_CHARS))
            reply = ("error", {"kind": type(exc).__name__, "message": shorten(str(exc), MAX_REPLY_ERROR_CHARS)})
        except Exception as exc:  # a bug: answer, log the traceback, keep serving
            log.error("%s request from %s: internal error\n%s", message.type, peer, shorten(traceback.format_exc(), 20 * MAX_LOGGED_CHARS))
            reply = ("error", {"kind": type(exc).__name__, "message": shorten(f"internal error: {exc}", MAX_REPLY_ERROR_CHARS)})
        if reply is not None:
            self._reply(self.router, ids, message, *reply)
        if message.type == "shutdown" and reply is not None and reply[0] == "ok":
            log.info("shutdown requested by %s", peer)
            self.stop.set()

    def _reply(self, sock: zmq.Socket, ids: list[bytes], request: Message, mtype: str, body: Mapping[str, Any]) -> None:
        _, frames = self.session.encode(mtype, body, parent=request.id)
        sock.send_multipart(ids + frames, copy=False)

    # ------------------------------------------------------------------ requests

    def _on_ping(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "pong", {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "host": socket.gethostname(),
            "profile_id": self.profile.profile_id,
            "profile_name": self.profile.name,
            "slots": max(0, self.config.slots - self.jobs.running_ranks()),
            "jobs": self.jobs.active(),
        }

    def _on_status(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "status", {
            "uptime_s": time.time() - self.started,
            "cache": self.cache.stats(),
            "queue": self.queue_length(),
            "jobs": self.jobs.summaries(),
            "drops": {"folder": str(self.config.watch), "done": self.drops.done, "failed": self.drops.failed},
            "snapshots": self.snapshots.stats(),
        }

    def queue_length(self) -> int:
        return self._tasks.qsize() + (1 if self._busy else 0) + self.drops.pending

    def _on_shutdown(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "ok", {}

    def _on_compile(self, ids: list[bytes], msg: Message) -> tuple[str, dict] | None:
        start = time.perf_counter()
        body = msg.body
        kind = body["graph_kind"]
        if kind not in ("hapg", "pt2", "graphs"):
            raise OptionsError(f"graph_kind {kind!r} is not hapg, pt2 or graphs", field="graph_kind")
        graph = body["graph"]
        if not graph:
            raise GraphFormatError("the graph is empty (0 bytes)")
        profile = self.profile if body.get("profile") is None else load_profile(body["profile"])
        options = CompileOptions.from_mapping({**(self.config.options or {}), **(body.get("options") or {})})
        lowered = self._lowered_before(graph, kind, options)
        served = self.cache.lookup(lowered, profile, options) if lowered is not None else None
        if served is not None:
            log.info("compile request: cache hit, %.1f ms", (time.perf_counter() - start) * 1e3)
            return "plan", {"plan": served.data, "cache": "hit", "seconds": time.perf_counter() - start}
        self._tasks.put(_Request(ids, msg, graph, kind, profile, options, start))
        return None  # the worker answers

    def _on_launch(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        job = self.jobs.launch(msg.body)
        return "launched", {"job": job.spec.job, "pids": [r.proc.pid for r in job.ranks if r.proc is not None]}

    def _on_job_status(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "job", self.jobs.get(msg.body["job"]).status()

    def _on_job_events(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        job = self.jobs.get(msg.body["job"])
        job.renew()  # its launcher is there
        events, done = job.events_after(msg.body["after"])
        return "events", {"job": job.spec.job, "events": events, "done": done}

    def _on_cancel(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        self.jobs.cancel(msg.body["job"])
        return "ok", {}

    def _on_pause(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        self.jobs.get(msg.body["job"]).pause_requested = True
        return "ok", {}

    def _on_park(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        self.jobs.park(msg.body["job"], msg.body["generation"])
        return "ok", {}

    def _on_switch(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        self.jobs.switch(msg.body["job"], msg.body)
        return "ok", {}

    # -- training snapshots (in memory, answered at once: never behind a compile)

    def _on_snapshot_put(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        b = msg.body
        self.snapshots.put(b["run"], b["step"], b["rank"], b["world"], b["name"], b["data"], offset=b["offset"],
                           total=b["total"], count=b["count"])
        return "ok", {}

    def _on_snapshot_list(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "snapshots", {"entries": self.snapshots.list(msg.body["run"])}

    def _on_snapshot_get(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        b = msg.body
        data, total = self.snapshots.get(b["run"], b["step"], b["rank"], b["name"], b["offset"], b["length"])
        return "snapshot_data", {"data": data, "total": total}

    def _on_snapshot_drop(self, ids: list[bytes], msg: Message) -> tuple[str, dict]:
        return "dropped", {"count": self.snapshots.drop(msg.body["run"], msg.body.get("before_step"))}

    # ------------------------------------------------------------------ the compile worker

    def _load_compiler(self) -> None:
        """Import the compiler (and torch, for .pt2) and the ``--import`` modules, then
        stop the collector scanning them: torch's millions of module-level objects made
        every full collection a 100+ ms pause of the main loop too, and they live as long
        as the process."""
        try:
            import hapd.compiler.driver  # noqa: F401
            import hapd.ir.lower  # noqa: F401
        except Exception as exc:  # a broken install: every compile will say why
            log.error("cannot import the compiler: %s", exc)
        for name in self.config.imports:  # custom ops: a program using them fails to load and says which
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a bad module must not stop the worker
                log.error("cannot import %s (--import): %s: %s", name, type(exc).__name__, exc)
        gc.collect()
        gc.freeze()

    def _work(self) -> None:
        replies = self.ctx.socket(zmq.PAIR)
        replies.connect(self._inproc)
        loaded = self.config.preload
        if loaded:
            self._load_compiler()
        try:
            while True:
                task = self._tasks.get()
                if task is None:
                    return
                if not loaded:  # the first task imports the compiler (a compile would anyway)
                    self._load_compiler()
                    loaded = True
                if self.stop.is_set():
                    self._abandon(replies, task)
                    continue
                if isinstance(task, Drop):
                    self._busy = f"drop {task.path.name}"
                    self.drops.process(task)
                else:
                    self._busy = "a compile request"
                    self._process_request(replies, task)
                self._busy = None
        finally:
            replies.close(linger=WORKER_LINGER_MS)

    def _abandon(self, replies: zmq.Socket, task: _Request | Drop) -> None:
        if isinstance(task, Drop):
            self.drops.abandon(task)  # left in the folder: compiled at the next start
        else:
            self._reply(replies, task.ids, task.message, "error", {"kind": "HapdError", "message": "the daemon is shutting down"})

    def _process_request(self, replies: zmq.Socket, req: _Request) -> None:
        try:
            graph = self._graphs(req.graph, req.kind, req.options)
            served = self.cache.compile(graph, req.profile, req.options, relp=self.config.relp)
            seconds = time.perf_counter() - req.received
            uncached = f" (not cached: {served.not_cached})" if served.not_cached else ""
            log.info("compile request: cache %s, %.2f s%s", served.path, seconds, uncached)
            reply = ("plan", {"plan": served.data, "cache": served.path, "seconds": seconds,
                              **({"not_cached": served.not_cached} if served.not_cached else {})})
        except HapdError as exc:
            log.warning("compile request failed: %s: %s", type(exc).__name__, shorten(str(exc), MAX_LOGGED_CHARS))
            reply = ("error", {"kind": type(exc).__name__, "message": shorten(str(exc), MAX_REPLY_ERROR_CHARS)})
        except Exception as exc:  # noqa: BLE001 - a bug in a compile must not stop the worker
            log.error("compile request: internal error\n%s", traceback.format_exc())
            reply = ("error", {"kind": type(exc).__name__, "message": shorten(f"internal error: {exc}", MAX_REPLY_ERROR_CHARS)})
        self._reply(replies, req.ids, req.message, *reply)

    # -- .pt2

    def _lowered_key(self, pt2: bytes, options: CompileOptions | None = None) -> str:
        """Key of a .pt2's lowered graph; with ``options`` that price other batches
        (pipelines, overlap), of the graphs of every batch they price."""
        tag = f"hapd.lowered\0{__version__}\0torch {self._torch_version}\0".encode()
        if options is not None and _prices_other_batches(options):
            tag += f"graphs\0pipeline {options.pipeline}\0overlap {options.overlap}\0".encode()
        return hashlib.sha256(tag + hashlib.sha256(pt2).digest()).hexdigest()

    def _lowered_before(self, graph: bytes, kind: str, options: CompileOptions) -> Any:
        """What a compile request's cache lookup reads, without lowering: the graph, the
        graphs sent (kind ``graphs``), or a .pt2's graph(s) lowered before; ``None`` when
        the .pt2 has not been lowered yet."""
        if kind == "hapg":
            return graph
        if kind == "graphs":
            return _graph_set(graph)
        cached = self.cache.get_lowered(self._lowered_key(graph, options))
        if cached is None or not _prices_other_batches(options):
            return cached
        return _graph_set(cached)

    def _graphs(self, graph: bytes, kind: str, options: CompileOptions) -> Any:
        """A request's graph to compile: as sent, or its .pt2 lowered for ``options``."""
        if kind == "hapg":
            return graph
        if kind == "graphs":
            return _graph_set(graph)
        return self._lower_for(graph, options)

    def _lower_for(self, pt2: bytes, options: CompileOptions) -> Any:
        """A .pt2's graph IR, or with pipelines or overlap in ``options`` the graphs of
        every batch they price, cut from the program
        (:func:`hapd.compiler.techniques.graphs_of_program`; cached)."""
        if not _prices_other_batches(options):
            return self._lower(pt2)
        from hapd.compiler.techniques import GraphSet, graphs_of_file

        key = self._lowered_key(pt2, options)
        cached = self.cache.get_lowered(key)
        if cached is not None:
            return GraphSet.from_bytes(cached)
        graphs = self._read_pt2(pt2, lambda path: graphs_of_file(path, options))
        self.cache.put_lowered(key, graphs.to_bytes())
        return graphs

    def _read_pt2(self, pt2: bytes, read: Callable[[Path], Any]) -> Any:
        """``read`` of a private copy of the .pt2 bytes (removed after); an error names
        the graph, not the copy."""
        tmp = self._private_copy(pt2)
        try:
            return read(tmp)
        except HapdError as exc:
            exc.message = str(exc).replace(str(tmp), "the .pt2 file")
            exc.args = (exc.message,)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def _lower(self, pt2: bytes) -> bytes:
        """The graph IR of a .pt2 (from the cache when it was lowered before)."""
        key = self._lowered_key(pt2)
        cached = self.cache.get_lowered(key)
        if cached is not None:
            return cached
        from hapd.ir.lower import lower

        graph = self._read_pt2(pt2, lambda path: lower(path).data)
        self.cache.put_lowered(key, graph)
        return graph

    def _private_copy(self, pt2: bytes) -> Path:
        """A private copy of a .pt2 to lower (torch loads programs from files): in the
        state directory's ``tmp/``, else, when that file system is full, in the system's
        temporary folder."""
        name = f"{LOWER_COPY_PREFIX}{secrets.token_hex(8)}.pt2"
        folders = (self.config.home / "tmp", Path(tempfile.gettempdir()))
        reasons = []
        for folder in folders:
            tmp = folder / name
            try:
                tmp.write_bytes(pt2)
                return tmp
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                reasons.append(f"{folder}: {exc.strerror}")
        raise HapdError(f"no room for a private copy of the .pt2 to lower ({'; '.join(reasons)})")


def _prices_other_batches(options: CompileOptions) -> bool:
    """Whether ``options`` price graphs at other batches than the global one
    (:func:`hapd.compiler.techniques.needs_other_batches`, without importing torch)."""
    return options.pipeline == "auto" or options.overlap


def _graph_set(data: bytes) -> Any:
    """The graphs of a technique search from their bytes (a request's ``graphs``);
    :class:`GraphFormatError` for bytes that are not that."""
    from hapd.compiler.techniques import GraphSet

    try:
        return GraphSet.from_bytes(data)
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise GraphFormatError(f"graphs: not the graphs of a technique search ({type(exc).__name__}: {exc})") from exc


def _rejection_kind(exc: ProtocolError) -> str:
    """What a rejection is counted under when it is not logged by itself: the error's
    class and first words (``AuthError: bad signature``)."""
    return " ".join([f"{type(exc).__name__}:", *str(exc).split()[:2]]).rstrip(":;,")


def _peer(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError, OSError):
        return "?"
