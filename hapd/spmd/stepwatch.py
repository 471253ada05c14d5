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

**Every forward is checked before its first collective** (:class:`StepCheck`): each
rank of a :class:`~hapd.train.parallel_module.ParallelModule` brings to one all-gather
of 9 integers its step (optimizer steps taken + 1), which forward of that step this is,
the mode, the loader's batch, a hash of the global batch's shapes and whether the
inputs it was given have the shapes the plan runs on it. When they all agree (every
healthy step) that is all; otherwise every rank gathers the others' details and raises
the same diagnosis at this forward — the rank fed a batch of another size named with
its input, the shape expected and the shape given (:class:`~hapd.errors.PlanError`), or
the ranks out of step with each one's step (:class:`~hapd.errors.CollectiveError`) —
instead of pairing one rank's step with another's or waiting out the timeout in
collectives that no longer match.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hapd.errors import CollectiveError, HapdError, PlanError

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


STEP_CHECK_ENV = "HAPD_STEP_CHECK"
"""Environment variable: ``0`` turns :class:`StepCheck` off (default on). Every rank
must see the same value — the launcher gives every rank its environment — or the
ranks with the check would wait in an all-gather the others never run."""


def step_check_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :class:`StepCheck` runs: ``HAPD_STEP_CHECK`` unset, ``1``, ``true`` or
    ``on``; ``0``, ``false`` or ``off`` turns it off (its all-gather per forward cost
    1.0 ms on a tiny MLP's 2.4 ms step on 2 CPU ranks). Anything else is a
    :class:`~hapd.errors.HapdError` naming the variable."""
    raw = (os.environ if environ is None else environ).get(STEP_CHECK_ENV, "").strip().lower()
    if raw in ("", "1", "true", "on"):
        return True
    if raw in ("0", "false", "off"):
        return False
    raise HapdError(f"{STEP_CHECK_ENV}={raw!r} must be 1 or 0 (on or off)", field=STEP_CHECK_ENV)


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


# --------------------------------------------------------------------------------------
# Every forward checked against the others' before its first collective
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """What one rank brings to a forward (``kind="forward"``) or to building the program
    for a batch of other shapes (``kind="build"``, which is collective too)."""

    rank: int
    kind: str
    step: int
    """Optimizer steps this rank took + 1: the step in progress."""
    forward: int
    """Which forward of the step (1, 2, … with gradient accumulation)."""
    mode: str
    """``"training"`` (with autograd), ``"training (no_grad)"`` or ``"eval"``."""
    position: tuple[int, int] | None
    """(epoch, batch) the loader handed out for this forward; None without one."""
    shapes: list[list[int]]
    """The global batch's shapes the program runs."""
    names: list[str] = field(default_factory=list)
    """The forward's input names."""
    given: list[list[int]] | None = None
    """The shapes of the inputs this rank was given, when they are not ``expected``."""
    expected: list[list[int]] | None = None
    """The shapes the plan runs on this rank (with ``given``)."""

    def key(self) -> list[int]:
        """The integers every rank must agree on (the last says the inputs fit)."""
        epoch, batch = self.position if self.position is not None else (-1, -1)
        digest = zlib.crc32(json.dumps(self.shapes).encode())
        return [0 if self.kind == "forward" else 1, self.step, self.forward, _MODES.index(self.mode), epoch, batch,
                digest, len(self.shapes), int(self.given is None)]

    def where(self) -> str:
        """``rank 1: step 3, forward 1, training, batch shapes [[8, 32], [8]]``."""
        pos = f", the loader's batch {self.position[1]} of epoch {self.position[0]}" if self.position else ""
        doing = "building a program for forward" if self.kind == "build" else "forward"
        return (f"rank {self.rank}: step {self.step}, {doing} {self.forward} of it, {self.mode}{pos}, "
                f"global batch shapes {self.shapes}")


_MODES = ("training", "training (no_grad)", "eval")


class StepCheck:
    """One rank's check of every forward of a module against the other ranks' (see
    the module docstring): one all-gather of :meth:`Arrival.key` per forward, the
    details gathered only when they disagree. Steps are counted at each step of an
    optimizer that holds one of ``params`` (a post-step hook: :func:`_count_steps`)."""

    def __init__(self, rank: int, world: int, group: Any, device: torch.device, params: Sequence[torch.Tensor]):
        self.rank, self.world, self.group, self.device = rank, world, group, torch.device(device)
        self.param_ids = {id(p) for p in params}
        self.step = 1
        self.forwards = 0
        """Forwards checked in this step so far."""
        _count_steps(self)

    def stepped(self) -> None:
        """An optimizer holding the module's parameters stepped: the next step begins."""
        self.step += 1
        self.forwards = 0

    def arrival(self, kind: str, mode: str, position: tuple[int, int] | None, shapes: Sequence[Sequence[int]],
                names: Sequence[str] = (), given: Sequence[Sequence[int]] | None = None,
                expected: Sequence[Sequence[int]] | None = None) -> Arrival:
        """This rank's arrival at its next forward (or at building a program for it)."""
        fits = given is None or expected is None or _fits(given, expected)
        return Arrival(self.rank, kind, self.step, self.forwards + 1, mode, position, [list(s) for s in shapes],
                       list(names), None if fits else [list(s) for s in given],
                       None if fits else [list(s) for s in expected])

    def agree(self, arrival: Arrival) -> None:
        """:meth:`start` and :meth:`Pending.wait`: the check done before this returns."""
        self.start(arrival).wait()

    def start(self, arrival: Arrival) -> "Pending":
        """Put the all-gather of every rank's :meth:`Arrival.key` in flight (a forward
        without collectives of its own computes meanwhile); :meth:`Pending.wait` raises
        the disagreement. Counts the forward when ``arrival`` is one."""
        mine = torch.tensor(arrival.key(), dtype=torch.int64, device=self.device)
        table = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.device)
        work = dist.all_gather_into_tensor(table, mine, group=self.group, async_op=True)
        if arrival.kind == "forward":
            self.forwards += 1
        return Pending(self, arrival, work, table)


@dataclass
class Pending:
    """A forward's check in flight (:meth:`StepCheck.start`)."""

    check: StepCheck
    arrival: Arrival
    work: Any
    table: torch.Tensor

    def wait(self) -> None:
        """Wait for every rank's key; when one differs or a rank's inputs do not fit,
        raise on every rank the error that names who and how (a second, rare gather
        of the details, :func:`disagreement`)."""
        self.work.wait()
        table = self.table.cpu().view(self.check.world, -1)
        if bool((table == table[0]).all()) and bool(table[:, -1].all()):
            return
        everyone: list[Any] = [None] * self.check.world
        dist.all_gather_object(everyone, self.arrival, group=self.check.group)
        raise disagreement(self.check.rank, everyone)


def _fits(given: Sequence[Sequence[int]], expected: Sequence[Sequence[int]]) -> bool:
    """Whether inputs of ``given`` shapes are what the plan runs (an empty expected
    shape, a scalar input the plan does not size, takes any)."""
    return len(given) == len(expected) and all(not e or list(g) == list(e) for g, e in zip(given, expected))


def disagreement(rank: int, everyone: Sequence[Arrival]) -> HapdError:
    """The error rank ``rank`` raises when the ranks' arrivals at a forward disagree:
    a rank given inputs of other shapes (:class:`~hapd.errors.PlanError` naming the
    input, the shape the plan runs and the one given), ranks at different steps
    (:class:`~hapd.errors.CollectiveError` naming each rank's step), or ranks running
    different programs (:class:`~hapd.errors.PlanError`)."""
    misfed = [a for a in everyone if a.given is not None]
    if misfed:
        notes = []
        for a in misfed:
            for k, (g, e) in enumerate(zip(a.given, a.expected)):
                if e and g != e:
                    name = a.names[k] if k < len(a.names) else f"input {k}"
                    notes.append(f"rank {a.rank} input {k} ({name}): expected shape {e}, given {g}")
            if len(a.given) != len(a.expected):
                notes.append(f"rank {a.rank}: {len(a.given)} inputs given, the plan runs {len(a.expected)}")
        own = next((a for a in misfed if a.rank == rank), None)
        lead = (f"rank {rank}: this rank was given a batch of another size at step {own.step}" if own is not None
                else f"rank {rank}: rank(s) {', '.join(str(a.rank) for a in misfed)} were given a batch of another "
                     f"size at step {misfed[0].step}")
        return PlanError(f"{lead}: {'; '.join(notes)} (the pieces of a global batch of shapes {misfed[0].shapes}; "
                         "cut a batch of another size on every rank with shard_inputs, or read it with hapd.loader)",
                         field=f"step {misfed[0].step}")
    steps = {(a.step, a.forward, a.position) for a in everyone}
    listing = "; ".join(a.where() for a in everyone)
    if len(steps) > 1:
        return CollectiveError(f"rank {rank}: ranks out of step: {listing} (every rank must run the same forwards "
                               "and optimizer steps on the same batches: one skipped or repeated a step)",
                               field=f"step {everyone[rank].step}")
    return PlanError(f"rank {rank}: the ranks run different programs at step {everyone[rank].step}: {listing} "
                     "(every rank must cut the same global batch, in the same mode: shard_inputs or "
                     "expect_batch on one rank alone builds a program the others do not)",
                     field=f"step {everyone[rank].step}")


_checks: "weakref.WeakSet[StepCheck]" = weakref.WeakSet()
_checks_lock = threading.Lock()
_step_hook: Any = None


def _count_steps(check: StepCheck) -> None:
    """Count ``check``'s steps at each optimizer step (one post-step hook for the
    process, registered with the first check: the steps of an optimizer holding
    none of a check's parameters are not its)."""
    global _step_hook
    with _checks_lock:
        _checks.add(check)
        if _step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _step_hook = register_optimizer_step_post_hook(_on_optimizer_step)


def _on_optimizer_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    with _checks_lock:
        checks = list(_checks)
    for check in checks:
        if any(id(p) in check.param_ids for group in optimizer.param_groups for p in group["params"]):
            check.stepped()


__all__ = ["Arrival", "CheckIn", "Pending", "DEFAULT_COLLECTIVE_TIMEOUT_S", "StepCheck", "StepWatch", "disagreement", "TIMEOUT_ENV", "collective_timeout_s", "seconds_from_env"]
