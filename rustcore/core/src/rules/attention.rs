//! `scaled_dot_product_attention(query, key, value, attn_mask?, …)` on `[B, H, S, D]`
//! (or any `[…, S, D]`) operands.
//!
//! - `"data-parallel"` (rank ≥ 3): split the batch (dim 0) of query, key and value (and of the mask
//!   when its dim 0 is not broadcast) → output split on dim 0.
//! - `"head-parallel"` (rank-4 operands): split the heads (dim 1) the same way → output
//!   split on dim 1.
//! - `"query-split"`: split the query sequence (dim `rank-2`) with key and value
//!   replicated → output split on that dim. Only without a mask and when not causal: a
//!   causal or masked slice of queries would need its row offset into the mask.
//!
//! With `dropout_p > 0` (training) the runtime runs the math attention with the
//! probabilities dropped by hapd's counter-based generator (`hapd/spmd/random/random_ops.py`,
//! `CounterAttention`): each rank draws its slice of the single-device probabilities, so
//! the same rules hold. The cost adds the draw (as a dropout's, per probability) and the
//! probabilities written and read again in memory, which a fused kernel never does.
//!
//! A key/value operand whose split dim has size 1 where the query's does not is
//! broadcast, so it stays replicated; any other size mismatch (grouped-query attention
//! with fewer key/value heads than query heads) is not split, since a rank's query heads
//! would not line up with its key/value heads. Attention is not linear in its
//! operands: no partial-sum rules.

use super::rule_names::{DATA_PARALLEL, HEAD_PARALLEL, QUERY_SPLIT};
use super::{by_name, gather, matmul_class, random, Family, OpCtx, Rule, I};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.scaled_dot_product_attention"],
    rules,
    flops,
    class: matmul_class,
    check_shapes,
};

/// The dim of an operand of `shape` (aligned from the right with a rank-`rank` tensor)
/// matching dim `d` of size `size`; `Ok(None)` when it is broadcast there (missing or
/// size 1), `Err` when it has another size.
fn aligned(shape: &[usize], rank: usize, d: usize, size: usize) -> Result<Option<usize>, ()> {
    let offset = rank.checked_sub(shape.len()).ok_or(())?;
    if d < offset {
        return Ok(None);
    }
    match shape[d - offset] {
        s if s == size => Ok(Some(d - offset)),
        1 => Ok(None),
        _ => Err(()),
    }
}

/// The layout of an operand for a split of dim `d` of size `size`.
fn layout_for(shape: &[usize], rank: usize, d: usize, size: usize) -> Option<Layout> {
    match aligned(shape, rank, d, size).ok()? {
        Some(dk) => gather(dk),
        None => Some(I),
    }
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(qi), Some(ki), Some(vi)) = (ctx.input_index("query"), ctx.input_index("key"), ctx.input_index("value"))
    else {
        return Vec::new();
    };
    let (q, k, v) = (ctx.in_shape(qi), ctx.in_shape(ki), ctx.in_shape(vi));
    let rank = q.len();
    if rank < 2 || k.len() != rank || v.len() != rank || ctx.out_shape(0).len() != rank {
        return Vec::new();
    }
    let mask = ctx.input_index("attn_mask").map(|m| ctx.in_shape(m));
    let is_causal = ctx.bool_arg("is_causal").unwrap_or(false);

    let mut rules = Vec::new();
    let mut split = |name: &'static str, d: usize| {
        let n = q[d];
        let (Some(gq), Some(lk), Some(lv)) = (gather(d), layout_for(k, rank, d, n), layout_for(v, rank, d, n)) else {
            return;
        };
        let mut named = vec![("query", gq), ("key", lk), ("value", lv)];
        if let Some(m) = mask {
            let Some(lm) = layout_for(m, rank, d, n) else { return };
            named.push(("attn_mask", lm));
        }
        rules.push(Rule { name, inputs: by_name(ctx, &named, I), outputs: vec![gq], work: Work::Sharded });
    };
    if rank >= 3 {
        split(DATA_PARALLEL, 0);
    }
    if rank == 4 {
        split(HEAD_PARALLEL, 1);
    }
    if !is_causal && mask.is_none() {
        if let Some(g) = gather(rank - 2) {
            rules.push(Rule {
                name: QUERY_SPLIT,
                inputs: by_name(ctx, &[("query", g)], I),
                outputs: vec![g],
                work: Work::Sharded,
            });
        }
    }
    rules
}

/// `Q·Kᵀ` and `P·V` (2 FLOPs per multiply-add each) plus scale, mask and softmax
/// (about 5 per score): `2·L·Sq·Sk·(D + Dv) + 5·L·Sq·Sk` with `L` the product of the
/// leading (batch, head) dims of the output; `4·B·H·Sq·Sk·D + 5·B·H·Sq·Sk` when
/// `D = Dv`. With dropout, [`DROPOUT_FLOPS_PER_SCORE`] more per score (the math
/// attention; [`fused_flops`] prices hapd's fused kernel).
fn flops(ctx: &OpCtx) -> f64 {
    match plain_flops_and_scores(ctx) {
        Some((plain, _)) => plain,
        None => ctx.out_numel(),
    }
}

/// The FLOPs a dropped attention adds to [`flops`] as the math attention runs it
/// ([`DROPOUT_FLOPS_PER_SCORE`] per score), priced at the element-wise rate
/// ([`crate::rules::OpRules::elementwise_flops`]); `None` without dropout.
pub fn dropout_flops(ctx: &OpCtx) -> Option<f64> {
    if !dropped(ctx) {
        return None;
    }
    let (_, scores) = plain_flops_and_scores(ctx)?;
    Some(DROPOUT_FLOPS_PER_SCORE * scores)
}

/// Whether the attention drops probabilities (`dropout_p > 0`: training).
fn dropped(ctx: &OpCtx) -> bool {
    ctx.float_arg("dropout_p").unwrap_or(0.0) > 0.0
}

/// `(FLOPs without dropout, scores)` of the attention ([`flops`]'s formula), `None`
/// when its operands are not the shapes it takes.
fn plain_flops_and_scores(ctx: &OpCtx) -> Option<(f64, f64)> {
    let (qi, ki, vi) = (ctx.input_index("query")?, ctx.input_index("key")?, ctx.input_index("value")?);
    let (q, k, v, out) = (ctx.in_shape(qi), ctx.in_shape(ki), ctx.in_shape(vi), ctx.out_shape(0));
    let rank = q.len();
    if rank < 2 || k.len() < 2 || v.is_empty() || out.len() < 2 {
        return None;
    }
    let lead = out[..out.len() - 2].iter().product::<usize>() as f64;
    let (sq, sk) = (q[rank - 2] as f64, k[k.len() - 2] as f64);
    let (d, dv) = (q[rank - 1] as f64, v[v.len() - 1] as f64);
    let scores = lead * sq * sk;
    Some((2.0 * scores * (d + dv) + 5.0 * scores, scores))
}

/// What a dropped probability costs beyond the fused kernel: the counter-based draw
/// (a dropout's [`random::FLOPS_PER_ELEMENT`]) and the unfused math attention's passes
/// over the materialized probabilities (scores written, softmax read and written, the
/// dropout read and written: about 6 element-wise passes, priced as FLOPs).
pub const DROPOUT_FLOPS_PER_SCORE: f64 = random::FLOPS_PER_ELEMENT + 6.0;

/// What a dropped probability costs in hapd's fused attention kernel
/// (`hapd/spmd/random/attention_kernels.py`), as forward FLOPs: the kernel keeps its
/// scores in registers (no pass over memory) but draws each score's keep decision
/// twice, once in the forward and once more in the backward to regenerate the mask it
/// did not keep: `2 ×` [`random::FLOPS_PER_ELEMENT`] per training step. The cost model
/// prices a training step as 3× an op's forward FLOPs ([`crate::cost::compute_row`]),
/// so the two draws are a third of that each forward: 12 FLOPs, half of the math
/// attention's [`DROPOUT_FLOPS_PER_SCORE`].
pub const FUSED_DROPOUT_FLOPS_PER_SCORE: f64 = 2.0 * random::FLOPS_PER_ELEMENT / 3.0;

/// The FLOPs a dropped attention adds to [`flops`] as hapd's fused kernel runs it:
/// [`FUSED_DROPOUT_FLOPS_PER_SCORE`] per score in place of the math attention's
/// [`DROPOUT_FLOPS_PER_SCORE`]; `None` for an attention without dropout (or of shapes
/// the formula does not take), which costs the same either way.
pub fn fused_dropout_flops(ctx: &OpCtx) -> Option<f64> {
    if !dropped(ctx) {
        return None;
    }
    let (_, scores) = plain_flops_and_scores(ctx)?;
    Some(FUSED_DROPOUT_FLOPS_PER_SCORE * scores)
}

/// Query, key and value have one rank ≥ 2; query and key agree on the feature dim, key
/// and value on the sequence.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let q = ctx.require_input(0)?;
    let k = ctx.require_input(1)?;
    let v = ctx.require_input(2)?;
    if q.rank() < 2 || k.rank() != q.rank() || v.rank() != q.rank() {
        return ctx.shape_error(format!("q {:?}, k {:?}, v {:?} must have one rank ≥ 2", q.shape, k.shape, v.shape));
    }
    let r = q.rank();
    if q.shape[r - 1] != k.shape[r - 1] || k.shape[r - 2] != v.shape[r - 2] {
        return ctx.shape_error(format!("q {:?}, k {:?}, v {:?} do not agree", q.shape, k.shape, v.shape));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, boolean, float, none, rules, A, A::T};
    use crate::rules::OpRules;

    fn sdpa(q: &'static [usize], kv: &'static [usize], mask: A, causal: bool) -> OpRules {
        sdpa_p(q, kv, mask, causal, 0.0)
    }

    fn sdpa_p(q: &'static [usize], kv: &'static [usize], mask: A, causal: bool, p: f64) -> OpRules {
        let args = vec![
            ("query", T(q)),
            ("key", T(kv)),
            ("value", T(kv)),
            ("attn_mask", mask),
            ("dropout_p", float(p)),
            ("is_causal", boolean(causal)),
            ("scale", none()),
            ("enable_gqa", boolean(false)),
        ];
        rules("aten.scaled_dot_product_attention", args, &[q])
    }

    const QKV: &[usize] = &[2, 4, 16, 8];

    #[test]
    fn batch_heads_and_queries() {
        let dp = "data-parallel G0,G0,G0 -> G0 sharded";
        let hp = "head-parallel G1,G1,G1 -> G1 sharded";
        assert_rules(&sdpa(QKV, QKV, none(), false), &[dp, hp, "query-split G2,I,I -> G2 sharded"]);
        assert_rules(&sdpa(QKV, QKV, none(), true), &[dp, hp]);
        // rank 3: no heads
        let qkv3: &'static [usize] = &[2, 16, 8];
        let qkv2: &'static [usize] = &[16, 8];
        assert_rules(&sdpa(qkv2, qkv2, none(), false), &["query-split G0,I,I -> G0 sharded"]);
        assert_rules(
            &sdpa(qkv3, qkv3, none(), false),
            &["data-parallel G0,G0,G0 -> G0 sharded", "query-split G1,I,I -> G1 sharded"],
        );
    }

    #[test]
    fn masks() {
        let cases: &[(&'static [usize], &[&str])] = &[
            // a per-batch mask broadcast over the heads
            (&[2, 1, 16, 16], &["data-parallel G0,G0,G0,G0 -> G0 sharded", "head-parallel G1,G1,G1,I -> G1 sharded"]),
            (&[2, 4, 16, 16], &["data-parallel G0,G0,G0,G0 -> G0 sharded", "head-parallel G1,G1,G1,G1 -> G1 sharded"]),
            // one mask for everything
            (&[16, 16], &["data-parallel G0,G0,G0,I -> G0 sharded", "head-parallel G1,G1,G1,I -> G1 sharded"]),
        ];
        for (mask, expected) in cases {
            assert_rules(&sdpa(QKV, QKV, T(mask), false), expected);
        }
    }

    #[test]
    fn grouped_query_attention_keeps_heads_whole() {
        let got = sdpa(QKV, &[2, 2, 16, 8], none(), true);
        assert_rules(&got, &["data-parallel G0,G0,G0 -> G0 sharded"]);
        // one key/value head is broadcast: replicate it
        let got = sdpa(QKV, &[2, 1, 16, 8], none(), true);
        assert_rules(&got, &["data-parallel G0,G0,G0 -> G0 sharded", "head-parallel G1,I,I -> G1 sharded"]);
    }

    #[test]
    fn flops_formula() {
        let got = sdpa(QKV, &[2, 4, 32, 8], none(), false);
        let (bh, sq, sk, d) = (8.0, 16.0, 32.0, 8.0);
        assert_eq!(got.flops, 4.0 * bh * sq * sk * d + 5.0 * bh * sq * sk);
        assert_eq!(got.class, crate::cost::WorkClass::Matmul);
    }

    #[test]
    fn dropout_keeps_the_rules_and_prices_the_draw() {
        let dp = "data-parallel G0,G0,G0 -> G0 sharded";
        let hp = "head-parallel G1,G1,G1 -> G1 sharded";
        let got = sdpa_p(QKV, QKV, none(), false, 0.1);
        assert_rules(&got, &[dp, hp, "query-split G2,I,I -> G2 sharded"]);
        let plain = sdpa(QKV, QKV, none(), false);
        assert_eq!(got.flops, plain.flops);
        assert_eq!(plain.elementwise_flops, 0.0);
        assert_eq!(got.elementwise_flops, super::DROPOUT_FLOPS_PER_SCORE * 8.0 * 16.0 * 16.0);
        assert_eq!(got.class, crate::cost::WorkClass::Matmul);
    }

    #[test]
    fn the_fused_kernel_prices_its_two_draws_only() {
        let scores = 8.0 * 16.0 * 16.0;
        let g = graph_p(0.1);
        let node = g.nodes.last().unwrap();
        let fused = crate::rules::fused_attention_flops(&g, node).expect("an attention with dropout");
        assert_eq!(fused, super::FUSED_DROPOUT_FLOPS_PER_SCORE * scores);
        assert!(fused < crate::rules::rules_for(&g, node).elementwise_flops);
        // without dropout the fused kernel and the math attention cost the same
        let g = graph_p(0.0);
        assert_eq!(crate::rules::fused_attention_flops(&g, g.nodes.last().unwrap()), None);
    }

    fn graph_p(p: f64) -> crate::ir::Graph {
        let args = vec![
            ("query", T(QKV)),
            ("key", T(QKV)),
            ("value", T(QKV)),
            ("attn_mask", none()),
            ("dropout_p", float(p)),
            ("is_causal", boolean(false)),
        ];
        crate::rules::testkit::graph("aten.scaled_dot_product_attention", args, &[(QKV, crate::ir::DType::F32)])
    }
}
