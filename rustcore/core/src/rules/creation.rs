//! Ops that make a tensor from scalars: its values do not depend on any operand's
//! values, so they cost no communication.
//!
//! - Sources without tensor operands (`arange`, `zeros`, `ones`, `full`, `empty`,
//!   `scalar_tensor`): replicated is the only rule, and it is right — every rank makes
//!   the same full tensor.
//! - `new_zeros`/`new_ones`/`new_full`/`new_empty(self, size, …)` read only `self`'s
//!   dtype and device, and `size` is the full shape: whatever layout `self` has, the
//!   result is the full tensor (`"fill"`: any split or partial sum of `self` → Identity).
//! - `full_like`/`empty_like(self, …)` and the functional `fill.Scalar(self, value)`
//!   (a constant in `self`'s shape; torch ≥ 2.15 exports T5's decoder start token so)
//!   follow their operand's layout (`"sharded"` on
//!   every dim); a partial-sum operand gives the full constant (`"fill"`), like
//!   `zeros_like`.

use super::rule_names::{FILL, SHARDED};
use super::{check_same_shape, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.arange",
        "aten.arange.start",
        "aten.arange.start_step",
        "aten.zeros",
        "aten.ones",
        "aten.full",
        "aten.empty.memory_format",
        "aten.scalar_tensor",
        "aten.new_zeros",
        "aten.new_ones",
        "aten.new_full",
        "aten.new_empty",
        "aten.full_like",
        "aten.empty_like",
        "aten.fill.Scalar",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn is_new(op: &str) -> bool {
    matches!(op, "aten.new_zeros" | "aten.new_ones" | "aten.new_full" | "aten.new_empty")
}

fn is_like(op: &str) -> bool {
    matches!(op, "aten.full_like" | "aten.empty_like" | "aten.fill.Scalar")
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 || ctx.n_outputs() != 1 {
        return Vec::new();
    }
    let rank = ctx.in_shape(0).len();
    let op = ctx.op();
    let mut rules = Vec::new();
    if is_new(op) {
        for g in (0..rank).filter_map(gather) {
            rules.push(ctx.uniform(FILL, g, Layout::Identity, Work::Full));
        }
    } else if is_like(op) {
        for g in (0..rank).filter_map(gather) {
            rules.push(ctx.uniform(SHARDED, g, g, Work::Sharded));
        }
    } else {
        return Vec::new();
    }
    rules.push(ctx.uniform(FILL, Layout::Reduce, Layout::Identity, Work::Full));
    rules
}

/// Filling memory is no arithmetic.
fn flops(_: &OpCtx) -> f64 {
    0.0
}

/// `*_like` keep their operand's shape; `new_*` make `size`.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let op = ctx.op();
    if is_like(op) {
        return check_same_shape(ctx);
    }
    if is_new(op) {
        let out = ctx.require_out()?;
        let size = ctx.ints_arg("size").unwrap_or_default();
        if size.iter().map(|&d| d.max(0) as usize).collect::<Vec<_>>() != out.shape {
            return ctx.shape_error(format!("size {size:?} but the result is {:?}", out.shape));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, float, int, ints, none, rules, A::T};
    use crate::rules::{check_shapes, rules_for};

    #[test]
    fn sources_are_replicated_and_free() {
        let got = rules("aten.arange.start", vec![("start", int(0)), ("end", int(16)), ("dtype", none())], &[&[16]]);
        assert_rules(&got, &[]);
        assert_eq!(got.flops, 0.0);
        let got = rules("aten.zeros", vec![("size", ints(&[2, 3])), ("dtype", none())], &[&[2, 3]]);
        assert_rules(&got, &[]);
    }

    #[test]
    fn new_ops_give_the_full_tensor_from_any_layout() {
        let got = rules("aten.new_ones", vec![("self", T(&[4, 8])), ("size", ints(&[2, 3]))], &[&[2, 3]]);
        assert_rules(&got, &["fill G0 -> I full", "fill G1 -> I full", "fill R -> I full"]);
    }

    #[test]
    fn like_ops_follow_their_operand() {
        let got = rules("aten.full_like", vec![("self", T(&[4, 8])), ("fill_value", float(1.0))], &[&[4, 8]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "fill R -> I full"]);
        let got = rules("aten.fill.Scalar", vec![("self", T(&[4, 8])), ("value", float(0.0))], &[&[4, 8]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "fill R -> I full"]);
    }

    #[test]
    fn shape_checks() {
        let g = crate::rules::testkit::graph(
            "aten.new_zeros",
            vec![("self", T(&[4, 8])), ("size", ints(&[2, 3]))],
            &[(&[3, 2], crate::ir::DType::F32)],
        );
        let node = g.nodes.last().unwrap();
        assert!(check_shapes(&g, node).unwrap_err().to_string().contains("size [2, 3]"));
        assert_rules(&rules_for(&g, node), &["fill G0 -> I full", "fill G1 -> I full", "fill R -> I full"]);
    }
}
