"""Each rank's copy of its state at the last two steps it completed, kept in its
process's memory across a switch in place, and the survivors' agreement on the step
to go on from.

:meth:`hapd.Elastic.step_done` keeps, before any collective of its own, a copy of what
this rank holds (:func:`entries`, :func:`small_state`): its pieces of the parameters
and buffers, its optimizer state (under the keys checkpoints give them,
:func:`hapd.state.checkpoint.optimizer_held`), and the small state a snapshot saves
(the sampler's position, the RNG, the dropouts' generator step, ``state`` such as a
scheduler, the param groups' settings). The buffers are allocated once and written
with ``copy_``: a step's cost is a memcpy of the rank's state, into host memory (a
GPU's is the scarcer; pinned for GPU tensors), the parameters and the optimizer state
beside the next step (:class:`StepCopies`).

The copies live in :class:`StepCopies`, one per elastic run (``$HAPD_ELASTIC_RUN``) in
this module's registry (:func:`kept`): when :mod:`hapd.elastic.in_place` runs the
script again after a lost host, the new model and the new :class:`hapd.Elastic` find
the copies the previous run kept.

**Why two.** A failure inside step k+1 leaves the survivors at different points of it:
some applied update k+1 (and kept its copy), some never reached it. None can be two
steps ahead (step k+2's collectives need every rank past step k+1). So every survivor
holds a copy of the last step all completed, ``s`` = the least of their newest steps
(:func:`agree`): the newest, or the one before. Copying at the start of a step instead
is the same copy (the end of step k is the start of k+1), so two buffers that alternate
are the least that is correct, at one memcpy a step.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from hapd.elastic.moves import Piece, dtype_name
from hapd.state.checkpoint import (
    draw_count,
    held_tensors,
    optimizer_held,
    optimizer_hyperparameters,
    optimizer_parameters,
)
from hapd.state.checkpoint_format import MODEL, OPTIM
from hapd.state.held import Held

COPY_ENV = "HAPD_STEP_COPY"
"""``0`` turns the step copies off (the state then comes from the snapshot after a
switch in place, as after a restart); anything else or unset: on."""

HOST_SHARE = 0.5
"""The most of the host memory available when the copies are first made (its
``MemAvailable``, shared by the host's ranks: ``$LOCAL_WORLD_SIZE``) the two copies may
take; a rank whose state needs more keeps none (:class:`CopiesTooLarge`) and says so: a
7B model's replicated Adam state is 112 GB a copy, and a host that swaps or kills a rank
for its copies trains worse than one that reloads a snapshot."""


class CopiesTooLarge(Exception):
    """Two copies of this rank's state do not fit its share of the host's memory."""


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``); None where
    it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_budget(nbytes: int, local_ranks: int, available: int | None) -> None:
    """:class:`CopiesTooLarge` when two copies of ``nbytes`` pass this rank's share of
    ``available`` host bytes (:data:`HOST_SHARE` over ``local_ranks``); nothing when the
    host's memory is unknown."""
    if available is None:
        return
    budget = HOST_SHARE * available / max(1, local_ranks)
    if 2 * nbytes > budget:
        raise CopiesTooLarge(f"two step copies of this rank's state take {2 * nbytes / 2**30:.2f} GiB, more than "
                             f"its share of the host's available memory ({budget / 2**30:.2f} GiB: "
                             f"{HOST_SHARE:.0%} of {available / 2**30:.2f} GiB over {local_ranks} rank(s))")


@dataclass
class SmallState:
    """What a snapshot saves beside the tensors, as it was at the copy's step."""

    sampler: Any
    """The sampler's (or loader's) ``state_dict()``; None without a sampler."""
    rng: dict[str, Any]
    """This rank's torch RNG state (``cpu``, and ``cuda`` when used)."""
    seed: int
    """This rank's ``torch.initial_seed()`` (a new rank is seeded from it, as from a checkpoint's)."""
    draws: int | None
    """The counter-based dropout generator's step (:func:`hapd.state.checkpoint.draw_count`)."""
    user: dict[str, Any]
    """``state``'s ``state_dict()``s by name (a scheduler)."""
    hyperparameters: list[dict[str, Any]]
    """Each optimizer param group's settings (a scheduler's ``lr``); empty without an optimizer."""


@dataclass
class StepCopy:
    """One rank's state at the end of ``step``, as the generation ``generation`` laid it out."""

    step: int
    generation: int
    rank: int
    """The rank in that generation."""
    world: int
    tensors: dict[str, Tensor]
    """Entry key (``model/…``, ``optim/…/…``) → this rank's copy of its piece."""
    pieces: tuple[Piece, ...]
    """Where each of ``tensors`` lies in its whole tensor."""
    objects: dict[str, Any]
    """Optimizer state values that are not tensors, by key."""
    small: SmallState

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class _UnderWay:
    """A copy's part that runs beside the next step: a thread (CPU tensors) and an event
    on a side stream (GPU tensors)."""

    thread: threading.Thread | None = None
    event: Any = None
    seconds: list[float] = field(default_factory=list)
    """The thread's time, once it ended."""
    errors: list[str] = field(default_factory=list)
    failed: bool = False
    """The part beside the step failed (kept once set; ``errors`` is cleared when told)."""


@dataclass
class StepCopies:
    """This rank's copies of one run: the two newest steps, the newest last.

    **Beside the next step.** With ``overlap`` (:meth:`keep`) the tensors that only an
    optimizer step changes — trained parameters and the optimizer state — are copied
    beside the next step's forward and backward (a thread for CPU tensors, a side stream
    for GPU ones), and the optimizer's next step waits for them first
    (:meth:`before_update`, an optimizer step pre-hook that :class:`hapd.Elastic`
    registers); buffers, which a forward may change (running statistics, the dropouts'
    step), are copied at once."""

    copies: list[StepCopy] = field(default_factory=list)
    local_ranks: int = 1
    """The ranks on this host, sharing its memory (:func:`check_budget`)."""
    seconds: list[float] = field(default_factory=list)
    """How long each copy took in the foreground (the last :data:`TIMES_KEPT`)."""
    beside: list[float] = field(default_factory=list)
    """How long each copy's part beside the next step took (CPU tensors; the last :data:`TIMES_KEPT`)."""
    _under_way: _UnderWay | None = None
    _stream: Any = None

    def keep(self, step: int, generation: int, rank: int, world: int, entries: Sequence[Held],
             objects: Mapping[str, Any], small: SmallState, *, overlap: bool = False) -> StepCopy:
        """Copy ``entries`` (this rank's pieces under their keys, :func:`entries`) as the
        copy of ``step``, into the buffers of the older copy when it is laid out alike
        (else new ones); the older copy is replaced. :class:`CopiesTooLarge` (nothing
        copied) when two copies pass the host-memory budget (:func:`check_budget`). ``overlap``: copy the trained
        parameters and the optimizer state beside the next step (the class docstring)."""
        start = time.perf_counter()
        self.wait()
        reuse = self.copies[0] if len(self.copies) == 2 else None
        self.copies = self.copies[1:] if len(self.copies) == 2 else self.copies
        layout = [(h.key, tuple(h.local.shape), h.local.dtype) for h in entries]
        if reuse is None or [(k, tuple(t.shape), t.dtype) for k, t in reuse.tensors.items()] != layout:
            if not self.copies:  # the first copy of a layout: both are allocated in turn
                check_budget(sum(h.local.numel() * h.local.element_size() for h in entries), self.local_ranks,
                             host_available_bytes())
            tensors = {h.key: _host_buffer(h.local) for h in entries}
        else:
            tensors = reuse.tensors
        later = [(tensors[h.key], h.local.detach()) for h in entries if overlap and updated_only_by_optimizer(h)]
        with torch.no_grad():
            for h in entries:
                if not (overlap and updated_only_by_optimizer(h)):
                    tensors[h.key].copy_(h.local.detach())
        pieces = tuple(Piece(h.key, tuple(h.offsets), tuple(h.local.shape), tuple(h.size), dtype_name(h.local.dtype))
                       for h in entries)
        kept = StepCopy(step, generation, rank, world, tensors, pieces, copy.deepcopy(dict(objects)), small)
        self.copies.append(kept)
        self._start(later)
        self.seconds = (self.seconds + [time.perf_counter() - start])[-TIMES_KEPT:]
        return kept

    def _start(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Copy ``pairs`` (target, source) beside what comes next."""
        on_gpu = [(t, s) for t, s in pairs if s.is_cuda]
        on_cpu = [(t, s) for t, s in pairs if not s.is_cuda]
        under_way = _UnderWay()
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # the step's update is done
            with torch.cuda.stream(self._stream), torch.no_grad():
                for target, source in on_gpu:
                    target.copy_(source, non_blocking=True)
                    source.record_stream(self._stream)  # its memory not reused before the copy ran (a model freed)
                under_way.event = torch.cuda.Event()
                under_way.event.record(self._stream)
        if on_cpu:
            def run() -> None:
                began = time.perf_counter()
                try:
                    with torch.no_grad():
                        for target, source in on_cpu:
                            target.copy_(source)
                except Exception as exc:  # noqa: BLE001 - told at the next wait, the copy dropped
                    under_way.errors.append(f"{type(exc).__name__}: {exc}")
                    under_way.failed = True
                under_way.seconds.append(time.perf_counter() - began)

            under_way.thread = threading.Thread(target=run, daemon=True, name="hapd-step-copy")
            under_way.thread.start()
        self._under_way = under_way if (on_gpu or on_cpu) else None

    def before_update(self) -> None:
        """Before the optimizer changes what the last copy reads: the CPU part waited
        for, the GPU part ordered before the update on the current stream (no wait on
        the host)."""
        under_way = self._under_way
        if under_way is None:
            return
        if under_way.event is not None:
            torch.cuda.current_stream().wait_event(under_way.event)
            under_way.event = None
        self._join(under_way)

    def landing(self) -> Callable[[], bool]:
        """A wait, callable from another thread, until the newest copy is whole (its
        part beside the step ended); it answers whether the copy is sound (that part did
        not fail). :mod:`hapd.elastic.replica` sends the copy once it is."""
        under_way = self._under_way
        if under_way is None:
            return lambda: True
        thread, event = under_way.thread, under_way.event

        def wait() -> bool:
            if event is not None:
                event.synchronize()
            if thread is not None:
                thread.join()
            return not under_way.failed

        return wait

    def wait(self) -> None:
        """Until the last copy is whole (on the host: before it is read or replaced). A
        copy whose part beside the step failed is dropped."""
        under_way, self._under_way = self._under_way, None
        if under_way is None:
            return
        if under_way.event is not None:
            under_way.event.synchronize()
        self._join(under_way)

    def _join(self, under_way: _UnderWay) -> None:
        if under_way.thread is not None:
            under_way.thread.join()
            under_way.thread = None
            self.beside = (self.beside + under_way.seconds)[-TIMES_KEPT:]
        if under_way.errors and self.copies:
            self.copies.pop()  # torn: not a copy of its step
            under_way.errors.clear()

    def of_step(self, step: int) -> StepCopy | None:
        return next((c for c in self.copies if c.step == step), None)

    @property
    def generation(self) -> int | None:
        """The generation the copies were laid out by (None: none kept)."""
        return self.copies[-1].generation if self.copies else None

    def clear(self) -> None:
        self.wait()
        self.copies = []

    def ready(self) -> None:
        """Wait for the copies under way (before they are read)."""
        self.wait()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def updated_only_by_optimizer(h: Held) -> bool:
    """Whether only an optimizer step changes ``h`` between two steps' ends: a trained
    parameter and the optimizer's state do; a buffer may change in a forward."""
    return h.key.startswith(OPTIM) or h.local.requires_grad


TIMES_KEPT = 64
"""How many of the last copies' times :attr:`StepCopies.seconds` keeps."""

_KEPT: dict[str, StepCopies] = {}
"""Each elastic run's copies on this rank (this process), by run id."""


def kept(run: str) -> StepCopies:
    """The copies of ``run`` this process keeps (empty at first); the same object for the
    script's next run in this process."""
    return _KEPT.setdefault(run, StepCopies())


def forget(run: str) -> None:
    """Free ``run``'s copies."""
    _KEPT.pop(run, None)


def _host_buffer(like: Tensor) -> Tensor:
    """A host tensor shaped like ``like`` (pinned when ``like`` is on a GPU: its copy can
    then run on a side stream, not waited for)."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


# --------------------------------------------------------------------------------------
# What a copy takes of a rank's state
# --------------------------------------------------------------------------------------


def entries(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[list[Held], dict[str, Any]]:
    """This rank's pieces under the keys checkpoints give them — the model's
    (``model/<name>``; :func:`hapd.state.checkpoint.held_tensors`) and the optimizer's
    (``optim/<name>/<state>``) — and the optimizer's values that are not tensors. An
    empty piece is left out."""
    held = held_tensors(module)
    out = [Held(MODEL + h.key, h.local, h.offsets, h.size) for h in held if h.local.numel() or not h.partial]
    objects: dict[str, Any] = {}
    if optimizer is not None:
        tensors, objects = optimizer_held(optimizer, held)
        out += [h for h in tensors if h.local.numel() or not h.partial]
    return out, objects


def small_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, sampler: Any,
                user: Mapping[str, Any]) -> SmallState:
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return SmallState(
        sampler=copy.deepcopy(sampler.state_dict()) if sampler is not None else None,
        rng=rng, seed=torch.initial_seed(), draws=draw_count(module),
        user={name: copy.deepcopy(obj.state_dict()) for name, obj in user.items()},
        hyperparameters=copy.deepcopy(optimizer_hyperparameters(optimizer)) if optimizer is not None else [])


def needed_pieces(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[tuple[Piece, ...],
                                                                                      tuple[Piece, ...]]:
    """What this rank's new module holds (its model pieces, to be filled) and the pieces
    of its optimizer's parameters (whose states it needs laid out alike)."""
    held = held_tensors(module)
    model = tuple(Piece(MODEL + h.key, tuple(h.offsets), tuple(h.local.shape), tuple(h.size), dtype_name(h.local.dtype))
                  for h in held)
    params = () if optimizer is None else tuple(
        Piece(h.key, tuple(h.offsets), tuple(h.local.shape), tuple(h.size), dtype_name(h.local.dtype))
        for h in optimizer_parameters(optimizer, held))
    return model, params


# --------------------------------------------------------------------------------------
# The survivors' agreement
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """What one rank of the new group says at resume (gathered from every rank): the
    copies it holds, and what its new module needs."""

    rank: int
    """Its rank in the new group."""
    generation: int | None
    """The generation its copies were laid out by; None: it holds none (a new process)."""
    old_rank: int | None
    copies: dict[int, tuple[tuple[Piece, ...], dict[str, Any], SmallState]]
    """Step → (the pieces it holds, its non-tensor optimizer values, its small state)."""
    needs: tuple[Piece, ...]
    """The model pieces its new module holds."""
    params: tuple[Piece, ...]
    """Its optimizer's parameters' pieces (by model key, without ``model/``)."""
    replicas: dict[int, tuple[Piece, ...]] = field(default_factory=dict)
    """Step → the pieces of other ranks it holds replicas of (:mod:`hapd.elastic.replica`),
    laid out by ``generation``."""


@dataclass(frozen=True)
class Agreement:
    """The step the survivors go on from (None: none they all hold, ``reason`` says why)."""

    step: int | None
    survivors: tuple[int, ...] = ()
    """The new ranks that hold a copy of ``step`` (of the newest generation any holds)."""
    reason: str = ""
    earlier: int | None = None
    """The step before ``step`` when every survivor holds a copy of it too (else None):
    where they go on from when only replicas of that step hold a lost rank's pieces."""


def agree(offers: Sequence[Offer]) -> Agreement:
    """The last step every survivor completed: the least of their newest copies' steps,
    every survivor holding a copy of it (the newest or the one before). The survivors
    are the ranks whose copies are of the newest generation any rank's are."""
    holding = [o for o in offers if o.generation is not None and o.copies]
    if not holding:
        return Agreement(None, reason="no rank holds a step copy")
    generation = max(o.generation for o in holding if o.generation is not None)
    survivors = sorted((o for o in holding if o.generation == generation), key=lambda o: o.rank)
    step = min(max(o.copies) for o in survivors)
    lacking = [o.rank for o in survivors if step not in o.copies]
    if lacking:
        return Agreement(None, reason=f"ranks {lacking} hold no copy of step {step}")
    earlier = step - 1 if all(step - 1 in o.copies for o in survivors) else None
    return Agreement(step, tuple(o.rank for o in survivors), earlier=earlier)


def optimizer_needs(params: Iterable[Piece], held: Iterable[Piece]) -> list[Piece]:
    """The optimizer-state pieces a rank whose optimizer's parameters are ``params``
    needs, given the survivors' ``held`` pieces (whose keys say which states exist): a
    state as large as its parameter is split like it, any other (a scalar ``step``) is
    needed whole."""
    by_param = {p.key: p for p in params}
    sizes: dict[str, tuple[tuple[int, ...], str]] = {}
    for piece in held:
        if piece.key.startswith(OPTIM):
            sizes.setdefault(piece.key, (piece.size, piece.dtype))
    out = []
    for key, (size, dtype) in sorted(sizes.items()):
        param = by_param.get(key[len(OPTIM):].rsplit("/", 1)[0])
        if param is None:
            continue
        if size and size == param.size:
            if param.shape and 0 in param.shape:
                continue  # an empty piece of the parameter: nothing of its state here
            out.append(Piece(key, param.offsets, param.shape, size, dtype))
        else:
            out.append(Piece(key, (0,) * len(size), size, size, dtype))
    return out


__all__ = ["Agreement", "COPY_ENV", "CopiesTooLarge", "HOST_SHARE", "Offer", "SmallState", "StepCopies", "StepCopy", "agree", "check_budget", "entries", "forget", "host_available_bytes",
           "kept", "needed_pieces", "optimizer_needs", "small_state", "updated_only_by_optimizer"]
