//! `sum` and `mean`, over some dims (`sum.dim_IntList`, `mean.dim`) or all of them
//! (`sum`, `mean`, or a `dim` list that is `None` or empty).
//!
//! - A split dim that is reduced leaves each rank with a partial result: `Gather(d) →
//!   Reduce`. For `sum` that is exact (`"sharded-sum"`). For `mean` (`"sharded-mean"`)
//!   each rank's local mean is over its own slice only; the runtime rescales it by
//!   `local length / global length` of dim `d` (a rank with an empty slice contributes
//!   zero), after which the ranks' values sum to the true mean.
//! - A split dim that is kept stays split, renumbered past the reduced dims before it
//!   when `keepdim` is false.
//! - Both ops are linear, so a partial-sum input gives a partial-sum output
//!   (`"partial"`).

use super::rule_names::{PARTIAL, SHARDED, SHARDED_MEAN, SHARDED_SUM};
use super::{elementwise_class, gather, no_shape_checks, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::ir::Value;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.sum.dim_IntList", "aten.sum", "aten.mean.dim", "aten.mean"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes: no_shape_checks,
};

/// Which of the `rank` input dims are reduced, and `keepdim`; `None` when a listed dim
/// is out of range.
fn reduced_dims(ctx: &OpCtx, rank: usize) -> Option<(Vec<bool>, bool)> {
    let all = (vec![true; rank], false);
    match ctx.op() {
        "aten.sum" | "aten.mean" => Some(all),
        _ => {
            let keepdim = ctx.bool_arg("keepdim").unwrap_or(false);
            let dims = match ctx.arg("dim") {
                None | Some(Value::None(())) => return Some((all.0, keepdim)),
                Some(v) => v.as_ints()?,
            };
            if dims.is_empty() {
                return Some((all.0, keepdim));
            }
            let mut reduced = vec![false; rank];
            for d in dims {
                reduced[OpCtx::norm_dim(d, rank)?] = true;
            }
            Some((reduced, keepdim))
        }
    }
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let rank = ctx.in_shape(0).len();
    let split_name = if ctx.op().starts_with("aten.mean") { SHARDED_MEAN } else { SHARDED_SUM };
    let mut rules = Vec::new();
    if let Some((reduced, keepdim)) = reduced_dims(ctx, rank) {
        for d in 0..rank {
            let Some(g) = gather(d) else { continue };
            if reduced[d] {
                rules.push(ctx.uniform(split_name, g, Layout::Reduce, Work::Sharded));
            } else {
                let out = if keepdim { d } else { d - reduced[..d].iter().filter(|r| **r).count() };
                if let Some(g_out) = gather(out) {
                    rules.push(ctx.uniform(SHARDED, g, g_out, Work::Sharded));
                }
            }
        }
    }
    rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full));
    rules
}

/// One add per input element.
fn flops(ctx: &OpCtx) -> f64 {
    ctx.in_shape(0).iter().product::<usize>() as f64
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, boolean, ints, none, rules, A, A::T};

    const X: &[usize] = &[2, 16, 4];

    fn reduce(op: &str, dim: A, keepdim: bool, out: &[usize]) -> crate::rules::OpRules {
        rules(op, vec![("self", T(X)), ("dim", dim), ("keepdim", boolean(keepdim)), ("dtype", none())], &[out])
    }

    #[test]
    fn sum_over_some_dims() {
        let partial = "partial R -> R full";
        let cases: &[(A, bool, &[usize], &[&str])] = &[
            // the MoE gate's token count: sum over the sequence, kept
            (
                ints(&[1]),
                true,
                &[2, 1, 4],
                &["sharded G0 -> G0 sharded", "sharded-sum G1 -> R sharded", "sharded G2 -> G2 sharded", partial],
            ),
            (
                ints(&[1]),
                false,
                &[2, 4],
                &["sharded G0 -> G0 sharded", "sharded-sum G1 -> R sharded", "sharded G2 -> G1 sharded", partial],
            ),
            (
                ints(&[0, -1]),
                false,
                &[16],
                &["sharded-sum G0 -> R sharded", "sharded G1 -> G0 sharded", "sharded-sum G2 -> R sharded", partial],
            ),
            (
                ints(&[]),
                false,
                &[],
                &["sharded-sum G0 -> R sharded", "sharded-sum G1 -> R sharded", "sharded-sum G2 -> R sharded", partial],
            ),
            (
                none(),
                true,
                &[1, 1, 1],
                &["sharded-sum G0 -> R sharded", "sharded-sum G1 -> R sharded", "sharded-sum G2 -> R sharded", partial],
            ),
            (ints(&[3]), false, &[2, 16, 4], &[partial]),
        ];
        for (dim, keepdim, out, expected) in cases {
            let got = reduce("aten.sum.dim_IntList", dim.clone(), *keepdim, out);
            assert_rules(&got, expected);
            assert_eq!(got.flops, 128.0);
        }
    }

    #[test]
    fn mean_over_the_last_dim() {
        // RMSNorm's mean of squares
        let got = reduce("aten.mean.dim", ints(&[-1]), true, &[2, 16, 1]);
        assert_rules(
            &got,
            &[
                "sharded G0 -> G0 sharded",
                "sharded G1 -> G1 sharded",
                "sharded-mean G2 -> R sharded",
                "partial R -> R full",
            ],
        );
    }

    #[test]
    fn full_reductions() {
        for (op, name) in [("aten.sum", "sharded-sum"), ("aten.mean", "sharded-mean")] {
            let got = rules(op, vec![("self", T(&[3, 5])), ("dtype", none())], &[&[]]);
            let g = |d| format!("{name} G{d} -> R sharded");
            assert_rules(&got, &[&g(0), &g(1), "partial R -> R full"]);
        }
        // a scalar: only the partial rule
        let got = rules("aten.sum", vec![("self", T(&[]))], &[&[]]);
        assert_rules(&got, &["partial R -> R full"]);
    }
}
