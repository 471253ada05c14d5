"""The daemon's control protocol: message types, framing, HMAC signing, replay checks.

Modeled on jupyter_client's ``session.py``: one class (:class:`Session`) builds, signs,
serializes and checks messages and remembers recent message ids against replays; the
protocol version (:data:`PROTOCOL_VERSION`) is separate from the package version. A
message is a ZeroMQ multipart message (a ROUTER socket prefixes the sender's identity
frames)::

    [b"hapd", b"1", signature, header, body]

- ``b"hapd"``: the delimiter between routing identities and the message;
- ``b"1"``: the protocol version in ASCII digits;
- ``signature``: HMAC-SHA256 under the shared key, as 64 lowercase hex digits, of
  ``b"hapd" ‖ version ‖ u64be(len(header)) ‖ header ‖ u64be(len(body)) ‖ body``
  (the lengths make the split between header and body part of what is signed);
- ``header``: msgpack map ``{"id": 32 hex digits, "type": str, "time": unix seconds,
  "session": str}`` plus ``"parent"`` (the request's id) on replies;
- ``body``: msgpack map whose fields the message type declares (:data:`REQUESTS`,
  :data:`REPLIES`; documented in ``docs/protocol.md``).

A request whose body is longer than :data:`PART_BYTES` (a compile request's graph, a
launch's shipped script) is sent as ``part`` requests, each signed and checked like any
message and carrying at most :data:`PART_BYTES` of the whole body; the daemon answers
``ok`` to each but the last, joins them (:class:`PartedMessages`) and answers the whole
request as the reply to its last part. So the daemon's frame limit, what a peer can make
it buffer before authenticating, stays about a megabyte whatever the largest request.

A receiver checks, in this order and before decoding anything: the frame count, the
delimiter, the version, the frame sizes (:class:`Limits`), the signature
(``hmac.compare_digest``); then it decodes the header and rejects a message sent more
than ``window_s`` from its own clock or whose id it has already seen; only then does it
decode the body. msgpack only, never pickle. This module does not import torch.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import msgpack

from hapd.errors import AuthError, ProtocolError

PROTOCOL_VERSION = 1
"""Version of the wire protocol (not of the hapd package)."""

MAGIC = b"hapd"
"""First frame of every message: the delimiter after the routing identities."""

MAX_FRAMES = 16
"""Most frames a message may have, routing identities included."""

DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"
"""Where a daemon listens unless told otherwise (loopback: a daemon starts processes)."""

MAX_SMALL_FRAME = 64
"""Bytes of the delimiter, version and signature frames a receiver looks at (a
signature is 64 hex digits; longer frames are refused by their length)."""

MAX_JOB_ID_CHARS = 64
"""Longest job id a message may carry (checked before the id is looked up or logged)."""

PART_BYTES = 2**20
"""A request body longer than this is sent in ``part`` requests of this many bytes each."""

PART_SLACK_BYTES = 4096
"""Bytes of a ``part`` body besides its data (its other fields, msgpack framing)."""

MAX_PARTED_MESSAGES = 8
"""Requests being received in parts at once (the oldest unfinished one is forgotten)."""

MAX_REPLAY_SENDERS = 4096
"""Senders (header ``session``) whose replay floors are remembered one by one; beyond
this many, the oldest floors merge into one floor for every sender."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What a receiver accepts. Sizes are checked before anything is decoded."""

    max_header_bytes: int = 64 * 1024
    """Largest header frame."""
    max_body_bytes: int = 256 * 2**20
    """Largest body frame (a ``compile`` request carries a whole graph)."""
    window_s: float = 60.0
    """Reject a message whose ``time`` is further than this from the receiver's clock
    (hosts' clocks must agree to within it)."""
    seen_ids: int = 65536
    """How many recent message ids are remembered against replays (see
    :class:`ReplayMemory`: when more arrive within the window, the oldest-dated are
    forgotten and only their own sender's older messages are refused)."""

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_body_bytes", "seen_ids"):
            if getattr(self, name) < 1:
                raise ProtocolError(f"{name} {getattr(self, name)} must be ≥ 1", field=name)
        if not self.window_s > 0:
            raise ProtocolError(f"window_s {self.window_s} must be > 0", field="window_s")


# ----------------------------------------------------------------------------- message types


@dataclass(frozen=True)
class Field:
    """One body field of a message type."""

    name: str
    kind: str
    """``str``, ``bytes``, ``int``, ``number`` (int or float), ``bool``, ``map``,
    ``list``, ``str_list``, ``str_map`` (str → str) or ``any``."""
    doc: str
    required: bool = True
    """An optional field may be absent or nil."""
    max_chars: int | None = None
    """For a ``str`` field: its longest value."""


@dataclass(frozen=True)
class MessageType:
    """A message type: its name, body fields, and (for a request) its reply types."""

    name: str
    doc: str
    fields: tuple[Field, ...] = ()
    replies: tuple[str, ...] = ()

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)


def _opt(name: str, kind: str, doc: str) -> Field:
    return Field(name, kind, doc, required=False)


def _job(doc: str = "job id") -> Field:
    return Field("job", "str", doc, max_chars=MAX_JOB_ID_CHARS)


MAX_SNAPSHOT_NAME_CHARS = 128
"""Longest snapshot file name a message may carry."""


def _run() -> Field:
    return Field("run", "str", "run id: letters, digits, '.', '_', '-' (≤ 64), like a job id", max_chars=MAX_JOB_ID_CHARS)


def _snapshot_file(doc: str) -> Field:
    return Field("name", "str", doc, max_chars=MAX_SNAPSHOT_NAME_CHARS)


JOB_STATES = ("starting", "running", "exited", "failed", "cancelled")
"""States of a launched job, in the order they can happen."""

EVENT_STREAMS = ("stdout", "stderr", "exit")
"""What a job event records: an output line of a rank, or its exit."""

REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in (
        MessageType("ping", "Is the daemon there, which versions, which profile, how busy.", (), ("pong",)),
        MessageType(
            "compile",
            "Compile a graph for a profile (the daemon's unless given); served from the plan cache when it can.",
            (
                Field("graph", "bytes", "the graph file's bytes: a .hapg graph IR or a torch.export .pt2, or the "
                      "graphs of a technique search (hapd.compiler.techniques.GraphSet.to_bytes)"),
                Field("graph_kind", "str", '"hapg", "pt2" or "graphs"'),
                _opt("profile", "map", "a cluster profile document (the JSON map); default: the daemon's profile"),
                _opt("options", "map", "CompileOptions fields (mode, zero, max_rounds, …); default: the daemon's"),
            ),
            ("plan",),
        ),
        MessageType("status", "Uptime, cache statistics, queue length and jobs.", (), ("status",)),
        MessageType("shutdown", "Stop the daemon (after the reply; the compile in progress finishes).", (), ("ok",)),
        MessageType(
            "launch",
            "Start this host's ranks of a job, each a subprocess with torchrun's environment.",
            (
                _job("job id, unique on this daemon: letters, digits, '.', '_', '-' (≤ 64)"),
                Field("script", "str", "the Python script to run: a path (relative to cwd) or, with script_bytes, its file name"),
                _opt("script_bytes", "bytes", "the script's content; the daemon writes it to a job directory and runs that"),
                Field("args", "str_list", "arguments after the script"),
                Field("env", "str_map", "extra environment for every rank (the torchrun variables are set by the daemon)"),
                Field("nproc", "int", "ranks on this host (LOCAL_WORLD_SIZE)"),
                Field("node_rank", "int", "this host's index among the job's hosts (GROUP_RANK)"),
                Field("nnodes", "int", "number of hosts in the job"),
                Field("rank_offset", "int", "global rank of this host's local rank 0"),
                Field("world_size", "int", "ranks in the whole job (WORLD_SIZE)"),
                Field("master_addr", "str", "address of global rank 0's host (MASTER_ADDR)"),
                Field("master_port", "int", "rendezvous port on master_addr (MASTER_PORT)"),
                _opt("start_at", "number", "unix time at which to start the ranks (a synchronized start); default now"),
                _opt("cwd", "str", "working directory of the ranks; default the daemon's"),
                _opt("lease_s", "number", "the job's lease: with no job_events poll about it for this long, the daemon "
                                          "cancels it (1 s to 7 days; default 60 s)"),
                _opt("in_place", "bool", "run the ranks under hapd's in-place runner: a rank whose peer went away waits "
                                         "for a switch and runs the script again in its process (an elastic job)"),
            ),
            ("launched",),
        ),
        MessageType("job_status", "State of a job and of each of its ranks.", (_job(),), ("job",)),
        MessageType(
            "job_events",
            "Output lines and exits of a job's ranks after a sequence number (per-iteration timings are output lines); "
            "renews the job's lease.",
            (_job(), Field("after", "int", "return events with seq > after; 0 for all")),
            ("events",),
        ),
        MessageType("cancel", "Stop every rank of a job (its whole process group).", (_job(),), ("ok",)),
        MessageType("pause", "Ask a job's ranks to stop at their next step boundary (an elastic job, for a host "
                             "joining); job_status then says pause: true.", (_job(),), ("ok",)),
        MessageType("park", "Ask an in-place job's ranks of one generation to leave their process groups at once and "
                            "park (an elastic job whose host went silent while they wait on it in a collective).",
                    (_job(), Field("generation", "int", "the generation whose ranks park (a later one ignores it)")),
                    ("ok",)),
        MessageType(
            "switch",
            "Tell an in-place job's ranks where they go on (an elastic job's next generation on the hosts left); "
            "job_status then carries it, and the ranks' events their new global ranks.",
            (
                _job(),
                Field("generation", "int", "the elastic job's generation they go on in (≥ 1, growing)"),
                Field("node_rank", "int", "this host's index among the generation's hosts (GROUP_RANK)"),
                Field("nnodes", "int", "number of hosts in the generation"),
                Field("rank_offset", "int", "global rank of this host's local rank 0 in the generation"),
                Field("world_size", "int", "ranks in the generation (WORLD_SIZE)"),
                Field("master_addr", "str", "address of the generation's rank 0's host (MASTER_ADDR)"),
                Field("master_port", "int", "rendezvous port on master_addr (MASTER_PORT)"),
                Field("env", "str_map", "environment the ranks set before running the script again"),
                _opt("nproc", "int", "this host's ranks in the generation: those of the job still running here (the "
                                     "ranks killed by a signal are left out); default: that number"),
            ),
            ("ok",),
        ),
        MessageType(
            "snapshot_put",
            "Store a chunk of one file of a rank's training snapshot in the daemon's memory.",
            (
                _run(),
                Field("step", "int", "training step of the snapshot (≥ 0)"),
                Field("rank", "int", "global rank that saved it (0 ≤ rank < world)"),
                Field("world", "int", "ranks of the run that saved it"),
                Field("count", "int", "how many files the rank's snapshot has (the same in each of its puts)"),
                _snapshot_file("file name: 1-128 letters, digits, '.', '_', '-', without '..'"),
                Field("offset", "int", "where the chunk goes in the file; 0 (re)starts the file, others continue it"),
                Field("total", "int", "bytes of the whole file"),
                Field("data", "bytes", "the chunk"),
            ),
            ("ok",),
        ),
        MessageType("snapshot_list", "The complete snapshots of a run this daemon holds.", (_run(),), ("snapshots",)),
        MessageType(
            "snapshot_get",
            "Bytes of one file of a snapshot.",
            (
                _run(),
                Field("step", "int", "training step"),
                Field("rank", "int", "global rank"),
                _snapshot_file("file name"),
                Field("offset", "int", "first byte to return"),
                Field("length", "int", "most bytes to return (at most 16 MiB)"),
            ),
            ("snapshot_data",),
        ),
        MessageType(
            "snapshot_drop",
            "Forget a run's snapshots, or only those of steps before a step.",
            (_run(), _opt("before_step", "int", "drop only steps < before_step; default every step")),
            ("dropped",),
        ),
        MessageType(
            "part",
            "One piece of a request whose body is longer than PART_BYTES; answered ok, the last by the whole "
            "request's reply.",
            (
                Field("message", "str", "id shared by the parts of one request: 32 hex digits", max_chars=32),
                Field("type", "str", "the whole request's type", max_chars=64),
                Field("index", "int", "this part's position, from 0"),
                Field("count", "int", "how many parts the request has"),
                Field("size", "int", "bytes of the whole request's msgpack body"),
                Field("data", "bytes", "the next bytes of that body (at most PART_BYTES)"),
            ),
            ("ok",),
        ),
    )
}
"""Request types (client → daemon), each with the reply type it gets (or ``error``)."""

REPLIES: dict[str, MessageType] = {
    m.name: m
    for m in (
        MessageType(
            "pong",
            "Reply to ping.",
            (
                Field("protocol", "int", "the daemon's protocol version"),
                Field("version", "str", "the daemon's hapd package version"),
                Field("host", "str", "the daemon's host name"),
                Field("profile_id", "str", "sha256 id of the daemon's cluster profile"),
                Field("profile_name", "str", "its name"),
                Field("slots", "int", "free rank slots (configured slots minus running ranks)"),
                Field("jobs", "int", "jobs not yet finished"),
            ),
        ),
        MessageType(
            "plan",
            "Reply to compile.",
            (
                Field("plan", "bytes", "the .hplan bytes"),
                Field("cache", "str", '"hit" (served from the cache), "miss" (compiled) or "lp-only" (cached program re-costed, LP re-solved)'),
                Field("seconds", "number", "time the daemon spent on the request"),
                _opt("not_cached", "str", 'why the compiled plan was not stored in the cache ("cache full", …); '
                                          "absent when it was"),
            ),
        ),
        MessageType(
            "status",
            "Reply to status.",
            (
                Field("uptime_s", "number", "seconds since the daemon started"),
                Field("cache", "map", "entries, bytes, max_bytes, hits, misses, lp_only, corrupt, evictions, not_cached"),
                Field("queue", "int", "drops and compiles waiting or in progress"),
                Field("jobs", "list", "job summaries: {job, state, nproc, world_size, rank_offset, started}"),
                _opt("drops", "map", "drop folder counters: done, failed, and the folder"),
                _opt("snapshots", "map", "snapshot store: runs, entries, bytes, max_bytes"),
            ),
        ),
        MessageType(
            "snapshots",
            "Reply to snapshot_list.",
            (Field("entries", "list", "complete snapshots by step then rank: [{step, rank, world, bytes, files: [names]}]"),),
        ),
        MessageType(
            "snapshot_data",
            "Reply to snapshot_get.",
            (Field("data", "bytes", "the file's bytes from offset (fewer than length at its end)"),
             Field("total", "int", "bytes of the whole file")),
        ),
        MessageType("dropped", "Reply to snapshot_drop.", (Field("count", "int", "snapshots (step, rank) forgotten"),)),
        MessageType("ok", "Success without data (shutdown, cancel, snapshot_put, a part before the last)."),
        MessageType(
            "launched",
            "Reply to launch.",
            (Field("job", "str", "job id"), Field("pids", "list", "process id of each local rank (empty until a delayed start)")),
        ),
        MessageType(
            "job",
            "Reply to job_status.",
            (
                Field("job", "str", "job id"),
                Field("state", "str", "one of " + ", ".join(JOB_STATES)),
                Field("ranks", "list", "per local rank: {rank (global), local_rank, pid, returncode (nil while running)}"),
                _opt("reason", "str", "why the job ended or is ending (a failing rank, a cancel, an expired lease)"),
                _opt("pause", "bool", "a pause was asked for the job (its ranks stop at their next step boundary)"),
                _opt("switch", "map", "the last switch request, with the time the daemon took it"),
            ),
        ),
        MessageType(
            "events",
            "Reply to job_events.",
            (
                Field("job", "str", "job id"),
                Field("events", "list", "[{seq, rank (global), stream: stdout|stderr|exit, line, time}] in seq order"),
                Field("done", "bool", "the job has finished and no event follows the last one returned"),
            ),
        ),
        MessageType(
            "error",
            "Reply to any request that failed; the client raises RemoteError.",
            (Field("kind", "str", "exception class name (a hapd.errors class)"), Field("message", "str", "what went wrong")),
        ),
    )
}
"""Reply types (daemon → client)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, bytes),
    "int": _is_int,
    "number": lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "map": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "str_list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "str_map": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "any": lambda v: True,
}


def validate_body(mtype: MessageType, body: Mapping[str, Any], where: str = "body") -> None:
    """Check ``body`` against ``mtype``'s fields; :class:`ProtocolError` names the field."""
    for f in mtype.fields:
        value = body.get(f.name)
        if value is None:
            if f.required:
                raise ProtocolError(f"{mtype.name}: field {f.name!r} is missing", field=f"{where}.{f.name}")
            continue
        if not _KIND_CHECKS[f.kind](value):
            raise ProtocolError(
                f"{mtype.name}: field {f.name!r} should be {f.kind}, got {type(value).__name__}", field=f"{where}.{f.name}"
            )
        if f.max_chars is not None and len(value) > f.max_chars:
            raise ProtocolError(
                f"{mtype.name}: field {f.name!r} is {len(value)} characters; at most {f.max_chars}", field=f"{where}.{f.name}"
            )
    unknown = sorted(k for k in body if mtype.field(k) is None)
    if unknown:
        raise ProtocolError(f"{mtype.name}: unknown field {unknown[0]!r}", field=f"{where}.{unknown[0]}")


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Message:
    """A decoded, authenticated message."""

    type: str
    body: dict[str, Any]
    id: str
    time: float
    session: str
    parent: str | None = None

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": self.type, "time": self.time, "session": self.session}
        if self.parent is not None:
            out["parent"] = self.parent
        return out


def split_envelope(frames: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Split a ROUTER-side message into (routing identities, message frames) at the
    first ``b"hapd"`` frame."""
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"{len(frames)} frames; at most {MAX_FRAMES}")
    for i, frame in enumerate(frames):
        if frame == MAGIC:
            return list(frames[:i]), list(frames[i:])
    raise ProtocolError("not a hapd message: no b'hapd' delimiter frame")


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _unpackb(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext, timestamp=3)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, …
        raise ProtocolError(f"{what} is not valid msgpack ({type(exc).__name__}: {exc})") from None


def _check_plain(obj: Any, depth: int = 0) -> None:
    """Only msgpack's plain types (no ext, no timestamps), nested at most 32 deep."""
    if depth > 32:
        raise ProtocolError("body nested too deeply")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(f"map key {k!r} is not a string")
            _check_plain(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_plain(v, depth + 1)
    elif isinstance(obj, float):
        if not math.isfinite(obj):
            raise ProtocolError("non-finite number")
    elif not (obj is None or isinstance(obj, (str, bytes, bool, int))):
        raise ProtocolError(f"value of type {type(obj).__name__} is not allowed")


def _u64(n: int) -> bytes:
    return struct.pack(">Q", n)


class ReplayMemory:
    """The ids of messages accepted within the time window, so that none is accepted twice.

    It holds at most ``capacity`` ids. An id whose message is dated more than
    ``window_s`` before now is dropped (its time alone refuses a replay). When more ids
    arrive than it holds, the id of the **oldest-dated** message is forgotten, and the
    floor of **that message's sender** (its header ``session``) rises to that date: the
    sender's messages dated at or before its floor are refused ("older than the replay
    memory reaches"), so a replay never gets through. A sender's own messages are dated
    in increasing order, so its floor never refuses its new messages; and a sender whose
    clock runs ahead fills the memory with ids dated in the future, which are the last
    to be forgotten: it can never raise another sender's floor past that sender's own
    messages. Floors are kept for :data:`MAX_REPLAY_SENDERS` senders; beyond that the
    lowest merge into one floor for all. Thread-safe."""

    def __init__(self, capacity: int, window_s: float, *, max_senders: int = MAX_REPLAY_SENDERS) -> None:
        self.capacity = capacity
        self.window_s = window_s
        self.max_senders = max_senders
        self._senders: dict[str, str] = {}  # id → its sender
        self._dates: list[tuple[float, str]] = []  # heap of (message time, id), oldest first
        self._floors: dict[str, float] = {}  # sender → date at or before which its ids may be forgotten
        self._floor = -math.inf  # the same, for senders whose own floor was merged
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._senders)

    def remember(self, mid: str, mtime: float, sender: str, now: float) -> None:
        """Record an accepted message; :class:`AuthError` for a replay, or for a message
        dated where the memory no longer reaches for its sender."""
        with self._lock:
            self._expire(now - self.window_s)
            if mid in self._senders:
                raise AuthError(f"replayed message {mid}", field="header.id")
            if mtime <= max(self._floor, self._floors.get(sender, -math.inf)):
                raise AuthError("message older than the replay memory reaches", field="header.time")
            self._senders[mid] = sender
            heapq.heappush(self._dates, (mtime, mid))
            while len(self._senders) > self.capacity:
                self._forget_oldest()

    def _expire(self, horizon: float) -> None:
        """Drop the ids dated before ``horizon`` (their time alone refuses them)."""
        while self._dates and self._dates[0][0] < horizon:
            _, mid = heapq.heappop(self._dates)
            self._senders.pop(mid, None)
        if len(self._floors) > self.max_senders:
            self._floors = {s: f for s, f in self._floors.items() if f >= horizon}

    def _forget_oldest(self) -> None:
        mtime, mid = heapq.heappop(self._dates)
        sender = self._senders.pop(mid)
        self._floors[sender] = max(self._floors.get(sender, -math.inf), mtime)
        if len(self._floors) > self.max_senders:
            self._merge_floors()

    def _merge_floors(self) -> None:
        """Keep the higher half of the senders' floors; the rest become the common floor."""
        ordered = sorted(self._floors.items(), key=lambda item: item[1])
        cut = len(ordered) - self.max_senders // 2
        self._floor = max(self._floor, ordered[cut - 1][1])
        self._floors = dict(ordered[cut:])


class Session:
    """Builds, signs and checks messages under one shared key (one per socket user).

    ``encode`` is safe from any thread; ``open``/``decode`` remember message ids and
    take a lock. ``clock`` is injectable for tests."""

    def __init__(
        self,
        key: bytes,
        *,
        session: str | None = None,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise AuthError("a session key must be at least 16 bytes", field="key")
        self._auth = hmac.new(key, digestmod=hashlib.sha256)
        self.session = session or uuid.uuid4().hex
        self.limits = limits or Limits()
        self.clock = clock
        self.replays = ReplayMemory(self.limits.seen_ids, self.limits.window_s)
        self.version_frame = str(PROTOCOL_VERSION).encode()

    # -- signing

    def sign(self, version: bytes, header: bytes, body: bytes) -> bytes:
        """HMAC-SHA256 over the delimiter, version, and length-prefixed header and body,
        as 64 lowercase hex digits."""
        h = self._auth.copy()
        h.update(MAGIC)
        h.update(version)
        h.update(_u64(len(header)))
        h.update(header)
        h.update(_u64(len(body)))
        h.update(body)
        return h.hexdigest().encode()

    def encode(self, type: str, body: Mapping[str, Any] | None = None, *, parent: str | None = None) -> tuple[Message, list[bytes]]:  # noqa: A002
        """A new message of ``type`` and its frames (without routing identities)."""
        body = dict(body or {})
        mtype = (REPLIES if parent is not None else REQUESTS).get(type)
        if mtype is None:
            raise ProtocolError(f"unknown message type {type!r}", field="type")
        validate_body(mtype, body)
        message = Message(type=type, body=body, id=uuid.uuid4().hex, time=self.clock(), session=self.session, parent=parent)
        header = _packb(message.header())
        payload = _packb(body)
        return message, [MAGIC, self.version_frame, self.sign(self.version_frame, header, payload), header, payload]

    def encode_request(self, type: str, body: Mapping[str, Any] | None = None, *,  # noqa: A002
                       part_bytes: int = PART_BYTES) -> list[tuple[Message, list[bytes]]]:
        """The messages that carry a request: itself, or, when its body is longer than
        ``part_bytes``, its ``part`` messages (the whole request's reply answers the last)."""
        body = dict(body or {})
        mtype = REQUESTS.get(type)
        if mtype is None or type == "part":
            raise ProtocolError(f"unknown request type {type!r}", field="type")
        validate_body(mtype, body)
        payload = _packb(body)
        if len(payload) <= part_bytes:
            return [self.encode(type, body)]
        whole = uuid.uuid4().hex
        count = -(-len(payload) // part_bytes)
        return [self.encode("part", {"message": whole, "type": type, "index": i, "count": count, "size": len(payload),
                                     "data": payload[i * part_bytes:(i + 1) * part_bytes]})
                for i in range(count)]

    # -- checking

    def open(self, frames: Sequence[bytes], *, replay: bool = True) -> Message:
        """Authenticate and decode a message (frames after the routing identities).

        Raises :class:`AuthError` for a bad signature, a stale or replayed message, and
        :class:`ProtocolError` for anything malformed; the type and fields are not
        checked here (:meth:`check`)."""
        limits = self.limits
        if len(frames) != 5:
            raise ProtocolError(f"expected 5 frames (hapd, version, signature, header, body), got {len(frames)}")
        # small frames as bytes; header and body stay views (of a ROUTER's frames) until authenticated
        magic, version, signature = (bytes(f[: MAX_SMALL_FRAME + 1]) for f in frames[:3])
        header, body = (f if isinstance(f, bytes) else memoryview(f) for f in frames[3:])
        if magic != MAGIC:
            raise ProtocolError("not a hapd message: the first frame is not b'hapd'")
        if version != self.version_frame:
            shown = version[:8].decode("ascii", "replace")
            raise ProtocolError(f"protocol version {shown!r}; this side speaks {PROTOCOL_VERSION}", field="version")
        if len(header) > limits.max_header_bytes:
            raise ProtocolError(f"oversized header: {len(header)} bytes > {limits.max_header_bytes}", field="header")
        if len(body) > limits.max_body_bytes:
            raise ProtocolError(f"oversized body: {len(body)} bytes > {limits.max_body_bytes}", field="body")
        if len(frames[2]) != 64:
            raise AuthError(f"unsigned or malformed signature ({len(frames[2])} bytes)", field="signature")
        if not hmac.compare_digest(signature, self.sign(version, header, body)):
            raise AuthError("bad signature: wrong key or a tampered message", field="signature")
        head = _unpackb(header, "header")
        message = self._header(head)
        now = self.clock()
        skew = now - message.time
        if abs(skew) > limits.window_s:
            when = f"sent {skew:.1f} s ago" if skew > 0 else f"dated {-skew:.1f} s in the future"
            raise AuthError(f"stale message: {when}; the window is {limits.window_s:g} s (are the clocks in sync?)", field="time")
        if replay:
            self.replays.remember(message.id, message.time, message.session, now)
        decoded = _unpackb(body, "body")
        if not isinstance(decoded, dict):
            raise ProtocolError(f"body is a {type(decoded).__name__}, not a map", field="body")
        _check_plain(decoded)
        return Message(message.type, decoded, message.id, message.time, message.session, message.parent)

    def _header(self, head: Any) -> Message:
        if not isinstance(head, dict):
            raise ProtocolError("header is not a map", field="header")
        mid, mtype, mtime, session, parent = (head.get(k) for k in ("id", "type", "time", "session", "parent"))
        if not isinstance(mid, str) or len(mid) != 32 or any(c not in "0123456789abcdef" for c in mid):
            raise ProtocolError("header id is not 32 hex digits", field="header.id")
        if not isinstance(mtype, str) or not 0 < len(mtype) <= 64:
            raise ProtocolError("header type is not a short string", field="header.type")
        if isinstance(mtime, bool) or not isinstance(mtime, (int, float)) or not math.isfinite(mtime):
            raise ProtocolError("header time is not a number", field="header.time")
        if not isinstance(session, str) or len(session) > 128:
            raise ProtocolError("header session is not a short string", field="header.session")
        if parent is not None and not isinstance(parent, str):
            raise ProtocolError("header parent is not a string", field="header.parent")
        unknown = sorted(set(head) - {"id", "type", "time", "session", "parent"})
        if unknown:
            raise ProtocolError(f"unknown header field {unknown[0]!r}", field=f"header.{unknown[0]}")
        return Message(mtype, {}, mid, float(mtime), session, parent)

    def check(self, message: Message, *, reply: bool = False) -> MessageType:
        """The message's type, after checking its body fields."""
        table = REPLIES if reply else REQUESTS
        mtype = table.get(message.type)
        if mtype is None:
            kind = "reply" if reply else "request"
            raise ProtocolError(f"unknown {kind} type {message.type!r}", field="header.type")
        validate_body(mtype, message.body)
        return mtype

    def decode(self, frames: Sequence[bytes], *, reply: bool = False, replay: bool = True) -> Message:
        """:meth:`open` then :meth:`check`."""
        message = self.open(frames, replay=replay)
        self.check(message, reply=reply)
        return message


@dataclass
class _Receiving:
    """A request being received in parts."""

    type: str
    count: int
    size: int
    data: bytearray
    updated: float
    next_index: int = 0


class PartedMessages:
    """Joins the ``part`` requests of each request sent in parts (all authenticated
    already) into the whole request. A whole body is at most ``max_body_bytes``; at most
    ``max_messages`` requests are received at once (a new one makes the oldest
    forgotten), and one whose next part does not come within ``window_s`` is forgotten.
    Parts come in order, from one sender (header ``session``). Errors are
    :class:`ProtocolError`. Used by one thread."""

    def __init__(self, max_body_bytes: int, *, window_s: float = 60.0, max_messages: int = MAX_PARTED_MESSAGES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_body_bytes = max_body_bytes
        self.window_s = window_s
        self.max_messages = max_messages
        self.clock = clock
        self._receiving: dict[tuple[str, str], _Receiving] = {}

    def __len__(self) -> int:
        return len(self._receiving)

    def add(self, part: Message) -> Message | None:
        """Take one part (its body checked against the ``part`` type); the whole request
        once this was its last part (its id, time and session those of the last part),
        else None."""
        now = self.clock()
        self._expire(now)
        body = part.body
        key = (part.session, body["message"])
        try:
            receiving = self._receiving.get(key) or self._begin(key, body, now)
            self._check(receiving, body)
        except ProtocolError:
            self._receiving.pop(key, None)  # the sender gets the error; what it sent so far is dropped
            raise
        receiving.data += body["data"]
        receiving.next_index += 1
        receiving.updated = now
        if receiving.next_index < receiving.count:
            return None
        del self._receiving[key]
        if len(receiving.data) != receiving.size:  # (cannot be more: checked per part)
            raise ProtocolError(f"parted {receiving.type}: {len(receiving.data)} bytes received, {receiving.size} announced",
                                field="body.size")
        decoded = _unpackb(bytes(receiving.data), "body")
        if not isinstance(decoded, dict):
            raise ProtocolError(f"body is a {type(decoded).__name__}, not a map", field="body")
        _check_plain(decoded)
        return Message(receiving.type, decoded, part.id, part.time, part.session)

    def _begin(self, key: tuple[str, str], body: Mapping[str, Any], now: float) -> _Receiving:
        mtype, count, size = body["type"], body["count"], body["size"]
        if mtype not in REQUESTS or mtype == "part":
            raise ProtocolError(f"part of an unknown request type {mtype!r}", field="body.type")
        if body["index"] != 0:
            raise ProtocolError(f"part {body['index']} of a request whose first part never came", field="body.index")
        if not 0 < size <= self.max_body_bytes:
            raise ProtocolError(f"oversized body: {size} bytes > {self.max_body_bytes} (in parts)", field="body.size")
        if not 1 < count <= size:
            raise ProtocolError(f"a request of {size} bytes cannot come in {count} parts", field="body.count")
        if len(self._receiving) >= self.max_messages:
            oldest = min(self._receiving, key=lambda k: self._receiving[k].updated)
            del self._receiving[oldest]
        receiving = _Receiving(mtype, count, size, bytearray(), now)
        self._receiving[key] = receiving
        return receiving

    @staticmethod
    def _check(receiving: _Receiving, body: Mapping[str, Any]) -> None:
        if (body["type"], body["count"], body["size"]) != (receiving.type, receiving.count, receiving.size):
            raise ProtocolError("a part disagrees with the first part of its request (type, count or size)",
                                field="body.count")
        if body["index"] != receiving.next_index:
            raise ProtocolError(f"part {body['index']} came where part {receiving.next_index} was expected",
                                field="body.index")
        if len(receiving.data) + len(body["data"]) > receiving.size:
            raise ProtocolError(f"parts longer than the {receiving.size} bytes announced", field="body.data")

    def _expire(self, now: float) -> None:
        for key in [k for k, r in self._receiving.items() if now - r.updated > self.window_s]:
            del self._receiving[key]


__all__ = [
    "PROTOCOL_VERSION",
    "MAGIC",
    "DEFAULT_ADDRESS",
    "Limits",
    "MAX_JOB_ID_CHARS",
    "MAX_SNAPSHOT_NAME_CHARS",
    "ReplayMemory",
    "Field",
    "MessageType",
    "REQUESTS",
    "REPLIES",
    "JOB_STATES",
    "EVENT_STREAMS",
    "Message",
    "Session",
    "PartedMessages",
    "PART_BYTES",
    "split_envelope",
    "validate_body",
]
