//! `softmax` and `log_softmax` along one dim: every other dim splits freely. They are
//! not linear, so a partial-sum input has no rule.

use super::rule_names::SHARDED;
use super::{check_same_shape, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;

pub const FAMILY: Family = Family {
    ops: &["aten.softmax.int", "aten.log_softmax.int"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes: check_same_shape,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let rank = ctx.in_shape(0).len();
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let Some(dim) = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, rank)) else { return Vec::new() };
    (0..rank).filter(|&d| d != dim).filter_map(gather).map(|g| ctx.uniform(SHARDED, g, g, Work::Sharded)).collect()
}

/// Max, subtract, exp, sum, divide (or log): about 5 FLOPs per element.
fn flops(ctx: &OpCtx) -> f64 {
    5.0 * ctx.out_numel()
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, int, none, rules, A::T};

    #[test]
    fn splits_every_dim_but_the_normalized_one() {
        let cases: &[(&str, i64, &[&str])] = &[
            ("aten.softmax.int", -1, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded"]),
            ("aten.softmax.int", 1, &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded"]),
            ("aten.log_softmax.int", 0, &["sharded G1 -> G1 sharded", "sharded G2 -> G2 sharded"]),
        ];
        for (op, dim, expected) in cases {
            let got = rules(op, vec![("self", T(&[2, 16, 4])), ("dim", int(*dim)), ("dtype", none())], &[&[2, 16, 4]]);
            assert_rules(&got, expected);
            assert_eq!(got.flops, 5.0 * 128.0);
        }
    }

    #[test]
    fn bad_dim_gives_replicated_only() {
        let got = rules("aten.softmax.int", vec![("self", T(&[2, 4])), ("dim", int(5))], &[&[2, 4]]);
        assert_rules(&got, &[]);
    }
}
