"""A counter-based random generator: any piece of a random tensor without the rest.

:func:`uniform` gives the float32 uniforms in ``[0, 1)`` of one piece of a global
tensor. Each element's value is a pure function of ``(seed, stream, step, part, the
element's linear index in the single-device tensor)``, so the ranks of a plan that
splits a random op each draw exactly their slice of the single-device draw, and the
single-device program run with this generator draws the same values.

The generator is SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014; the seeder of Java's ``SplittableRandom`` and of xoshiro),
which is counter-based by construction: its ``n``-th output is ``mix64(base + n·γ)``.
Element ``i`` of a draw takes output ``i + 1`` of the stream whose ``base`` mixes the
seed with ``(step, part, stream)``. It is written here in vectorized torch integer ops,
because torch's own generators cannot give a slice of a random tensor without drawing
the elements before it. Words live in int64 tensors: multiplication wraps modulo 2**64
(the low 64 bits of the product, as the unsigned algorithm needs) and a logical right
shift is an arithmetic one masked. About 15 element-wise integer ops per element, each
its own kernel: on an H100 the draw of an 8×1024×768 mask took 1.11 ms against 0.026 ms
for torch's fused ``native_dropout`` (a Philox-4x32-10 in the same torch ops, ~250 ops,
took 10.4 ms). On CUDA the runtime draws with one fused kernel instead
(:mod:`hapd.spmd.random.counter_kernels`, the same bits); these ops run on CPU and under
``torch.compile``, and give the same bits on CPU and CUDA. The top 24 bits of an output
make the uniform.

The values are SplitMix64's, not torch's: a model run with hapd's generator draws other
masks than the eager model (see ``docs/runtime.md``, "Exact, for random ops").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment (2**64 / golden ratio)."""
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""SplitMix64's finalizer multipliers (Stafford's Mix13)."""
STREAM_BITS = 16
"""A stream id is below ``2**16``; the part (a micro-batch, a duplica) takes the next
16 bits and the step the 32 above them."""


def _signed(word: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return word - (1 << 64) if word >= 1 << 63 else word


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64's output function on int64 words (a bijection of 64-bit words)."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX[0])
    x = (x ^ _shr(x, 27)) * _signed(_MIX[1])
    return x ^ _shr(x, 31)


def splitmix64(state: int, count: int) -> list[int]:
    """The first ``count`` outputs of SplitMix64 seeded with ``state`` (unsigned ints):
    what :func:`uniform`'s words are, for checking against the published sequence."""
    steps = torch.arange(1, count + 1, dtype=torch.int64) * _signed(_GAMMA) + _signed(state & ((1 << 64) - 1))
    return [int(w) & ((1 << 64) - 1) for w in mix64(steps)]


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
    ``part`` (``< 2**16``) the parts of a batch run apart (micro-batches, duplicas)."""
    if not 0 <= stream < 1 << STREAM_BITS:
        raise ValueError(f"stream {stream} is outside [0, {1 << STREAM_BITS})")
    index = global_index(global_shape, offsets, local_shape, device)
    step = step.to(device=index.device, dtype=torch.int64) if isinstance(step, Tensor) else \
        torch.tensor(step, dtype=torch.int64, device=index.device)
    part = part.to(device=index.device, dtype=torch.int64) if isinstance(part, Tensor) else part
    draw = (step << (2 * STREAM_BITS)) | ((part & 0xFFFF) << STREAM_BITS) | stream
    seeded = mix64(torch.tensor(_signed(seed & ((1 << 64) - 1)), dtype=torch.int64, device=index.device))
    base = mix64(seeded + draw * _signed(_GAMMA))
    if index.device.type == "cpu" and index.numel() > CHUNK and not torch.compiler.is_compiling():
        return _uniform_in_chunks(index, base)
    words = mix64(base + (index + 1) * _signed(_GAMMA))
    return _shr(words, 40).to(torch.float32) * (1.0 / (1 << 24))


CHUNK = 1 << 15
"""Elements a CPU draw works on at once (:func:`_uniform_in_chunks`)."""


def _uniform_in_chunks(index: Tensor, base: Tensor) -> Tensor:
    """:func:`uniform`'s last steps on the CPU, the same bits: each op runs in place on
    a chunk of :data:`CHUNK` elements, so the ~15 passes over a chunk stay in the
    cache (the whole-tensor ops stream every pass through memory; on one core an
    attention's 2×4×512×512 draw took 59 ms that way, 13 ms in chunks)."""
    flat = index.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.float32)
    start = _signed((int(base) + _signed(_GAMMA)) & ((1 << 64) - 1))  # base + (i + 1)·γ = i·γ + (base + γ)
    words = torch.empty(min(CHUNK, flat.numel()), dtype=torch.int64)
    spare = torch.empty_like(words)
    for at in range(0, flat.numel(), CHUNK):
        n = min(CHUNK, flat.numel() - at)
        w, t = words[:n], spare[:n]
        torch.mul(flat[at:at + n], _signed(_GAMMA), out=w)
        w += start
        for bits, multiplier in ((30, _MIX[0]), (27, _MIX[1]), (31, None)):  # mix64, in place
            torch.bitwise_right_shift(w, bits, out=t)
            t &= (1 << (64 - bits)) - 1
            w ^= t
            if multiplier is not None:
                w *= _signed(multiplier)
        w >>= 40
        w &= (1 << 24) - 1
        torch.mul(w, 1.0 / (1 << 24), out=out[at:at + n])
    return out.view(index.shape)


__all__ = ["CHUNK", "STREAM_BITS", "global_index", "mix64", "splitmix64", "uniform"]
