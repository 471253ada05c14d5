"""hapd's counter-based draw as one fused kernel on CUDA (Triton).

:func:`hapd.spmd.random.counter_rng.uniform` in torch ops is about 15 element-wise kernels
(each reading and writing int64 words): on an H100 an 8×1024×768 mask took 1.11 ms
against 0.026 ms for torch's ``native_dropout``. The kernels here compute the same
SplitMix64 words in registers, one pass over the elements:

- :func:`fused_uniform`: the float32 uniforms of a piece (what ``uniform`` returns);
- :func:`fused_dropout`: ``native_dropout``'s ``(result, mask)`` of a piece in one read
  of ``x`` and one write of each, as torch's kernel does.

They give the same bits as the torch ops (tests compare them, on CPU under Triton's
interpreter, ``TRITON_INTERPRET=1``). Written by hand because no library draws a slice of
a counter-based random tensor: torch's Philox kernels take an offset into the stream of
a whole tensor, not an element's index in a larger one.

:func:`available` says whether a tensor can take the kernels: CUDA, Triton importable,
and not inside ``torch.compile`` (whose Inductor fuses the torch ops itself).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hapd.spmd.random.counter_rng import mix64

BLOCK = 1024
"""Elements per Triton program."""
MAX_DIMS = 4
"""Dims of a piece after merging (:func:`merged_dims`); more fall back to torch ops."""


@functools.cache
def _triton() -> Any:
    """``(triton, uniform_kernel, dropout_kernel)``, or None where Triton is not
    installed. Loaded on first use: importing Triton costs about a second, and a CPU-only
    install may lack it."""
    try:
        import triton

        from hapd.spmd.random import counter_triton
    except ImportError:
        return None
    return triton, counter_triton.uniform_kernel, counter_triton.dropout_kernel


def available(x: Tensor) -> bool:
    """Whether ``x`` can take the fused kernels: on CUDA (or any device under Triton's
    interpreter), Triton importable, outside ``torch.compile``."""
    if torch.compiler.is_compiling():
        return False
    if not (x.is_cuda or _interpreted()):
        return False
    return _triton() is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def merged_dims(global_shape: Sequence[int], offsets: Sequence[int],
                local_shape: Sequence[int]) -> tuple[list[int], list[int], list[int]] | None:
    """The piece described with as few dims as possible (a dim whose piece is whole
    merges into the one before it), left-padded to :data:`MAX_DIMS`: ``(global,
    offsets, local)``, or None when more dims remain."""
    g, o, local = [], [], []
    for size, start, length in zip(global_shape, offsets, local_shape, strict=True):
        if g and length == size and start == 0:
            g[-1], o[-1], local[-1] = g[-1] * size, o[-1] * size, local[-1] * size
        else:
            g.append(int(size))
            o.append(int(start))
            local.append(int(length))
    if len(g) > MAX_DIMS:
        return None
    pad = MAX_DIMS - len(g)
    return [1] * pad + g, [0] * pad + o, [1] * pad + local


@functools.lru_cache(maxsize=64)
def _seeded(seed: int) -> int:
    """``mix64(seed)`` as the int64 with its bits (the kernels take it as a scalar)."""
    signed = seed & ((1 << 64) - 1)
    signed = signed - (1 << 64) if signed >= 1 << 63 else signed
    return int(mix64(torch.tensor(signed, dtype=torch.int64)))


def _launch_args(seed: int, stream: int, duplica: int, dims: tuple[list[int], list[int], list[int]]) -> list[Any]:
    """``seeded, stream, duplica, n, l1, l2, l3, o0, o1, o2, o3, s0, s1, s2``: the local
    dims after the first, the offsets and the global strides of the first three dims."""
    g, o, local = dims
    strides = [math.prod(g[d + 1:]) for d in range(MAX_DIMS)]
    return [_seeded(seed), int(stream), int(duplica), math.prod(local), local[1], local[2], local[3],
            *o, strides[0], strides[1], strides[2]]


def _scalar(value: Tensor | int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.int64).reshape(())
    return torch.tensor(int(value), dtype=torch.int64, device=device)


def fused_uniform(seed: int, stream: int, step: Tensor | int, part: Tensor | int, duplica: int,
                  global_shape: Sequence[int], offsets: Sequence[int], local_shape: Sequence[int],
                  device: torch.device) -> Tensor | None:
    """The float32 uniforms of the piece, drawn by one kernel (``part``: the batch part,
    ``duplica``: the duplica, combined as ``part·2 + duplica`` as the torch ops do), or
    None when the piece has too many dims to merge."""
    dims = merged_dims(global_shape, offsets, local_shape)
    kernels = _triton()
    if dims is None or kernels is None:
        return None
    triton, uniform_kernel, _ = kernels
    out = torch.empty(list(local_shape), dtype=torch.float32, device=device)
    args = _launch_args(seed, stream, duplica, dims)
    n = args[3]
    if n:
        uniform_kernel[(triton.cdiv(n, BLOCK),)](out, _scalar(step, device), _scalar(part, device), *args[:3], *args[3:],
                                                 BLOCK=BLOCK)
    return out


class _FusedDropout(torch.autograd.Function):
    """``native_dropout`` of a piece with hapd's draw: one kernel forward; the backward is
    torch's ``native_dropout_backward`` (the gradient where the mask keeps, scaled)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, step: Tensor, part: Tensor, seed: int, stream: int, duplica: int, p: float,
                dims: tuple[list[int], list[int], list[int]]) -> tuple[Tensor, Tensor]:
        triton, _, dropout_kernel = _triton()
        source = x.contiguous()
        out = torch.empty_like(source)
        mask = torch.empty(source.shape, dtype=torch.bool, device=source.device)
        scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        args = _launch_args(seed, stream, duplica, dims)
        n = args[3]
        if n:
            dropout_kernel[(triton.cdiv(n, BLOCK),)](source, out, mask.view(torch.int8), step, part, *args[:3], n,
                                                     float(p), scale, *args[4:], BLOCK=BLOCK)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        ctx.mark_non_differentiable(mask)
        return out, mask

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _mask_grad: Any) -> tuple[Any, ...]:
        (mask,) = ctx.saved_tensors
        return (torch.ops.aten.native_dropout_backward(grad.contiguous(), mask, ctx.scale),
                None, None, None, None, None, None, None)


def fused_dropout(x: Tensor, p: float, seed: int, stream: int, step: Tensor | int, part: Tensor | int, duplica: int,
                  global_shape: Sequence[int], offsets: Sequence[int]) -> tuple[Tensor, Tensor] | None:
    """``(result, mask)`` of ``native_dropout(x, p, True)`` on the piece ``x`` of the
    single-device tensor of ``global_shape`` at ``offsets``, drawn by one kernel, or None
    when the piece has too many dims to merge."""
    dims = merged_dims(global_shape, offsets, list(x.shape))
    if dims is None or _triton() is None:
        return None
    return _FusedDropout.apply(x, _scalar(step, x.device), _scalar(part, x.device), int(seed), int(stream),
                               int(duplica), float(p), dims)


__all__ = ["BLOCK", "MAX_DIMS", "available", "fused_dropout", "fused_uniform", "merged_dims"]
