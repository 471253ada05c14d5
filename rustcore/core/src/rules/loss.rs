//! `cross_entropy_loss(self, target, weight?, reduction, …)` and `nll_loss(self,
//! target, weight?, reduction, …)` with `self` `[N, C, d1…]` and `target` `[N, d1…]`
//! (class indices) or `[N, C, d1…]` (probabilities); `reduction` 0 none, 1 mean, 2 sum.
//!
//! Only the batch (dim 0) of `self` and `target` splits, with the class weights
//! replicated:
//!
//! - sum → `"sharded-sum"`: each rank's sum over its samples is a partial sum (`Reduce`).
//! - mean → `"sharded-mean"`: partial sums too, but the runtime divides each rank's
//!   local *sum* by the global count (the number of non-ignored targets over all ranks,
//!   or their total class weight), not by its local count.
//! - none → `"sharded"`: the per-sample losses stay split on dim 0.
//!
//! An unbatched `self` (`[C]`) has no batch to split.

use super::rule_names::{SHARDED, SHARDED_MEAN, SHARDED_SUM};
use super::{by_name, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.cross_entropy_loss", "aten.nll_loss"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(si), Some(ti)) = (ctx.input_index("self"), ctx.input_index("target")) else { return Vec::new() };
    let (x, t) = (ctx.in_shape(si), ctx.in_shape(ti));
    if x.len() < 2 || t.first() != x.first() {
        return Vec::new();
    }
    let Some(g0) = gather(0) else { return Vec::new() };
    let (name, out) = match ctx.int_arg("reduction").unwrap_or(1) {
        0 if ctx.out_shape(0).first() == x.first() => (SHARDED, g0),
        1 => (SHARDED_MEAN, Layout::Reduce),
        2 => (SHARDED_SUM, Layout::Reduce),
        _ => return Vec::new(),
    };
    vec![Rule {
        name,
        inputs: by_name(ctx, &[("self", g0), ("target", g0)], Layout::Identity),
        outputs: vec![out],
        work: Work::Sharded,
    }]
}

/// Log-softmax (or the log-probability pick), weight and reduce: about 4 FLOPs per
/// element of `self`.
fn flops(ctx: &OpCtx) -> f64 {
    let x = ctx.input_index("self").map_or(ctx.in_shape(0), |k| ctx.in_shape(k));
    4.0 * x.iter().product::<usize>() as f64
}

/// `self` `[C]` with a scalar target, or `[N, C, d1…]` with a target `[N, d1…]`.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let x = ctx.require_input(0)?;
    let y = ctx.require_input(1)?;
    let batch_ok = match (x.rank(), y.rank()) {
        (1, 0) => true,
        (rx, ry) if rx >= 2 && ry == rx - 1 => y.shape[0] == x.shape[0] && y.shape[1..] == x.shape[2..],
        _ => false,
    };
    if !batch_ok {
        return ctx.shape_error(format!("input {:?} and target {:?} do not match", x.shape, y.shape));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, float, int, none, rules, A, A::Td, A::T};
    use crate::ir::DType;
    use crate::rules::OpRules;

    fn loss(op: &str, x: &'static [usize], t: A, weight: A, reduction: i64, out: &[usize]) -> OpRules {
        let mut args = vec![("self", T(x)), ("target", t), ("weight", weight), ("reduction", int(reduction))];
        args.push(("ignore_index", int(-100)));
        if op == "aten.cross_entropy_loss" {
            args.push(("label_smoothing", float(0.0)));
        }
        rules(op, args, &[out])
    }

    #[test]
    fn batch_split_by_reduction() {
        let labels = || Td(&[32], DType::I64);
        let cases: &[(&str, i64, &[usize], &[&str])] = &[
            ("aten.cross_entropy_loss", 2, &[], &["sharded-sum G0,G0 -> R sharded"]),
            ("aten.cross_entropy_loss", 1, &[], &["sharded-mean G0,G0 -> R sharded"]),
            ("aten.cross_entropy_loss", 0, &[32], &["sharded G0,G0 -> G0 sharded"]),
            ("aten.nll_loss", 2, &[], &["sharded-sum G0,G0 -> R sharded"]),
            ("aten.nll_loss", 1, &[], &["sharded-mean G0,G0 -> R sharded"]),
        ];
        for (op, reduction, out, expected) in cases {
            let got = loss(op, &[32, 128], labels(), none(), *reduction, out);
            assert_rules(&got, expected);
            assert_eq!(got.flops, 4.0 * 32.0 * 128.0);
        }
    }

    #[test]
    fn class_weights_stay_replicated() {
        let got = loss("aten.nll_loss", &[8, 5], Td(&[8], DType::I64), T(&[5]), 2, &[]);
        assert_rules(&got, &["sharded-sum G0,G0,I -> R sharded"]);
        // probabilities as targets, and extra dims
        let got = loss("aten.cross_entropy_loss", &[8, 5, 3], T(&[8, 5, 3]), none(), 1, &[]);
        assert_rules(&got, &["sharded-mean G0,G0 -> R sharded"]);
    }

    #[test]
    fn unbatched_has_no_split() {
        let got = loss("aten.cross_entropy_loss", &[5], Td(&[], DType::I64), none(), 2, &[]);
        assert_rules(&got, &[]);
    }
}
