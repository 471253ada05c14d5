"""The plan cache: content-addressed, checksummed, atomically written, size-bounded (LRU).

An entry's key is the sha256 of the canonical JSON of (graph id, profile id, compiler
version, options): the same graph compiled for the same cluster by the same hapd with
the same options is the same plan. Each entry is one file::

    b"HAPDCACH" ‖ u32be(len(header)) ‖ header (msgpack) ‖ payload

with header ``{"format": "hapd.cache-entry", "version": 1, "kind", "key", "parts",
"family", "sha256", "length", "created"}``. Writes go to a temporary file in the same
folder that is fsynced and renamed over the entry, so a reader (or a daemon restarted
after SIGKILL) sees either no entry or a whole one. ``get`` checks the magic, the
header, that the header's key is the key asked for, the payload's length and sha256,
and that the plan inside names the same key; anything else is a corrupt or mismatched
entry: it is logged, deleted, and reported as a miss, never served.

Entries are kept under ``max_bytes`` by evicting the least recently used (a hit touches
the file's mtime, so the order survives restarts). Besides plans, the cache holds
lowered graphs of ``.pt2`` files (kind ``"lowered"``), so dropping the same ``.pt2``
twice does not lower it twice.

The **family** of a plan key is the same hash without the profile id: when a graph is
compiled for a profile it has no plan for, but a plan of the same family exists for
another profile, :meth:`PlanCache.compile` re-costs that plan's program for the new
profile and re-solves only the sharding-ratio LP (``"lp-only"``, see
:mod:`hapd.compiler.replan`) instead of searching again.

One daemon owns a cache folder at a time (the daemon takes a lock on it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import msgpack

from hapd import __version__
from hapd.errors import HapdError, OptionsError, PlanError
from hapd.util import atomic_write, format_bytes, private_folder

if TYPE_CHECKING:
    from hapd.compiler.techniques import GraphSet
    from hapd.compiler.options import CompileOptions
    from hapd.compiler.plan import Plan
    from hapd.profile.schema import Profile

log = logging.getLogger("hapd.cache")

ENTRY_MAGIC = b"HAPDCACH"
ENTRY_FORMAT = "hapd.cache-entry"
ENTRY_VERSION = 1
MAX_HEADER = 1 << 20
KINDS = ("plan", "lowered")
DEFAULT_MAX_CACHE_BYTES = 2 * 2**30
"""The cache's size bound unless one is given (``hapd serve --max-cache-bytes``)."""
PATHS = ("hit", "miss", "lp-only")
"""How a compile was served: from the cache, by a full compile, or by re-solving the LP
for a cached program of another profile."""

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""Errors of a write that found the cache's file system (or the user's quota) full."""
CACHE_FULL = "cache full"
"""How a plan served but not cached for lack of space is described (logs, replies,
drop reports)."""

_HEAD = struct.Struct(">8sI")


def _digest(doc: Mapping[str, Any]) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """What a plan is a function of."""

    graph_id: str
    profile_id: str
    compiler_version: str
    options: Mapping[str, Any]
    """``CompileOptions.key()``."""
    graphs: Mapping[str, Any] | None = None
    """A technique search's graphs (:meth:`hapd.compiler.techniques.GraphSet.key`: the
    ids of the micro-batch and half-batch graphs priced beside ``graph_id``, the global
    batch's, and why any is missing); ``None`` for a compile of one graph (its key is
    then what it was before techniques were searched)."""
    cost_model: str | None = None
    """The pipeline pricing's revision (``None``: this hapd's,
    :data:`hapd.compiler.pipeline.stage_cost.COST_MODEL_REVISION`, read when the key is
    made into parts: the daemon loads the compiler on its first compile, never at
    import): a plan whose pipelines were priced by an older one (same hapd version,
    graph, profile and options) is not served. Part of the key where pipelines are
    priced (a technique search's graphs, or ``pipeline`` not ``"off"`` in the options);
    other keys are what they were."""

    def parts(self) -> dict[str, Any]:
        parts = {
            "graph_id": self.graph_id,
            "profile_id": self.profile_id,
            "compiler_version": self.compiler_version,
            "options": dict(self.options),
        }
        if self.graphs is not None:
            parts["graphs"] = dict(self.graphs)
        if self.graphs is not None or self.options.get("pipeline", "off") != "off":
            if self.cost_model is None:
                from hapd.compiler.pipeline.stage_cost import COST_MODEL_REVISION

                parts["cost_model"] = COST_MODEL_REVISION
            else:
                parts["cost_model"] = self.cost_model
        return parts

    @property
    def digest(self) -> str:
        return _digest(self.parts())

    @property
    def family(self) -> str:
        """The key without the profile: plans of one graph, compiler and options."""
        parts = self.parts()
        del parts["profile_id"]
        return _digest(parts)

    @classmethod
    def of(cls, graph: "str | bytes | GraphSet", profile: "Profile", options: "CompileOptions") -> "CacheKey":
        """The key of compiling ``graph`` (a graph id, a graph's bytes, or the graphs of
        a technique search) for ``profile`` with ``options``."""
        if isinstance(graph, str):
            return cls(graph, profile.profile_id, __version__, options.key())
        if isinstance(graph, (bytes, bytearray)):
            return cls(hashlib.sha256(graph).hexdigest(), profile.profile_id, __version__, options.key())
        return cls(graph.full.graph_id, profile.profile_id, __version__, options.key(), graph.key())

    def matches(self, plan_key: Mapping[str, Any]) -> bool:
        """Whether a plan's ``key`` map is for this key (a technique search's plan
        names the global batch's graph in ``graphs.full``; its ``graph_id`` is the graph
        its program runs, the half batch's for overlap)."""
        graphs = plan_key.get("graphs")
        full = graphs.get("full") if isinstance(graphs, Mapping) else plan_key.get("graph_id")
        return (
            full == self.graph_id
            and plan_key.get("profile_id") == self.profile_id
            and plan_key.get("compiler_version") == self.compiler_version
            and _digest({"o": plan_key.get("options")}) == _digest({"o": dict(self.options)})
            and _digest({"g": graphs}) == _digest({"g": dict(self.graphs) if self.graphs is not None else None})
        )


@dataclass(frozen=True)
class Served:
    """A plan and how it was obtained."""

    plan: "Plan"
    data: bytes
    """The plan's bytes (``.hplan``)."""
    path: str
    """``"hit"``, ``"miss"`` or ``"lp-only"``."""
    seconds: float
    """Time spent serving it (lookup, compile, writes)."""
    not_cached: str | None = None
    """Why a compiled plan was not stored (``"cache full"``, …); None when it was, or
    for a hit."""


@dataclass
class _CachedFile:
    kind: str
    path: Path
    size: int
    family: str | None
    profile_id: str | None
    parts: dict[str, Any] | None


class _CorruptEntry(HapdError):
    """A cache entry failed its checks (internal: reported as a miss)."""


def _pack_entry(kind: str, key: str, payload: bytes, parts: Mapping[str, Any] | None, family: str | None) -> bytes:
    header = msgpack.packb(
        {
            "format": ENTRY_FORMAT,
            "version": ENTRY_VERSION,
            "kind": kind,
            "key": key,
            "parts": dict(parts) if parts is not None else None,
            "family": family,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "length": len(payload),
            "created": time.time(),
        },
        use_bin_type=True,
    )
    return _HEAD.pack(ENTRY_MAGIC, len(header)) + header + payload


def _parse_header(blob: bytes) -> tuple[dict[str, Any], int]:
    if len(blob) < _HEAD.size:
        raise _CorruptEntry(f"truncated ({len(blob)} bytes)")
    magic, hlen = _HEAD.unpack_from(blob)
    if magic != ENTRY_MAGIC:
        raise _CorruptEntry("bad magic")
    if hlen > MAX_HEADER or _HEAD.size + hlen > len(blob):
        raise _CorruptEntry("truncated header")
    try:
        header = msgpack.unpackb(blob[_HEAD.size : _HEAD.size + hlen], raw=False)
    except Exception as exc:  # msgpack's ValueError family
        raise _CorruptEntry(f"unreadable header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != ENTRY_FORMAT:
        raise _CorruptEntry("not a cache entry header")
    if header.get("version") != ENTRY_VERSION:
        raise _CorruptEntry(f"entry version {header.get('version')!r}, this hapd reads {ENTRY_VERSION}")
    if header.get("kind") not in KINDS or not isinstance(header.get("key"), str):
        raise _CorruptEntry("bad kind or key in header")
    return header, _HEAD.size + hlen


class PlanCache:
    """The on-disk cache under ``root`` (thread-safe)."""

    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_MAX_CACHE_BYTES, *, clean_tmp: bool = False) -> None:
        if max_bytes < 1:
            raise OptionsError(f"max_bytes {max_bytes} must be ≥ 1", field="max_bytes")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self._lock = threading.RLock()
        self._index: OrderedDict[str, _CachedFile] = OrderedDict()  # least recently used first
        self._last_ns = 0
        self.counters = {"hits": 0, "misses": 0, "lp_only": 0, "corrupt": 0, "evictions": 0, "not_cached": 0}
        self._failing: str | None = None  # why writes fail, since the first that did (warned once)
        for kind in KINDS:
            private_folder(self.root / kind)
        self._scan(clean_tmp)

    # -- layout

    def _path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.entry"

    def _scan(self, clean_tmp: bool) -> None:
        found: list[tuple[float, str, _CachedFile]] = []
        for kind in KINDS:
            for path in (self.root / kind).glob("*/*"):
                if path.name.endswith(".tmp"):
                    if clean_tmp:
                        log.info("cache: removing unfinished write %s", path.name)
                        path.unlink(missing_ok=True)
                    continue
                if not path.name.endswith(".entry"):
                    continue
                try:
                    with path.open("rb") as handle:
                        head = handle.read(_HEAD.size)
                        if len(head) == _HEAD.size:
                            head += handle.read(min(_HEAD.unpack(head)[1], MAX_HEADER))
                    header, _ = _parse_header(head)
                    if header["key"] != path.name[: -len(".entry")] or header["kind"] != kind:
                        raise _CorruptEntry("entry file name does not match its key")
                    st = path.stat()
                except (OSError, struct.error, _CorruptEntry) as exc:
                    self._discard(path, str(exc))
                    continue
                parts = header.get("parts") if isinstance(header.get("parts"), dict) else None
                entry = _CachedFile(kind, path, st.st_size, header.get("family"), parts.get("profile_id") if parts else None, parts)
                found.append((st.st_mtime_ns, header["key"], entry))
                self._last_ns = max(self._last_ns, st.st_mtime_ns)
        for _, key, entry in sorted(found, key=lambda t: t[0]):
            self._index[key] = entry
        if found:
            log.info("cache: %d entries, %s, in %s", len(found), format_bytes(self.total_bytes), self.root)
        self._evict()

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._index), "bytes": self.total_bytes, "max_bytes": self.max_bytes, **self.counters}

    def _discard(self, path: Path, reason: str) -> None:
        log.warning("cache: corrupt or mismatched entry %s (%s): removed, will recompile", path.name, reason)
        self.counters["corrupt"] += 1
        path.unlink(missing_ok=True)
        key = path.name[: -len(".entry")]
        self._index.pop(key, None)

    # -- raw entries

    def _read(self, kind: str, key: str) -> tuple[dict[str, Any], bytes] | None:
        path = self._path(kind, key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self._index.pop(key, None)
            return None
        except OSError as exc:
            log.warning("cache: cannot read %s (%s): treated as a miss", path, exc.strerror)
            return None
        try:
            header, start = _parse_header(blob)
            if header["key"] != key or header["kind"] != kind:
                raise _CorruptEntry(f"entry holds key {str(header['key'])[:16]}…, not {key[:16]}…")
            payload = blob[start:]
            if header.get("length") != len(payload):
                raise _CorruptEntry(f"payload is {len(payload)} bytes, header says {header.get('length')}")
            if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
                raise _CorruptEntry("payload checksum mismatch")
        except _CorruptEntry as exc:
            self._discard(path, str(exc))
            return None
        self._touch(kind, key, header, path, len(blob))
        return header, payload

    def _stamp(self, path: Path) -> None:
        """Set the entry's mtime to a strictly increasing now (the file system's own
        clock is too coarse to order entries used within a few ms): the LRU order."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except OSError:
            pass

    def _touch(self, kind: str, key: str, header: dict[str, Any], path: Path, size: int) -> None:
        self._stamp(path)
        entry = self._index.get(key)
        if entry is None:
            parts = header.get("parts") if isinstance(header.get("parts"), dict) else None
            entry = _CachedFile(kind, path, size, header.get("family"), parts.get("profile_id") if parts else None, parts)
            self._index[key] = entry
        self._index.move_to_end(key)

    def _write(self, kind: str, key: str, payload: bytes, parts: Mapping[str, Any] | None = None, family: str | None = None) -> str | None:
        """Store an entry; None when stored, else why not (the entry is too large for the
        bound, or the file system refused the write: then the caller serves it uncached)."""
        blob = _pack_entry(kind, key, payload, parts, family)
        if len(blob) > self.max_bytes:
            log.warning("cache: %s entry of %s exceeds the bound %s: not cached", kind, format_bytes(len(blob)), format_bytes(self.max_bytes))
            return f"larger than the cache bound {format_bytes(self.max_bytes)}"
        path = self._path(kind, key)
        try:
            private_folder(path.parent)
            atomic_write(path, blob, mode=0o600)
        except OSError as exc:
            return self._write_failed(exc)
        self._write_succeeded()
        with self._lock:
            self._stamp(path)
            self._index[key] = _CachedFile(kind, path, len(blob), family, (parts or {}).get("profile_id"), dict(parts) if parts else None)
            self._index.move_to_end(key)
            self._evict(keep=key)
        return None

    def _write_failed(self, exc: OSError) -> str:
        """Count a write the file system refused; warn at the first of a run of them."""
        full = exc.errno in NO_SPACE_ERRNOS
        reason = CACHE_FULL if full else f"cache not writable ({exc.strerror})"
        with self._lock:
            self.counters["not_cached"] += 1
            first, self._failing = self._failing is None, reason
        if first and full:
            log.warning("cache full: no space left in %s; plans are served but not cached until space frees", self.root)
        elif first:
            log.warning("cache not writable: %s in %s; plans are served but not cached until a write succeeds", exc.strerror, self.root)
        return reason

    def _write_succeeded(self) -> None:
        with self._lock:
            recovered, self._failing = self._failing, None
        if recovered is not None:
            log.info("cache: writes succeed again in %s: plans are cached", self.root)

    def _evict(self, keep: str | None = None) -> None:
        with self._lock:
            total = self.total_bytes
            for key in list(self._index):
                if total <= self.max_bytes:
                    break
                if key == keep:
                    continue
                entry = self._index.pop(key)
                entry.path.unlink(missing_ok=True)
                total -= entry.size
                self.counters["evictions"] += 1
                log.info("cache: evicted %s entry %s… (%s) to stay under %s", entry.kind, key[:16], format_bytes(entry.size), format_bytes(self.max_bytes))

    # -- plans

    def get(self, key: CacheKey) -> tuple["Plan", bytes] | None:
        """The verified plan and its bytes, or None (a miss; a bad entry is removed)."""
        from hapd.compiler.plan import Plan

        digest = key.digest
        with self._lock:
            found = self._read("plan", digest)
            if found is None:
                return None
            header, payload = found
            try:
                if header.get("parts") is None or _digest(header["parts"]) != digest:
                    raise _CorruptEntry("header key parts do not hash to the key")
                plan = Plan.from_bytes(payload)
                if not key.matches(plan.key):
                    raise _CorruptEntry("the plan inside is for another graph, profile, compiler or options")
            except (_CorruptEntry, PlanError) as exc:
                self._discard(self._path("plan", digest), str(exc))
                return None
            return plan, payload

    def put(self, key: CacheKey, data: bytes) -> bool:
        """Store plan bytes under ``key`` (atomically); False if it exceeds the bound or
        the file system refused the write (its file system is full)."""
        return self._write("plan", key.digest, data, key.parts(), key.family) is None

    def other_profiles(self, key: CacheKey) -> list[CacheKey]:
        """Keys of cached plans of the same family for other profiles, most recent first."""
        family = key.family
        with self._lock:
            out = []
            for entry in reversed(self._index.values()):
                if entry.kind == "plan" and entry.family == family and entry.parts and entry.profile_id != key.profile_id:
                    p = entry.parts
                    out.append(CacheKey(p["graph_id"], p["profile_id"], p["compiler_version"], p["options"],
                                        p.get("graphs"), p.get("cost_model", "")))
            return out

    # -- lowered graphs

    def get_lowered(self, key: str) -> bytes | None:
        with self._lock:
            found = self._read("lowered", key)
        return None if found is None else found[1]

    def put_lowered(self, key: str, graph: bytes) -> None:
        self._write("lowered", key, graph)

    # -- the compile path

    def lookup(self, graph: "bytes | GraphSet", profile: "Profile", options: "CompileOptions") -> Served | None:
        """A cache hit for (graph, profile, options), or None. Cheap: no compile.
        ``graph``: a graph's bytes, or the graphs of a technique search
        (:class:`~hapd.compiler.techniques.GraphSet`)."""
        start = time.perf_counter()
        key = CacheKey.of(graph, profile, options)
        found = self.get(key)
        if found is None:
            return None
        with self._lock:
            self.counters["hits"] += 1
        return Served(found[0], found[1], "hit", time.perf_counter() - start)

    def compile(self, graph: "bytes | GraphSet", profile: "Profile", options: "CompileOptions", *,
                relp: bool = True) -> Served:
        """Serve (graph, profile, options) from the cache, by re-solving the LP for a
        program cached for another profile (``relp``; for a technique search, when the
        cached plan runs SPMD: :func:`hapd.compiler.replan.relp_graphs`), or by
        compiling; store the result."""
        from hapd.compiler.driver import compile as compile_plan

        start = time.perf_counter()
        hit = self.lookup(graph, profile, options)
        if hit is not None:
            return hit
        key = CacheKey.of(graph, profile, options)
        plan, path = None, "miss"
        if relp:
            plan = self._relp(graph, key, profile, options)
            if plan is not None:
                path = "lp-only"
        if plan is None:
            plan = compile_plan(graph, profile, options)
        data = plan.to_bytes()
        not_cached = self._write("plan", key.digest, data, key.parts(), key.family)
        with self._lock:
            self.counters["lp_only" if path == "lp-only" else "misses"] += 1
        return Served(plan, data, path, time.perf_counter() - start, not_cached)

    def _relp(self, graph: "bytes | GraphSet", key: CacheKey, profile: "Profile",
              options: "CompileOptions") -> "Plan | None":
        from hapd.compiler.replan import relp_graphs, relp_plan

        for other in self.other_profiles(key):
            found = self.get(other)
            if found is None:
                continue
            try:
                if isinstance(graph, (bytes, bytearray)):
                    return relp_plan(graph, found[0], profile, options)
                return relp_graphs(graph, found[0], profile, options)
            except HapdError as exc:
                log.info("cache: cannot reuse the program of profile %s… (%s): full compile", other.profile_id[:12], exc)
                return None
        return None

