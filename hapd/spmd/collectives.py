"""Collectives between hapd's tensor layouts, as autograd functions.

A tensor on a rank relates to the full (single-device) tensor in one of three ways:

* ``Gather(d)``: the rank holds a contiguous slice along dim ``d``. Slices may be uneven
  and empty: rank ``r`` holds ``lengths[r]`` elements starting at ``sum(lengths[:r])``.
* ``Reduce``: the rank holds a partial sum; the full value is the sum over ranks.
* ``Identity``: every rank holds the full tensor.

Gradients have the dual layouts: the gradient of an ``Identity`` tensor is a ``Reduce``
(each rank holds the part of the gradient from its own share of the loss), the gradient
of a ``Reduce`` tensor is an ``Identity`` and ``Gather(d)`` stays ``Gather(d)``. So each
backward is the dual collective:

=====================  =========================  ==========================================
function               forward                    backward
=====================  =========================  ==========================================
``all_gather``         Gather(d) → Identity       ``reduce_scatter`` (same variant)
``reduce_scatter``     Reduce → Gather(d)         ``all_gather`` (same variant)
``all_reduce``         Reduce → Identity          ``all_reduce``
``all_to_all``         Gather(s) → Gather(d)      ``all_to_all`` from d back to s
``replicate``          Identity → Identity        ``all_reduce`` (replicated parameters)
``dynamic_slice``      Identity → Gather(d)       zero-pad to the full size (local)
``mask_to_rank_zero``  Identity → Reduce          ``mask_to_rank_zero`` (local)
=====================  =========================  ==========================================

All ranks of the group must make the same calls in the same order with the same
lengths (SPMD). Arguments are checked before any communication and raise
:class:`~hapd.errors.PlanError`. Inputs are never written; outputs are fresh,
contiguous tensors of the input's dtype, on the input's device. Backwards are built from
these same functions, so double backward works. With one rank nothing is communicated.

dtypes: Gloo (torch 2.9) refuses int16, uint16, uint32, uint64 and the float8 types in
every collective (``RuntimeError: Invalid scalar type``) and NCCL has no int16/uint16/
uint32/uint64 either, so on every backend these travel as a wider or same-size type and
are converted back: int16/uint16 as int32 (a cast), uint32 as int32 and uint64 as int64
(bit views: sums wrap the same way), float8 as uint8 bits when moved and as float32 when
summed (one rounding, at the end). Every other dtype is sent as it is.

Gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole (padded) input
followed by a local copy of this rank's chunk, so on Gloo the padded ``reduce_scatter``
moves as much data as an all-reduce. It is still one public reduce-scatter call, the
same code path as on NCCL.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from hapd.errors import PlanError
from hapd.spmd import group_sockets

_FLOAT8 = [
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
]
_INTS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int32, torch.uint64: torch.int64}
_MOVE_AS: dict[torch.dtype, torch.dtype] = {**_INTS, **{t: torch.uint8 for t in _FLOAT8}}
"""dtype → the dtype it is moved as (gathers, broadcasts, all-to-all)."""
_SUM_AS: dict[torch.dtype, torch.dtype] = {**_INTS, **{t: torch.float32 for t in _FLOAT8}}
"""dtype → the dtype it is summed in (reductions)."""

_CONTIGUOUS = torch.contiguous_format


# --- helpers -----------------------------------------------------------------------------


def _wire(t: Tensor, table: dict[torch.dtype, torch.dtype]) -> Tensor:
    """``t`` in a dtype the backends carry: a bit view when the sizes match, else a cast.
    For reading only: the result may alias ``t``."""
    wire = table.get(t.dtype)
    if wire is None:
        return t
    return t.view(wire) if wire.itemsize == t.dtype.itemsize else t.to(wire)


def _unwire(t: Tensor, dtype: torch.dtype) -> Tensor:
    if t.dtype == dtype:
        return t
    return t.view(dtype) if t.dtype.itemsize == dtype.itemsize else t.to(dtype)


def _fresh(x: Tensor) -> Tensor:
    return x.clone(memory_format=_CONTIGUOUS)


def _shape(x: Tensor, dim: int, n: int) -> list[int]:
    """``x``'s shape with ``n`` elements along ``dim``."""
    shape = list(x.shape)
    shape[dim] = n
    return shape


def _offsets(lengths: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))[:-1]


def _padded(x: Tensor, dim: int, size: int) -> Tensor:
    """``x`` zero-padded to ``size`` along ``dim``, contiguous (``x`` itself if it fits)."""
    if x.shape[dim] == size:
        return x.contiguous()
    out = x.new_zeros(_shape(x, dim, size))
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) in ``group``; (1, 0) without a process group (one device)."""
    if group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _group(name: str, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) in ``group``; (1, 0) without a process group (one device)."""
    world, rank = _size_rank(group)
    if rank < 0:
        raise PlanError(f"{name}: this process is not a member of the group")
    return world, rank


def _dim(name: str, x: Tensor, dim: int) -> int:
    """``dim`` normalized to ``[0, x.dim())``."""
    if not -x.dim() <= dim < x.dim():
        raise PlanError(f"{name}: dim {dim} is out of range for a {x.dim()}-d input of shape {list(x.shape)}")
    return dim % x.dim()


def _lengths(name: str, lengths: Sequence[int], world: int, dim: int) -> tuple[int, ...]:
    try:
        out = tuple(operator.index(n) for n in lengths)
    except TypeError:
        raise PlanError(f"{name} on dim {dim}: lengths must be integers, got {list(lengths)!r}") from None
    if len(out) != world:
        raise PlanError(f"{name} on dim {dim}: {len(out)} lengths {list(out)} for a group of {world} ranks")
    if any(n < 0 for n in out):
        raise PlanError(f"{name} on dim {dim}: negative length in {list(out)}")
    return out


def _check_local(name: str, x: Tensor, dim: int, lengths: Sequence[int], rank: int) -> None:
    """A ``Gather(dim)`` input holds exactly this rank's slice."""
    if x.shape[dim] != lengths[rank]:
        raise PlanError(
            f"{name} on dim {dim}: the input has {x.shape[dim]} elements along dim {dim} "
            f"but rank {rank}'s length is {lengths[rank]} (lengths {list(lengths)})"
        )


def _check_full(name: str, x: Tensor, dim: int, lengths: Sequence[int]) -> None:
    """A full-size input splits into ``lengths`` along ``dim``."""
    if x.shape[dim] != sum(lengths):
        raise PlanError(
            f"{name} on dim {dim}: the input has {x.shape[dim]} elements along dim {dim} "
            f"but the lengths {list(lengths)} sum to {sum(lengths)}"
        )


# --- communication (no autograd) --------------------------------------------------------
#
# Each collective is issued asynchronously (``async_op=True``) and returns a
# :class:`Pending`; the blocking forms below wait on it at once. Overlapped execution
# (:mod:`hapd.spmd.duplicas`) keeps the pending collective in flight while it computes
# something else, and waits later.


class Pending:
    """A collective in flight: its work handles, and how to build its result once they
    are done (unpad, concatenate, convert back from the wire dtype)."""

    __slots__ = ("_works", "_finish")

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], Tensor]):
        self._works, self._finish = list(works), finish

    def wait(self) -> Tensor:
        """Block until every piece has arrived; the result (once)."""
        for work in self._works:
            work.wait()
        self._works = []
        return self._finish()


def _ready(x: Tensor) -> Pending:
    """A "collective" that needs no communication (one rank, nothing to move)."""
    return Pending((), lambda: x)


def _start_gather(
    x: Tensor, dim: int, lengths: tuple[int, ...], grouped: bool, group: dist.ProcessGroup | None
) -> Pending:
    world, rank = _size_rank(group)
    if world == 1 or sum(lengths) == 0:
        return _ready(_fresh(x))
    w = _wire(x, _MOVE_AS)
    if grouped:
        parts, works = [], []
        for r, n in enumerate(lengths):
            if n:
                buf = w.contiguous() if r == rank else w.new_empty(_shape(w, dim, n))
                works.append(dist.broadcast(buf, group=group, group_src=r, async_op=True))
                parts.append(buf)
        return Pending(works, lambda: _unwire(torch.cat(parts, dim), x.dtype))
    size = max(lengths)
    shard = _padded(w, dim, size)
    buf = shard.new_empty((world, *shard.shape))
    work = dist.all_gather_into_tensor(buf.view(-1), shard.view(-1), group=group, async_op=True)

    def finish() -> Tensor:
        if dim == 0 and all(n == size for n in lengths):
            out = buf.view(_shape(w, 0, world * size))
        else:
            out = torch.cat([buf[r].narrow(dim, 0, n) for r, n in enumerate(lengths) if n], dim)
        return _unwire(out, x.dtype)

    return Pending([work], finish)


def _start_reduce_scatter(
    x: Tensor, dim: int, lengths: tuple[int, ...], grouped: bool, group: dist.ProcessGroup | None
) -> Pending:
    world, rank = _size_rank(group)
    if world == 1 or sum(lengths) == 0:
        return _ready(_fresh(x))
    w = _wire(x, _SUM_AS)
    if grouped:
        works, mine = [], w.new_empty(_shape(w, dim, 0))
        for r, (start, n) in enumerate(zip(_offsets(lengths), lengths)):
            if n:
                buf = _fresh(w.narrow(dim, start, n))
                works.append(dist.reduce(buf, group=group, group_dst=r, async_op=True))
                if r == rank:
                    mine = buf
        return Pending(works, lambda: _unwire(mine, x.dtype))
    size = max(lengths)
    if dim == 0 and all(n == size for n in lengths):
        buf = w.contiguous()
    else:
        buf = w.new_zeros((world, *_shape(w, dim, size)))
        for r, (start, n) in enumerate(zip(_offsets(lengths), lengths)):
            buf[r].narrow(dim, 0, n).copy_(w.narrow(dim, start, n))
    chunk = w.new_empty(_shape(w, dim, size))
    work = dist.reduce_scatter_tensor(chunk.view(-1), buf.view(-1), group=group, async_op=True)
    return Pending([work], lambda: _unwire(chunk.narrow(dim, 0, lengths[rank]).contiguous(), x.dtype))


def _start_all_reduce(x: Tensor, group: dist.ProcessGroup | None) -> Pending:
    buf = _fresh(_wire(x, _SUM_AS))
    if _size_rank(group)[0] == 1:
        return _ready(_unwire(buf, x.dtype))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return Pending([work], lambda: _unwire(buf, x.dtype))


def _start_all_to_all(
    x: Tensor,
    src_dim: int,
    dst_dim: int,
    src_lengths: tuple[int, ...],
    dst_lengths: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> Pending:
    """Each block travels with ``src_dim`` first, so what a rank receives is, in rank
    order, its output with ``src_dim`` and ``dst_dim`` moved to the front."""
    world, rank = _size_rank(group)
    if world == 1:
        return _ready(_fresh(x))
    w = _wire(x, _MOVE_AS)
    order = [src_dim, dst_dim, *(d for d in range(x.dim()) if d not in (src_dim, dst_dim))]
    xp = w.permute(order)  # (src_lengths[rank], sum(dst_lengths), *rest)
    rest = list(xp.shape[2:])
    inner = math.prod(rest)
    send_splits = [src_lengths[rank] * n * inner for n in dst_lengths]
    recv_splits = [n * dst_lengths[rank] * inner for n in src_lengths]
    send = w.new_empty(sum(send_splits))
    for seg, block in zip(send.split(send_splits), xp.split(list(dst_lengths), dim=1)):
        seg.view(block.shape).copy_(block)
    recv = w.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                  group=group, async_op=True)

    def finish() -> Tensor:
        out = recv.view(sum(src_lengths), dst_lengths[rank], *rest).permute([order.index(d) for d in range(x.dim())])
        return _unwire(out.contiguous(), x.dtype)

    return Pending([work], finish)


# --- autograd functions ------------------------------------------------------------------


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, grouped, group):
        ctx.args = (dim, lengths, grouped, group)
        return _start_gather(x, dim, lengths, grouped, group).wait()

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, *ctx.args), None, None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, grouped, group):
        ctx.args = (dim, lengths, grouped, group)
        return _start_reduce_scatter(x, dim, lengths, grouped, group).wait()

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, *ctx.args), None, None, None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _start_all_reduce(x, group).wait()

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.group), None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, src_lengths, dst_lengths, group):
        ctx.args = (dst_dim, src_dim, dst_lengths, src_lengths, group)
        return _start_all_to_all(x, src_dim, dst_dim, src_lengths, dst_lengths, group).wait()

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.args), None, None, None, None, None


class _Replicate(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _fresh(x)

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.group), None


class _MaskToRankZero(Function):
    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        return _fresh(x) if keep else torch.zeros_like(x, memory_format=_CONTIGUOUS)

    @staticmethod
    def backward(ctx, grad):
        return _MaskToRankZero.apply(grad, ctx.keep), None


# --- split collectives (overlapped execution) ---------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One collective as overlapped execution issues it: :func:`start_exchange` puts it in
    flight and :func:`finish_exchange` waits for it, so work can run in between; in
    backward, the finish starts the dual collective and the start waits for it (autograd
    runs the other duplica's backward in between: it executes ready nodes latest-created
    first, and the other duplica's nodes were created between the two)."""

    name: str
    forward: Callable[[Tensor], Pending]
    backward: Callable[[Tensor], Pending]


class Flight:
    """The pending collectives of one exchange call, forward and backward: what the start
    hands to the finish. One per call, so several forwards may share one backward."""

    __slots__ = ("exchange", "forward", "backward")

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.forward: Pending | None = None
        self.backward: Pending | None = None


class _StartExchange(Function):
    @staticmethod
    def forward(ctx, x, flight):
        flight.forward = flight.exchange.forward(x)
        ctx.flight = flight
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        pending, ctx.flight.backward = ctx.flight.backward, None
        if pending is None:
            raise PlanError(f"{ctx.flight.exchange.name}: backward reached the start of a collective before its finish")
        return pending.wait(), None


class _FinishExchange(Function):
    @staticmethod
    def forward(ctx, token, flight):
        pending, flight.forward = flight.forward, None
        if pending is None:
            raise PlanError(f"{flight.exchange.name}: finished before it was started")
        ctx.flight = flight
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.backward = ctx.flight.exchange.backward(grad.contiguous())
        return grad.new_empty(0), None


def start_exchange(x: Tensor, exchange: Exchange) -> tuple[Tensor, Flight]:
    """Put ``exchange`` in flight on ``x``: a token (an empty tensor that carries the
    autograd edge) and the flight to finish."""
    flight = Flight(exchange)
    return _StartExchange.apply(x, flight), flight


def finish_exchange(token: Tensor, flight: Flight) -> Tensor:
    """Wait for the collective ``flight`` carries; its result. Not twice differentiable."""
    return _FinishExchange.apply(token, flight)


def exchange(
    kind: str,
    *,
    src_dim: int | None = None,
    dst_dim: int | None = None,
    src_lengths: Sequence[int] | None = None,
    dst_lengths: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Exchange | None:
    """The :class:`Exchange` of a plan collective ``kind`` (the names
    :class:`hapd.spmd.rank.Communicate` takes), or None for the local ones
    (``dynamic_slice``, ``mask_to_rank_zero``: nothing to overlap). Same arguments, checks
    and dual collectives as the blocking functions of this module."""
    world, rank = _group(kind, group)
    if kind in ("dynamic_slice", "mask_to_rank_zero"):
        return None
    if kind in ("all_gather", "all_gather_grouped", "reduce_scatter", "reduce_scatter_grouped"):
        grouped = kind.endswith("grouped")
        gather = kind.startswith("all_gather")
        dim = src_dim if gather else dst_dim
        if dim is None:
            raise PlanError(f"{kind}: no split dim")
        lengths = _lengths(kind, src_lengths if gather else dst_lengths, world, dim)

        def gathered(x: Tensor) -> Pending:
            _check_local(kind, x, dim, lengths, rank)
            return _start_gather(x, dim, lengths, grouped, group)

        def scattered(x: Tensor) -> Pending:
            _check_full(kind, x, dim, lengths)
            return _start_reduce_scatter(x, dim, lengths, grouped, group)

        return Exchange(kind, gathered, scattered) if gather else Exchange(kind, scattered, gathered)
    if kind == "all_reduce":
        return Exchange(kind, lambda x: _start_all_reduce(x, group), lambda g: _start_all_reduce(g, group))
    if kind == "all_to_all":
        if src_dim is None or dst_dim is None or src_dim == dst_dim:
            raise PlanError(f"all_to_all: dims {src_dim} and {dst_dim}")
        sl = _lengths(kind, src_lengths, world, src_dim)
        dl = _lengths(kind, dst_lengths, world, dst_dim)

        def there(x: Tensor) -> Pending:
            _check_local(kind, x, src_dim, sl, rank)
            return _start_all_to_all(x, src_dim, dst_dim, sl, dl, group)

        return Exchange(kind, there, lambda g: _start_all_to_all(g, dst_dim, src_dim, dl, sl, group))
    raise PlanError(f"unknown collective {kind!r}")


# --- public API --------------------------------------------------------------------------


def all_gather(
    x: Tensor, dim: int, lengths: Sequence[int], *, grouped: bool = False, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Gather(dim) → Identity: the full tensor from every rank's slice.

    ``grouped=False`` pads each slice to ``max(lengths)`` for one all-gather, then strips
    the padding; ``grouped=True`` broadcasts each non-empty slice from its owner instead
    (no padding, one call per rank). Backward: ``reduce_scatter`` with the same variant."""
    world, rank = _group("all_gather", group)
    dim = _dim("all_gather", x, dim)
    lengths = _lengths("all_gather", lengths, world, dim)
    _check_local("all_gather", x, dim, lengths, rank)
    return _AllGather.apply(x, dim, lengths, grouped, group)


def reduce_scatter(
    x: Tensor, dim: int, lengths: Sequence[int], *, grouped: bool = False, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Reduce → Gather(dim): the sum over ranks, of which each rank keeps its slice.

    ``grouped=False`` pads every slice to ``max(lengths)`` for one
    ``dist.reduce_scatter_tensor`` (an all-reduce underneath on Gloo, see the module
    notes); ``grouped=True`` reduces each non-empty slice onto its owner (one
    ``dist.reduce`` per rank). Backward: ``all_gather`` with the same variant."""
    world, _ = _group("reduce_scatter", group)
    dim = _dim("reduce_scatter", x, dim)
    lengths = _lengths("reduce_scatter", lengths, world, dim)
    _check_full("reduce_scatter", x, dim, lengths)
    return _ReduceScatter.apply(x, dim, lengths, grouped, group)


def all_reduce(x: Tensor, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Reduce → Identity: the sum over ranks, on every rank. Backward: ``all_reduce``."""
    _group("all_reduce", group)
    return _AllReduce.apply(x, group)


def all_to_all(
    x: Tensor,
    src_dim: int,
    dst_dim: int,
    src_lengths: Sequence[int],
    dst_lengths: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Gather(src_dim) → Gather(dst_dim) with one ``dist.all_to_all_single``.

    Rank ``r`` holds ``full[src slice r]`` (full size along ``dst_dim``) and gets back
    ``full[dst slice r]`` (full size along ``src_dim``). Backward: the reverse
    ``all_to_all``."""
    world, rank = _group("all_to_all", group)
    src_dim = _dim("all_to_all", x, src_dim)
    dst_dim = _dim("all_to_all", x, dst_dim)
    if src_dim == dst_dim:
        raise PlanError(f"all_to_all: src_dim and dst_dim are both dim {src_dim}")
    src_lengths = _lengths("all_to_all", src_lengths, world, src_dim)
    dst_lengths = _lengths("all_to_all", dst_lengths, world, dst_dim)
    _check_local("all_to_all", x, src_dim, src_lengths, rank)
    _check_full("all_to_all", x, dst_dim, dst_lengths)
    return _AllToAll.apply(x, src_dim, dst_dim, src_lengths, dst_lengths, group)


def replicate(x: Tensor, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Identity → Identity: a copy of ``x``; backward sums the gradient over ranks
    (``all_reduce``), which is what a replicated parameter needs."""
    _group("replicate", group)
    return _Replicate.apply(x, group)


def dynamic_slice(x: Tensor, dim: int, lengths: Sequence[int], *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Identity → Gather(dim): this rank's slice, without communication. Backward: the
    gradient zero-padded back to the full size (local)."""
    world, rank = _group("dynamic_slice", group)
    dim = _dim("dynamic_slice", x, dim)
    lengths = _lengths("dynamic_slice", lengths, world, dim)
    _check_full("dynamic_slice", x, dim, lengths)
    return _fresh(x.narrow(dim, _offsets(lengths)[rank], lengths[rank]))


def mask_to_rank_zero(x: Tensor, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Identity → Reduce: ``x`` on rank 0, zeros elsewhere (the sum over ranks is ``x``).
    Backward masks the gradient the same way. No communication."""
    _, rank = _group("mask_to_rank_zero", group)
    return _MaskToRankZero.apply(x, rank == 0)


# --- two-level all-reduce across hosts ----------------------------------------------------


@dataclass(frozen=True)
class HostGroups:
    """Process groups for summing over ranks in two levels when ranks share hosts: the
    ranks of this rank's host (``local``), and one leader per host — its lowest rank —
    (``leaders``, set on leaders only). Each host's sum then crosses the slow link once:
    a flat ring all-reduce over ``N`` ranks sends ``2(N-1)/N`` of the buffer over every
    ring edge, the edges between hosts included, while the leaders' all-reduce over ``H``
    hosts sends ``2(H-1)/H`` (two hosts: 1 buffer instead of 1.5)."""

    local: dist.ProcessGroup
    local_back: dist.ProcessGroup
    """A second group of the same ranks, for the broadcasts back from the leader: a
    pipelined sum issues reduces and broadcasts at different times on the leader than
    on the others, and each group must see the same calls in the same order."""
    leader: int
    """Global rank of this host's leader."""
    leaders: dist.ProcessGroup | None


def host_groups(node_of_rank: Sequence[int]) -> HostGroups | None:
    """The :class:`HostGroups` of this rank, given every rank's host (node) index, or
    None where a flat all-reduce is as good (one host, or one rank per host). Every rank
    of the world must call this with the same list (it creates process groups)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if len(node_of_rank) != world:
        raise PlanError(f"host_groups: {len(node_of_rank)} host indices for a world of {world} ranks")
    hosts = sorted(set(node_of_rank))
    members = {h: [r for r, n in enumerate(node_of_rank) if n == h] for h in hosts}
    if len(hosts) < 2 or all(len(m) == 1 for m in members.values()):
        return None
    local = local_back = None
    with group_sockets.tracked():  # their connections are shut down at once when a rank leaves a broken job
        for h in hosts:  # every rank creates every group, in the same order
            group, back = dist.new_group(members[h]), dist.new_group(members[h])
            if rank in members[h]:
                local, local_back = group, back
        leader_ranks = [members[h][0] for h in hosts]
        leaders = dist.new_group(leader_ranks)
    leader = members[node_of_rank[rank]][0]
    assert local is not None and local_back is not None
    return HostGroups(local=local, local_back=local_back, leader=leader, leaders=leaders if rank == leader else None)


def two_level_sum_(buf: Tensor, hosts: HostGroups) -> None:
    """Sum ``buf`` over all ranks in place: reduce onto the host's leader, all-reduce
    among leaders, broadcast from the leader. Same calls on every rank of the world."""
    dist.reduce(buf, dst=hosts.leader, group=hosts.local)
    if hosts.leaders is not None:
        dist.all_reduce(buf, group=hosts.leaders)
    dist.broadcast(buf, src=hosts.leader, group=hosts.local_back)


__all__ = [
    "Exchange",
    "Flight",
    "Pending",
    "exchange",
    "finish_exchange",
    "start_exchange",
    "HostGroups",
    "host_groups",
    "two_level_sum_",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "replicate",
    "dynamic_slice",
    "mask_to_rank_zero",
]
