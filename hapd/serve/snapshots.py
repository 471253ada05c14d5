"""The daemon's in-memory store of training snapshots (elastic restarts).

Every few steps each rank writes its snapshot (its shard of a
``torch.distributed.checkpoint`` save: a few files) and sends it to two daemons, its own
host's and the next host's; when a host dies, the ranks restarted on the survivors list
and fetch the snapshots from every daemon still alive. The daemon is the process that
outlives the ranks on a host, so it holds them, in memory only.

What the store holds, per **run** (an id like a job id): **entries** keyed by
``(step, rank)``, each the ``world`` (ranks of the run that saved it) and its files,
name → bytes. It keeps:

- the ``keep`` most recent distinct steps of each run: the first put of a newer step
  evicts the oldest step's entries; a put of a step older than all those kept is refused;
- at most ``max_bytes`` in all: a put that would exceed it first evicts older steps (of
  every run, least recently written first; never a run's newest step nor the step being
  put), and is refused, evicting nothing, when even that would not make room;
- runs touched (put, get, list) within the last ``ttl_s``: others are dropped, checked at
  each call.

A file may come in chunks (``offset``, ``total`` bytes), in order; its ``total`` bytes
are reserved against ``max_bytes`` at its first chunk. An entry is **complete** once it
has its ``count`` files, each with all its bytes; only complete entries are listed.
Errors are :class:`~hapd.errors.SnapshotError` naming the field. Thread-safe.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hapd.errors import SnapshotError
from hapd.wire.contract import JOB_ID
from hapd.wire.protocol import MAX_SNAPSHOT_NAME_CHARS

log = logging.getLogger("hapd.snapshots")

DEFAULT_SNAPSHOT_KEEP = 2
"""Most recent distinct steps kept per run."""
DEFAULT_SNAPSHOT_MAX_BYTES = 4 * 2**30
"""Bytes of snapshot files a daemon holds at most, by default."""
DEFAULT_SNAPSHOT_TTL_S = 900.0
"""A run untouched (no put, get or list) this long is dropped."""
MAX_SNAPSHOT_FILES = 4096
"""Most files one entry may have."""
MAX_SNAPSHOT_READ_BYTES = 16 * 2**20
"""Most bytes one read (one ``snapshot_data`` reply) returns."""

SNAPSHOT_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_SNAPSHOT_NAME_CHARS}}}")


@dataclass
class _File:
    data: bytearray
    received: int = 0

    @property
    def complete(self) -> bool:
        return self.received == len(self.data)


@dataclass
class _SnapshotEntry:
    world: int
    count: int
    """How many files the entry has once complete."""
    time: float
    """Clock of its last put."""
    files: dict[str, _File] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.files) == self.count and all(f.complete for f in self.files.values())

    @property
    def bytes(self) -> int:
        return sum(len(f.data) for f in self.files.values())


@dataclass
class _Run:
    touched: float
    entries: dict[tuple[int, int], _SnapshotEntry] = field(default_factory=dict)

    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.entries})

    def step_bytes(self, step: int) -> int:
        return sum(e.bytes for (s, _), e in self.entries.items() if s == step)

    def step_time(self, step: int) -> float:
        return max(e.time for (s, _), e in self.entries.items() if s == step)


def check_run(run: Any) -> str:
    if not isinstance(run, str) or not JOB_ID.fullmatch(run):
        raise SnapshotError(f"run id {run!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                            "digit", field="run")
    return run


def check_name(name: Any) -> str:
    """A snapshot file name: 1-128 of letters, digits, '.', '_', '-', without '..'."""
    if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name) or ".." in name or name == ".":
        raise SnapshotError(f"snapshot file name {name!r} must be 1-{MAX_SNAPSHOT_NAME_CHARS} letters, digits, '.', "
                            "'_' or '-', and neither '.' nor contain '..'", field="name")
    return name


def _check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f"≥ {low}"
        raise SnapshotError(f"{name} {value!r} must be an integer {bound}", field=name)
    return value


class SnapshotStore:
    """Snapshots of runs, in memory; see the module's docstring. ``clock`` (monotonic
    seconds) is injectable for tests."""

    def __init__(self, *, keep: int = DEFAULT_SNAPSHOT_KEEP, max_bytes: int = DEFAULT_SNAPSHOT_MAX_BYTES,
                 ttl_s: float = DEFAULT_SNAPSHOT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if keep < 1:
            raise SnapshotError(f"keep {keep} must be ≥ 1", field="keep")
        if max_bytes < 0:
            raise SnapshotError(f"max_bytes {max_bytes} must be ≥ 0", field="max_bytes")
        if not ttl_s > 0:
            raise SnapshotError(f"ttl_s {ttl_s} must be > 0", field="ttl_s")
        self.keep = keep
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._runs: dict[str, _Run] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    # -- the four operations

    def put(self, run: str, step: int, rank: int, world: int, name: str, data: bytes, *, offset: int = 0,
            total: int | None = None, count: int = 1) -> bool:
        """Store ``data`` at ``offset`` of file ``name`` of entry ``(step, rank)`` of
        ``run``, a file of ``total`` bytes (default: ``data`` is the whole file) in an
        entry of ``count`` files. A chunk at offset 0 (re)starts the file; the others
        continue it, with no gap (a chunk sent again is written again). Whether the
        entry is now complete."""
        check_run(run)
        check_name(name)
        _check_int(step, "step", 0)
        _check_int(world, "world", 1)
        _check_int(rank, "rank", 0, world - 1)
        _check_int(count, "count", 1, MAX_SNAPSHOT_FILES)
        _check_int(offset, "offset", 0)
        total = len(data) if total is None else _check_int(total, "total", 0)
        if offset + len(data) > total:
            raise SnapshotError(f"{name}: a chunk of {len(data)} bytes at offset {offset} ends past the file's {total} "
                                "bytes", field="offset")
        with self._lock:
            now = self.clock()
            self._expire(now)
            state = self._runs.get(run)
            entry = state.entries.get((step, rank)) if state is not None else None
            if entry is not None and (entry.world, entry.count) != (world, count):
                raise SnapshotError(f"run {run} step {step} rank {rank} was put with world {entry.world} and "
                                    f"{entry.count} files, now with world {world} and {count}: drop it first",
                                    field="world")
            if entry is not None and name not in entry.files and len(entry.files) >= count:
                raise SnapshotError(f"run {run} step {step} rank {rank} already has its {count} files "
                                    f"({', '.join(sorted(entry.files))}), not {name}", field="name")
            old = entry.files.get(name) if entry is not None else None
            if offset == 0:
                state = self._reserve(run, state, step, total - (len(old.data) if old is not None else 0), name, now)
                entry = state.entries.setdefault((step, rank), _SnapshotEntry(world, count, now))
                file = entry.files[name] = _File(bytearray(total))
            else:
                file = self._continued(run, step, rank, name, old, offset, total)
            file.data[offset:offset + len(data)] = data
            file.received = max(file.received, offset + len(data))
            entry.time = state.touched = now
            return entry.complete

    def list(self, run: str) -> list[dict[str, Any]]:
        """The complete entries of ``run`` (none for an unknown run), by step then rank:
        ``{step, rank, world, bytes, files: [names]}``."""
        check_run(run)
        with self._lock:
            state = self._touch(run)
            if state is None:
                return []
            return [{"step": step, "rank": rank, "world": e.world, "bytes": e.bytes, "files": sorted(e.files)}
                    for (step, rank), e in sorted(state.entries.items()) if e.complete]

    def get(self, run: str, step: int, rank: int, name: str, offset: int = 0,
            length: int = MAX_SNAPSHOT_READ_BYTES) -> tuple[bytes, int]:
        """``(bytes, the file's total bytes)``: at most ``length`` bytes of a complete
        file from ``offset`` (fewer at its end)."""
        check_run(run)
        check_name(name)
        _check_int(step, "step", 0)
        _check_int(rank, "rank", 0)
        _check_int(offset, "offset", 0)
        _check_int(length, "length", 0, MAX_SNAPSHOT_READ_BYTES)
        with self._lock:
            state = self._touch(run)
            entry = state.entries.get((step, rank)) if state is not None else None
            if entry is None:
                held = ", ".join(f"{s}/{r}" for s, r in sorted(state.entries)) if state is not None else ""
                raise SnapshotError(f"no snapshot of run {run} at step {step} rank {rank} on this daemon"
                                    + (f" (it holds step/rank {held})" if held else ""), field="step")
            file = entry.files.get(name)
            if file is None:
                raise SnapshotError(f"run {run} step {step} rank {rank} has no file {name} "
                                    f"(it has {', '.join(sorted(entry.files)) or 'none yet'})", field="name")
            if not file.complete:
                raise SnapshotError(f"{name} of run {run} step {step} rank {rank} is still being received "
                                    f"({file.received} of {len(file.data)} bytes)", field="name")
            if offset > len(file.data):
                raise SnapshotError(f"offset {offset} is past the end of {name} ({len(file.data)} bytes)", field="offset")
            return bytes(file.data[offset:offset + length]), len(file.data)

    def drop(self, run: str, before_step: int | None = None) -> int:
        """Forget ``run``'s entries (those of steps before ``before_step`` only, when
        given), complete or not; how many."""
        check_run(run)
        if before_step is not None:
            _check_int(before_step, "before_step", 0)
        with self._lock:
            self._expire(self.clock())
            state = self._runs.get(run)
            if state is None:
                return 0
            victims = [s for s in state.steps() if before_step is None or s < before_step]
            count = sum(self._evict(run, state, s) for s in victims)
            if not state.entries:
                del self._runs[run]
            return count

    def stats(self) -> dict[str, int]:
        """``{runs, entries, bytes, max_bytes}`` (entries complete or not; bytes reserved)."""
        with self._lock:
            self._expire(self.clock())
            entries = sum(len(s.entries) for s in self._runs.values())
            return {"runs": len(self._runs), "entries": entries, "bytes": self._bytes, "max_bytes": self.max_bytes}

    # -- inside the lock

    def _touch(self, run: str) -> _Run | None:
        now = self.clock()
        self._expire(now)
        state = self._runs.get(run)
        if state is not None:
            state.touched = now
        return state

    def _expire(self, now: float) -> None:
        for run in [r for r, s in self._runs.items() if now - s.touched > self.ttl_s]:
            state = self._runs.pop(run)
            freed = sum(e.bytes for e in state.entries.values())
            self._bytes -= freed
            log.info("snapshots of run %s dropped: untouched for %.0f s (%d entries, %d bytes)",
                     run, now - state.touched, len(state.entries), freed)

    def _continued(self, run: str, step: int, rank: int, name: str, old: _File | None, offset: int,
                   total: int) -> _File:
        """The file a chunk past offset 0 continues."""
        where = f"{name} of run {run} step {step} rank {rank}"
        if old is None:
            raise SnapshotError(f"a chunk of {where} at offset {offset} before its first chunk (offset 0), or after "
                                "the file was evicted or dropped", field="offset")
        if total != len(old.data):
            raise SnapshotError(f"{where} was started with {len(old.data)} bytes, this chunk says {total}", field="total")
        if offset > old.received:
            raise SnapshotError(f"a chunk of {where} at offset {offset}, but only {old.received} bytes of it came",
                                field="offset")
        return old

    def _reserve(self, run: str, state: _Run | None, step: int, need: int, name: str, now: float) -> _Run:
        """Make room for ``need`` more bytes of ``step`` of ``run`` (evicting steps past
        ``keep`` and, when over ``max_bytes``, older steps); the run's state."""
        steps = state.steps() if state is not None else []
        keep_victims: list[int] = []
        if step not in steps:
            newer = sorted([*steps, step], reverse=True)
            if step not in newer[:self.keep]:
                raise SnapshotError(f"step {step} of run {run} is older than the {self.keep} steps kept "
                                    f"({', '.join(map(str, newer[:self.keep]))})", field="step")
            keep_victims = newer[self.keep:]
        freed = sum(state.step_bytes(s) for s in keep_victims) if state is not None else 0
        cap_victims: list[tuple[str, int]] = []
        if self._bytes - freed + need > self.max_bytes:
            spared = {(r, max(other.steps())) for r, other in self._runs.items()}  # each run's newest step
            spared |= {(run, max([*steps, step])), (run, step), *((run, v) for v in keep_victims)}
            candidates = sorted((other.step_time(s), r, s) for r, other in self._runs.items()
                                for s in other.steps() if (r, s) not in spared)
            for _, r, s in candidates:
                if self._bytes - freed + need <= self.max_bytes:
                    break
                freed += self._runs[r].step_bytes(s)
                cap_victims.append((r, s))
            if self._bytes - freed + need > self.max_bytes:
                raise SnapshotError(
                    f"snapshot store full: {name} of run {run} step {step} needs {need} more bytes; the store holds "
                    f"{self._bytes} of its {self.max_bytes} bytes and dropping every older step would free only "
                    f"{freed} (hapd serve --snapshot-mb sets the bound)", field="total")
        for s in keep_victims:
            self._evict(run, state, s)
        for r, s in cap_victims:
            self._evict(r, self._runs[r], s)
            log.info("snapshots of run %s step %d evicted to make room for run %s step %d", r, s, run, step)
            if r != run and not self._runs[r].entries:
                del self._runs[r]
        if state is None:
            state = self._runs[run] = _Run(now)
        self._bytes += need
        return state

    def _evict(self, run: str, state: _Run, step: int) -> int:
        """Forget the entries of ``step`` of ``run``; how many."""
        keys = [k for k in state.entries if k[0] == step]
        for k in keys:
            self._bytes -= state.entries.pop(k).bytes
        return len(keys)


__all__ = [
    "SnapshotStore",
    "DEFAULT_SNAPSHOT_KEEP",
    "DEFAULT_SNAPSHOT_MAX_BYTES",
    "DEFAULT_SNAPSHOT_TTL_S",
    "MAX_SNAPSHOT_FILES",
    "MAX_SNAPSHOT_READ_BYTES",
    "check_name",
    "check_run",
]
