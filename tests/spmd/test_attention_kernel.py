"""The fused counter attention draws the math attention's dropout mask and computes its
output and gradients.

:mod:`hapd.spmd.random.attention_kernels` runs on CUDA; here it runs under Triton's
interpreter (``TRITON_INTERPRET=1``, in one subprocess: the variable must be set before
the kernels are defined, and Triton's import is paid once), on CPU tensors, against
:class:`hapd.spmd.random.random_ops.CounterAttention`'s math path (the fused kernels
switched off for the reference) and :func:`hapd.spmd.random.counter_rng.uniform`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hapd.spmd.random.attention_kernels import fused_attention, why_not
from hapd.spmd.random.random_ops import CounterAttention

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import contextlib
    from unittest import mock

    import torch
    from hapd.spmd.random import counter_kernels as ck
    from hapd.spmd.random.counter_rng import uniform
    from hapd.spmd.random.random_ops import CounterAttention

    assert ck.available(torch.zeros(1))
    SEED, STREAM = 2**63 + 12345, 7
    STEP, PART, DUPLICA = torch.tensor(5), torch.tensor(1), 1

    def module(p, shape, offsets, **kw):
        kw = {"is_causal": False, "scale": None, "enable_gqa": False, **kw}
        return CounterAttention(p, STREAM, shape, offsets, SEED, **kw)

    def fused_node(out):
        # the fused attention's autograd node under the reshape of its output, or None
        node = out.grad_fn
        while node is not None and "FusedAttention" not in type(node).__name__:
            node = node.next_functions[0][0] if node.next_functions else None
        return node

    def run(m, q, k, v, mask, grad, math):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        switch = mock.patch.object(ck, "available", lambda _x: False) if math else contextlib.nullcontext()
        with switch:
            out = m(*leaves, mask, STEP, PART, DUPLICA)
        assert (fused_node(out) is None) == math, "the path taken is not the one asked for"
        grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
        return [out.detach(), *grads]

    def errors(got, want):
        return [float((g.float() - w.float()).abs().max()) for g, w in zip(got, want)]

    torch.manual_seed(0)

    # (a) the keep mask is the math path's, bit for bit, whole and in pieces: with v the
    # identity the output is the dropped probabilities, nonzero exactly where kept
    B, H, SQ, SK, P = 2, 2, 40, 32, 0.5
    q, k = torch.randn(B, H, SQ, 32), torch.randn(B, H, SK, 32)
    eye = torch.eye(SK).expand(B, H, SK, SK)
    whole = module(P, [B, H, SQ, SK], [0, 0, 0, 0])(q, k, eye, None, STEP, PART, DUPLICA)
    want = uniform(SEED, STREAM, STEP, [B, H, SQ, SK], [0, 0, 0, 0], [B, H, SQ, SK], part=PART * 2 + DUPLICA) >= P
    assert torch.equal(whole != 0, want) and 0.4 < float(want.float().mean()) < 0.6
    for offsets, piece in (((1, 0, 0, 0), (slice(1, 2),)), ((0, 1, 0, 0), (slice(None), slice(1, 2))),
                           ((0, 0, 24, 0), (slice(None), slice(None), slice(24, 40)))):
        got = module(P, [B, H, SQ, SK], list(offsets))(q[piece], k[piece[:2]], eye[piece[:2]], None,
                                                       STEP, PART, DUPLICA)
        assert torch.equal(got != 0, want[piece]), offsets
        assert float((got - whole[piece]).abs().max()) < 1e-6, offsets
    print("masks equal")

    # (b) fp32 outputs and gradients against the math path
    def case(name, p=0.1, b=2, h=2, hkv=None, sq=48, sk=48, d=32, mask=None, offsets=None, global_shape=None,
             transposed=False, dims=4, **kw):
        hkv = hkv or h
        q = torch.randn(b, sq, h, d).transpose(1, 2) if transposed else torch.randn(b, h, sq, d)
        k, v = torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
        if dims == 3:
            q, k, v = q[0], k[0], v[0]
        shape = global_shape or [*q.shape[:-1], sk]
        m = module(p, shape, offsets or [0] * len(shape), **kw)
        grad = torch.randn(*q.shape[:-1], d)
        return name, m, q, k, v, mask, grad

    S = 48
    blocks = torch.zeros(S, S, dtype=torch.bool)
    blocks[:20, :20] = True
    blocks[20:, 20:] = True
    blocks[30] = False  # a row with every key masked
    cases = [
        case("no mask"),
        case("causal", is_causal=True),
        case("causal, p=0", p=0.0, is_causal=True),
        case("bool mask, custom scale", mask=torch.rand(2, 1, S, S) > 0.3, scale=0.3),
        case("additive mask", mask=torch.randn(1, 2, S, S)),
        case("block-diagonal", mask=blocks),
        case("gqa, transposed q", h=4, hkv=2, transposed=True, enable_gqa=True),
        case("head dim 80, 3 dims, keys > queries", dims=3, d=80, sq=24, sk=40, is_causal=True),
        case("a piece of the queries", sq=24, global_shape=[2, 2, 72, 48], offsets=[0, 0, 40, 0]),
    ]
    worst = [0.0] * 4
    for name, m, q, k, v, mask, grad in cases:
        got, want = run(m, q, k, v, mask, grad, math=False), run(m, q, k, v, mask, grad, math=True)
        err = errors(got, want)
        assert max(err) < 1e-5, (name, err)
        assert all(torch.isfinite(t).all() for t in got), name
        worst = [max(w, e) for w, e in zip(worst, err)]
    name, m, q, k, v, mask, grad = cases[5]
    out, gq = run(m, q, k, v, mask, grad, math=False)[:2]
    assert torch.equal(out[:, :, 30], torch.zeros_like(out[:, :, 30])) and not gq[:, :, 30].any()
    print("fp32 max errors out/dq/dk/dv", " ".join(f"{e:.3g}" for e in worst))

    # (c) bf16 and fp16 against the fp32 math path on the same (rounded) inputs
    for dtype in (torch.bfloat16, torch.float16):
        for name, m, q, k, v, mask, grad in (cases[5], cases[6]):
            low = [t.to(dtype) for t in (q, k, v)]
            got = run(m, *low, mask, grad, math=False)
            want = run(m, *[t.float() for t in low], mask, grad, math=True)
            assert all(t.dtype == dtype and torch.isfinite(t).all() for t in got), (dtype, name)
            err = errors(got, want)
            scale = [max(1.0, float(w.abs().max())) for w in want]
            assert all(e < 2e-2 * s for e, s in zip(err, scale)), (dtype, name, err)
            print(f"{dtype} {name} errors out/dq/dk/dv", " ".join(f"{e:.3g}" for e in err))

    # (d) the backward keeps no mask: the node holds q, k, v, the output, the log-sum-exp,
    # the mask it was given, the step and the part
    name, m, q, k, v, mask, grad = cases[5]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = m(*leaves, mask, STEP, PART, DUPLICA)
    saved = fused_node(out).saved_tensors
    inputs = {t.data_ptr() for t in (*leaves, mask)}
    own = [t for t in saved if t.data_ptr() not in inputs]
    assert sorted(tuple(t.shape) for t in own) == sorted([(), (), (2, 2, S), (2, 2, S, 32)]), \\
        [tuple(t.shape) for t in own]
    assert len(saved) == 8 and sum(t.data_ptr() in inputs for t in saved) == 4

    # a head dim the kernels do not take: the math path
    name, m, q, k, v, mask, grad = case("head dim 8", d=8)
    out = m(q, k, v, None, STEP, PART, DUPLICA)
    assert fused_node(out) is None and out.shape == (2, 2, 48, 8)
    print("fused attention equal")
""")


def test_fused_attention_draws_and_computes_the_math_path() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "masks equal" in done.stdout and "fused attention equal" in done.stdout
    print(done.stdout)


def test_calls_the_kernels_do_not_take_are_told_apart() -> None:
    q, k, v = (torch.zeros(2, 2, 8, 32) for _ in range(3))
    shape, at = [2, 2, 8, 8], [0, 0, 0, 0]
    assert why_not(q, k, v, None, enable_gqa=False, global_shape=shape, offsets=at) is None
    assert "head dims" in why_not(q[..., :8], k[..., :8], v[..., :8], None, enable_gqa=False, global_shape=shape,
                                  offsets=at)
    five = q.reshape(1, 2, 2, 8, 32)
    assert "dims" in why_not(five, five, five, None, enable_gqa=False, global_shape=[1, *shape], offsets=[0, *at])
    three = torch.zeros(2, 3, 8, 32)
    assert "heads" in why_not(q, three, three, None, enable_gqa=True, global_shape=shape, offsets=at)
    assert "mask of torch.int64" in why_not(q, k, v, torch.ones(8, 8, dtype=torch.int64), enable_gqa=False,
                                            global_shape=shape, offsets=at)
    assert "not inside" in why_not(q, k, v, None, enable_gqa=False, global_shape=shape, offsets=[1, 0, 0, 0])
    assert "grows" in why_not(q[:1], k[:1], v[:1], torch.zeros(2, 2, 8, 8), enable_gqa=False,
                              global_shape=[1, 2, 8, 8], offsets=at)


def test_cpu_tensors_take_the_math_path() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernels on CPU tensors")
    q = torch.randn(1, 2, 8, 32, requires_grad=True)
    kw = dict(p=0.1, is_causal=False, scale=None, enable_gqa=False, seed=1, stream=0, step=0, part=0, duplica=0,
              global_shape=[1, 2, 8, 8], offsets=[0, 0, 0, 0])
    assert fused_attention(q, q, q, None, **kw) is None
    m = CounterAttention(0.1, 0, [1, 2, 8, 8], [0, 0, 0, 0], 1, is_causal=False, scale=None, enable_gqa=False)
    out = m(q, q, q, None, torch.tensor(0), torch.tensor(0))
    assert "Fused" not in type(out.grad_fn).__name__ and out.shape == (1, 2, 8, 32)
