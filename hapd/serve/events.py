"""A job's output events: the newest few in memory, every one in a spill file.

The daemon numbers a job's events (output lines, pieces of long lines, rank exits) from
1 and appends each, as one msgpack map, to ``events.spill`` in the job's folder; it
keeps in memory only a **tail** of the newest ones, bounded in events and in bytes of
text (smaller still once the job has finished). A ``job_events`` poll is answered from
the tail, or, for older events (a launcher that fell behind, or asks again from 0),
from the spill file, found through a sparse index of file offsets. So the daemon's
memory does not grow with what its jobs print, and nothing is lost while the spill file
stays under its bound: past it, or when the file cannot be written, the events older
than the tail are replaced in a reply by one ``stderr`` event saying how many were
dropped (:func:`dropped_marker`).

Not thread-safe by itself: the job holds its lock around every call. No torch import here.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from hapd.util import private_folder

log = logging.getLogger("hapd.jobs")

SPILL_FILE = "events.spill"
"""Name of the spill file in a job's folder."""
DEFAULT_TAIL_EVENTS = 4096
"""Events of a running job kept in memory."""
DEFAULT_TAIL_BYTES = 4 * 2**20
"""Bytes of text of a running job's events kept in memory."""
FINISHED_TAIL_EVENTS = 256
"""Events of a finished job kept in memory (the rest are read from its spill file)."""
FINISHED_TAIL_BYTES = 64 * 1024
"""Bytes of text of a finished job's events kept in memory."""
DEFAULT_MAX_SPILL_BYTES = 2**30
"""Largest spill file of one job; later events are kept only while in the tail."""
INDEX_EVERY = 256
"""The spill index holds the file offset of every this-many-th event."""
EVENT_OVERHEAD_BYTES = 64
"""What an event costs in memory and on the wire besides its text (its other fields)."""


def event_bytes(event: dict[str, Any]) -> int:
    """What an event is counted as against the byte bounds."""
    return len(event["line"]) + EVENT_OVERHEAD_BYTES


def dropped_marker(first: int, last: int, rank: int, why: str) -> dict[str, Any]:
    """The event that stands, in a reply, for events ``first..last`` that are lost."""
    count = last - first + 1
    return {"seq": last, "rank": rank, "stream": "stderr", "time": time.time(),
            "line": f"hapd: {count} output event(s) of this job ({first}..{last}) were dropped by the daemon: {why}"}


class EventLog:
    """One job's events: a bounded tail in memory, everything in ``spill`` (None: no
    spill file; events older than the tail are then dropped). ``rank`` is the rank the
    drop marker is attributed to."""

    def __init__(self, spill: Path | None, *, rank: int, tail_events: int = DEFAULT_TAIL_EVENTS,
                 tail_bytes: int = DEFAULT_TAIL_BYTES, max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES) -> None:
        self.rank = rank
        self.tail_events = tail_events
        self.tail_bytes = tail_bytes
        self.max_spill_bytes = max_spill_bytes
        self.seq = 0
        """The last event's number."""
        self._tail: deque[dict[str, Any]] = deque()
        self._tail_size = 0
        self._spill_path = spill
        self._spill: BinaryIO | None = None
        self._spill_id: tuple[int, int] | None = None
        """(device, inode) of the spill file this log made: a job id used again makes a
        new file at the same path, which this log must not remove."""
        self._spill_size = 0
        self._spilled = 0
        """Events 1..spilled are in the spill file."""
        self._index = array("Q")
        """Offset of event ``1 + k * INDEX_EVERY`` at position ``k``."""
        self._spill_stopped = "no job folder to spill output to" if spill is None else ""
        if spill is not None:
            self._open_spill(spill)

    def _open_spill(self, path: Path) -> None:
        """A new, empty spill file (a job id used again gets a file of its own: the old
        one is unlinked first, so a late writer of the old job cannot touch it)."""
        try:
            private_folder(path.parent)
            path.unlink(missing_ok=True)
            self._spill = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
            info = os.fstat(self._spill.fileno())
            self._spill_id = (info.st_dev, info.st_ino)
        except OSError as exc:
            self._stop_spilling(f"cannot write {path}: {exc.strerror or exc}")

    def _stop_spilling(self, why: str) -> None:
        if not self._spill_stopped:
            log.warning("output of a job is no longer spilled to disk (%s); events older than the last %d are dropped",
                        why, self.tail_events)
        self._spill_stopped = why
        if self._spill is not None:
            try:
                self._spill.close()
            except OSError:
                pass
            self._spill = None

    # -- writing

    def append(self, event: dict[str, Any]) -> int:
        """Number ``event`` (its ``seq`` is set), spill it and keep it in the tail."""
        self.seq += 1
        event["seq"] = self.seq
        self._write(event)
        self._tail.append(event)
        self._tail_size += event_bytes(event)
        self._trim()
        return self.seq

    def _write(self, event: dict[str, Any]) -> None:
        if self._spill is None:
            return
        record = msgpack.packb(event, use_bin_type=True)
        if self._spill_size + len(record) > self.max_spill_bytes:
            self._stop_spilling(f"the spill file reached its bound of {self.max_spill_bytes} bytes")
            return
        try:
            if (event["seq"] - 1) % INDEX_EVERY == 0:
                self._index.append(self._spill_size)
            self._spill.write(record)
        except OSError as exc:
            self._stop_spilling(f"cannot write {self._spill_path}: {exc.strerror or exc}")
            return
        self._spill_size += len(record)
        self._spilled = event["seq"]

    def _trim(self) -> None:
        while len(self._tail) > 1 and (len(self._tail) > self.tail_events or self._tail_size > self.tail_bytes):
            self._tail_size -= event_bytes(self._tail.popleft())

    def finish(self) -> None:
        """The job has ended: keep only a small tail, close the spill file (it stays for reading)."""
        self.tail_events = min(self.tail_events, FINISHED_TAIL_EVENTS)
        self.tail_bytes = min(self.tail_bytes, FINISHED_TAIL_BYTES)
        self._trim()
        if self._spill is not None:
            try:
                self._spill.close()
            except OSError as exc:
                self._stop_spilling(f"cannot write {self._spill_path}: {exc.strerror or exc}")
            self._spill = None

    def close(self) -> None:
        """Forget everything (the job itself is forgotten, or the daemon stops): the
        spill file is removed too, so no job's output outlives its record."""
        self.finish()
        self._tail.clear()
        self._tail_size = 0
        if self._spill_path is None or self._spill_id is None:
            return
        try:
            info = os.stat(self._spill_path)
            if (info.st_dev, info.st_ino) == self._spill_id:
                self._spill_path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", self._spill_path, exc.strerror or exc)

    # -- reading

    @property
    def tail_first(self) -> int:
        """The number of the oldest event in memory (``seq + 1`` when none is)."""
        return self._tail[0]["seq"] if self._tail else self.seq + 1

    def after(self, after: int, limit: int, max_bytes: int) -> list[dict[str, Any]]:
        """Events numbered above ``after``: at most ``limit`` of them and, past the
        first, at most ``max_bytes`` of them (:func:`event_bytes`)."""
        first = max(after + 1, 1)
        if first > self.seq or limit < 1:
            return []
        if first >= self.tail_first:
            return _bounded(self._tail_from(first), limit, max_bytes)
        if first <= self._spilled:
            return self._from_spill(first, limit, max_bytes)
        return [dropped_marker(first, self.tail_first - 1, self.rank, self._spill_stopped or "not spilled")]

    def _tail_from(self, first: int) -> Any:
        start = first - self.tail_first  # numbers are contiguous in the tail
        return (self._tail[i] for i in range(start, len(self._tail)))

    def _from_spill(self, first: int, limit: int, max_bytes: int) -> list[dict[str, Any]]:
        """Events from the spill file, from ``first`` up to the last spilled one."""
        try:
            if self._spill is not None:
                self._spill.flush()
            with open(self._spill_path, "rb") as f:  # type: ignore[arg-type]
                f.seek(self._index[(first - 1) // INDEX_EVERY])
                unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=max(16 * 2**20, 2 * max_bytes))
                out = _bounded(_numbered(unpacker, first, self._spilled), limit, max_bytes)
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            why = f"the spill file {self._spill_path} cannot be read ({type(exc).__name__}: {exc})"
            return [dropped_marker(first, min(self._spilled, self.tail_first - 1), self.rank, why)]
        if not out or out[0]["seq"] != first:
            return [dropped_marker(first, min(self._spilled, self.tail_first - 1), self.rank, "the spill file is damaged")]
        return out


def _numbered(records: Any, first: int, last: int) -> Any:
    """The records numbered ``first..last`` (those before ``first``, read from the
    indexed offset on, are skipped)."""
    for record in records:
        seq = record.get("seq", 0) if isinstance(record, dict) else 0
        if seq > last:
            return
        if seq >= first:
            yield record


def _bounded(events: Any, limit: int, max_bytes: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    size = 0
    for event in events:
        size += event_bytes(event)
        if out and (len(out) >= limit or size > max_bytes):
            break
        out.append(event)
    return out
