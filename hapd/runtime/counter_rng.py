"""A counter-based random generator: any piece of a random tensor without the rest.

:func:`uniform` gives the float32 uniforms in ``[0, 1)`` of one piece of a global
tensor. Each element's value is a pure function of ``(seed, stream, step, part, the
element's linear index in the single-device tensor)``, so the ranks of a plan that
splits a random op each draw exactly their slice of the single-device draw, and the
single-device program run with this generator draws the same values.

The generator is Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011; the generator of CUDA's ``curand`` and of torch's CUDA dropout),
written here in vectorized torch integer ops: torch's own generators cannot give a
slice of a random tensor without drawing the elements before it. The counter is
``(index low word, index high word, step, stream + part << 16)`` and the key is the
64-bit seed; the first output word's top 24 bits make the uniform. Words are held in
int64 tensors and masked to 32 bits; products of two 32-bit words are formed from
16-bit halves so that no int64 overflows (torch's integer multiply would wrap, and its
right shift is arithmetic). The same ops run on CPU and CUDA and give the same bits.

The values are Philox's, not torch's: a model run with hapd's generator draws other
masks than the eager model (see ``docs/runtime.md``, "Exact, for random ops").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_MUL = (0xD2511F53, 0xCD9E8D57)
"""Philox-4x32's round multipliers."""
_WEYL = (0x9E3779B9, 0xBB67AE85)
"""Philox-4x32's key increments (golden ratio, sqrt(3) - 1)."""
ROUNDS = 10
STREAM_BITS = 16
"""A stream id is below ``2**16``; the part (a micro-batch, a duplica) fills the rest
of the fourth counter word."""


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of ``a * m`` for 32-bit words ``a`` (int64 tensor) and
    the constant ``m``, without overflowing int64."""
    lo16, hi16 = a & 0xFFFF, a >> 16
    p_lo, p_hi = lo16 * m, hi16 * m  # each < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return high, low


def philox(counter: Sequence[Tensor | int], key: tuple[int, int], rounds: int = ROUNDS) -> tuple[Tensor, ...]:
    """Philox-4x32 on 32-bit words: four counter words (int64 tensors or ints, which
    broadcast) and two key words -> four output words (int64 tensors in ``[0, 2**32)``)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) if not isinstance(c, Tensor) else c for c in counter)
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _MUL[0])
        hi1, lo1 = _mulhilo(c2, _MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _WEYL[0]) & _M32, (k1 + _WEYL[1]) & _M32
    return c0, c1, c2, c3


def global_index(global_shape: Sequence[int], offsets: Sequence[int], local_shape: Sequence[int],
                 device: torch.device | str | None = None) -> Tensor:
    """The linear index in the (contiguous) single-device tensor of ``global_shape`` of
    every element of the piece of shape ``local_shape`` that starts at ``offsets``."""
    if not len(global_shape) == len(offsets) == len(local_shape):
        raise ValueError(f"global shape {list(global_shape)}, offsets {list(offsets)} and local shape "
                         f"{list(local_shape)} differ in rank")
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        if offsets[d] < 0 or offsets[d] + local_shape[d] > global_shape[d]:
            raise ValueError(f"dim {d}: the piece [{offsets[d]}, {offsets[d] + local_shape[d]}) is outside "
                             f"[0, {global_shape[d]})")
        shape = [1] * len(global_shape)
        shape[d] = local_shape[d]
        along = (torch.arange(local_shape[d], dtype=torch.int64, device=device) + offsets[d]) * stride
        index = index + along.view(shape)
        stride *= global_shape[d]
    return index.expand(*local_shape)


def uniform(seed: int, stream: int, step: Tensor | int, global_shape: Sequence[int], offsets: Sequence[int],
            local_shape: Sequence[int], device: torch.device | str | None = None, part: Tensor | int = 0) -> Tensor:
    """float32 uniforms in ``[0, 1)`` of the piece of shape ``local_shape`` at
    ``offsets`` of a random tensor of ``global_shape``; ``stream`` (``< 2**16``) tells
    random ops apart, ``step`` (an int or an integer scalar tensor) training steps,
    ``part`` the parts of a batch run apart (micro-batches, duplicas)."""
    if not 0 <= stream < 1 << STREAM_BITS:
        raise ValueError(f"stream {stream} is outside [0, {1 << STREAM_BITS})")
    index = global_index(global_shape, offsets, local_shape, device)
    seed &= (1 << 64) - 1
    step = step.to(device=index.device, dtype=torch.int64) if isinstance(step, Tensor) else step
    part = part.to(device=index.device, dtype=torch.int64) if isinstance(part, Tensor) else part
    words = philox((index & _M32, index >> 32, step & _M32, (stream + (part << STREAM_BITS)) & _M32),
                   (seed & _M32, seed >> 32))
    return (words[0] >> 8).to(torch.float32) * (1.0 / (1 << 24))


__all__ = ["ROUNDS", "STREAM_BITS", "global_index", "philox", "uniform"]
