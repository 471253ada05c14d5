//! Broadcasting element-wise `add`, `sub`, `mul`, `div` (tensor ∘ tensor or tensor ∘
//! scalar).

use super::rule_names::{PARTIAL, SHARDED};
use super::{check_same_shape, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

/// The dim of an operand of `shape` that lines up with output dim `d` of an output of
/// rank `rank` (numpy alignment from the right), unless it is broadcast (or has more
/// dims than the output).
pub(crate) fn aligned_dim(shape: &[usize], rank: usize, d: usize, size: usize) -> Option<usize> {
    let offset = rank.checked_sub(shape.len())?;
    (d >= offset && shape[d - offset] == size).then(|| d - offset)
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let op = ctx.op();
    let out = ctx.out_shape(0);
    let mut rules = Vec::new();
    match ctx.n_inputs() {
        1 => {
            // tensor ∘ scalar
            for g in (0..out.len()).filter_map(gather) {
                rules.push(ctx.uniform(SHARDED, g, g, Work::Sharded));
            }
            if matches!(op, "aten.mul.Tensor" | "aten.div.Tensor") {
                rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full));
            }
        }
        2 => {
            for d in 0..out.len() {
                let Some(g_out) = gather(d) else { continue };
                let per_input: Vec<Layout> = (0..2)
                    .map(|k| match aligned_dim(ctx.in_shape(k), out.len(), d, out[d]) {
                        Some(dk) => gather(dk).unwrap_or(Layout::Identity),
                        None => Layout::Identity,
                    })
                    .collect();
                if per_input.iter().any(|l| matches!(l, Layout::Gather(_))) {
                    rules.push(Rule { name: SHARDED, inputs: per_input, outputs: vec![g_out], work: Work::Sharded });
                }
            }
            let partial = |a: Layout, b: Layout| Rule {
                name: PARTIAL,
                inputs: vec![a, b],
                outputs: vec![Layout::Reduce],
                work: Work::Full,
            };
            match op {
                "aten.add.Tensor" | "aten.sub.Tensor" => {
                    rules.push(partial(Layout::Reduce, Layout::Reduce))
                }
                "aten.mul.Tensor" => {
                    rules.push(partial(Layout::Reduce, Layout::Identity));
                    rules.push(partial(Layout::Identity, Layout::Reduce));
                }
                "aten.div.Tensor" => rules.push(partial(Layout::Reduce, Layout::Identity)),
                _ => {}
            }
        }
        _ => {}
    }
    rules
}

fn flops(ctx: &OpCtx) -> f64 {
    ctx.out_numel()
}

/// Two operands broadcast to the output; one operand (the other a scalar) has its shape.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let Some(b) = ctx.inputs.get(1) else { return check_same_shape(ctx) };
    let out = ctx.require_out()?;
    let a = ctx.require_input(0)?;
    if broadcast(&a.shape, &b.shape).as_deref() != Some(out.shape.as_slice()) {
        return ctx.shape_error(format!(
            "operands {:?} and {:?} do not broadcast to output {:?}",
            a.shape, b.shape, out.shape
        ));
    }
    Ok(())
}

/// Numpy-style broadcast of two shapes, or None when they do not broadcast.
pub(crate) fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}
