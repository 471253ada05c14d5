//! `embedding(weight [V, H], indices)`: output `indices.shape + [H]`.
//!
//! - `"data-parallel"`: any dim of the indices splits, with the table replicated →
//!   the output is split on the same dim.
//! - `"hidden-split"`: the table split by columns (dim 1), indices replicated → the
//!   output is split on its last dim.
//! - `"vocab-parallel"`: the table split by rows (dim 0), indices replicated → partial
//!   sums. Runtime: each rank looks up only the indices inside its row range (shifted
//!   to local rows) and writes zeros for the others, so exactly one rank contributes
//!   each output row. Every rank still writes the whole output, hence `Work::Full`.

use super::rule_names::{DATA_PARALLEL, HIDDEN_SPLIT, VOCAB_PARALLEL};
use super::{by_name, elementwise_class, gather, Family, OpCtx, Rule, I};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.embedding"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(wi), Some(ii)) = (ctx.input_index("weight"), ctx.input_index("indices")) else { return Vec::new() };
    let (weight, indices, out) = (ctx.in_shape(wi), ctx.in_shape(ii), ctx.out_shape(0));
    if weight.len() != 2 || out.len() != indices.len() + 1 {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = (0..indices.len())
        .filter_map(gather)
        .map(|g| Rule {
            name: DATA_PARALLEL,
            inputs: by_name(ctx, &[("weight", I), ("indices", g)], I),
            outputs: vec![g],
            work: Work::Sharded,
        })
        .collect();
    if let (Some(g0), Some(g1), Some(g_last)) = (gather(0), gather(1), gather(out.len() - 1)) {
        rules.push(Rule {
            name: HIDDEN_SPLIT,
            inputs: by_name(ctx, &[("weight", g1), ("indices", I)], I),
            outputs: vec![g_last],
            work: Work::Sharded,
        });
        rules.push(Rule {
            name: VOCAB_PARALLEL,
            inputs: by_name(ctx, &[("weight", g0), ("indices", I)], I),
            outputs: vec![Layout::Reduce],
            work: Work::Full,
        });
    }
    rules
}

/// A copy per output element.
fn flops(ctx: &OpCtx) -> f64 {
    ctx.out_numel()
}

/// A 2-D table, and an output of the indices' shape plus the hidden size.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let w = ctx.require_input(0)?;
    let idx = ctx.require_input(1)?;
    if w.rank() != 2 {
        return ctx.shape_error(format!("weight must be 2-D, got {:?}", w.shape));
    }
    let mut expect = idx.shape.clone();
    expect.push(w.shape[1]);
    if out.shape != expect {
        return ctx.shape_error(format!(
            "output {:?} but indices {:?} with weight {:?} give {:?}",
            out.shape, idx.shape, w.shape, expect
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, boolean, int, rules, A::Td};
    use crate::ir::DType;

    #[test]
    fn token_embedding() {
        let args = vec![
            ("weight", Td(&[128, 32], DType::F32)),
            ("indices", Td(&[2, 16], DType::I64)),
            ("padding_idx", int(-1)),
            ("scale_grad_by_freq", boolean(false)),
            ("sparse", boolean(false)),
        ];
        let got = rules("aten.embedding", args, &[&[2, 16, 32]]);
        assert_rules(
            &got,
            &[
                "data-parallel I,G0 -> G0 sharded",
                "data-parallel I,G1 -> G1 sharded",
                "hidden-split G1,I -> G2 sharded",
                "vocab-parallel G0,I -> R full",
            ],
        );
        assert_eq!(got.flops, (2 * 16 * 32) as f64);
    }

    #[test]
    fn scalar_index() {
        let args = vec![("weight", Td(&[10, 4], DType::F32)), ("indices", Td(&[], DType::I64))];
        let got = rules("aten.embedding", args, &[&[4]]);
        assert_rules(&got, &["hidden-split G1,I -> G0 sharded", "vocab-parallel G0,I -> R full"]);
    }
}
