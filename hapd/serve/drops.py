"""The drop folder's compile side: every graph file dropped into the folder is compiled
for the daemon's profile.

The :class:`~hapd.serve.watch.DropWatcher` hands over each file once completely written
(:mod:`hapd.serve.watch`); :meth:`DropProcessor.process` then, on the daemon's compile
worker:

1. reads the file, and gives it back to the watcher when it changed meanwhile;
2. lowers a ``.pt2`` to the graph IR, and serves the plan from the cache or compiles it;
3. writes ``out/STEM.report.txt``, then ``out/STEM.hplan`` (once the plan exists, both
   are complete);
4. moves the dropped file to ``done/``; on any error instead writes
   ``failed/NAME.error`` and moves the file to ``failed/``.

A drop is done only when its plan is in ``out/`` or its error in ``failed/``; only then is
the dropped file moved, so a daemon killed mid-compile compiles the file again at its
next start. A file replaced while it was compiled is compiled again. A symbolic link
(or a FIFO, a socket, a device) is never opened: it is moved to ``failed/`` with an
error saying so.

Every name a file system takes gets an answer: when ``STEM.report.txt`` or
``NAME.error`` would be longer than :data:`NAME_MAX` bytes, the stem or name is cut
short and ended with ``~`` and 8 hex digits of its sha256 (:func:`bounded_name`); the
report and the error file name the drop in full.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hapd.errors import GraphFormatError, HapdError
from hapd.profile.schema import Profile
from hapd.serve.cache import PlanCache, Served
from hapd.serve.watch import INCOMING, Drop, DropWatcher, move_out
from hapd.util import atomic_write

if TYPE_CHECKING:
    from hapd.compiler.options import CompileOptions

log = logging.getLogger("hapd.drops")

GRAPH_KINDS = {".hapg": "hapg", ".pt2": "pt2"}
"""Graph kind of each file suffix the drop folder compiles."""

OUT = "out"
"""Subfolder of the drop folder for ``NAME.hplan`` and ``NAME.report.txt``."""
FAILED = "failed"
"""Subfolder for dropped files that failed, with their ``NAME.error``."""
DONE = "done"
"""Subfolder for dropped files whose plan is in ``out/``."""
SUBFOLDERS = (INCOMING, OUT, FAILED, DONE)
"""Every subfolder of the drop folder (created at the daemon's start)."""
NAME_MAX = 255
"""Longest file name in bytes (Linux file systems): output names are kept within it."""
OUT_SUFFIXES = (".hplan", ".report.txt")
"""What ``out/`` holds for one drop (the stem is shared: cut for the longest suffix)."""
ERROR_SUFFIX = ".error"
"""Suffix of a failed drop's error file in ``failed/``."""
NAME_TAG_HEX = 8
"""Hex digits of the name's sha256 that end a name cut short."""


def bounded_name(name: str, suffix: str) -> str:
    """``name + suffix`` when it fits :data:`NAME_MAX` bytes, else ``name`` cut short
    (on a character boundary) + ``~`` + the first hex digits of its sha256 + ``suffix``."""
    if len(os.fsencode(name + suffix)) <= NAME_MAX:
        return name + suffix
    tag = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:NAME_TAG_HEX]
    room = NAME_MAX - len(os.fsencode(tag + suffix))
    kept = name
    while len(os.fsencode(kept)) > room:
        kept = kept[:-1]
    return kept + tag + suffix


def out_stem(stem: str) -> str:
    """The stem of a drop's files in ``out/``: ``stem``, cut short when needed so that
    every one of :data:`OUT_SUFFIXES` fits."""
    longest = max(OUT_SUFFIXES, key=lambda s: len(os.fsencode(s)))
    return bounded_name(stem, longest)[: -len(longest)]


def shown(name: str) -> str:
    """A file name for a log line or a text file: bytes that are not UTF-8 escaped."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _text(lines: str) -> bytes:
    return lines.encode("utf-8", "backslashreplace")


class DropProcessor:
    """The drops of one folder: watches it (``on_ready`` gets each file ready to read),
    and compiles one drop at a time on the caller's thread (:meth:`process`)."""

    def __init__(
        self,
        folder: Path,
        *,
        cache: PlanCache,
        profile: Profile,
        options: CompileOptions,
        relp: bool,
        lower: Callable[[bytes], bytes],
        on_ready: Callable[[Drop], None],
        settle_s: float,
        rescan_s: float,
    ) -> None:
        self.folder = folder
        self.cache = cache
        self.profile = profile
        """What every drop is compiled for."""
        self.options = options
        self.relp = relp
        """Serve a graph cached for another profile by re-solving only the LP."""
        self.lower = lower
        """A ``.pt2``'s bytes → its graph IR."""
        self.done = 0
        """Drops compiled since the start."""
        self.failed = 0
        """Drops failed since the start."""
        self.watcher = DropWatcher(folder, on_ready, settle_s=settle_s, rescan_s=rescan_s)
        self._unmovable: dict[Path, tuple[int, int, int]] = {}
        """Drops answered but not moved out (the file system refused): not answered again
        while unchanged (the rescan hands them over every few seconds)."""

    # -- lifecycle

    def start(self) -> None:
        """Start watching the folder (it is scanned at once)."""
        self.watcher.start()

    def stop(self) -> None:
        """Stop watching the folder."""
        self.watcher.stop()

    @property
    def pending(self) -> int:
        """Files noticed and not yet handed over."""
        return self.watcher.pending

    def abandon(self, drop: Drop) -> None:
        """Leave ``drop`` in the folder uncompiled: compiled at the next start."""
        self.watcher.finished(drop.path)

    # -- one drop

    def process(self, drop: Drop) -> None:
        """Compile one drop into ``out/`` and move it to ``done/``, or write its error to
        ``failed/`` and move it there; errors end here (logged), never raised."""
        path, name = drop.path, shown(drop.path.name)
        start = time.perf_counter()
        if self._unmovable.get(path) == drop.signature:  # answered already; said why it stays
            self.watcher.finished(path)
            return
        if drop.refusal is not None:
            self._fail(drop, start, f"not read: {drop.refusal}")
            return
        data = self._read(drop, start)
        if data is None:
            return
        try:
            served = self._serve(name, path.suffix, data)
            plan_path = self._write_outputs(path, served, start)
        except HapdError as exc:
            self._fail(drop, start, f"{type(exc).__name__}: {exc}" + "".join(f" [{k} {v}]" for k, v in (("node", exc.node), ("field", exc.field)) if v))
            return
        except Exception as exc:  # noqa: BLE001 - one bad file must not stop the daemon
            log.error("drop %s: internal error\n%s", name, traceback.format_exc())
            self._fail(drop, start, f"internal error: {type(exc).__name__}: {exc}")
            return
        self._settle(drop, self.folder / DONE)
        self.done += 1
        uncached = f", not cached: {served.not_cached}" if served.not_cached else ""
        log.info("drop %s → %s (cache %s%s, %.3f s)", name, shown(str(plan_path.relative_to(self.folder))), served.path, uncached,
                 time.perf_counter() - start)

    def _read(self, drop: Drop, start: float) -> bytes | None:
        """The dropped file's bytes; None when it is gone, unreadable (failed) or changed
        since the watcher handed it over (given back to the watcher)."""
        path = drop.path
        try:
            data = path.read_bytes()
            after = os.stat(path)
        except FileNotFoundError:
            self.watcher.finished(path)
            return None
        except OSError as exc:
            self._fail(drop, start, f"cannot read the file: {exc.strerror}")
            return None
        if (after.st_ino, after.st_size, after.st_mtime_ns) != drop.signature or len(data) != after.st_size:
            log.info("drop %s changed while being read; waiting for it to settle", shown(path.name))
            self.watcher.retry(path)
            return None
        return data

    def _serve(self, name: str, suffix: str, data: bytes) -> Served:
        """The plan of a dropped graph: from the cache, else compiled (and cached)."""
        if not data:
            raise GraphFormatError("the file is empty (0 bytes)")
        kind = GRAPH_KINDS[suffix]
        graph = data if kind == "hapg" else self.lower(data)
        served = self.cache.lookup(graph, self.profile, self.options)
        if served is None:
            log.info("drop %s: compiling for %s (%d devices)", shown(name), self.profile.name, self.profile.world)
            served = self.cache.compile(graph, self.profile, self.options, relp=self.relp)
        return served

    def _write_outputs(self, path: Path, served: Served, start: float) -> Path:
        """The report, then the plan: once ``NAME.hplan`` exists, both are complete."""
        out = self.folder / OUT
        stem = out_stem(path.stem)
        plan_path = out / f"{stem}.hplan"
        key = served.plan.key
        uncached = f" (not cached: {served.not_cached})" if served.not_cached else ""
        report = [
            f"drop:      {shown(path.name)}",
            f"graph id:  {key.get('graph_id')}",
            f"profile:   {self.profile.name} ({key.get('profile_id')})",
            f"served:    cache {served.path} in {time.perf_counter() - start:.3f} s{uncached}",
            f"plan:      {shown(plan_path.name)}",
            "",
            served.plan.explain(),
            "",
        ]
        atomic_write(out / f"{stem}.report.txt", _text("\n".join(report)), mode=0o644)
        atomic_write(plan_path, served.data, mode=0o644)
        return plan_path

    def _fail(self, drop: Drop, start: float, reason: str) -> None:
        """Write ``failed/NAME.error`` with ``reason`` and move the drop to ``failed/``."""
        failed = self.folder / FAILED
        name = drop.path.name
        error_path = failed / bounded_name(name, ERROR_SUFFIX)
        try:
            atomic_write(error_path, _text(f"{shown(name)}: {reason}\n"), mode=0o644)
        except OSError as exc:
            log.error("drop %s failed (%s) and its error file cannot be written: %s", shown(name), reason, exc.strerror)
        self._settle(drop, failed)
        self.failed += 1
        log.warning("drop %s failed: %s → failed/%s (%.3f s)", shown(name), reason, shown(error_path.name), time.perf_counter() - start)

    def _settle(self, drop: Drop, folder: Path) -> None:
        """Move the dropped file into ``folder`` unless it was replaced meanwhile."""
        path = drop.path
        try:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != drop.signature:
                log.info("drop %s was replaced while compiling; compiling the new one", shown(path.name))
                self.watcher.retry(path)
                return
            move_out(path, folder)
            self._unmovable.pop(path, None)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("cannot move %s to %s: %s; it stays in the folder, not answered again while unchanged",
                      shown(path.name), folder.name, exc.strerror)
            self._unmovable[path] = drop.signature
        self.watcher.finished(path)
