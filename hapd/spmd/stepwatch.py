"""Which rank is missing when a collective waits too long.

Every collective of a job runs under the process group's timeout
(:func:`collective_timeout_s`: ``HAPD_COLLECTIVE_TIMEOUT`` seconds, default
:data:`DEFAULT_COLLECTIVE_TIMEOUT_S`), so a rank that is not there makes the others fail
instead of hanging. To say *who* is not there, each rank **checks in** at the start of
every training step (:meth:`StepWatch.begin`): it writes its step number, and the shapes
of its step's inputs when it knows them, under its own key in the job's rendezvous store
(one small write per step). When a collective fails, :meth:`StepWatch.failed` reads every
rank's check-in and turns the error into a :class:`~hapd.errors.CollectiveError` that
names the step and, for each rank not at it, where that rank is: behind (it did not
arrive), ahead (it skipped a step), never checked in, or at the step with inputs of
another shape than at its previous step (it cut a batch of another size).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hapd.errors import CollectiveError, HapdError

TIMEOUT_ENV = "HAPD_COLLECTIVE_TIMEOUT"
"""Environment variable: seconds a collective may wait for the other ranks."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""A collective's timeout when ``HAPD_COLLECTIVE_TIMEOUT`` is unset."""
KEY_PREFIX = "hapd/step/"
"""Store key prefix of the check-ins (``hapd/step/RANK``)."""
READ_TIMEOUT_S = 2.0
"""How long reading the check-ins after a failure may take."""
MAX_ERROR_CHARS = 300
"""Characters of the backend's own error kept in the message."""


def seconds_from_env(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """Environment variable ``name`` as seconds (> 0, finite), or ``default`` when unset
    or empty; :class:`~hapd.errors.HapdError` naming it otherwise."""
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise HapdError(f"{name}={raw!r} must be a positive number of seconds", field=name)
    return value


def collective_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``HAPD_COLLECTIVE_TIMEOUT`` (seconds, > 0), or :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S, environ)


@dataclass(frozen=True)
class CheckIn:
    """Where a rank said it was."""

    step: int
    shapes: list | None = None
    previous: list | None = None
    """The shapes it gave at its previous step."""


@dataclass
class StepWatch:
    """One rank's check-ins in ``store`` (the job's rendezvous store)."""

    store: Any
    rank: int
    world: int
    timeout_s: float
    step: int = 0
    _shapes: list | None = field(default=None, repr=False)
    _previous: list | None = field(default=None, repr=False)

    @classmethod
    def for_job(cls, timeout_s: float | None = None) -> "StepWatch | None":
        """The watch of this rank of the default process group (None: no group, one
        rank, or no store to check in with)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        try:
            store = dist.PrefixStore(KEY_PREFIX, dist.distributed_c10d._get_default_store())
        except (AttributeError, RuntimeError, ValueError):
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(),
                   collective_timeout_s() if timeout_s is None else timeout_s)

    def begin(self, step: int, shapes: Sequence[Sequence[int]] | None = None) -> None:
        """This rank starts ``step`` (with inputs of ``shapes``, when known)."""
        now = [list(s) for s in shapes] if shapes is not None else None
        record = {"step": step, "shapes": now, "previous": self._shapes}
        self.store.set(str(self.rank), json.dumps(record))
        self.step, self._shapes, self._previous = step, now, self._shapes

    @contextmanager
    def watching(self, step: int, shapes: Sequence[Sequence[int]] | None = None) -> Iterator[None]:
        """Check in for ``step``; a failed collective inside becomes a :class:`CollectiveError`."""
        self.begin(step, shapes)
        started = time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, …) are RuntimeErrors
            raise self.failed(exc, time.monotonic() - started) from exc

    def failed(self, exc: BaseException, waited_s: float) -> CollectiveError:
        """The error that says, for a collective that failed after ``waited_s``, which
        ranks were not at this step."""
        backend = " ".join(str(exc).split())[:MAX_ERROR_CHARS]
        others = self._read_others()
        own = CheckIn(self.step, self._shapes, self._previous)
        if others is None:
            missing, where = _where(own, self.rank, {})
            missing = [r for r in missing if r == self.rank]
            where = "the other ranks' check-ins cannot be read (the store's host, rank 0, has exited?)" + \
                ("; " + where if missing else "")
        else:
            missing, where = _where(own, self.rank, others)
        who = (f"rank(s) {', '.join(map(str, missing))} out of step: " if missing else "") + where
        return CollectiveError(f"rank {self.rank}: a collective of step {self.step} failed after {waited_s:.1f} s "
                               f"(timeout {self.timeout_s:g} s, {TIMEOUT_ENV}): {who} [{backend}]", field=f"step {self.step}")

    def _read_others(self) -> dict[int, CheckIn | None] | None:
        try:
            self.store.set_timeout(timedelta(seconds=READ_TIMEOUT_S))
            out: dict[int, CheckIn | None] = {}
            for rank in range(self.world):
                if rank == self.rank:
                    continue
                key = str(rank)
                out[rank] = _parse(self.store.get(key)) if self.store.check([key]) else None
            return out
        except (RuntimeError, ValueError):
            return None


def _parse(raw: bytes) -> CheckIn | None:
    try:
        data = json.loads(raw)
        return CheckIn(int(data["step"]), data.get("shapes"), data.get("previous"))
    except (ValueError, KeyError, TypeError):
        return None


def _where(own: CheckIn, rank: int, others: Mapping[int, CheckIn | None]) -> tuple[list[int], str]:
    """The ranks not at this rank's step (or there with a batch cut otherwise, this rank
    included) and a sentence on each."""
    step = own.step
    missing, notes = [], []
    for other, check in sorted({**others, rank: own}.items()):
        if check is None:
            missing.append(other)
            notes.append(f"rank {other} never checked in")
        elif check.step < step:
            missing.append(other)
            notes.append(f"rank {other} did not arrive (it is at step {check.step})")
        elif check.step > step:
            missing.append(other)
            notes.append(f"rank {other} is at step {check.step} (it skipped step {step}?)")
        elif _recut(check.shapes, check.previous):
            missing.append(other)
            notes.append(f"rank {other} cut a batch of another size at step {step}: inputs {check.shapes}, "
                         f"{check.previous} at its step before")
    if not notes:
        notes.append(f"every rank checked in at step {step}; they wait in different collectives or with "
                     "inputs of different shapes")
    return missing, "; ".join(notes)


def _recut(shapes: list | None, previous: list | None) -> bool:
    return shapes is not None and previous is not None and shapes != previous


__all__ = ["CheckIn", "DEFAULT_COLLECTIVE_TIMEOUT_S", "StepWatch", "TIMEOUT_ENV", "collective_timeout_s", "seconds_from_env"]
