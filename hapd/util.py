"""Small helpers every room shares: atomic file writes, byte sizes, timing summaries,
the end of a rank's process.

No torch here: the launcher and the daemon import this module.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import secrets
import statistics
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

# --------------------------------------------------------------------------
# The cyclic garbage collector, paused over a compile
# --------------------------------------------------------------------------


_GC_LOCK = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the block runs (nested blocks and
    threads share one pause; it comes back as it was when the last one ends).

    A compile makes millions of short-lived objects (the core's programs unpacked, fx
    graphs traced, lowered graphs decoded) among torch's millions of long-lived ones;
    each collection they trigger scans the heap, which took some 40 % of a compile
    (ViT-24 on paper-8). Reference counting still frees everything acyclic at once; the
    cycles a compile leaves (fx graphs) wait for the first collection after it."""
    global _gc_holders, _gc_was_enabled
    with _GC_LOCK:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


# --------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------


TEMP_NAME_KEEP_BYTES = 200
"""Bytes of a file's name kept in the name of its temporary sibling: with the dot, the
process id and the random tag that sibling stays within a file system's 255-byte name
limit for any name that fits it."""


def _temp_sibling(path: Path) -> Path:
    """A hidden, unique name next to ``path`` ending in ``.tmp``: the plan cache removes
    such leftovers at start-up and the drop folder never picks them up."""
    kept = os.fsdecode(os.fsencode(path.name)[:TEMP_NAME_KEEP_BYTES])
    return path.with_name(f".{kept}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable, where the file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path, *, mode: int = 0o666) -> Iterator[BinaryIO]:
    """A binary file open for writing that replaces ``path`` when the block ends.

    On a normal exit the file is fsynced, renamed over ``path`` and the folder fsynced,
    so a reader (or the machine after a crash) sees the old file or the whole new one.
    On any exception the temporary file is removed and ``path`` is left as it was.
    ``mode`` is the new file's permission bits before the umask, as for ``open``.
    """
    path = Path(path)
    tmp = _temp_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def private_folder(path: str | Path) -> Path:
    """``path`` as a folder only its owner can enter (0700): made so, or narrowed when
    it exists, is this process's and lets others in. A daemon's and a launcher's state
    (jobs, run reports, the plan cache, rank output) is readable by its user alone."""
    folder = Path(path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid == os.geteuid() and info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def atomic_write(path: str | Path, data: bytes | str, *, mode: int = 0o666) -> Path:
    """Replace ``path`` with ``data`` (a ``str`` is written as UTF-8) all at once; see
    :func:`atomic_file`. Returns the path."""
    payload = data.encode() if isinstance(data, str) else data
    with atomic_file(path, mode=mode) as handle:
        handle.write(payload)
    return Path(path)


# --------------------------------------------------------------------------
# Byte sizes
# --------------------------------------------------------------------------

_UNITS = ("B", "KiB", "MiB", "GiB")


def home_dir() -> Path:
    """hapd's state directory: ``$HAPD_HOME``, else ``~/.hapd``."""
    env = os.environ.get("HAPD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".hapd"


def format_bytes(n: float) -> str:
    """``n`` bytes for a person, in binary units up to GiB: ``"512 B"``,
    ``"1.50 KiB"``, ``"2.00 GiB"``."""
    value = float(n)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"


# --------------------------------------------------------------------------
# Timing summaries
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingSummary:
    """Statistics of per-iteration times, in the times' unit. With no times, ``count``
    is 0 and every statistic is NaN."""

    count: int
    """How many times."""
    mean: float
    std: float
    """Population standard deviation (0 for a single time)."""
    min: float
    max: float
    median: float
    p90: float
    """The sorted times' element at index ``int(0.9 * (count - 1))`` (no interpolation)."""


def summarize(times: Iterable[float]) -> TimingSummary:
    """Mean ± std, min, max, median and p90 of ``times``."""
    ordered = sorted(float(t) for t in times)
    if not ordered:
        return TimingSummary(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    return TimingSummary(
        count=len(ordered),
        mean=statistics.fmean(ordered),
        std=statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
        min=ordered[0],
        max=ordered[-1],
        median=statistics.median(ordered),
        p90=ordered[int(0.9 * (len(ordered) - 1))],
    )



# --------------------------------------------------------------------------
# The end of a rank's process
# --------------------------------------------------------------------------


def exit_process(status: int) -> NoReturn:
    """End this process with ``status`` the way a ``multiprocessing`` child ends: wait
    for its non-daemon threads, run the ``atexit`` handlers (hapd's process-group
    teardown and telemetry, a script's own), flush stdout and stderr, then leave with
    :func:`os._exit`, skipping the interpreter's finalization. Every entry point that runs
    as a rank (the worker, the baselines, the profiler, the elastic runner) ends so.

    Why not return from ``main``: C++ threads outlive the Python code that used them —
    Gloo's workers finishing their last work, the TCP store's loop, libzmq's and the
    profiler's threads — and one that touches a Python object after finalization began
    (dropping a tensor a collective held) is ended by CPython mid-stack, which C++
    answers with ``std::terminate``: a rank that trained, reported and left its group
    still exits with SIGABRT (status 134, "terminate called without an active
    exception"), rarely and only on a busy host. The launcher reports that as a failed
    job and an elastic job as a fault. Nothing is left for finalization to do that a
    rank needs: its files are closed, its output flushed, its group destroyed."""
    try:
        current = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not current and not thread.daemon and thread is not threading.main_thread():
                thread.join()
        atexit._run_exitfuncs()  # noqa: SLF001 - the handlers finalization would run, run while all is whole
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to tell
                stream.flush()
        os._exit(status)


__all__ = ["TimingSummary", "atomic_file", "atomic_write", "private_folder", "exit_process", "format_bytes", "gc_paused", "home_dir",
           "summarize"]
