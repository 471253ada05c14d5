"""The Triton kernels of :mod:`hapd.spmd.random.attention_kernels` (imported only where
Triton is installed and a kernel is about to run; Triton's ``jit`` needs its kernels and
the functions they call at module level).

A flash attention (Dao et al., "FlashAttention", NeurIPS 2022; the backward of
FlashAttention-2) whose dropout is hapd's counter-based draw: a program holds a tile of
queries, walks the keys tile by tile with an online softmax in fp32 and keeps only each
row's log-sum-exp, so no ``queries × keys`` tensor is ever written. The keep decision of
score ``(b, h, i, j)`` is SplitMix64's word at that score's linear index in the
single-device probabilities (:func:`hapd.spmd.random.counter_triton.mix64`, the bits of
:func:`hapd.spmd.random.counter_rng.uniform`), so the backward draws the mask again
instead of storing it, and a rank's piece draws its slice of the single-device mask.

Two backward kernels, each recomputing the probabilities from the log-sum-exp: one per
key tile (``dk``, ``dv``: it walks the queries of every head of its group, so grouped
heads sum without atomics) and one per query tile (``dq``).
"""

import triton
import triton.language as tl

from hapd.spmd.random.counter_triton import mix64

SCALARS = ["seeded", "stream", "duplica", "o0", "o1", "o2", "o3", "s0", "s1", "s2"]
"""The draw's integer arguments, never specialized by value (Triton would compile a
kernel per value of a seed or an offset that happens to be 1 or a multiple of 16)."""


@triton.jit
def draw_base(step_ptr, part_ptr, seeded, stream, duplica):
    # the draw's base, as counter_rng.uniform: (step, part·2 + duplica, stream) mixed with the seed
    step = tl.load(step_ptr).to(tl.int64)
    part = tl.load(part_ptr).to(tl.int64) * 2 + duplica
    draw = ((step << 32) | ((part & 0xFFFF) << 16) | stream).to(tl.uint64)
    return mix64(tl.full((), seeded, tl.int64).to(tl.uint64) + draw * 0x9E3779B97F4A7C15)


@triton.jit
def row_index(b, h, rows, o0, o1, o2, o3, s0, s1, s2):
    # the single-device linear index of score (b, h, row, 0): offsets added, global strides
    return ((b.to(tl.int64) + o0) * s0 + (h.to(tl.int64) + o1) * s1 + (rows.to(tl.int64) + o2) * s2
            + o3.to(tl.int64))


@triton.jit
def keeps(base, first, cols, p):
    # whether each score of the tile survives dropout: its uniform (top 24 bits) >= p
    index = (first[:, None] + cols[None, :].to(tl.int64)).to(tl.uint64)
    w = mix64(base + (index + 1) * 0x9E3779B97F4A7C15)
    return (w >> 40).to(tl.float32) * (1.0 / 16777216.0) >= p


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    # a·b accumulated in fp32; "widened": both sides in fp32 first (Triton's interpreter
    # multiplies bf16 operands as their raw 16-bit integers; widening gives the products
    # of a bf16 tensor core, which are exact in fp32)
    if PRECISION == "widened":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def scores(q, k_t, scale, rows, cols, SQ, SK, mask_ptr, smm, smn,
           CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr):
    # q·kᵀ·scale in fp32 with the math attention's masks: causal (the local triangle),
    # then a bool mask (-inf where false) or an additive one; keys past the end -inf
    s = dot(q, k_t, PRECISION) * scale
    live = cols[None, :] < SK
    if CAUSAL:
        live = live & (cols[None, :] <= rows[:, None])
    inside = (rows[:, None] < SQ) & (cols[None, :] < SK)
    if MASK_KIND == 1:
        allowed = tl.load(mask_ptr + rows[:, None] * smm + cols[None, :] * smn, mask=inside, other=0)
        live = live & (allowed != 0)
    s = tl.where(live, s, float("-inf"))
    if MASK_KIND == 2:
        s = s + tl.load(mask_ptr + rows[:, None] * smm + cols[None, :] * smn, mask=inside, other=0.0).to(tl.float32)
    return s


@triton.jit
def forward_tile(q, k_base, v_base, mask_ptr, start_n, rows, acc, m_i, l_i, base, first,
                 skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p,
                 CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # one key tile of the online softmax: the running max, the sum of the undropped
    # probabilities (the softmax's), and the dropped ones times v
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_t = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                  mask=(cols[None, :] < SK) & (offs_d[:, None] < D), other=0.0)
    s = scores(q, k_t, scale, rows, cols, SQ, SK, mask_ptr, smm, smn, CAUSAL, MASK_KIND, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: exp(-inf) = 0, no NaN
    alpha = tl.exp(m_i - m_safe)
    probs = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(probs, 1)
    if DROPOUT:
        probs = tl.where(keeps(base, first, cols, p), probs, 0.0)
    v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :] * svd,
                mask=(cols[:, None] < SK) & (offs_dv[None, :] < DV), other=0.0)
    acc = acc * alpha[:, None] + dot(probs.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=SCALARS)
def attention_fwd(Q, K, V, O, LSE, MASK, STEP, PART,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                  smb, smh, smm, smn,
                  H, SQ, SK, D, DV, scale, p, drop_scale,
                  seeded, stream, duplica, o0, o1, o2, o3, s0, s1, s2,
                  GROUP: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                  PRECISION: tl.constexpr, STATIC_SQ: tl.constexpr, STATIC_SK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                mask=(rows[:, None] < SQ) & (offs_d[None, :] < D), other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    mask_ptr = MASK + b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    base = draw_base(STEP, PART, seeded, stream, duplica)
    first = row_index(b, h, rows, o0, o1, o2, o3, s0, s1, s2)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, start_m + BLOCK_M)  # keys past the tile's last query are all masked
    if STATIC_SK:  # the interpreter (its loops need bounds known when written): the tiles past hi skipped
        for start_n in range(0, STATIC_SK, BLOCK_N):
            if start_n < hi:
                acc, m_i, l_i = forward_tile(q, k_base, v_base, mask_ptr, start_n, rows, acc, m_i, l_i, base, first,
                                             skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p, CAUSAL,
                                             MASK_KIND, DROPOUT, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        for start_n in range(0, hi, BLOCK_N):
            acc, m_i, l_i = forward_tile(q, k_base, v_base, mask_ptr, start_n, rows, acc, m_i, l_i, base, first,
                                         skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p, CAUSAL,
                                         MASK_KIND, DROPOUT, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
    alive = l_i > 0.0  # a row with every key masked: output 0, log-sum-exp +inf (its probabilities 0)
    out = acc * tl.where(alive, drop_scale / tl.where(alive, l_i, 1.0), 0.0)[:, None]
    lse = tl.where(alive, m_i + tl.log(tl.where(alive, l_i, 1.0)), float("inf"))
    tl.store(O + b * sob + h * soh + rows[:, None] * som + offs_dv[None, :] * sod, out.to(O.dtype.element_ty),
             mask=(rows[:, None] < SQ) & (offs_dv[None, :] < DV))
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, lse, mask=rows < SQ)


@triton.jit
def dropped_grads(q, k_t, v_t, do, lse, delta, scale, rows, cols, SQ, SK, mask_ptr, smm, smn,
                  base, first, p, drop_scale,
                  CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    # (probabilities dropped and scaled, dS) of a tile, its mask drawn again: P from the
    # log-sum-exp, dP = Z·c·(dO·vᵀ), dS = P ∘ (dP − rowsum(dO ∘ O))
    s = scores(q, k_t, scale, rows, cols, SQ, SK, mask_ptr, smm, smn, CAUSAL, MASK_KIND, PRECISION)
    probs = tl.exp(s - lse[:, None])
    dp = dot(do, v_t, PRECISION) * drop_scale
    dropped = probs * drop_scale
    if DROPOUT:
        kept = keeps(base, first, cols, p)
        dp = tl.where(kept, dp, 0.0)
        dropped = tl.where(kept, dropped, 0.0)
    return dropped, probs * (dp - delta[:, None])


@triton.jit
def dkdv_tile(Q, DO, LSE, DELTA, mask_ptr, k_t, v_t, dk, dv, b, h, start_m, cols, base,
              sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, smm, smn, H, SQ, SK, D, DV, scale, p, drop_scale,
              o0, o1, o2, o3, s0, s1, s2,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # one query tile's share of a key tile's dk (unscaled) and dv
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    live_rows = rows < SQ
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                mask=live_rows[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_dv[None, :] * sdd,
                 mask=live_rows[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + (b * H + h) * SQ + rows, mask=live_rows, other=float("inf"))
    delta = tl.load(DELTA + (b * H + h) * SQ + rows, mask=live_rows, other=0.0)
    first = row_index(b, h, rows, o0, o1, o2, o3, s0, s1, s2)
    dropped, ds = dropped_grads(q, k_t, v_t, do, lse, delta, scale, rows, cols, SQ, SK, mask_ptr, smm, smn,
                                base, first, p, drop_scale, CAUSAL, MASK_KIND, DROPOUT, PRECISION)
    dv += dot(tl.trans(dropped.to(do.dtype)), do, PRECISION)
    dk += dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=SCALARS)
def attention_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV_, MASK, STEP, PART,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                       sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, smb, smh, smm, smn,
                       H, HKV, SQ, SK, D, DV, scale, p, drop_scale,
                       seeded, stream, duplica, o0, o1, o2, o3, s0, s1, s2,
                       GROUP: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                       PRECISION: tl.constexpr, STATIC_SQ: tl.constexpr, STATIC_SK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    hk = (bhk % HKV).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd,
                mask=(cols[:, None] < SK) & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_dv[None, :] * svd,
                mask=(cols[:, None] < SK) & (offs_dv[None, :] < DV), other=0.0)
    k_t = tl.trans(k)
    v_t = tl.trans(v)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    base = draw_base(STEP, PART, seeded, stream, duplica)
    lo = start_n * 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # the queries before the tile's first key see none of it
    for g in range(0, GROUP):  # the query heads that read this key head: their sum, no atomics
        h = hk * GROUP + g
        mask_ptr = MASK + b * smb + h * smh
        if STATIC_SQ:  # the interpreter: bounds known when written, the tiles before lo skipped
            for start_m in range(0, STATIC_SQ, BLOCK_M):
                if start_m >= lo:
                    dk, dv = dkdv_tile(Q, DO, LSE, DELTA, mask_ptr, k_t, v_t, dk, dv, b, h, start_m, cols, base,
                                       sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, smm, smn, H, SQ, SK, D, DV, scale, p,
                                       drop_scale, o0, o1, o2, o3, s0, s1, s2, CAUSAL, MASK_KIND, DROPOUT, PRECISION,
                                       BLOCK_M, BLOCK_D, BLOCK_DV)
        else:
            for start_m in range(lo, SQ, BLOCK_M):
                dk, dv = dkdv_tile(Q, DO, LSE, DELTA, mask_ptr, k_t, v_t, dk, dv, b, h, start_m, cols, base,
                                   sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, smm, smn, H, SQ, SK, D, DV, scale, p,
                                   drop_scale, o0, o1, o2, o3, s0, s1, s2, CAUSAL, MASK_KIND, DROPOUT, PRECISION,
                                   BLOCK_M, BLOCK_D, BLOCK_DV)
    dk = dk * scale
    tl.store(DK + b * sdkb + hk * sdkh + cols[:, None] * sdkn + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
             mask=(cols[:, None] < SK) & (offs_d[None, :] < D))
    tl.store(DV_ + b * sdvb + hk * sdvh + cols[:, None] * sdvn + offs_dv[None, :] * sdvd,
             dv.to(DV_.dtype.element_ty), mask=(cols[:, None] < SK) & (offs_dv[None, :] < DV))


@triton.jit
def dq_tile(q, do, lse, delta, k_base, v_base, mask_ptr, dq, start_n, rows, base, first,
            skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p, drop_scale,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # one key tile's share of a query tile's dq (unscaled)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd,
                mask=(cols[:, None] < SK) & (offs_d[None, :] < D), other=0.0)
    v_t = tl.load(v_base + cols[None, :] * svn + offs_dv[:, None] * svd,
                  mask=(cols[None, :] < SK) & (offs_dv[:, None] < DV), other=0.0)
    _, ds = dropped_grads(q, tl.trans(k), v_t, do, lse, delta, scale, rows, cols, SQ, SK, mask_ptr, smm, smn,
                          base, first, p, drop_scale, CAUSAL, MASK_KIND, DROPOUT, PRECISION)
    return dq + dot(ds.to(k.dtype), k, PRECISION)


@triton.jit(do_not_specialize=SCALARS)
def attention_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, MASK, STEP, PART,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                     sdqb, sdqh, sdqm, sdqd, smb, smh, smm, smn,
                     H, SQ, SK, D, DV, scale, p, drop_scale,
                     seeded, stream, duplica, o0, o1, o2, o3, s0, s1, s2,
                     GROUP: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                     PRECISION: tl.constexpr, STATIC_SQ: tl.constexpr, STATIC_SK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    live_rows = rows < SQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                mask=live_rows[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_dv[None, :] * sdd,
                 mask=live_rows[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=live_rows, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=live_rows, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    mask_ptr = MASK + b * smb + h * smh
    base = draw_base(STEP, PART, seeded, stream, duplica)
    first = row_index(b, h, rows, o0, o1, o2, o3, s0, s1, s2)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, start_m + BLOCK_M)
    if STATIC_SK:
        for start_n in range(0, STATIC_SK, BLOCK_N):
            if start_n < hi:
                dq = dq_tile(q, do, lse, delta, k_base, v_base, mask_ptr, dq, start_n, rows, base, first,
                             skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p, drop_scale, CAUSAL, MASK_KIND,
                             DROPOUT, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        for start_n in range(0, hi, BLOCK_N):
            dq = dq_tile(q, do, lse, delta, k_base, v_base, mask_ptr, dq, start_n, rows, base, first,
                         skn, skd, svn, svd, smm, smn, SQ, SK, D, DV, scale, p, drop_scale, CAUSAL, MASK_KIND,
                         DROPOUT, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
    dq = dq * scale
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqm + offs_d[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=live_rows[:, None] & (offs_d[None, :] < D))
