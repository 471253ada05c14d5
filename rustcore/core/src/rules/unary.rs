//! Shape-preserving element-wise ops with one tensor operand.

use super::rule_names::{PARTIAL, SHARDED};
use super::{check_same_shape, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.relu",
        "aten.gelu",
        "aten.silu",
        "aten.sigmoid",
        "aten.tanh",
        "aten.neg",
        "aten.exp",
        "aten.rsqrt",
        "aten.sqrt",
        "aten.pow.Tensor_Scalar",
        "aten.to.dtype",
        "aten._to_copy",
        "aten.to.dtype_layout",
        "aten.to.device",
        "aten.clone",
        "aten.contiguous",
        "aten.clamp_min",
        "aten.type_as",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

/// Ops linear in their input: they also map a partial sum to a partial sum.
fn is_linear(op: &str) -> bool {
    matches!(
        op,
        "aten.neg"
            | "aten.to.dtype"
            | "aten._to_copy"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten.clone"
            | "aten.contiguous"
    )
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = (0..ctx.in_shape(0).len())
        .filter_map(gather)
        .map(|g| ctx.uniform(SHARDED, g, g, Work::Sharded))
        .collect();
    if is_linear(ctx.op()) {
        rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full));
    }
    rules
}

fn flops(ctx: &OpCtx) -> f64 {
    let per_element = match ctx.op() {
        "aten.gelu" => 8.0,
        "aten.silu" | "aten.sigmoid" | "aten.tanh" | "aten.exp" => 4.0,
        _ => 1.0,
    };
    per_element * ctx.out_numel()
}

/// The activations, `neg`, `exp` and `rsqrt` keep their input's shape.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    match ctx.op() {
        "aten.relu" | "aten.gelu" | "aten.silu" | "aten.sigmoid" | "aten.tanh" | "aten.rsqrt"
        | "aten.neg" | "aten.exp" => check_same_shape(ctx),
        _ => Ok(()),
    }
}
