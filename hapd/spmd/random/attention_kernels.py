""":class:`hapd.spmd.random.random_ops.CounterAttention` as one fused kernel (Triton).

The math attention materializes the ``queries × keys`` scores, probabilities and mask
of every head (``B·H·S²`` floats each), which is what torch's fused attention avoids and
why an attention with dropout cost a rank memory and time that one without did not.
:func:`fused_attention` runs the same attention as a flash attention
(:mod:`hapd.spmd.random.attention_triton`): tiles of queries and keys, an online softmax,
the log-sum-exp kept per row, and the dropout keep decision of every score drawn inside
the kernel by hapd's counter-based generator at the score's linear index in the
single-device probabilities, the bits the math path draws
(:func:`hapd.spmd.random.counter_rng.uniform`). The backward draws the mask again; the
autograd node holds ``q``, ``k``, ``v``, the output, the log-sum-exp and the attention
mask it was given, nothing of size ``queries × keys``.

What it takes: ``q``, ``k``, ``v`` of 2 to 4 dims with one float dtype (fp32, bf16,
fp16; accumulated in fp32), head dims 16 to 256, grouped heads (``k``/``v`` heads
dividing ``q``'s), a causal triangle (upper-left, the local one as the math path), a
boolean or additive mask broadcastable to the probabilities (read with its strides, so
a broadcast mask is never expanded in memory). Anything else gives None and the caller
runs the math path. It runs where :func:`hapd.spmd.random.counter_kernels.available`
says the fused kernels may: CUDA, or Triton's interpreter on CPU (where the tests run
it), never inside ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hapd.spmd.random import counter_kernels
from hapd.spmd.random.counter_kernels import _interpreted, _scalar, _seeded

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the kernels take (``q``, ``k`` and ``v`` alike)."""
HEAD_DIMS = (16, 256)
"""The head dims the kernels take (padded to a power of two inside)."""
NO_MASK, BOOL_MASK, ADDED_MASK = 0, 1, 2
"""The kernels' ``MASK_KIND``."""


@functools.cache
def _kernels() -> Any:
    """``(triton, attention_triton)``, or None where Triton is not installed (imported
    on first use, as :mod:`hapd.spmd.random.counter_kernels` does)."""
    try:
        import triton

        from hapd.spmd.random import attention_triton
    except ImportError:
        return None
    return triton, attention_triton


@dataclass(frozen=True)
class Draw:
    """What keys the dropout of one attention call: the seed (as ``mix64(seed)``), the
    stream and duplica, ``p``, and the piece's offsets and the single-device strides of
    the probabilities' first three dims (their last dim's stride is 1)."""

    seeded: int
    stream: int
    duplica: int
    p: float
    offsets: tuple[int, int, int, int]
    strides: tuple[int, int, int]

    @property
    def scale(self) -> float:
        """What a kept probability is multiplied by: ``1 / (1 − p)``, 0 when ``p`` is 1
        (as :class:`hapd.spmd.random.random_ops.CounterDropout`)."""
        return 1.0 / (1.0 - self.p) if self.p < 1.0 else 0.0

    def args(self) -> list[Any]:
        """The kernels' ``p, drop_scale, seeded, stream, duplica, o0..o3, s0..s2``."""
        return [self.p, self.scale, self.seeded, self.stream, self.duplica, *self.offsets, *self.strides]


@dataclass(frozen=True)
class Shape:
    """The attention's compile-time choices: causal, the mask's kind, the dot's
    precision (fp32 dots as torch's matmul does them) and the heads per key head."""

    causal: bool
    mask_kind: int
    precision: str
    group: int

    def fma(self, q: Tensor) -> bool:
        """Whether the dots run on the FMA units (fp32 IEEE), not on tensor cores."""
        return q.dtype == torch.float32 and self.precision == "ieee"


def why_not(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, *, enable_gqa: bool,
            global_shape: Sequence[int], offsets: Sequence[int]) -> str | None:
    """Why the fused attention cannot run this call (the math path then does), or None
    when it can."""
    if not 2 <= q.dim() <= 4 or not k.dim() == v.dim() == q.dim():
        return f"q, k, v of {q.dim()}, {k.dim()}, {v.dim()} dims (2 to 4, alike, are fused)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device) or (attn_mask is not None and attn_mask.device != q.device):
        return "tensors on different devices"
    if not HEAD_DIMS[0] <= q.size(-1) <= HEAD_DIMS[1] or not HEAD_DIMS[0] <= v.size(-1) <= HEAD_DIMS[1]:
        return f"head dims {q.size(-1)}, {v.size(-1)} outside {HEAD_DIMS}"
    if k.size(-1) != q.size(-1) or k.size(-2) != v.size(-2) or k.shape[:-2] != v.shape[:-2]:
        return "k and v do not pair with q"
    if q.shape[:-3] != k.shape[:-3] or (q.dim() >= 3 and _group(q, k, enable_gqa) is None):
        return "q's and k's batch or heads do not pair"
    probs = [*q.shape[:-1], k.size(-2)]
    if len(global_shape) != len(probs) or len(offsets) != len(probs) or any(
            o < 0 or o + n > g for g, o, n in zip(global_shape, offsets, probs)):
        return f"the piece {probs} at {list(offsets)} is not inside {list(global_shape)}"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"a mask of {attn_mask.dtype}"
        if attn_mask.requires_grad:
            return "a mask that asks for a gradient"
        try:
            torch.broadcast_shapes(attn_mask.shape, probs)
        except RuntimeError:
            return f"a mask of shape {list(attn_mask.shape)} for probabilities {probs}"
        if list(torch.broadcast_shapes(attn_mask.shape, probs)) != probs:
            return f"a mask of shape {list(attn_mask.shape)} grows the probabilities {probs}"
    return None


def supported(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, *, enable_gqa: bool,
              global_shape: Sequence[int], offsets: Sequence[int]) -> bool:
    """Whether :func:`fused_attention` runs this call (on a device that takes it)."""
    return why_not(q, k, v, attn_mask, enable_gqa=enable_gqa, global_shape=global_shape, offsets=offsets) is None


def _group(q: Tensor, k: Tensor, enable_gqa: bool) -> int | None:
    """Query heads per key head: 1, ``H / Hkv`` with ``enable_gqa`` (the math path's
    ``repeat_interleave``), ``H`` for one key head (matmul broadcasts it), else None."""
    heads, kv_heads = q.size(-3), k.size(-3)
    if kv_heads == heads:
        return 1
    if kv_heads == 1 or (enable_gqa and kv_heads and heads % kv_heads == 0):
        return heads // kv_heads
    return None


def _four(x: Tensor) -> Tensor:
    """``x`` as ``[B, H, S, D]`` (leading dims of 1 added; a view)."""
    return x.reshape(*[1] * (4 - x.dim()), *x.shape)


def _precision(x: Tensor) -> str:
    """The kernels' dots: fp32 ones as torch's matmul does them (IEEE unless fp32
    matmuls may use TF32); bf16 ones under the interpreter "widened" to fp32 (its
    ``tl.dot`` multiplies bf16 operands' raw bits)."""
    if x.dtype == torch.bfloat16 and _interpreted():
        return "widened"
    tf32 = x.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "ieee"


def _blocks(head_dim: int, backward: bool, fma: bool) -> dict[str, int]:
    """Tile sizes and warps. Under the interpreter, 32: few Python-level iterations
    and still several tiles at the tests' sizes. On a GPU, tiles whose kernels ptxas
    compiles for sm_90 spilling at most a few hundred bytes of registers (larger ones
    spilled tens of kilobytes): the flash attention tutorial's for tensor-core dots,
    smaller ones for fp32 IEEE dots (``fma``: run on the FMA units, their operands in
    registers)."""
    if _interpreted():
        return {"BLOCK_M": 32, "BLOCK_N": 32}
    warps = 4 if head_dim <= 64 and not backward else 8  # a backward tile holds twice the accumulators
    if fma:
        return {"BLOCK_M": 16 if head_dim > 128 else 32, "BLOCK_N": 32, "num_warps": warps, "num_stages": 2}
    if head_dim > 128:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": warps, "num_stages": 2}
    if backward:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": warps, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if head_dim <= 64 else 32, "num_warps": warps, "num_stages": 2}


def _pow2(n: int) -> int:
    """A head dim's tile: the power of two at or above it (at least 16, ``tl.dot``'s
    least); the lanes past the head dim load zeros."""
    return max(16, 1 << (n - 1).bit_length())


class _FusedAttention(torch.autograd.Function):
    """The fused attention forward and its two backward kernels; the mask is drawn
    again in the backward, never stored."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, step: Tensor, part: Tensor,
                scale: float, draw: Draw, shape: Shape) -> Tensor:
        triton, kernels = _kernels()
        b, h, sq, d = q.shape
        sk, dv = k.size(2), v.size(3)
        out = torch.empty(b, h, sq, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
        blocks = _blocks(max(d, dv), backward=False, fma=shape.fma(q))
        if out.numel():
            mask_arg, mask_strides = _mask_args(mask, q)
            grid = (triton.cdiv(sq, blocks["BLOCK_M"]), b * h)
            kernels.attention_fwd[grid](
                q, k, v, out, lse, mask_arg, step, part, *q.stride(), *k.stride(), *v.stride(),
                *out.stride(), *mask_strides, h, sq, sk, d, dv, float(scale), *draw.args(),
                **_constants(shape, draw, sq, sk, d, dv), **blocks)
        ctx.save_for_backward(q, k, v, out, lse, mask, step, part)
        ctx.scale, ctx.draw, ctx.shape = scale, draw, shape
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, mask, step, part = ctx.saved_tensors
        triton, kernels = _kernels()
        b, h, sq, d = q.shape
        hkv, sk, dv = k.size(1), k.size(2), v.size(3)
        dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if not (q.numel() and k.numel() and v.numel()):
            return dq.zero_(), dk.zero_(), dvv.zero_(), None, None, None, None, None, None
        delta = (grad.float() * out.float()).sum(-1)  # rowsum(dO ∘ O): what dS subtracts
        mask_arg, mask_strides = _mask_args(mask, q)
        draw, shape = ctx.draw, ctx.shape
        common = _constants(shape, draw, sq, sk, d, dv)
        blocks = _blocks(max(d, dv), backward=True, fma=shape.fma(q))
        kernels.attention_bwd_dkdv[(triton.cdiv(sk, blocks["BLOCK_N"]), b * hkv)](
            q, k, v, grad, lse, delta, dk, dvv, mask_arg, step, part, *q.stride(), *k.stride(), *v.stride(),
            *grad.stride(), *dk.stride(), *dvv.stride(), *mask_strides, h, hkv, sq, sk, d, dv,
            float(ctx.scale), *draw.args(), **common, **blocks)
        kernels.attention_bwd_dq[(triton.cdiv(sq, blocks["BLOCK_M"]), b * h)](
            q, k, v, grad, lse, delta, dq, mask_arg, step, part, *q.stride(), *k.stride(), *v.stride(),
            *grad.stride(), *dq.stride(), *mask_strides, h, sq, sk, d, dv, float(ctx.scale),
            *draw.args(), **common, **blocks)
        return dq, dk, dvv, None, None, None, None, None, None


def _constants(shape: Shape, draw: Draw, sq: int, sk: int, d: int, dv: int) -> dict[str, Any]:
    """The kernels' compile-time arguments. Under the interpreter the loops' bounds are
    given as constants too (``STATIC_SQ``, ``STATIC_SK``): it runs a loop only over
    bounds it can turn into Python ints, which its scalars (one-element arrays) are not;
    on a GPU they are 0 and the loops run over runtime bounds, one compiled kernel for
    every length."""
    static = _interpreted()
    return {"GROUP": shape.group, "CAUSAL": shape.causal, "MASK_KIND": shape.mask_kind, "DROPOUT": draw.p > 0.0,
            "PRECISION": shape.precision, "STATIC_SQ": sq if static else 0, "STATIC_SK": sk if static else 0,
            "BLOCK_D": _pow2(d), "BLOCK_DV": _pow2(dv)}


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, list[int]]:
    """The kernels' mask pointer and its four strides (0 along broadcast dims); ``q``
    stands in for a missing mask (never read: ``MASK_KIND`` is 0)."""
    if mask is None:
        return q, [0, 0, 0, 0]
    return (mask.view(torch.uint8) if mask.dtype == torch.bool else mask), list(mask.stride())


def _draw(seed: int, stream: int, duplica: int, p: float, global_shape: Sequence[int],
          offsets: Sequence[int]) -> Draw:
    """The :class:`Draw` of a piece of probabilities of 2 to 4 dims (left-padded to 4)."""
    pad = 4 - len(global_shape)
    g = [1] * pad + [int(s) for s in global_shape]
    o = [0] * pad + [int(x) for x in offsets]
    return Draw(_seeded(seed), int(stream), int(duplica), float(p), (o[0], o[1], o[2], o[3]),
                (g[1] * g[2] * g[3], g[2] * g[3], g[3]))


def fused_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, *, p: float, is_causal: bool,
                    scale: float | None, enable_gqa: bool, seed: int, stream: int, step: Tensor | int,
                    part: Tensor | int, duplica: int, global_shape: Sequence[int],
                    offsets: Sequence[int]) -> Tensor | None:
    """:class:`hapd.spmd.random.random_ops.CounterAttention`'s attention of this rank's
    pieces in one fused kernel (its dropout drawn at ``offsets`` of the single-device
    probabilities of ``global_shape``), or None when the call is not one the kernels
    take (:func:`why_not`) or Triton cannot run here."""
    if not counter_kernels.available(q) or _kernels() is None:
        return None
    if torch.is_autocast_enabled(q.device.type):  # the math path's matmuls would run in the autocast dtype
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if why_not(q, k, v, attn_mask, enable_gqa=enable_gqa, global_shape=global_shape, offsets=offsets) is not None:
        return None
    q4, k4, v4 = _four(q), _four(k), _four(v)
    probs = [*q4.shape[:-1], k4.size(-2)]
    mask4, kind = None, NO_MASK
    if attn_mask is not None:
        mask4 = attn_mask.expand(*[*q.shape[:-1], k.size(-2)]).reshape(probs)
        kind = BOOL_MASK if attn_mask.dtype == torch.bool else ADDED_MASK
    group = q4.size(1) // k4.size(1)
    shape = Shape(bool(is_causal), kind, _precision(q), group)
    draw = _draw(seed, stream, duplica, p, global_shape, offsets)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.size(-1))
    with torch.autocast(q.device.type, enabled=False):
        out = _FusedAttention.apply(q4, k4, v4, mask4, _scalar(step, q.device), _scalar(part, q.device), scale,
                                    draw, shape)
    return out.reshape(*q.shape[:-1], v.size(-1))


__all__ = ["DTYPES", "HEAD_DIMS", "fused_attention", "supported", "why_not"]
