"""Overlapped execution: one rank program run as two interleaved duplicas (HiDup).

In a tensor- or expert-parallel plan every collective inside forward and backward
stalls the rank: it waits for its all-gather or all-to-all, then computes. Here the
global batch is cut in two halves (*duplicas*, first rows and last rows along each
input's batch dim); a plan compiled for the half batch runs on both, and
:func:`overlapped` interleaves them in one fx graph so that while one duplica's
collective is in flight the other computes. Per communication point ``k`` (the plan's
collectives on batch-dependent tensors, in program order) the graph runs::

    start comm_k(A); compute interval k-1 (B); finish comm_k(A)
    start comm_k(B); compute interval k   (A); finish comm_k(B)

where interval ``k`` is the computation between points ``k`` and ``k+1``. The
collectives are :func:`hapd.spmd.collectives.start_exchange` /
:func:`~hapd.spmd.collectives.finish_exchange` pairs (async work handles on Gloo;
NCCL's own stream on a GPU). Backward overlaps the same way in reverse: a finish's
backward starts the dual collective and the start's backward waits for it, and
autograd runs the nodes created in between — the other duplica's — meanwhile.

What both duplicas share is computed once: parameters and everything that depends on
no input (a ZeRO parameter's all-gather, a replicated weight's cast). Gradients of
parameters accumulate from both duplicas before autograd's accumulation runs, so the
replicated parameters' gradient sum over ranks (:class:`hapd.spmd.gradsync.GradSync`)
happens once per backward, as without duplicas.

Exactness: the single-device loss must be the sum of the two halves' losses. That holds
when the loss is a sum over samples (``reduction="sum"``, ``.sum()``), and for a
cross-entropy / NLL mean over counted targets whose divisor the plan all-reduces
(:class:`hapd.spmd.adapters.GlobalSum`): the two duplicas' divisors are merged into
one count over both halves. Any other loss, a plan that updates buffers from the batch
(batch norm's running statistics) or batch statistics synchronized across rows is a
:class:`~hapd.errors.PlanError` naming the node: the halves would not add up to the
whole batch's result.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from hapd.ir.op_facts import (BATCH_SPLIT_LOSSES, LOSS_OPS, MEAN, PASS_THROUGH_OPS, SUM, SUM_OPS, overloads,
                                    resolve)
from hapd.errors import PlanError
from hapd.spmd import collectives
from hapd.spmd.adapters import GlobalSum, SyncedBatchNorm
from hapd.spmd.random.random_ops import CounterDraw
from hapd.spmd.rank import Communicate, RankModule, set_attr

DUPLICAS = ("a", "b")
_HOLDER = "hapd_exchanges"
"""Submodule of the one-duplica module holding the :class:`StartExchange` modules."""

_PASS_THROUGH = overloads(PASS_THROUGH_OPS)
_SUMS = overloads(SUM_OPS)
_LOSSES = {resolve(name): LOSS_OPS[name] for name in BATCH_SPLIT_LOSSES}
"""The losses whose mean over counted targets the plan can split over the batch."""


class OverlappedModule(RankModule):
    """A rank program run as two interleaved duplicas: ``forward(*a_inputs, *b_inputs)``
    returns this rank's part of the whole batch's loss (both halves'). ``hapd_inputs``
    and ``hapd_view`` are one duplica's (the plan's); :meth:`shard_inputs` and
    :meth:`local_shapes` are both halves'."""

    hapd_duplicas: int = 2
    hapd_batch_dims: tuple[int | None, ...]
    hapd_single: RankModule
    """The one-duplica program (the plan's own rank module) this was built from."""

    def shard_inputs(self, *full: Tensor) -> tuple[Tensor, ...]:
        """This rank's pieces of both halves of the full (global-batch) inputs: the
        first half's pieces, then the second's."""
        halves = split_batch(full, self.hapd_batch_dims)
        return tuple(t for half in halves for t in self.hapd_single.shard_inputs(*half))

    def local_shapes(self) -> list[list[int]]:
        return self.hapd_single.local_shapes() * 2


def split_batch(full: Sequence[Tensor], batch_dims: Sequence[int | None]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The global batch as two halves (first rows, last rows) along each input's batch
    dim; an input without one goes whole to both. The batch must be even."""
    if len(full) != len(batch_dims):
        raise PlanError(f"expected {len(batch_dims)} inputs, got {len(full)}")
    a, b = [], []
    for i, (t, d) in enumerate(zip(full, batch_dims)):
        if d is None:
            a.append(t)
            b.append(t)
            continue
        n = t.shape[d]
        if n % 2:
            raise PlanError(f"input {i}: overlapped execution cuts the batch in two halves; batch {n} is odd")
        a.append(t.narrow(d, 0, n // 2))
        b.append(t.narrow(d, n // 2, n // 2))
    return tuple(a), tuple(b)


# --------------------------------------------------------------------------------------
# What the program is made of
# --------------------------------------------------------------------------------------


def _batch_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on an input (placeholders included)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _module(gm: fx.GraphModule, node: fx.Node) -> Any:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _exchange_of(module: Communicate) -> collectives.Exchange | None:
    return collectives.exchange(module.kind, src_dim=module.src_dim, dst_dim=module.dst_dim,
                                src_lengths=module.src_lengths, dst_lengths=module.dst_lengths, group=module.group)


class StartExchange(nn.Module):
    """What the graph calls to put one of the plan's collectives in flight (fx code holds
    state in modules): ``(token, flight)`` for :func:`collectives.finish_exchange`."""

    def __init__(self, exchange: collectives.Exchange, tensor: str):
        super().__init__()
        self.exchange, self.tensor = exchange, tensor

    def forward(self, x: Tensor) -> tuple[Tensor, collectives.Flight]:
        return collectives.start_exchange(x, self.exchange)

    def extra_repr(self) -> str:
        return f"{self.exchange.name}: {self.tensor}"


def _check_batch_independent(gm: RankModule, batch: set[fx.Node]) -> None:
    """The halves must not see each other: no buffer updated from the batch, no batch
    statistics shared across rows."""
    if gm.hapd_updated:
        raise PlanError(f"overlapped execution: buffer {gm.hapd_updated[0]} is updated from the whole batch "
                        "(running statistics); two halves would update it twice with other values",
                        node=gm.hapd_updated[0])
    for node in gm.graph.nodes:
        if node in batch and isinstance(_module(gm, node), SyncedBatchNorm):
            raise PlanError(f"overlapped execution: {node.name} normalizes with statistics over the whole batch; "
                            "two halves would each use their own", node=node.name)


def loss_counts(gm: RankModule, output: fx.Node) -> list[fx.Node]:
    """The :class:`GlobalSum` nodes dividing the loss (a mean over counted targets), or
    [] for a sum over samples; a :class:`PlanError` naming the op for any other loss."""
    node = output
    while (node.op == "call_function" and node.target in _PASS_THROUGH) or (
            isinstance(_module(gm, node), Communicate) and _module(gm, node).kind == "mask_to_rank_zero"):
        node = node.args[0]
    if node.op == "call_function" and node.target in _SUMS:
        return []
    if node.op == "call_function" and node.target in _LOSSES:
        at = _LOSSES[node.target].reduction_arg
        reduction = node.args[at] if len(node.args) > at else node.kwargs.get("reduction", MEAN)
        if reduction == SUM:
            return []
    if node.op == "call_function" and node.target is torch.ops.aten.div.Tensor:
        divisor = node.args[1]
        if isinstance(divisor, fx.Node) and isinstance(_module(gm, divisor), GlobalSum):
            return [divisor]
    what = node.target if node.op == "call_function" else (_module(gm, node) or node.op)
    raise PlanError(f"overlapped execution adds the two halves' losses, but the loss comes from {node.name} ({what}), "
                    "which is neither a sum over samples nor a mean over counted targets split over the batch; "
                    "use reduction='sum' (or a cross-entropy mean the plan splits over the batch)", node=node.name)


# --------------------------------------------------------------------------------------
# Building the interleaved graph
# --------------------------------------------------------------------------------------


class _Builder:
    """Emits nodes of the one-duplica graph for duplica ``a`` or ``b`` (or once, for what
    both share) into the new graph, each after everything it reads."""

    def __init__(self, gm: RankModule, batch: set[fx.Node], merged: Iterable[fx.Node]):
        self.gm, self.batch = gm, batch
        self.graph = fx.Graph()
        self.env: dict[tuple[str, fx.Node], fx.Node] = {}
        self.flights: dict[tuple[str, fx.Node], fx.Node] = {}
        self.merged = set(merged)
        self.exchanges: dict[fx.Node, str] = {}
        """communication point → the target of its :class:`StartExchange` in ``holder``"""
        self.holder = nn.Module()
        for node in gm.graph.nodes:
            if node in batch and isinstance(_module(gm, node), Communicate):
                comm = _module(gm, node)
                ex = _exchange_of(comm)
                if ex is not None:
                    name = f"start_{len(self.exchanges)}"
                    self.holder.add_module(name, StartExchange(ex, comm.tensor))
                    self.exchanges[node] = f"{_HOLDER}.{name}"
        self.overlapped = 0

    def key(self, dup: str, node: fx.Node) -> tuple[str, fx.Node]:
        return (dup, node) if node in self.batch and node not in self.merged else ("", node)

    def value(self, dup: str, node: fx.Node) -> fx.Node:
        """``node``'s value for duplica ``dup``, emitting it (and what it reads) if needed."""
        key = self.key(dup, node)
        if key not in self.env:
            if node in self.merged:
                self.env[key] = self._merged(node)
            elif node in self.exchanges:
                self.finish(dup, node)
            else:
                self.env[key] = self._copy(dup, node)
        return self.env[key]

    def _args(self, dup: str, node: fx.Node) -> tuple[tuple, dict]:
        return fx.map_arg((node.args, node.kwargs), lambda n: self.value(dup, n))

    def _copy(self, dup: str, node: fx.Node) -> fx.Node:
        args, kwargs = self._args(dup, node)
        if dup and node.op == "call_module" and isinstance(_module(self.gm, node), CounterDraw):
            kwargs = {**kwargs, "duplica": DUPLICAS.index(dup)}  # each half draws a mask of its own
        new = self.graph.create_node(node.op, node.target, args, kwargs,
                                     name=f"{node.name}_{dup}" if dup and node in self.batch else node.name)
        new.meta = dict(node.meta)
        return new

    def _merged(self, node: fx.Node) -> fx.Node:
        """A divisor count of both duplicas at once: its all-reduce sums ``a``'s and ``b``'s
        local counts, so each duplica's loss is its sum over the whole batch's count."""
        (local,) = node.args
        both = self.graph.call_function(operator.add, (self.value("a", local), self.value("b", local)))
        return self.graph.create_node("call_module", node.target, (both,), {}, name=node.name)

    def start(self, dup: str, node: fx.Node) -> None:
        key = (dup, node)
        if key in self.flights or key in self.env:
            return
        (x,) = node.args
        pair = self.graph.call_module(self.exchanges[node], (self.value(dup, x),))
        self.flights[key] = pair

    def finish(self, dup: str, node: fx.Node) -> None:
        key = (dup, node)
        if key in self.env:
            return
        self.start(dup, node)
        pair = self.flights.pop(key)
        token = self.graph.call_function(operator.getitem, (pair, 0))
        flight = self.graph.call_function(operator.getitem, (pair, 1))
        self.env[key] = self.graph.call_function(collectives.finish_exchange, (token, flight))

    def interval(self, dup: str, nodes: Sequence[fx.Node]) -> None:
        for node in nodes:
            self.value(dup, node)


def overlapped(single: RankModule, batch_dims: Sequence[int | None] | None = None) -> OverlappedModule:
    """``single`` (a rank module of a plan compiled for half the global batch) run as two
    interleaved duplicas; see the module docstring. ``batch_dims``: each input's batch
    dim in the global batch (default 0 for every input with a dim)."""
    graph = single.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in graph.nodes if n.op == "output"]
    if batch_dims is None:
        batch_dims = tuple(0 if len(shape) > 0 else None for shape in single.local_shapes())
    if len(batch_dims) != len(placeholders):
        raise PlanError(f"{len(batch_dims)} batch dims for {len(placeholders)} inputs")
    batch = _batch_dependent(graph)
    _check_batch_independent(single, batch)
    loss = output.args[0]
    if not isinstance(loss, fx.Node):
        raise PlanError("overlapped execution needs a program whose output is one loss tensor")
    b = _Builder(single, batch, loss_counts(single, loss))
    for dup in DUPLICAS:
        for p in placeholders:
            b.env[(dup, p)] = b.graph.placeholder(f"{p.name}_{dup}")
            b.env[(dup, p)].meta = dict(p.meta)
    points, intervals = _intervals(graph, b.exchanges)
    _interleave(b, points, intervals)
    total = b.graph.call_function(operator.add, (b.value("a", loss), b.value("b", loss)))
    b.graph.output(total)
    b.graph.lint()

    if hasattr(single, _HOLDER):
        raise PlanError("this rank module already runs overlapped (build it again with distribute)")
    single.add_module(_HOLDER, b.holder)
    module = OverlappedModule(single, b.graph, class_name="OverlappedModule")
    _take_over(module, single, batch_dims, len(points))
    module.register_forward_pre_hook(lambda m, _args: m.hapd_sync.reset())
    return module


def _intervals(graph: fx.Graph, exchanges: dict[fx.Node, str]) -> tuple[list[fx.Node], list[list[fx.Node]]]:
    """The communication points, and the intervals of nodes between them, in program order."""
    points = [n for n in graph.nodes if n in exchanges]
    intervals: list[list[fx.Node]] = [[]]
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node in exchanges:
            intervals.append([])
        else:
            intervals[-1].append(node)
    return points, intervals


def _interleave(b: _Builder, points: list[fx.Node], intervals: list[list[fx.Node]]) -> None:
    """Each duplica's intervals while the other's exchange at a point is in flight."""
    b.interval("a", intervals[0])
    for k, point in enumerate(points, start=1):
        b.start("a", point)
        b.interval("b", intervals[k - 1])
        b.finish("a", point)
        b.start("b", point)
        b.interval("a", intervals[k])
        b.finish("b", point)
    b.interval("b", intervals[-1])


def _take_over(module: OverlappedModule, single: RankModule, batch_dims: Sequence[int | None], points: int) -> None:
    """Give ``module`` the one-duplica module's parameter names and hapd attributes (inputs: each half's)."""
    have = dict(module.named_parameters(remove_duplicate=False))
    for name in single.hapd_params:  # every name of a tied parameter, as the one-duplica module has them
        if name not in have:
            set_attr(module, name, single.get_parameter(name), parameter=True)
    for attr in ("hapd_view", "hapd_params", "hapd_buffers", "hapd_updated", "hapd_sync"):
        setattr(module, attr, getattr(single, attr))
    module.hapd_inputs = list(single.hapd_inputs)  # each half's: forward takes them twice
    module.hapd_batch_dims = tuple(batch_dims)
    module.__dict__["hapd_single"] = single  # not a submodule: its parameters are this module's
    module.hapd_points = points

__all__ = ["OverlappedModule", "loss_counts", "overlapped", "split_batch"]
