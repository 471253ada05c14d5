"""Ops whose rule needs more than running the op on this rank's pieces.

Most steps of a plan run their op unchanged on the local pieces of its operands. The
rest are listed in :data:`ADAPTERS`, keyed on (op name, rule name): each adapter emits
the fx nodes that compute this rank's part of the op's result under that rule (a view
to the local shape, a bias added once, a vocabulary-parallel lookup, a mean divided by
the global count). Rule names come from the core (``hapd._core.rule_names()``), so the
Rust rules and these keys are spelled in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn

from hapd import _core
from hapd.ir.op_facts import BATCH_SPLIT_LOSSES, MEAN, SUM
from hapd.spmd.collectives import all_reduce
from hapd.spmd.layout import gather_dim
from hapd.spmd.random.random_ops import (
    RANDOM_OPS,
    CounterDropout,
    attention_args,
    counter_attention,
    counter_random,
    dropout_args,
    is_random,
    probability_shape,
)
from hapd.spmd.rank import RankView

_RULES: Mapping[str, str] = _core.rule_names()
"""The core's rule names (one source of truth: ``rustcore/core/src/rules/rule_names.rs``)."""

REPLICATED = _RULES["REPLICATED"]
"""Every operand and result whole on every rank."""
PARTIAL = _RULES["PARTIAL"]
"""Partial-sum operands give a partial-sum result."""
SHARDED = _RULES["SHARDED"]
"""The same dim split on the operands and the result (here: views to the local shape)."""
BROADCAST_SPLIT = _RULES["BROADCAST_SPLIT"]
"""``expand`` of a replicated operand to this rank's length of a broadcast dim."""
DATA_PARALLEL = _RULES["DATA_PARALLEL"]
"""The batch split, weights replicated (here: ops told the batch size get the local one)."""
ROW_PARALLEL = _RULES["ROW_PARALLEL"]
"""Linear/conv/addmm split on the input features: partial sums, the bias added on rank 0."""
VOCAB_PARALLEL = _RULES["VOCAB_PARALLEL"]
"""Embedding table split by rows: each rank looks up only the ids in its rows."""
SHARDED_MEAN = _RULES["SHARDED_MEAN"]
"""A mean (or mean-reduced loss) over a split dim: the local sum over the global count."""
DATA_PARALLEL_SYNCED = _RULES["DATA_PARALLEL_SYNCED"]
"""Batch norm in training on a split batch, its statistics all-reduced (synchronized)."""
EXPERT_PARALLEL = _RULES["EXPERT_PARALLEL"]
"""Stacked expert weights split by expert: each rank runs only its experts (partial sums)."""


class Emitter(Protocol):
    """What an adapter uses of the builder of the rank's fx graph
    (:func:`hapd.spmd.rewrite.distribute`'s)."""

    graph: fx.Graph
    """The rank's graph being built: an adapter adds its nodes to it."""
    view: RankView
    """The plan seen from this rank."""
    group: Any
    """The process group the collectives run in."""
    streams: Mapping[str, int]
    """Random node name -> its stream, for the nodes drawn with hapd's generator (none
    when the program draws with torch's)."""

    def add_module(self, prefix: str, module: nn.Module) -> str:
        """Register ``module`` for the graph to call; returns its target name."""
        ...

    def local_out_shape(self, step: Mapping[str, Any]) -> list[int]:
        """This rank's shape of ``step``'s (first) output."""
        ...

    def random_inputs(self, node: fx.Node) -> tuple[int, int, fx.Node, fx.Node]:
        """For a dropout node of the program: (its stream, the seed, the graph's step
        node, its part node) (:mod:`hapd.spmd.random.random_ops`)."""
        ...


Adapter = Callable[[Emitter, Mapping[str, Any], fx.Node, tuple, dict], fx.Node]
"""``adapt(emitter, step, fx node of the op, local args, local kwargs) -> result node``."""


# --------------------------------------------------------------------------------------
# Modules the adapted ops call
# --------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """``embedding`` with this rank holding vocabulary rows ``[start, start+length)``:
    ids outside it give zero rows, so the sum over ranks is the full lookup."""

    def __init__(self, start: int, length: int):
        super().__init__()
        self.start, self.length = start, length

    def forward(self, weight: Tensor, indices: Tensor, padding_idx: int = -1) -> Tensor:
        local = indices - self.start
        inside = (local >= 0) & (local < self.length)
        if self.length == 0:
            return weight.new_zeros((*indices.shape, weight.shape[-1])) + weight.sum() * 0
        pad = padding_idx - self.start if 0 <= padding_idx - self.start < self.length else -1
        rows = torch.ops.aten.embedding.default(weight, local.clamp(0, self.length - 1), pad)
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.length})"


class GlobalSum(nn.Module):
    """The sum over ranks of a local count (no gradient): the divisor of a sharded mean
    loss, whose element count depends on the labels."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        total = x.detach().clone()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        return total


class SyncedBatchNorm(nn.Module):
    """``_native_batch_norm_legit_functional`` in training on this rank's rows of the
    batch, normalizing with the statistics of the whole batch: the per-channel sums for
    the mean, then for the variance (two passes, as a single device's kernel computes
    them), are all-reduced, so every rank gets the single-device mean, variance, result
    rows and running-statistics update. The all-reduces are differentiable (backward: an
    all-reduce of the statistics' gradients), which makes the backward the single
    device's too. Returns what the op returns: (result, mean, inverse std, new running
    mean, new running variance).

    Written here rather than taken from ``torch.nn.SyncBatchNorm``: that module runs on
    CUDA only (its statistics kernels have no CPU implementation) and its rows must be
    equal in number on every rank, where hapd's splits are uneven."""

    def __init__(self, group: Any, count: int):
        super().__init__()
        self.group = group
        self.count = count
        """Elements per channel in the whole batch (batch × spatial)."""

    def forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, training: bool, momentum: float, eps: float) -> tuple[Tensor, ...]:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = all_reduce(x.sum(dims), group=self.group) / self.count
        centered = x - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims), group=self.group) / self.count
        invstd = torch.rsqrt(var + eps)
        out = centered * invstd.view(shape)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        with torch.no_grad():
            unbiased = var * (self.count / max(self.count - 1, 1))
            new_mean = running_mean * (1 - momentum) + mean * momentum if running_mean is not None else mean.new_empty(0)
            new_var = running_var * (1 - momentum) + unbiased * momentum if running_var is not None else var.new_empty(0)
        return out, mean, invstd, new_mean, new_var

    def extra_repr(self) -> str:
        return f"count={self.count}"


# --------------------------------------------------------------------------------------
# The adapters
# --------------------------------------------------------------------------------------


_STRIDE_FREE: Mapping[Any, Any] = MappingProxyType({
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default,  # noqa: SLF001 - an ATen op name
})
"""Ops that assume their input's single-device strides, and the op a rank runs instead:
the same values, copying only where the local piece's strides need it."""


def stride_free(target: Any) -> Any:
    """The op a rank program runs for ``target``. A local piece (a slice of the batch, a
    result of a collective) seldom has the strides the single-device tensor had, so an
    ``aten.view`` that worked on one device can fail on a rank ("view size is not
    compatible with input tensor's size and stride"); ``aten.reshape`` gives the same
    values and copies only when it must."""
    return _STRIDE_FREE.get(target, target)


def _with_local_size(arg_index: int) -> Adapter:
    """Views/reshapes/expands: the size argument becomes the local output shape (views
    run as reshapes: :func:`stride_free`)."""

    def adapt(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
        args = list(args)
        args[arg_index] = em.local_out_shape(step)
        return em.graph.call_function(stride_free(node.target), tuple(args), kwargs)

    return adapt


def _unflatten(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """``unflatten`` (a view underneath, so stride-bound like ``view``): a reshape of the
    local piece to the local output shape."""
    return em.graph.call_function(torch.ops.aten.reshape.default, (args[0], em.local_out_shape(step)))


def _bias_on_rank_zero(bias_index: int) -> Adapter:
    """Row-parallel linear/conv: the partial sums add the bias once, on rank 0. Other
    ranks add ``0 · bias``, which keeps the bias in their graph: every rank then gets a
    (zero) gradient for it and joins its gradient all-reduce."""

    def adapt(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
        args, kwargs = list(args), dict(kwargs)
        if em.view.rank != 0:
            if len(args) > bias_index and args[bias_index] is not None:
                args[bias_index] = em.graph.call_function(torch.ops.aten.mul.Tensor, (args[bias_index], 0.0))
            elif kwargs.get("bias") is not None:
                kwargs["bias"] = em.graph.call_function(torch.ops.aten.mul.Tensor, (kwargs["bias"], 0.0))
        return em.graph.call_function(node.target, tuple(args), kwargs)

    return adapt


def _local_batch(arg_index: int) -> Adapter:
    """Ops told their batch size as an argument (``native_group_norm``'s ``N``): with the
    batch split, the local batch size."""

    def adapt(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
        args = list(args)
        args[arg_index] = em.local_out_shape(step)[0]
        return em.graph.call_function(node.target, tuple(args), kwargs)

    return adapt


def _vocab_parallel(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """Embedding with the table split by rows: this rank's lookup of the ids in its rows
    (zero rows for the others), a partial sum of the full lookup."""
    weight_name = step["inputs"][0]["tensor"]
    start, length = em.view.offset(weight_name, 0)
    padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    target = em.add_module("vocab_parallel_embedding", VocabParallelEmbedding(start, length))
    return em.graph.call_module(target, (args[0], args[1], padding))


def _sharded_mean(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """mean over a split dim: the local sum over the full element count (a partial sum;
    a zero-length piece gives 0, not NaN)."""
    x_name = step["inputs"][0]["tensor"]
    full = em.view.full_shape(x_name)
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if node.target is torch.ops.aten.mean.default or dims in (None, []):
        count = math.prod(full)
        summed = em.graph.call_function(torch.ops.aten.sum.default, (args[0],), {k: v for k, v in kwargs.items() if k == "dtype"})
    else:
        count = math.prod(full[d % len(full)] for d in dims)
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        extra = {"dtype": kwargs["dtype"]} if "dtype" in kwargs else {}
        summed = em.graph.call_function(torch.ops.aten.sum.dim_IntList, (args[0], list(dims), keepdim), extra)
    return em.graph.call_function(torch.ops.aten.div.Tensor, (summed, float(count)))


def _sharded_mean_loss(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """A loss the core splits over the batch (cross_entropy/nll:
    :data:`~hapd.ir.op_facts.BATCH_SPLIT_LOSSES`) with mean reduction on a split
    batch: the local sum over the global divisor (the count, or class weight, of the
    counted targets over all ranks, all-reduced since ignore_index makes it
    data-dependent)."""
    defaults = [None, None, None, MEAN, -100]
    names = ["self", "target", "weight", "reduction", "ignore_index"]
    kwargs = dict(kwargs)
    args = list(args) + [kwargs.pop(n, d) for n, d in zip(names[len(args) :], defaults[len(args) :])]
    weight, ignore = args[2], args[4]
    args[3] = SUM  # divided below
    summed = em.graph.call_function(node.target, tuple(args), kwargs)
    target_name = step["inputs"][1]["tensor"]
    g = em.graph
    if not em.view.dtype(target_name).startswith("int"):
        # class probabilities: the divisor is the number of samples
        full = em.view.full_shape(target_name)
        return g.call_function(torch.ops.aten.div.Tensor, (summed, float(full[0] * math.prod(full[2:]))))
    target = args[1]
    counted = g.call_function(torch.ops.aten.ne.Scalar, (target, ignore))
    if weight is None:
        local = g.call_function(torch.ops.aten.sum.default, (counted,))
    else:
        safe = g.call_function(torch.ops.aten.clamp_min.default, (target, 0))
        picked = g.call_function(torch.ops.aten.index.Tensor, (weight, [safe]))
        local = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.mul.Tensor, (picked, counted)),))
    total = g.call_module(em.add_module("global_count", GlobalSum(em.group)), (local,))
    return g.call_function(torch.ops.aten.div.Tensor, (summed, total))


def _synced_batch_norm(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """Batch norm in training with the batch split: :class:`SyncedBatchNorm` over the
    whole batch's element count per channel."""
    full = em.view.full_shape(step["inputs"][0]["tensor"])
    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    target = em.add_module("synced_batch_norm", SyncedBatchNorm(em.group, full[0] * math.prod(full[2:])))
    return em.graph.call_module(target, tuple(values))


def _counter_draw(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """A dropout, ``bernoulli``, ``rand_like`` or ``randn_like``, whole or split along
    one dim: :class:`~hapd.spmd.random.random_ops.CounterDropout` /
    :class:`~hapd.spmd.random.random_ops.CounterRandom` draws this rank's slice of the
    single-device draw (its offset along the split dim: the lengths of the ranks
    before it). A program drawing with torch's generator runs the op as it is."""
    if node.name not in em.streams:
        return em.graph.call_function(node.target, args, kwargs)
    inp = step["inputs"][0]
    full = em.view.full_shape(inp["tensor"])
    offsets = [0] * len(full)
    d = gather_dim(inp["layout"])
    if d is not None:
        offsets[d] = em.view.offset(inp["tensor"], d)[0]
    stream, seed, rng_step, part = em.random_inputs(node)
    if node.target in RANDOM_OPS:
        target = em.add_module("random", counter_random(node, stream, full, offsets, seed))
    else:
        p, train = dropout_args(node)
        single = node.target is torch.ops.aten.dropout.default
        target = em.add_module("dropout", CounterDropout(p, train, stream, full, offsets, seed, single=single))
    return em.graph.call_module(target, (args[0], rng_step, part))


def _counter_attention(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """Attention: unchanged without dropout; with ``dropout_p > 0``,
    :class:`~hapd.spmd.random.random_ops.CounterAttention` drawing this rank's slice of the
    single-device probabilities (split where the query is: batch, heads or queries). A
    program drawing with torch's generator runs the attention as it is."""
    if node.name not in em.streams:
        return em.graph.call_function(node.target, args, kwargs)
    query = step["inputs"][0]
    d = gather_dim(query["layout"])
    start, length = em.view.offset(query["tensor"], d) if d is not None else (0, 1)
    if not is_random(node) or length == 0:
        # an empty piece runs on one zero slice that is cut away again: nothing to draw
        local = attention_args(args, kwargs)
        local["dropout_p"] = 0.0
        return em.graph.call_function(node.target, (), local) if is_random(node) else \
            em.graph.call_function(node.target, args, kwargs)
    q_full = em.view.full_shape(query["tensor"])
    k_full = em.view.full_shape(step["inputs"][1]["tensor"])
    offsets = [0] * len(q_full)
    if d is not None:
        offsets[d] = start
    stream, seed, rng_step, part = em.random_inputs(node)
    target = em.add_module("attention", counter_attention(node, stream, probability_shape(q_full, k_full), offsets,
                                                          seed))
    local = attention_args(args, kwargs)
    return em.graph.call_module(target, (local["query"], local["key"], local["value"], local["attn_mask"], rng_step,
                                         part))


def _routed_experts_on_rank(em: Emitter, step: Mapping[str, Any], node: fx.Node, args: tuple,
                            kwargs: dict) -> fx.Node:
    """transformers' routed experts (:mod:`hapd.ir.experts`) with the expert weights
    split: this rank runs the pairs routed to its experts ``[start, start + length)``
    (the others contribute zero rows), a partial sum of the whole output."""
    names = ["hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "activation", "first_expert",
             "num_experts"]
    values = dict(zip(names, args)) | dict(kwargs)
    weight_name = step["inputs"][3]["tensor"]
    start, _ = em.view.offset(weight_name, 0)
    values["first_expert"] = start
    return em.graph.call_function(node.target, tuple(values[n] for n in names))


_ATTENTION_RULES = tuple(_RULES[name] for name in ("REPLICATED", "DATA_PARALLEL", "HEAD_PARALLEL", "QUERY_SPLIT"))
"""The attention's rules (``rustcore/core/src/rules/attention.rs``)."""


ADAPTERS: Mapping[tuple[str, str], Adapter] = MappingProxyType({
    **{("aten.scaled_dot_product_attention", rule): _counter_attention for rule in _ATTENTION_RULES},
    **{(op, rule): _counter_draw for rule in (REPLICATED, SHARDED)
       for op in ("aten.native_dropout", "aten.dropout", "aten.bernoulli", "aten.bernoulli.p", "aten.rand_like",
                  "aten.randn_like")},
    **{(op, SHARDED): _with_local_size(1) for op in ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.expand")},
    ("aten.expand", BROADCAST_SPLIT): _with_local_size(1),
    **{("aten.unflatten.int", rule): _unflatten for rule in (REPLICATED, SHARDED, PARTIAL)},
    ("aten.linear", ROW_PARALLEL): _bias_on_rank_zero(2),
    ("aten.linear", PARTIAL): _bias_on_rank_zero(2),
    **{(op, rule): _bias_on_rank_zero(0) for op in ("aten.addmm", "aten.baddbmm") for rule in (ROW_PARALLEL, PARTIAL)},
    ("aten.native_group_norm", DATA_PARALLEL): _local_batch(3),
    ("aten._native_batch_norm_legit_functional", DATA_PARALLEL_SYNCED): _synced_batch_norm,
    **{(op, ROW_PARALLEL): _bias_on_rank_zero(2) for op in ("aten.conv1d", "aten.conv2d", "aten.conv3d")},
    ("aten.embedding", VOCAB_PARALLEL): _vocab_parallel,
    ("hapd.routed_experts", EXPERT_PARALLEL): _routed_experts_on_rank,
    ("aten.mean", SHARDED_MEAN): _sharded_mean,
    ("aten.mean.dim", SHARDED_MEAN): _sharded_mean,
    **{(op, SHARDED_MEAN): _sharded_mean_loss for op in BATCH_SPLIT_LOSSES},
})
"""(op name, rule name) -> the :data:`Adapter` that emits the op for that rule; a step
whose pair is not here runs its op unchanged on the local pieces."""
