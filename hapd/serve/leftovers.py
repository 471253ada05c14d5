"""What a job's processes are, found again by another process: so that a cancel reaches
every descendant of a rank, and a daemon that restarts stops what its predecessor left.

- Every rank of a launch, and every process it starts (they inherit its environment),
  carries ``HAPD_JOB_TOKEN=TOKEN``, a random token of that launch
  (:data:`MARKER_ENV`): :func:`marked_processes` finds them all, even those that left
  the rank's process group or session, by scanning ``/proc/*/environ``. A recycled pid
  never carries another launch's token.
- While a job runs, the daemon keeps a **record** of it in its state directory
  (``STATE/ranks/TOKEN.json``, :class:`RankRecords`): the daemon's pid and start time, the
  token, and each rank guard's pid and start time (a guard leads its rank's process
  group). A daemon that starts reads the records its predecessor left: a guard whose pid
  still runs *with the recorded start time* has its process group killed, and every
  process marked with a record's token is killed; then the record is removed. A record
  of a daemon that still runs is left alone.

Linux (``/proc``), as the rest of the daemon. No torch import, nothing but the standard
library (the rank guard imports this).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from hapd.util import private_folder

log = logging.getLogger("hapd.jobs")

MARKER_ENV = "HAPD_JOB_TOKEN"
"""The environment variable that marks a launch's processes."""
RECORD_SUFFIX = ".json"


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (what tells it from a
    later process given the same pid); None when it does not run (or is a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def marked_processes(tokens: set[str], *, exclude: set[int] | None = None) -> dict[str, list[int]]:
    """The live processes whose environment carries ``HAPD_JOB_TOKEN`` equal to one of
    ``tokens``, by token (``exclude``: pids left out)."""
    found: dict[str, list[int]] = {}
    if not tokens:
        return found
    prefix = f"{MARKER_ENV}=".encode()
    skip = exclude or set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        for var in environ.split(b"\0"):
            if var.startswith(prefix):
                token = var[len(prefix):].decode(errors="replace")
                if token in tokens and process_start(int(entry.name)) is not None:
                    found.setdefault(token, []).append(int(entry.name))
                break
    return found


def signal_marked(tokens: set[str], sig: int, *, exclude: set[int] | None = None) -> int:
    """Send ``sig`` to every live process marked with one of ``tokens``; how many got it."""
    sent = 0
    for pids in marked_processes(tokens, exclude=exclude).values():
        for pid in pids:
            try:
                os.kill(pid, sig)
                sent += 1
            except (ProcessLookupError, PermissionError):
                pass
    return sent


@dataclass(frozen=True)
class RankRecord:
    """A job as its record tells it."""

    job: str
    token: str
    daemon_pid: int
    daemon_start: str | None
    guards: tuple[tuple[int, str | None], ...]
    """(pid, start time) of each rank's guard, the leader of its process group."""


class RankRecords:
    """The records of one daemon's running jobs, in ``folder`` (one file per job)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def _path(self, token: str) -> Path:
        return self.folder / f"{token}{RECORD_SUFFIX}"

    def write(self, job: str, token: str, guard_pids: list[int]) -> None:
        """Record a job's ranks as they start (a failure to write is logged: the job runs)."""
        me = os.getpid()
        data = {"job": job, "token": token, "daemon": {"pid": me, "start": process_start(me)},
                "guards": [{"pid": pid, "start": process_start(pid)} for pid in guard_pids]}
        path = self._path(token)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            private_folder(self.folder)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot record job %s's ranks in %s (%s): a daemon started after this one is killed cannot "
                        "find them", job, self.folder, exc.strerror or exc)

    def remove(self, token: str) -> None:
        """Forget a job's record (by its launch's token)."""
        try:
            self._path(token).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s: %s", self._path(token), exc.strerror or exc)

    def read(self) -> list[tuple[Path, RankRecord | None]]:
        """Every record file and what it says (None: unreadable)."""
        try:
            paths = sorted(p for p in self.folder.iterdir() if p.suffix == RECORD_SUFFIX and not p.name.startswith("."))
        except FileNotFoundError:
            return []
        return [(path, _parse(path)) for path in paths]

    def stop_leftovers(self) -> list[str]:
        """Kill what the jobs recorded by a daemon that no longer runs left, and remove
        their records; one line per job that had something left."""
        said = []
        for path, record in self.read():
            if record is not None and _runs(record.daemon_pid, record.daemon_start) and record.daemon_pid != os.getpid():
                continue  # another daemon's, still running
            if record is not None:
                killed = _kill_recorded(record)
                if killed:
                    said.append(f"job {record.job}: killed {killed} process(es) that daemon {record.daemon_pid} left")
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc.strerror or exc)
        for line in said:
            log.warning("%s", line)
        return said


def _parse(path: Path) -> RankRecord | None:
    try:
        data = json.loads(path.read_text())
        guards = tuple((int(g["pid"]), g.get("start")) for g in data["guards"])
        return RankRecord(str(data["job"]), str(data["token"]), int(data["daemon"]["pid"]), data["daemon"].get("start"),
                          guards)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read the job record %s (%s); removing it", path, exc)
        return None


def _runs(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` runs and is the one recorded (same start time)."""
    return start is not None and pid > 0 and process_start(pid) == start


def _kill_recorded(record: RankRecord) -> int:
    """SIGKILL the process groups of the record's guards that are still the recorded
    processes, and every process marked with its token; how many were signalled."""
    killed = 0
    for pid, start in record.guards:
        if _runs(pid, start):
            try:
                os.killpg(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed + signal_marked({record.token}, signal.SIGKILL)


__all__ = ["MARKER_ENV", "RankRecord", "RankRecords", "marked_processes", "process_start", "signal_marked"]
