"""The drop folder: notice graph files dropped into a folder, and hand each one over
once it is completely written.

A file is handed over (``on_ready``) when all of these hold:

- its name ends in ``.pt2`` or ``.hapg``, does not start with ``.`` and does not end
  in ``.tmp``;
- it arrived by a rename into the folder (atomic: handed over at once), or its size and
  modification time have not changed for ``settle_s`` after the last write or close;
- no process has it open for writing: checked with a Linux read lease
  (``F_SETLEASE``), which the kernel refuses while any writer holds the file open.
  Where leases are unavailable (another owner, another OS), a file that was neither
  renamed in nor closed after writing must instead be unchanged for ``fallback_s``.

The atomic way to drop is to write the file elsewhere on the same file system and
rename it into the folder: the folder's ``.incoming/`` subfolder (:data:`INCOMING`) is
there for that, or a hidden temporary name in the folder itself (``.bert.pt2.tmp`` →
``bert.pt2``). The first is noticed at once; the second usually too, but now and then
up to 0.5 s later: watchdog holds a rename's "moved from" half up to that long to pair
it with its "moved to" half, and holds every later event of the folder behind it. For
the same reason the daemon moves finished files out of the folder with a hard link and
an unlink, not a rename (:func:`move_out`): a rename out of the folder has no "moved
to" half and would stall the folder's events for the full 0.5 s.

Events come from watchdog (inotify on Linux: created, modified, closed-after-write and
moved-in); a rescan every ``rescan_s`` (and one at start) catches files dropped while
the daemon was down or events the kernel dropped in a burst. A file handed over is not
considered again until the consumer calls :meth:`DropWatcher.finished`; if it was
replaced meanwhile, the consumer calls :meth:`DropWatcher.retry`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

log = logging.getLogger("hapd.watch")

SUFFIXES = (".pt2", ".hapg")
"""What the drop folder compiles."""

INCOMING = ".incoming"
"""Subfolder of the drop folder to write files in before renaming them into it."""

DEFAULT_SETTLE_S = 0.2
"""A file written in place must be unchanged this long after its last write or close."""
DEFAULT_FALLBACK_S = 2.0
"""Where leases are unavailable, a file neither renamed in nor closed after writing must
be unchanged this long."""
DEFAULT_RESCAN_S = 2.0
"""Period of the folder rescan (for events lost in a burst)."""
CHECK_INTERVAL_S = 0.05
"""How often files noticed and not yet handed over are checked again."""
STOP_JOIN_S = 5.0
"""How long stopping waits for the event observer and the scheduler thread, each."""

Signature = tuple[int, int, int]
"""(inode, size, mtime in ns): a file's identity and version."""


def signature(st: os.stat_result) -> Signature:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def is_drop_name(name: str) -> bool:
    """Whether a file name is one the drop folder compiles."""
    return not name.startswith(".") and not name.endswith(".tmp") and name.endswith(SUFFIXES)


def move_out(path: Path, folder: Path) -> None:
    """Move ``path`` into ``folder`` (replacing a file of that name) without a rename
    out of the watched folder: a hard link, made under a short temporary name inside
    ``folder`` (any drop name fits beside it) and renamed there, then an unlink of
    ``path``. A rename would make watchdog hold every later event of the folder for
    0.5 s. Where hard links are not supported, a rename. A symbolic link is moved
    itself, never followed."""
    tmp = folder / f".hapd-move.{os.getpid()}.{secrets.token_hex(4)}.link.tmp"
    try:
        os.link(path, tmp, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        os.replace(path, folder / path.name)
        return
    try:
        os.replace(tmp, folder / path.name)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    path.unlink()


def has_writer(path: Path) -> bool | None:
    """Whether some process has ``path`` open for writing: True, False, or None when
    the kernel cannot tell us (no lease support, not the file's owner)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        setlease = getattr(fcntl, "F_SETLEASE", None)
        if setlease is None:
            return None
        try:
            fcntl.fcntl(fd, setlease, fcntl.F_RDLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY):
                return True
            return None
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Drop:
    """A dropped file, ready to read (or to refuse)."""

    path: Path
    signature: Signature
    """The file's (inode, size, mtime) when it was found ready (of the link itself for
    a symbolic link)."""
    refusal: str | None = None
    """Why it is not read: a symbolic link, a FIFO, … (it is answered with an error)."""


def refusal_of(mode: int) -> str | None:
    """Why a file of this type is not read from the drop folder; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link: links in the drop folder are not followed (drop the file itself)"
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a regular file")
    return f"{kind}: only regular files are read"


@dataclass
class _Candidate:
    sig: Signature | None = None
    changed: float = 0.0  # monotonic time of the last observed change
    moved: bool = False
    closed: bool = False


def _observer() -> Observer:
    """On Linux an inotify observer that reports a rename into the folder from outside
    it as a move (plain watchdog reports it as a creation, like a file being written)."""
    try:
        from watchdog.observers.inotify import InotifyObserver

        return InotifyObserver(generate_full_events=True)
    except (ImportError, TypeError, OSError):
        return Observer()


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: "DropWatcher") -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        kind = event.event_type
        if kind == "moved":
            self.watcher.notify(Path(os.fsdecode(event.dest_path)), "moved")
        elif kind in ("created", "modified", "closed"):
            self.watcher.notify(Path(os.fsdecode(event.src_path)), kind)


class DropWatcher:
    """Watches ``folder`` and calls ``on_ready(Drop)`` from its own thread."""

    def __init__(
        self,
        folder: Path,
        on_ready: Callable[[Drop], None],
        *,
        settle_s: float = DEFAULT_SETTLE_S,
        fallback_s: float = DEFAULT_FALLBACK_S,
        rescan_s: float = DEFAULT_RESCAN_S,
    ) -> None:
        self.folder = Path(folder)
        self.on_ready = on_ready
        self.settle_s = settle_s
        self.fallback_s = max(fallback_s, settle_s)
        self.rescan_s = rescan_s
        self._cond = threading.Condition()
        self._candidates: dict[Path, _Candidate] = {}
        self._inflight: set[Path] = set()
        self._stopping = False
        self._observer = _observer()
        self._thread = threading.Thread(target=self._loop, name="hapd-drops", daemon=True)

    # -- lifecycle

    def start(self) -> None:
        self._observer.schedule(_Handler(self), str(self.folder), recursive=False)
        self._observer.start()
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        # watchdog's inotify emitter logs a spurious error when stopped while it reads
        quiet = logging.getLogger("watchdog.observers.inotify")
        spurious = _DropMessage("called when the thread is inactive")
        quiet.addFilter(spurious)
        try:
            self._observer.stop()
            self._observer.join(timeout=STOP_JOIN_S)
        finally:
            quiet.removeFilter(spurious)
        self._thread.join(timeout=STOP_JOIN_S)

    @property
    def pending(self) -> int:
        """Files noticed and not yet handed over."""
        with self._cond:
            return len(self._candidates)

    # -- inputs

    def notify(self, path: Path, how: str) -> None:
        """A file event (``created``, ``modified``, ``closed``, ``moved``, ``scan``)."""
        if path.parent != self.folder or not is_drop_name(path.name):
            return
        with self._cond:
            if path in self._inflight:
                return  # the consumer re-checks the file before moving it away
            cand = self._candidates.get(path)
            if cand is None:
                cand = self._candidates[path] = _Candidate(changed=time.monotonic())
                if how != "scan":
                    log.debug("noticed %s (%s)", path.name, how)
            if how == "moved":
                cand.moved = True
            elif how == "closed":
                cand.closed = True
                cand.changed = time.monotonic()
            elif how in ("created", "modified"):
                cand.changed = time.monotonic()
                cand.moved = False
            self._cond.notify_all()

    def finished(self, path: Path) -> None:
        """The consumer is done with ``path`` (moved away, or gone)."""
        with self._cond:
            self._inflight.discard(path)

    def retry(self, path: Path) -> None:
        """The file changed while the consumer had it: consider it again."""
        with self._cond:
            self._inflight.discard(path)
        self.notify(path, "modified")

    def scan(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError as exc:
            log.warning("cannot list the drop folder %s: %s", self.folder, exc.strerror)
            return
        for name in sorted(names):
            if is_drop_name(name):
                self.notify(self.folder / name, "scan")

    # -- the scheduler thread

    def _loop(self) -> None:
        self.scan()
        next_scan = time.monotonic() + self.rescan_s
        while True:
            with self._cond:
                if self._stopping:
                    return
                timeout = CHECK_INTERVAL_S if self._candidates else max(0.0, next_scan - time.monotonic())
                self._cond.wait(timeout)
                if self._stopping:
                    return
                candidates = list(self._candidates.items())
            for path, cand in candidates:
                self._check(path, cand)
            if time.monotonic() >= next_scan:
                self.scan()
                next_scan = time.monotonic() + self.rescan_s

    def _check(self, path: Path, cand: _Candidate) -> None:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            self._forget(path, cand)
            return
        if stat.S_ISDIR(st.st_mode):
            self._forget(path, cand)
            return
        refusal = refusal_of(st.st_mode)
        if refusal is not None:  # answered (moved to failed/ with an error), never opened
            self._hand_over(path, cand, Drop(path, signature(st), refusal))
            return
        now = time.monotonic()
        sig = signature(st)
        with self._cond:
            if self._candidates.get(path) is not cand:
                return
            if cand.sig is None:
                cand.sig = sig
            elif sig != cand.sig:
                cand.sig, cand.changed, cand.moved = sig, now, False
                return
            quiet = now - cand.changed
            if not cand.moved and quiet < self.settle_s:
                return
        writer = has_writer(path)
        if writer:
            return
        if writer is None and not (cand.moved or cand.closed) and quiet < self.fallback_s:
            return
        self._hand_over(path, cand, Drop(path, sig))

    def _hand_over(self, path: Path, cand: _Candidate, drop: Drop) -> None:
        with self._cond:
            if self._candidates.get(path) is not cand or self._stopping:
                return
            del self._candidates[path]
            self._inflight.add(path)
        self.on_ready(drop)

    def _forget(self, path: Path, cand: _Candidate) -> None:
        with self._cond:
            if self._candidates.get(path) is cand:
                del self._candidates[path]
