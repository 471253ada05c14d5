"""The Triton kernels of :mod:`hapd.spmd.random.counter_kernels` (imported only where Triton
is installed and a kernel is about to run; Triton's ``jit`` needs its kernels and the
functions they call at module level).

SplitMix64 (see :mod:`hapd.spmd.random.counter_rng`) in unsigned 64-bit words: Triton's
``uint64`` multiplication wraps and its right shift is logical, as the algorithm needs.
"""

import triton
import triton.language as tl

SCALARS = ["seeded", "stream", "duplica", "n", "l1", "l2", "l3", "o0", "o1", "o2", "o3", "s0", "s1", "s2"]
"""The kernels' integer arguments, never specialized by value (Triton would make a 1 a
compile-time constant and compile a kernel per such value)."""


@triton.jit
def mix64(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def words(step_ptr, part_ptr, seeded, stream, duplica, offs, l1, l2, l3, o0, o1, o2, o3, s0, s1, s2):
    # the draw's base (as counter_rng.uniform): (step, part, stream) mixed with the seed
    step = tl.load(step_ptr).to(tl.int64)
    part = tl.load(part_ptr).to(tl.int64) * 2 + duplica
    draw = ((step << 32) | ((part & 0xFFFF) << 16) | stream).to(tl.uint64)
    base = mix64(tl.full((), seeded, tl.int64).to(tl.uint64) + draw * 0x9E3779B97F4A7C15)
    # the element's index in the single-device tensor, from its local index (4 dims)
    i = offs.to(tl.int64)
    i3 = i % l3
    i = i // l3
    i2 = i % l2
    i = i // l2
    i1 = i % l1
    i0 = i // l1
    index = (i0 + o0) * s0 + (i1 + o1) * s1 + (i2 + o2) * s2 + (i3 + o3)
    return mix64(base + (index.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)


@triton.jit(do_not_specialize=SCALARS)
def uniform_kernel(out_ptr, step_ptr, part_ptr, seeded, stream, duplica, n,
                   l1, l2, l3, o0, o1, o2, o3, s0, s1, s2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    w = words(step_ptr, part_ptr, seeded, stream, duplica, offs, l1, l2, l3, o0, o1, o2, o3, s0, s1, s2)
    u = (w >> 40).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + offs, u, mask=keep)


@triton.jit(do_not_specialize=SCALARS)
def dropout_kernel(x_ptr, out_ptr, mask_ptr, step_ptr, part_ptr, seeded, stream, duplica, n, p, scale,
                   l1, l2, l3, o0, o1, o2, o3, s0, s1, s2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    w = words(step_ptr, part_ptr, seeded, stream, duplica, offs, l1, l2, l3, o0, o1, o2, o3, s0, s1, s2)
    u = (w >> 40).to(tl.float32) * (1.0 / 16777216.0)
    kept = u >= p
    x = tl.load(x_ptr + offs, mask=keep)
    y = tl.where(kept, x.to(tl.float32) * scale, 0.0)
    tl.store(out_ptr + offs, y.to(x.dtype), mask=keep)
    tl.store(mask_ptr + offs, kept.to(tl.int8), mask=keep)

