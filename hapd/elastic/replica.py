"""Each rank's pieces that no other host holds, copied every step to a rank of the
next host: after a lost host (or rank) under a plan that splits a tensor over the
hosts, its pieces come back from memory at the switch in place, not from the snapshot.

The step copies (:mod:`hapd.elastic.step_copy`) keep each rank's state of its last two
steps in its own process. A tensor replicated over the hosts survives the loss of any
one of them there; a tensor the plan splits over the ranks (an MLP's columns) does
not: the lost ranks' columns were in the snapshot only, older (the automatic interval)
and slower to load. So each rank sends, every step, the pieces of its copy that no
rank of another host covers (:func:`lonely`; one rank of a host sends a piece its host's
ranks hold alike) to its *partner* (:func:`partners`: the rank of the same local index
on the next host, round the hosts), which keeps the last two it received. A plan that
splits nothing (data parallel) sends nothing.

**When.** Step k's pieces are sent at its end, on a thread: straight from the rank's
own tensors when only the optimizer changes them and they live on the host, else from
step k's copy once it is whole (its part beside step k+1 ended). They go over a Gloo
process group of their own (point to point; a pair's messages keep their order and
share no tag with the training's collectives), made with the job's group at its
rendezvous (:func:`hapd.spmd.distributed.side_group`: a rank lost while the others made
a group later would leave them waiting on the store, not on a connection that closes).
Each rank's step k+1 waits for its transfers before its first collective (a forward
pre-hook on the job's module; a transfer that failed parks the rank). So when any rank
completed step k+1, every partner holds step k's replicas; the survivors go on from the
last step all of them completed when its replicas arrived, else from the step before,
which every survivor holds then (none completed a later one:
:attr:`hapd.elastic.step_copy.Agreement.earlier`) with its replicas: at most one step
redone. The snapshot stays the fallback, and :meth:`hapd.Elastic.resume` says which.
A generation's resume lays the replicas out and sends the resumed step's.

**Cost.** A rank's lonely pieces (its parameters' and their optimizer states'), once
a step, over the link to the next host, while the next step's batch is drawn: the
forward waits for what is left of it. Two receive buffers per source. A generation in
which a rank would send more than ``$HAPD_REPLICA_MAX_MB`` (:data:`DEFAULT_MAX_MB`)
keeps no replicas and says so: a pipeline stage's whole state every step over the
hosts' link costs more than the steps it would save. ``$HAPD_REPLICA=0`` turns them off.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hapd.elastic.moves import Box, Piece, dtype_size
from hapd.elastic.park_events import PARK_REQUESTED
from hapd.errors import PEER_FAILURE, CollectiveError
from hapd.spmd import group_sockets
from hapd.spmd.distributed import side_group
from hapd.wire.contract import REPLICA_ENV

MAX_MB_ENV = "HAPD_REPLICA_MAX_MB"
"""The most MB a rank may send its partner a step; more: no replicas that generation."""
DEFAULT_MAX_MB = 64.0

SETTLE_S = 2.0
"""How long a generation's resume waits for the last generation's transfer (:meth:`Replicas.settle`)."""

_HEADER_TAG = 0
"""The tag of a replica's header (its step, or -1: the copy was torn); its tensors' follow
one tag per dtype from 1."""


def partners(hosts: Sequence[str]) -> list[int | None]:
    """Each rank's partner: the rank of its local index (modulo that host's ranks) on the
    next host, hosts in the order of their first rank, round them; None on one host."""
    order = list(dict.fromkeys(hosts))
    if len(order) < 2:
        return [None] * len(hosts)
    members: dict[str, list[int]] = defaultdict(list)
    for rank, host in enumerate(hosts):
        members[host].append(rank)
    out: list[int | None] = []
    for rank, host in enumerate(hosts):
        following = members[order[(order.index(host) + 1) % len(order)]]
        out.append(following[members[host].index(rank) % len(following)])
    return out


def lonely(hosts: Sequence[str], held: Sequence[Sequence[Piece]]) -> list[tuple[Piece, ...]]:
    """Each rank's pieces that the ranks of the other hosts do not cover whole (a lost
    host takes them with it); a piece that a lower rank of the same host holds alike is
    that rank's alone. Pure: the same on every rank given the same metadata."""
    elsewhere: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    for rank, pieces in enumerate(held):
        for piece in pieces:
            if piece.box.numel:
                elsewhere[piece.key].append((hosts[rank], piece))
    seen: set[tuple[str, Piece]] = set()
    out: list[tuple[Piece, ...]] = []
    for rank, pieces in enumerate(held):
        mine = []
        for piece in pieces:
            if not piece.box.numel or (hosts[rank], piece) in seen:
                continue
            seen.add((hosts[rank], piece))
            left = [piece.box]
            for host, other in elsewhere[piece.key]:
                if host == hosts[rank] or other.size != piece.size:
                    continue
                left = [part for region in left for part in _less(region, other.box)]
                if not left:
                    break
            if left:
                mine.append(piece)
        out.append(tuple(mine))
    return out


def _less(region: Box, other: Box) -> list[Box]:
    common = region.intersect(other)
    return [region] if common is None else region.minus(common)


@dataclass(frozen=True)
class Layout:
    """One generation's replicas as this rank sees them."""

    generation: int
    partner: int | None
    sends: tuple[Piece, ...]
    """This rank's pieces it sends its partner every step."""
    sources: tuple[tuple[int, tuple[Piece, ...]], ...]
    """The ranks whose partner this rank is, and the pieces each sends, in rank order."""

    @property
    def active(self) -> bool:
        return bool(self.sends) or bool(self.sources)


def layout(generation: int, rank: int, hosts: Sequence[str], held: Sequence[Sequence[Piece]]) -> Layout:
    """This rank's :class:`Layout` from every rank's host and pieces."""
    partner = partners(hosts)
    alone = lonely(hosts, held)
    sources = tuple((r, alone[r]) for r in range(len(hosts)) if partner[r] == rank and r != rank and alone[r])
    sends = alone[rank] if partner[rank] is not None and partner[rank] != rank else ()
    return Layout(generation, partner[rank], sends, sources)


@dataclass
class Received:
    """A replica this rank holds: ``source``'s lonely pieces at ``step``."""

    step: int
    generation: int
    source: int
    pieces: tuple[Piece, ...]
    tensors: dict[str, Tensor]


@dataclass
class Replicas:
    """This rank's replicas of one run (kept by the process across the script's runs, as
    the step copies are: :func:`kept`): the two newest received from each source, the
    layout and process group of the generation that sends them, the thread under way."""

    received: dict[int, list[Received]] = field(default_factory=dict)
    layout: Layout | None = None
    errors: list[str] = field(default_factory=list)
    """Transfers that failed (a peer lost), the newest last."""
    seconds: list[float] = field(default_factory=list)
    """Each step's transfer, wall seconds on its thread (the last 64)."""
    failed: str | None = None
    """The transfer under way failed (a peer lost), until :meth:`before_step` tells it."""
    sent_bytes: tuple[int, ...] = ()
    """The bytes each rank sends its partner a step in this generation (empty: one host)."""
    _group: Any = None
    _slots: dict[int, list[dict[str, Tensor]]] = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _epoch: int = 0
    """Counts the transfers given up (:meth:`settle`): one that ends later records nothing."""

    def set_up(self, generation: int, rank: int, hosts: Sequence[str], held: Sequence[Sequence[Piece] | None],
               max_bytes: float) -> Layout:
        """This generation's layout from every rank's host and pieces (None: a rank that
        keeps no step copies: then no replicas); its process group when any rank sends.
        Collective (the group's creation), the same on every rank."""
        self.reset()
        if any(pieces is None for pieces in held):
            self.layout = Layout(generation, None, (), ())
            return self.layout
        pieces = [tuple(p) for p in held if p is not None]
        sizes = [sum(p.box.numel * dtype_size(p.dtype) for p in alone) for alone in lonely(hosts, pieces)]
        largest = max(sizes, default=0)
        self.sent_bytes = tuple(sizes) if len(set(hosts)) > 1 else ()
        if largest > max_bytes:
            self.layout = Layout(generation, None, (), ())
            if rank == 0:
                print(f"hapd elastic: no replicas of the lost ranks' pieces this generation: a rank would send "
                      f"{largest / 2**20:.1f} MB a step, more than {MAX_MB_ENV}={max_bytes / 2**20:g}; a lost rank's "
                      "pieces come from the snapshot", file=sys.stderr, flush=True)
            return self.layout
        self.layout = layout(generation, rank, hosts, pieces)
        if any(self.sent_bytes):
            self._group = side_group()  # made at the job's rendezvous: a group made now could strand the others
            if self._group is None:  # a process group the script made itself
                with group_sockets.tracked():  # shut down at once when a rank leaves a broken job
                    self._group = dist.new_group(backend="gloo")
        self._slots = {source: [{p.key: torch.empty(p.shape, dtype=getattr(torch, p.dtype)) for p in sent}
                                for _ in range(2)] for source, sent in self.layout.sources}
        return self.layout

    @property
    def active(self) -> bool:
        """Whether replicas flow this generation (some rank sends)."""
        return self._group is not None

    def start(self, step: int, tensors: Mapping[str, Tensor] | None, landing: Callable[[], bool]) -> None:
        """Send this rank's lonely pieces of step ``step``'s copy (``tensors``, whole once
        ``landing`` returns; None: no copy of that step, its partner told so) and receive
        its sources', on a thread. Every rank of the layout calls it every step: a
        partner waits for what it sends."""
        self.wait()
        plan = self.layout
        if plan is None or self._group is None or not plan.active:
            return
        slots = {}
        for source, _sent in plan.sources:  # the older replica's buffers take this one
            older = self.received.get(source, [])
            in_use = {id(r.tensors) for r in older[-1:]}
            slots[source] = next(s for s in self._slots[source] if id(s) not in in_use)
            self.received[source] = [r for r in older if r.tensors is not slots[source]]
        generation, group, epoch = plan.generation, self._group, self._epoch

        def run() -> None:
            began = time.perf_counter()
            try:
                whole = landing() and tensors is not None
                ops = []
                if plan.partner is not None and plan.sends:
                    sent = ([tensors[p.key] for p in plan.sends] if tensors is not None and whole else
                            [torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in plan.sends])
                    ops += _sends(step if whole else -1, sent, plan.partner, group)
                headers, packed = {}, []
                for source, sent in plan.sources:
                    headers[source] = torch.zeros(1, dtype=torch.int64)
                    ops.append(dist.P2POp(dist.irecv, headers[source], source, group, _HEADER_TAG))
                    receives, buffers = _receives([slots[source][p.key] for p in sent], source, group)
                    ops += receives
                    packed += buffers
                for work in dist.batch_isend_irecv(ops) if ops else []:
                    work.wait()
                if self._epoch != epoch:
                    return  # given up at a switch: the next generation's replicas are laid out anew
                _unpack(packed)
                for source, sent in plan.sources:
                    if int(headers[source][0]) == step:
                        self.received.setdefault(source, []).append(
                            Received(step, generation, source, sent, slots[source]))
            except Exception as exc:  # noqa: BLE001 - a peer lost: its replica is not kept, the resume says so
                if self._epoch != epoch:
                    return
                told = f"step {step}: {type(exc).__name__}: {str(exc)[:200]}"
                self.errors = (self.errors + [told])[-8:]
                self.failed = told
            self.seconds = (self.seconds + [time.perf_counter() - began])[-64:]

        self._thread = threading.Thread(target=run, daemon=True, name="hapd-replica")
        self._thread.start()

    def before_step(self) -> None:
        """Before the next step's first collective (a forward pre-hook of the job's
        module): the last step's replicas are sent and received, or the rank parks
        (:class:`~hapd.errors.CollectiveError`) when a peer's transfer failed — so no rank
        completes a step whose predecessor's replicas its partners lack."""
        self.wait()
        failed, self.failed = self.failed, None
        if failed is not None and PEER_FAILURE.search(failed):
            raise CollectiveError(f"the replicas of a lost rank's pieces: {failed}")
        if failed is not None:  # not a peer's loss: said, and that step's replica is not kept
            print(f"hapd elastic: a replica transfer failed: {failed}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Until the step's transfers ended (the optimizer's next step waits here). Raises
        :class:`~hapd.errors.CollectiveError` when the launcher asks this rank to park
        meanwhile: a transfer from a host whose link went down (its connections do not
        close) would hold the rank past the launcher's hold, and every rank restarted."""
        thread = self._thread
        if thread is None:
            return
        start = time.perf_counter()
        while thread.is_alive():
            thread.join(0.05)  # returns as soon as the thread ends: no latency added
            if PARK_REQUESTED.is_set() and thread.is_alive():
                raise CollectiveError(f"asked to park (a host was lost) while waiting "
                                      f"{time.perf_counter() - start:.1f} s for the replicas' transfers")
        self._thread = None

    def settle(self, within_s: float = SETTLE_S) -> None:
        """At a generation's resume (and its reset): the last generation's transfer ended,
        or it is given up after ``within_s`` — its group was left, so one still running
        waits on a peer that went silent, and its replicas are not whole. Never a wait
        without end: a new rank 0 once waited here for the transfer of the generation it
        parked from while the others waited for it in the resume's gather, until their
        collective timeout, and every rank restarted."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(within_s)
        if thread.is_alive():
            self._epoch += 1
            self.errors = (self.errors + [f"a transfer still running {within_s:g} s after the switch: given up"])[-8:]

    def offered(self, generation: int | None) -> dict[int, tuple[Piece, ...]]:
        """Step → the pieces of other ranks held for it, laid out by ``generation``."""
        out: dict[int, list[Piece]] = defaultdict(list)
        for kept_ in self.received.values():
            for r in kept_:
                if r.generation == generation:
                    out[r.step] += r.pieces
        return {step: tuple(pieces) for step, pieces in out.items()}

    def sources(self, step: int, generation: int | None) -> dict[tuple[str, tuple[int, ...]], Tensor]:
        """The replicas of ``step`` as :func:`hapd.elastic.moves.execute` reads its sources."""
        return {(p.key, p.offsets): r.tensors[p.key] for kept_ in self.received.values() for r in kept_
                if r.step == step and r.generation == generation for p in r.pieces}

    def reset(self) -> None:
        """Forget the replicas, the layout and the group (a new generation's come next)."""
        self.settle()
        self.received, self.layout, self._group, self._slots, self.sent_bytes = {}, None, None, {}, ()
        self.failed = None


def _sends(step: int, tensors: Sequence[Tensor], dst: int, group: Any) -> list[Any]:
    ops = [dist.P2POp(dist.isend, torch.tensor([step], dtype=torch.int64), dst, group, _HEADER_TAG)]
    for tag, (_dtype, parts) in enumerate(sorted(_by_dtype(tensors).items()), start=1):
        ops.append(dist.P2POp(dist.isend, torch.cat([t.reshape(-1) for t in parts]), dst, group, tag))
    return ops


def _receives(tensors: Sequence[Tensor], src: int, group: Any) -> tuple[list[Any], list[tuple[Tensor, list[Tensor]]]]:
    """One receive per dtype of ``tensors`` (packed as :func:`_sends` packs them), and
    the buffers to unpack into them once received (:func:`_unpack`)."""
    ops, packed = [], []
    for tag, (_dtype, parts) in enumerate(sorted(_by_dtype(tensors).items()), start=1):
        buffer = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype)
        ops.append(dist.P2POp(dist.irecv, buffer, src, group, tag))
        packed.append((buffer, parts))
    return ops, packed


def _unpack(packed: Sequence[tuple[Tensor, list[Tensor]]]) -> None:
    for buffer, parts in packed:
        at = 0
        for t in parts:
            t.copy_(buffer[at:at + t.numel()].view(t.shape))
            at += t.numel()


def _by_dtype(tensors: Sequence[Tensor]) -> dict[str, list[Tensor]]:
    out: dict[str, list[Tensor]] = defaultdict(list)
    for t in tensors:
        out[str(t.dtype)].append(t)
    return out


_KEPT: dict[str, Replicas] = {}


def kept(run: str) -> Replicas:
    """The replicas of ``run`` this process keeps (the same object for the script's next
    run in this process)."""
    return _KEPT.setdefault(run, Replicas())


def forget(run: str) -> None:
    _KEPT.pop(run, None)


__all__ = ["DEFAULT_MAX_MB", "Layout", "MAX_MB_ENV", "REPLICA_ENV", "Received", "Replicas", "forget", "kept",
           "layout", "lonely", "partners"]
