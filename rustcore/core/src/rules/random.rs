//! Random ops whose pieces draw exactly the single-device values.
//!
//! `aten.native_dropout(x, p, train) -> (result, mask)` (and `aten.dropout`, one
//! result, should it survive normalization), `aten.bernoulli(probabilities)`,
//! `aten.bernoulli.p(x, p)` (stochastic depth's `empty(…).bernoulli_(p)`, functionalized),
//! `aten.rand_like(x)` and `aten.randn_like(x)` run on each rank with hapd's counter-based
//! generator (`hapd/spmd/random/counter_rng.py`): every element's keep decision is a pure
//! function of the seed, the op's stream (its position among the program's random
//! ops), the training step and the element's linear index in the single-device
//! tensor. A rank draws only its slice, and the slices are the single-device draw, so
//! these ops split like element-wise ones: `Gather(d)` in gives the same `Gather(d)` for
//! every result (a dropout's mask included). There is no partial-sum rule: dropout is
//! linear in `x` for a fixed mask, but the runtime keeps the rule set to the one the
//! exactness tests cover.
//!
//! Random ops made from a size alone (`rand`, `randn`, `randint`, …) and anything else
//! torch tags `nondeterministic_seeded` stay opaque: the runtime draws them with
//! torch's generator, whose pieces would not be the single-device values.

use super::rule_names::SHARDED;
use super::{check_same_shape, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.native_dropout",
        "aten.dropout",
        "aten.bernoulli",
        "aten.bernoulli.p",
        "aten.rand_like",
        "aten.randn_like",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

/// FLOPs per element: the draw (SplitMix64 over the element's index: about 15 integer
/// ops, `hapd/spmd/random/counter_rng.py`), the comparison and the scaled product.
pub const FLOPS_PER_ELEMENT: f64 = 18.0;

/// FLOPs per element of `randn_like`: two draws and the Box–Muller transform (a log,
/// a square root and a cosine, about 10 more).
const NORMAL_FLOPS_PER_ELEMENT: f64 = 2.0 * FLOPS_PER_ELEMENT + 10.0;

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let shape = ctx.in_shape(0);
    (0..shape.len())
        .filter(|&d| shape[d] > 1)
        .filter_map(gather)
        .map(|g| ctx.uniform(SHARDED, g, g, Work::Sharded))
        .collect()
}

fn flops(ctx: &OpCtx) -> f64 {
    let per = if ctx.op() == "aten.randn_like" { NORMAL_FLOPS_PER_ELEMENT } else { FLOPS_PER_ELEMENT };
    per * ctx.out_numel()
}

/// The result (and the mask) keep the input's shape.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    check_same_shape(ctx)
}

#[cfg(test)]
mod tests {
    use crate::ir::{DType, TAG_POINTWISE, TAG_RANDOM};
    use crate::rules::testkit::{assert_rules, boolean, float, graph, rules, tagged, A::T};
    use crate::rules::{rules_for, FAMILIES};

    fn dropout(shape: &'static [usize]) -> Vec<(&'static str, crate::rules::testkit::A)> {
        vec![("input", T(shape)), ("p", float(0.1)), ("train", boolean(true))]
    }

    #[test]
    fn dropout_splits_every_dim_for_result_and_mask() {
        let outs: &[(&[usize], DType)] = &[(&[4, 1, 8], DType::F32), (&[4, 1, 8], DType::Bool)];
        let g = graph("aten.native_dropout", dropout(&[4, 1, 8]), outs);
        let got = rules_for(&g, g.nodes.last().unwrap());
        assert_rules(&got, &["sharded G0 -> G0,G0 sharded", "sharded G2 -> G2,G2 sharded"]);
        assert_eq!(got.flops, 18.0 * 32.0);
        let single = rules("aten.dropout", dropout(&[2, 3]), &[&[2, 3]]);
        assert_rules(&single, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded"]);
    }

    #[test]
    fn bernoulli_and_like_draws_split_every_dim() {
        for (op, args) in [
            ("aten.bernoulli", vec![("input", T(&[4, 1, 8]))]),
            ("aten.bernoulli.p", vec![("input", T(&[4, 1, 8])), ("p", float(0.8))]),
            ("aten.rand_like", vec![("input", T(&[4, 1, 8]))]),
            ("aten.randn_like", vec![("input", T(&[4, 1, 8]))]),
        ] {
            let got = rules(op, args, &[&[4, 1, 8]]);
            assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded"]);
            let per = if op == "aten.randn_like" { super::NORMAL_FLOPS_PER_ELEMENT } else { 18.0 };
            assert_eq!(got.flops, per * 32.0, "{op}");
        }
    }

    #[test]
    fn no_partial_sum_rule() {
        let g = graph("aten.native_dropout", dropout(&[4, 8]), &[(&[4, 8], DType::F32), (&[4, 8], DType::Bool)]);
        let got = rules_for(&g, g.nodes.last().unwrap());
        assert!(got.rules.iter().all(|r| !r.inputs.contains(&crate::layout::Layout::Reduce)));
    }

    #[test]
    fn torch_tags_do_not_change_the_family() {
        // lowering tags native_dropout nondeterministic_seeded: the family is by name
        let tags = &[TAG_POINTWISE, TAG_RANDOM][..];
        let g = tagged("aten.native_dropout", dropout(&[4, 8]), &[(&[4, 8], DType::F32), (&[4, 8], DType::Bool)], tags);
        let got = rules_for(&g, g.nodes.last().unwrap());
        assert_rules(&got, &["sharded G0 -> G0,G0 sharded", "sharded G1 -> G1,G1 sharded"]);
        assert_eq!(FAMILIES.iter().filter(|f| f.ops.contains(&"aten.native_dropout")).count(), 1);
    }
}
