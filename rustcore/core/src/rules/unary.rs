//! Shape-preserving element-wise ops with one tensor operand.

use super::{gather, OpCtx, Rule};
use crate::cost::Work;
use crate::layout::Layout;

/// Ops linear in their input: they also map a partial sum to a partial sum.
fn is_linear(op: &str) -> bool {
    matches!(op, "aten.neg" | "aten.to.dtype" | "aten._to_copy" | "aten.clone" | "aten.contiguous")
}

pub fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = (0..ctx.in_shape(0).len())
        .filter_map(gather)
        .map(|g| ctx.uniform("sharded", g, g, Work::Sharded))
        .collect();
    if is_linear(ctx.op()) {
        rules.push(ctx.uniform("partial", Layout::Reduce, Layout::Reduce, Work::Full));
    }
    rules
}

pub fn flops(ctx: &OpCtx) -> f64 {
    let per_element = match ctx.op() {
        "aten.gelu" => 8.0,
        "aten.silu" | "aten.sigmoid" | "aten.tanh" | "aten.exp" => 4.0,
        _ => 1.0,
    };
    per_element * ctx.out_numel()
}
