"""The fused Triton draw gives the bits of the torch-op draw.

:mod:`hapd.spmd.random.counter_kernels` runs on CUDA; here it runs under Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable must be set before the
kernels are defined), on CPU tensors, against :func:`hapd.spmd.random.counter_rng.uniform`
and :class:`hapd.spmd.random.random_ops.CounterDropout`'s torch ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hapd.spmd.random.counter_kernels import MAX_DIMS, merged_dims

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import torch
    from hapd.spmd.random import counter_kernels as ck
    from hapd.spmd.random.counter_rng import uniform
    from hapd.spmd.random.random_ops import CounterDropout

    cpu = torch.device("cpu")
    assert ck.available(torch.zeros(1))
    pieces = [((7, 5, 3), (2, 0, 0), (3, 5, 3)), ((4, 9), (0, 5), (4, 4)), ((4, 9), (0, 5), (4, 0)),
              ((2, 3, 4, 5, 6), (0, 1, 0, 0, 0), (2, 2, 4, 5, 6)), ((6,), (0,), (6,)),
              ((3, 4, 5, 6, 7, 8), (1, 1, 1, 0, 0, 0), (1, 1, 1, 6, 7, 8)), ((2, 3, 5), (1, 1, 2), (1, 2, 3))]
    for seed in (0, 1, 12345678901234, 2**64 - 1):
        for step, part, duplica in ((0, 0, 0), (3, 1, 1), (2**31 + 5, 7, 0)):
            for g, o, l in pieces:
                st, pt = torch.tensor(step), torch.tensor(part)
                want = uniform(seed, 5, st, g, o, l, part=pt * 2 + duplica)
                got = ck.fused_uniform(seed, 5, st, pt, duplica, g, o, l, cpu)
                assert got is not None and torch.equal(got, want), (seed, step, g, o, l)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 6, 8, dtype=dtype, requires_grad=True)
        module = CounterDropout(0.3, True, 2, (10, 6, 8), (3, 0, 0), 99)
        st, pt = torch.tensor(2), torch.tensor(1)
        out, mask = module(x, st, pt, 1)  # the fused kernel
        u = uniform(99, 2, st, (10, 6, 8), (3, 0, 0), (4, 6, 8), part=pt * 2 + 1)
        assert torch.equal(mask, u >= 0.3) and 0.5 < float(mask.float().mean()) < 0.9
        expected = torch.where(u >= 0.3, x.detach() * (1 / 0.7), 0.0)
        # fp32 -> bf16 rounds to nearest even on a GPU (and in torch); Triton's
        # interpreter truncates: the fp32 product truncated is what it must give
        wide = torch.where(u >= 0.3, x.detach().float() * (1 / 0.7), 0.0)
        truncated = (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
        assert out.dtype == dtype
        assert torch.equal(out, expected) or (dtype == torch.bfloat16 and torch.equal(out, truncated))
        grad = torch.randn_like(x)
        out.backward(grad)
        assert torch.equal(x.grad, torch.where(u >= 0.3, grad * (1 / 0.7), 0.0))
    print("fused draws equal")
""")


def test_fused_kernels_draw_the_torch_ops_bits() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fused draws equal" in done.stdout


def test_pieces_merge_their_whole_dims() -> None:
    rows = 12 * 1024 * 1024  # a batch split: one dim, the rows before it skipped
    assert merged_dims((8, 12, 1024, 1024), (2, 0, 0, 0), (3, 12, 1024, 1024)) == \
        ([1, 1, 1, 8 * rows], [0, 0, 0, 2 * rows], [1, 1, 1, 3 * rows])
    assert merged_dims((8, 12, 1024, 64), (0, 4, 0, 0), (8, 4, 1024, 64)) == \
        ([1, 1, 8, 12 * 1024 * 64], [0, 0, 0, 4 * 1024 * 64], [1, 1, 8, 4 * 1024 * 64])
    assert merged_dims((4, 9), (0, 5), (4, 4)) == ([1, 1, 4, 9], [0, 0, 0, 5], [1, 1, 4, 4])
    assert merged_dims((2,) * (MAX_DIMS + 1), (1,) * (MAX_DIMS + 1), (1,) * (MAX_DIMS + 1)) is None


def test_cpu_tensors_take_the_torch_ops() -> None:
    import torch

    from hapd.spmd.random.counter_kernels import available

    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not available(torch.zeros(3))
