"""Dropout drawn with hapd's counter-based generator, on a rank and on one device.

A plan may split a dropout like an element-wise op (``rustcore/core/src/rules/random.rs``):
each rank runs :class:`CounterDropout` on its piece, drawing its slice of the
single-device mask with :func:`hapd.spmd.random.counter_rng.uniform`. What keys a draw:

- the **seed**: an attribute of every :class:`CounterDropout`, set at distribute time
  (default ``torch.initial_seed()`` of rank 0, which distribute sends to the other ranks;
  :func:`set_seed` changes it later, on every rank alike);
- the **stream**: the dropout's position among the program's dropouts in graph order
  (:func:`random_streams`), the same on every rank and in the single-device reference;
- the **step**: a scalar int64 buffer of the module (:data:`STEP`) that a forward
  pre-hook *replaces* (never writes into) before each forward, so it advances once per
  training forward, is equal on every rank, and a recompute span rerun in the backward
  (non-reentrant ``torch.utils.checkpoint`` keeps the tensors its forward read) draws
  with the value its forward used;
- the **part**: which part of the batch a run computes when a batch is run in parts
  (pipeline micro-batches: the buffer :data:`PART`; overlapped duplicas: the
  ``duplica`` argument), so that the parts draw distinct masks;
- the element's linear index in the single-device tensor: the piece's offsets along
  each dim (where this rank's piece starts) plus its local index.

``scaled_dot_product_attention`` with ``dropout_p > 0`` drops attention probabilities
inside a fused kernel, with torch's generator, where no slice of them can be drawn
alone. hapd runs such an attention as :class:`CounterAttention`: the math attention
(``softmax(q·kᵀ·scale + mask) · v``, as torch's own reference implementation), its
probabilities dropped by the counter-based generator. Each rank draws its slice of the
single-device ``[…, queries, keys]`` probabilities (split along the batch, the heads or
the queries as the attention is), so the attention splits like any other; the price is
the math attention's speed and memory (the probabilities are materialized), which the
cost model counts (``rustcore/core/src/rules/attention.rs``).

:func:`counter_reference` is the single-device program with the same generator in place:
what ``hapd check`` and the exactness tests compare a distributed program against.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram

from hapd.state.held import STEP
from hapd.ir.normalize import normalize
from hapd.ir.op_facts import ATTENTION, attention_args
from hapd.errors import PlanError
from hapd.spmd.random import attention_kernels, counter_kernels
from hapd.spmd.random.counter_rng import uniform

DROPOUT_OPS = frozenset({torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default})
"""The dropouts hapd draws with its own generator (``native_dropout``, and ``dropout``
should it survive normalization)."""
RANDOM_OPS = {
    torch.ops.aten.bernoulli.default: "bernoulli",
    torch.ops.aten.bernoulli.p: "bernoulli_p",
    torch.ops.aten.rand_like.default: "rand_like",
    torch.ops.aten.randn_like.default: "randn_like",
}
"""The other random ops hapd draws (:class:`CounterRandom`), by their kind."""
SEED = "hapd_rng_seed"
"""The rank module attribute holding the seed its dropouts draw with (another program of
the same model, distributed with ``shared=``, draws with it too)."""
COUNTER_RNG = "counter"
"""Random ops drawn by hapd's counter-based generator: each rank its slice."""
TORCH_RNG = "torch"
"""Random ops run as the program has them, drawn by torch's generator (one device)."""
RNG_CHOICES = (COUNTER_RNG, TORCH_RNG)
"""What :func:`hapd.spmd.rewrite.distribute`'s ``rng`` takes."""
PART = "hapd_rng_part"
"""The module buffer holding the part of the batch being run (pipeline micro-batch)."""

_log = logging.getLogger("hapd.random")


@dataclasses.dataclass(frozen=True)
class DrawParts:
    """Where a program's batch lies in the single-device batch, so that its random ops
    draw the single-device masks of its rows: the batch is cut into ``parts`` equal
    parts (an overlapped run's two duplicas, a pipeline's ``m`` micro-batches) and a run
    computes one of them (the duplica, or the micro-batch :func:`set_part` names).
    ``batch_dims``: per random op of the program, in stream order, the dim of the tensor
    it draws that holds the samples (outermost: a dim merging samples with other dims
    holds each sample's block whole); None where it is not known — that op then draws
    a mask of its own per part (valid dropout, not the single device's). ``stream_base``:
    the random ops of the whole model before this program's (a pipeline stage's)."""

    parts: int
    batch_dims: tuple[int | None, ...] = ()
    stream_base: int = 0

    def __post_init__(self) -> None:
        if self.parts < 1 or self.stream_base < 0:
            raise ValueError(f"parts {self.parts} and stream base {self.stream_base}: need parts ≥ 1, base ≥ 0")

    def stage(self, first: int, count: int) -> "DrawParts":
        """The parts of the ``count`` random ops from the ``first`` of this program on (a stage's)."""
        dims = self.batch_dims[first:first + count] if len(self.batch_dims) >= first + count else ()
        return DrawParts(self.parts, tuple(dims), self.stream_base + first)


class CounterDraw(nn.Module):
    """What every op drawn by the counter-based generator holds: its stream, the
    single-device shape of what it draws (``global_shape``) and where this rank's piece
    starts (``offsets``), and the seed (:func:`set_seed` changes it)."""

    def __init__(self, stream: int, global_shape: Sequence[int], offsets: Sequence[int], seed: int):
        super().__init__()
        self.stream = int(stream)
        self.global_shape, self.offsets = [int(s) for s in global_shape], [int(o) for o in offsets]
        self.seed = int(seed)
        self.parts, self.batch_dim, self.part_index = 1, None, 0
        """The program's batch as one of ``parts`` equal parts of the single-device batch
        (:class:`DrawParts`), ``batch_dim`` the dim of the drawn tensor holding the
        samples, ``part_index`` the micro-batch being run (:func:`set_part`)."""

    def piece(self, part: Tensor | int, duplica: int) -> tuple[list[int], list[int], Tensor | int, int]:
        """``(global shape, offsets, part, duplica)`` of the draw a run makes: where the
        program's batch is a part of the single-device batch and the samples' dim is
        known, this rank's piece of that part placed in the whole batch's draw (the
        single-device masks: no part in the key); else the program's own shape and a key
        per part (each part draws masks of its own)."""
        if self.parts > 1 and self.batch_dim is not None:
            d, index = self.batch_dim, self.part_index + duplica
            shape, offsets = list(self.global_shape), list(self.offsets)
            offsets[d] += index * shape[d]
            shape[d] *= self.parts
            return shape, offsets, 0, 0
        return self.global_shape, self.offsets, part, duplica

    def uniforms(self, local_shape: Sequence[int], device: torch.device, step: Tensor, part: Tensor, duplica: int,
                 *, per_element: int = 1) -> Tensor:
        """This piece's float32 uniforms in ``[0, 1)``; ``per_element`` > 1 gives that
        many independent ones per element, along a new last dim."""
        shape, offsets, part, duplica = self.piece(part, duplica)
        local = list(local_shape)
        if per_element > 1:
            shape, offsets, local = [*shape, per_element], [*offsets, 0], [*local, per_element]
        if counter_kernels.available(step):
            fused = counter_kernels.fused_uniform(self.seed, self.stream, step, part, duplica, shape, offsets, local,
                                                  device)
            if fused is not None:
                return fused
        return uniform(self.seed, self.stream, step, shape, offsets, local, device, part=part * 2 + duplica)

    def extra_repr(self) -> str:
        return f"stream={self.stream}, global_shape={self.global_shape}, offsets={self.offsets}"


class CounterDropout(CounterDraw):
    """``native_dropout(x, p, train)`` on this rank's piece of ``x``, whose single-device
    shape is ``global_shape`` and which starts at ``offsets``: returns ``(result,
    mask)`` as ``native_dropout`` does (``result = x · mask / (1 − p)``, ``mask`` bool;
    with ``train`` false: ``x`` and an all-true mask), or the result alone for
    ``aten.dropout`` (``single``)."""

    def __init__(self, p: float, train: bool, stream: int, global_shape: Sequence[int], offsets: Sequence[int],
                 seed: int, *, single: bool = False):
        super().__init__(stream, global_shape, offsets, seed)
        self.p, self.drops = float(p), bool(train)
        # (``drops``, not ``train``: that name is nn.Module's mode switch)
        self.single = single

    def forward(self, x: Tensor, step: Tensor, part: Tensor, duplica: int = 0) -> Any:
        fused = None
        if self.drops and counter_kernels.available(x):  # one kernel on CUDA
            shape, offsets, key_part, key_duplica = self.piece(part, duplica)
            fused = counter_kernels.fused_dropout(x, self.p, self.seed, self.stream, step, key_part, key_duplica,
                                                  shape, offsets)
        if fused is not None:
            out, mask = fused
        elif not self.drops:
            out, mask = x.clone(), torch.ones_like(x, dtype=torch.bool)
        else:
            mask = self.uniforms(x.shape, x.device, step, part, duplica) >= self.p
            # where() keeps only the bool mask for the backward pass (a byte an element, as
            # native_dropout does; x * mask.to(x.dtype) would keep it in x's dtype)
            out = torch.where(mask, x * (1.0 / (1.0 - self.p) if self.p < 1.0 else 0.0), 0.0)
        return out if self.single else (out, mask)

    def extra_repr(self) -> str:
        return f"p={self.p}, train={self.drops}, {super().extra_repr()}"


class CounterRandom(CounterDraw):
    """``bernoulli(probabilities)``, ``bernoulli.p(x, p)``, ``rand_like(x)`` or
    ``randn_like(x)`` (``op``) on this rank's piece of the operand: this rank's slice
    of the single-device draw, in ``dtype``. ``bernoulli`` keeps an element where its
    uniform is below its probability; ``randn_like`` is the Box–Muller transform of two
    uniforms per element."""

    def __init__(self, op: str, stream: int, global_shape: Sequence[int], offsets: Sequence[int], seed: int, *,
                 dtype: torch.dtype, p: float | None = None):
        super().__init__(stream, global_shape, offsets, seed)
        if op not in RANDOM_OPS.values():
            raise ValueError(f"unknown random op {op!r}")
        self.op, self.dtype, self.p = op, dtype, p

    def forward(self, x: Tensor, step: Tensor, part: Tensor, duplica: int = 0) -> Tensor:
        if self.op == "randn_like":
            u = self.uniforms(x.shape, x.device, step, part, duplica, per_element=2)
            radius = torch.sqrt(-2.0 * torch.log1p(-u[..., 0]))  # 1 - u in (0, 1]: a finite log
            return (radius * torch.cos(2.0 * math.pi * u[..., 1])).to(self.dtype)
        u = self.uniforms(x.shape, x.device, step, part, duplica)
        if self.op == "rand_like":
            return u.to(self.dtype)
        probability = x if self.op == "bernoulli" else self.p
        return (u < probability).to(self.dtype)

    def extra_repr(self) -> str:
        p = f", p={self.p}" if self.p is not None else ""
        return f"{self.op}{p}, {super().extra_repr()}"


class CounterAttention(CounterDropout):
    """``scaled_dot_product_attention(q, k, v, attn_mask, p, is_causal, scale=,
    enable_gqa=)`` in training with ``p > 0``, on this rank's pieces: the math attention,
    its probabilities dropped by :class:`CounterDropout`'s draw of this rank's slice of
    the single-device probabilities (``global_shape``: ``[…, queries, keys]``, the
    piece starting at ``offsets``). A causal attention here is never split along the
    queries (the core's rules), so its triangle is the local one. Where the fused
    kernels run (:func:`hapd.spmd.random.counter_kernels.available`) the same attention
    and draw run as one flash-attention kernel
    (:func:`hapd.spmd.random.attention_kernels.fused_attention`), which keeps no
    ``queries × keys`` tensor; calls it does not take run the math path."""

    def __init__(self, p: float, stream: int, global_shape: Sequence[int], offsets: Sequence[int], seed: int, *,
                 is_causal: bool, scale: float | None, enable_gqa: bool):
        super().__init__(p, True, stream, global_shape, offsets, seed, single=True)
        self.is_causal, self.scale, self.enable_gqa = bool(is_causal), scale, bool(enable_gqa)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,  # type: ignore[override]
                step: Tensor, part: Tensor, duplica: int = 0) -> Tensor:
        if counter_kernels.available(q):  # one flash-attention kernel, the same draw
            shape, offsets, key_part, key_duplica = self.piece(part, duplica)
            fused = attention_kernels.fused_attention(
                q, k, v, attn_mask, p=self.p, is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa,
                seed=self.seed, stream=self.stream, step=step, part=key_part, duplica=key_duplica,
                global_shape=shape, offsets=offsets)
            if fused is not None:
                return fused
        if self.enable_gqa and q.dim() >= 3 and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if self.is_causal:
            keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        probs = _safe_softmax(scores)
        return torch.matmul(super().forward(probs, step, part, duplica), v)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, is_causal={self.is_causal}, scale={self.scale}, enable_gqa={self.enable_gqa}"


def _safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over the keys; a row with every key masked gives zeros, as torch's
    attention does, not NaN."""
    probs = torch.softmax(scores, dim=-1)
    return probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers hapd draws: a dropout, ``bernoulli``,
    ``rand_like``, ``randn_like``, or an attention with ``dropout_p > 0``."""
    if node.op != "call_function":
        return False
    if node.target in DROPOUT_OPS or node.target in RANDOM_OPS:
        return True
    return node.target is ATTENTION and float(attention_args(node.args, node.kwargs)["dropout_p"]) > 0.0


def counter_random(node: fx.Node, stream: int, global_shape: Sequence[int], offsets: Sequence[int],
                   seed: int) -> CounterRandom:
    """The :class:`CounterRandom` of random node ``node`` (of :data:`RANDOM_OPS`)."""
    kind = RANDOM_OPS[node.target]
    p = float(node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)) if kind == "bernoulli_p" else None
    return CounterRandom(kind, stream, global_shape, offsets, seed, dtype=node.meta["val"].dtype, p=p)


def counter_attention(node: fx.Node, stream: int, global_shape: Sequence[int], offsets: Sequence[int],
                      seed: int) -> CounterAttention:
    """The :class:`CounterAttention` of attention node ``node`` (``global_shape``: its
    single-device probabilities)."""
    a = attention_args(node.args, node.kwargs)
    return CounterAttention(float(a["dropout_p"]), stream, global_shape, offsets, seed, is_causal=bool(a["is_causal"]),
                            scale=a["scale"], enable_gqa=bool(a["enable_gqa"]))


def probability_shape(query: Sequence[int], key: Sequence[int]) -> list[int]:
    """The single-device attention probabilities' shape: the query's, its last dim the
    keys'."""
    return [*query[:-1], key[-2]]


def dropout_args(node: fx.Node) -> tuple[float, bool]:
    """``(p, train)`` of a dropout node (``train=None`` is training, as in ATen)."""
    names = ("input", "p", "train")
    values = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args):]]
    train = values[2]
    return float(values[1]), True if train is None else bool(train)


def random_streams(graph: fx.Graph) -> dict[str, int]:
    """Random node name -> its stream: its position among the graph's random nodes
    (:func:`is_random`)."""
    return {n.name: k for k, n in enumerate(filter(is_random, graph.nodes))}


def has_random_ops(graph: fx.Graph) -> bool:
    """Whether the graph has a random node hapd draws (:func:`is_random`)."""
    return any(map(is_random, graph.nodes))


def choose_rng(rng: str | None, *, world: int, overlap: bool) -> str:
    """The generator a rank program draws with: ``rng`` when given, else ``"counter"``
    (hapd's, everywhere: one process, several ranks, duplicas, pipeline stages — so a
    script run as one process and as N ranks draws the same masks). ``"torch"`` (the
    program's own random ops, drawn by torch's generator as the eager model draws) only
    for a program that runs whole on one device, without duplicas: anywhere else the
    ranks or the duplicas would each draw a whole mask of their own."""
    if rng is None:
        return COUNTER_RNG
    if rng not in RNG_CHOICES:
        raise PlanError(f"rng must be one of {', '.join(map(repr, RNG_CHOICES))}, not {rng!r}")
    if rng == TORCH_RNG and not (world == 1 and not overlap):
        where = f"{world} ranks" if world != 1 else "two duplicas"
        raise PlanError(f"rng='torch' draws each random op whole, but this program runs on {where}: each would draw "
                        "a mask of its own, not its slice of one (use rng='counter', the default)")
    return rng


def default_seed() -> int:
    """The seed a distributed program draws with unless told: the process's
    ``torch.initial_seed()`` (the same on every rank when each set it alike)."""
    return torch.initial_seed()


def install_step(module: nn.Module, shared: nn.Module | None = None) -> None:
    """Give ``module`` the step and part buffers (not saved in its state dict) and a
    forward pre-hook that advances the step by replacing the buffer. With ``shared``
    (the training program of the same model, whose pieces ``module`` runs on) the two
    count one sequence of steps, as one device training the model does: a forward of
    either advances ``shared``'s step, and ``module`` draws with it."""
    device = next((t.device for t in (*module.parameters(), *module.buffers())), None)
    for name in (STEP, PART):
        old = getattr(module, name, None)
        value = old if isinstance(old, Tensor) else torch.zeros((), dtype=torch.int64, device=device)
        module.register_buffer(name, value, persistent=False)
    if shared is not None and isinstance(getattr(shared, STEP, None), Tensor):
        module.register_forward_pre_hook(lambda m, _args: _advance_shared(m, shared))
    else:
        module.register_forward_pre_hook(lambda m, _args: advance_step(m))


def _advance_shared(module: nn.Module, shared: nn.Module) -> None:
    """The next step of ``shared``'s sequence, drawn with by ``module``."""
    advance_step(shared)
    setattr(module, STEP, getattr(shared, STEP))


def advance_step(module: nn.Module) -> None:
    """The next training step: a new tensor (a recompute span keeps the old one)."""
    setattr(module, STEP, getattr(module, STEP) + 1)


def set_part(module: nn.Module, part: int) -> None:
    """The part of the batch the next forward runs (a new tensor, as for the step; the
    random ops placed in the single-device batch take its index)."""
    step = getattr(module, STEP)
    setattr(module, PART, torch.full((), part, dtype=torch.int64, device=step.device))
    for sub in module.modules():
        if isinstance(sub, CounterDraw):
            sub.part_index = int(part)


def apply_draw_parts(module: nn.Module, parts: DrawParts) -> int:
    """Give every random op of ``module`` its place in the single-device batch
    (:class:`DrawParts`, its ``batch_dims`` indexed by stream less the base); returns
    how many draw the single-device masks."""
    placed = 0
    for sub in module.modules():
        if isinstance(sub, CounterDraw):
            k = sub.stream - parts.stream_base
            sub.parts = parts.parts
            sub.batch_dim = parts.batch_dims[k] if 0 <= k < len(parts.batch_dims) else None
            placed += sub.batch_dim is not None or parts.parts == 1
    return placed


def _drawn_shape(node: fx.Node) -> Sequence[Any] | None:
    """The shape of what random node ``node`` draws (an attention: its probabilities)."""
    if node.target is ATTENTION:
        a = attention_args(node.args, node.kwargs)
        q, k = a["query"].meta.get("val"), a["key"].meta.get("val")
        return probability_shape(q.shape, k.shape) if q is not None and k is not None else None
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    return val.shape if isinstance(val, Tensor) else None


def random_batch_dims(program: ExportedProgram, batch: int | None = None) -> tuple[int | None, ...]:
    """Per random node of ``program`` (graph order, :func:`is_random`), the dim of what
    it draws that holds the samples: the one dim whose size is symbolic in a program
    exported with a symbolic batch (:mod:`hapd.ir.shapes`); in a static one at batch
    ``batch``, dim 0 where its size is a multiple of ``batch`` (the layout of batch-first
    models; None where it is not)."""
    out: list[int | None] = []
    for node in filter(is_random, program.graph.nodes):
        shape = _drawn_shape(node)
        if shape is None:
            out.append(None)
            continue
        symbolic = [d for d, n in enumerate(shape) if isinstance(n, torch.SymInt) and not n.node.expr.is_number]
        if symbolic:
            out.append(symbolic[0] if len(symbolic) == 1 else None)
        elif batch and len(shape) and int(shape[0]) % batch == 0:
            out.append(0)
        else:
            out.append(None)
    return tuple(out)


def set_seed(module: nn.Module, seed: int) -> None:
    """Every random op of ``module`` draws with ``seed`` from now on."""
    for sub in module.modules():
        if isinstance(sub, CounterDraw):
            sub.seed = int(seed)


def _buffer_reads_cloned(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (an unlifted program module) with each buffer it updates read through a
    clone: a functional op may save the buffer it reads for its backward
    (``_native_batch_norm_legit_functional`` saves the running statistics), and the
    module writes the buffer's new value in place at the end of the forward, which
    autograd would refuse in the backward. The same values; ``gm`` itself, changed."""
    changed = False
    for write in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]:
        buffer = write.args[0]
        if not isinstance(buffer, fx.Node) or buffer.op != "get_attr":
            continue
        readers = [u for u in buffer.users if u is not write]
        if not readers:
            continue
        with gm.graph.inserting_after(buffer):
            read = gm.graph.call_function(torch.ops.aten.clone.default, (buffer,))
        for user in readers:
            user.replace_input_with(buffer, read)
        changed = True
    if changed:
        gm.recompile()
    return gm


def counter_reference(program: ExportedProgram, seed: int) -> nn.Module:
    """The single-device program (``program.module()`` of the normalized program, a
    copy) with every dropout drawn by :class:`CounterDropout` with ``seed``: what a
    distributed program with the same seed equals. A program without dropout gives a
    copy of ``program.module()``."""
    if not has_random_ops(program.graph):
        return _buffer_reads_cloned(copy.deepcopy(program.module()))
    gm = _buffer_reads_cloned(copy.deepcopy(normalize(program).module()))
    streams = random_streams(gm.graph)
    gm.register_buffer(STEP, torch.zeros((), dtype=torch.int64), persistent=False)
    gm.register_buffer(PART, torch.zeros((), dtype=torch.int64), persistent=False)
    for node in list(gm.graph.nodes):
        if not is_random(node):
            continue
        stream = streams[node.name]
        name = f"hapd_dropout_{stream}"
        if node.target is ATTENTION:
            a = attention_args(node.args, node.kwargs)
            shape = probability_shape(a["query"].meta["val"].shape, a["key"].meta["val"].shape)
            gm.add_module(name, counter_attention(node, stream, shape, [0] * len(shape), seed))
            operands: tuple = (a["query"], a["key"], a["value"], a["attn_mask"])
        elif node.target in RANDOM_OPS:
            shape = list(node.args[0].meta["val"].shape)
            gm.add_module(name, counter_random(node, stream, shape, [0] * len(shape), seed))
            operands = (node.args[0],)
        else:
            p, train = dropout_args(node)
            shape = list(node.args[0].meta["val"].shape)
            single = node.target is torch.ops.aten.dropout.default
            gm.add_module(name, CounterDropout(p, train, stream, shape, [0] * len(shape), seed, single=single))
            operands = (node.args[0],)
        with gm.graph.inserting_before(node):
            step, part = gm.graph.get_attr(STEP), gm.graph.get_attr(PART)
            new = gm.graph.call_module(name, (*operands, step, part))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    install_step(gm)
    return gm


__all__ = ["ATTENTION", "COUNTER_RNG", "DROPOUT_OPS", "PART", "RANDOM_OPS", "RNG_CHOICES", "SEED", "STEP", "TORCH_RNG", "CounterAttention", "CounterDraw",
           "CounterDropout", "CounterRandom", "DrawParts", "advance_step", "apply_draw_parts", "random_batch_dims", "attention_args", "choose_rng", "counter_attention", "counter_random",
           "counter_reference", "default_seed", "dropout_args",
           "has_random_ops", "install_step", "is_random", "probability_shape", "random_streams", "set_part",
           "set_seed"]
