//! Broadcasting element-wise `add`, `sub`, `mul`, `div` (tensor ∘ tensor or tensor ∘
//! scalar).

use super::{gather, OpCtx, Rule};
use crate::cost::Work;
use crate::layout::Layout;

/// The dim of an operand of `shape` that lines up with output dim `d` of an output of
/// rank `rank` (numpy alignment from the right), unless it is broadcast.
pub(crate) fn aligned_dim(shape: &[usize], rank: usize, d: usize, size: usize) -> Option<usize> {
    let offset = rank - shape.len();
    (d >= offset && shape[d - offset] == size).then(|| d - offset)
}

pub fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let op = ctx.op();
    let out = ctx.out_shape(0);
    let mut rules = Vec::new();
    match ctx.n_inputs() {
        1 => {
            // tensor ∘ scalar
            for g in (0..out.len()).filter_map(gather) {
                rules.push(ctx.uniform("sharded", g, g, Work::Sharded));
            }
            if matches!(op, "aten.mul.Tensor" | "aten.div.Tensor") {
                rules.push(ctx.uniform("partial", Layout::Reduce, Layout::Reduce, Work::Full));
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
                    rules.push(Rule { name: "sharded", inputs: per_input, outputs: vec![g_out], work: Work::Sharded });
                }
            }
            let partial = |a: Layout, b: Layout| Rule {
                name: "partial",
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

pub fn flops(ctx: &OpCtx) -> f64 {
    ctx.out_numel()
}
