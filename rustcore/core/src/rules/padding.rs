//! Ops that act along some dims only and leave every other dim independent: padding
//! (`pad`, `constant_pad_nd`, the reflection and replication pads) and finite
//! differences (`diff`). Each element of the result reads only elements of its own
//! index along the other dims, so any of those dims may stay split.
//!
//! - `"sharded"`: a dim that is not padded (or, for `diff`, not differenced) split the
//!   same way on every operand (`diff`'s `prepend`/`append` included) and the result.
//!   Transformers' causal-LM loss shifts the labels with `pad` along the sequence, so
//!   the batch split survives it.
//! - `"partial"`: partial sums stay partial sums where the op is linear: `diff`, the
//!   reflection/replication/circular pads, and a constant pad by zero (padding each
//!   rank's piece by a nonzero value would add it once per rank).

use super::rule_names::{PARTIAL, SHARDED};
use super::{elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.pad",
        "aten.constant_pad_nd",
        "aten.reflection_pad1d",
        "aten.reflection_pad2d",
        "aten.reflection_pad3d",
        "aten.replication_pad1d",
        "aten.replication_pad2d",
        "aten.replication_pad3d",
        "aten.diff",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_outputs() != 1 {
        return Vec::new();
    }
    let x = ctx.in_shape(0);
    let Some(along) = acted_dims(ctx) else { return Vec::new() };
    let mut rules: Vec<Rule> = (0..x.len())
        .filter(|&d| x[d] > 1 && !along.contains(&d))
        .filter_map(gather)
        .map(|g| ctx.uniform(SHARDED, g, g, Work::Sharded))
        .collect();
    if is_linear(ctx) {
        rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full));
    }
    rules
}

/// The dims of input 0 the op acts along (the padded dims, or `diff`'s dim); `None`
/// when the arguments do not say.
fn acted_dims(ctx: &OpCtx) -> Option<Vec<usize>> {
    let rank = ctx.in_shape(0).len();
    if ctx.op() == "aten.diff" {
        let dim = ctx.int_arg("dim").unwrap_or(-1);
        return OpCtx::norm_dim(dim, rank).map(|d| vec![d]);
    }
    let name = if ctx.arg("pad").is_some() { "pad" } else { "padding" };
    padded_dims(&ctx.ints_arg(name)?, rank)
}

/// The dims a pad list changes: `pad` holds (before, after) pairs starting from the
/// last dim; a pair of zeros leaves its dim alone. `None` for a list that is odd or
/// longer than the rank allows.
fn padded_dims(pad: &[i64], rank: usize) -> Option<Vec<usize>> {
    if !pad.len().is_multiple_of(2) || pad.len() / 2 > rank {
        return None;
    }
    Some(
        pad.chunks(2)
            .enumerate()
            .filter(|(_, pair)| pair.iter().any(|&p| p != 0))
            .map(|(i, _)| rank - 1 - i)
            .collect(),
    )
}

/// Whether the op is linear in its tensor operands (see the module docs).
fn is_linear(ctx: &OpCtx) -> bool {
    match ctx.op() {
        "aten.diff" => true,
        "aten.pad" => {
            let constant = ctx.arg("mode").and_then(|v| v.as_str()).is_none_or(|m| m == "constant");
            !constant || pads_with_zero(ctx)
        }
        "aten.constant_pad_nd" => pads_with_zero(ctx),
        _ => true, // reflection and replication pads copy elements
    }
}

/// A constant pad's value is zero (absent or `None` means zero).
fn pads_with_zero(ctx: &OpCtx) -> bool {
    match ctx.arg("value") {
        None | Some(crate::ir::Value::None(())) => true,
        Some(v) => v.as_float() == Some(0.0),
    }
}

/// A pad copies each result element; `diff` of order `n` subtracts `n` times per one.
fn flops(ctx: &OpCtx) -> f64 {
    let order = if ctx.op() == "aten.diff" { ctx.int_arg("n").unwrap_or(1).max(1) as f64 } else { 1.0 };
    ctx.out_numel() * order
}

/// The result has the input's rank and, off the dims the op acts along, its sizes.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    if out.rank() != x.rank() {
        return ctx.shape_error(format!("input {:?} and output {:?} differ in rank", x.shape, out.shape));
    }
    let Some(along) = acted_dims(ctx) else {
        return ctx.shape_error("its pad list or dim does not fit the input's rank".to_string());
    };
    for d in (0..x.rank()).filter(|d| !along.contains(d)) {
        if x.shape[d] != out.shape[d] {
            return ctx.shape_error(format!("input {:?} and output {:?} differ in dim {d}", x.shape, out.shape));
        }
        for (k, other) in ctx.inputs.iter().enumerate().skip(1) {
            if other.shape.get(d) != Some(&x.shape[d]) {
                return ctx.shape_error(format!("operand {k} {:?} differs from input {:?} in dim {d}", other.shape, x.shape));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::padded_dims;
    use crate::rules::testkit::{assert_rules, float, int, ints, none, rules, A, A::T};
    use crate::ir::Value;

    fn mode(m: &str) -> A {
        A::V(Value::Str(m.to_string()))
    }

    #[test]
    fn pad_keeps_the_dims_it_does_not_pad() {
        // transformers' label shift: pad(labels [4, 8], (0, 1), value=-100)
        let args = vec![("self", T(&[4, 8])), ("pad", ints(&[0, 1])), ("mode", mode("constant")), ("value", float(-100.0))];
        let got = rules("aten.pad", args, &[&[4, 9]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded"]);
        assert_eq!(got.flops, 36.0);
        // padding by zero is linear; a (0, 0) pair pads nothing
        let args = vec![("self", T(&[4, 8, 6])), ("pad", ints(&[1, 1, 0, 0])), ("value", float(0.0))];
        let got = rules("aten.constant_pad_nd", args, &[&[4, 8, 8]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "partial R -> R full"]);
        let args = vec![("self", T(&[2, 3, 6, 6])), ("padding", ints(&[1, 1, 2, 2]))];
        let got = rules("aten.reflection_pad2d", args, &[&[2, 3, 10, 8]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "partial R -> R full"]);
        let args = vec![("self", T(&[4, 8])), ("pad", ints(&[0, 1])), ("mode", mode("replicate")), ("value", none())];
        assert_rules(&rules("aten.pad", args, &[&[4, 9]]), &["sharded G0 -> G0 sharded", "partial R -> R full"]);
    }

    #[test]
    fn pad_lists_name_dims_from_the_last() {
        assert_eq!(padded_dims(&[0, 1], 2), Some(vec![1]));
        assert_eq!(padded_dims(&[0, 0, 2, 0], 3), Some(vec![1]));
        assert_eq!(padded_dims(&[1, 1, 1, 1, 1, 1], 2), None);
        assert_eq!(padded_dims(&[1], 2), None);
    }

    #[test]
    fn diff_keeps_the_other_dims_and_splits_prepend_alike() {
        // transformers' packed-sequence check: diff(position_ids, prepend=…, dim=-1)
        let args = vec![("self", T(&[4, 16])), ("n", int(1)), ("dim", int(-1)), ("prepend", T(&[4, 1])), ("append", none())];
        let got = rules("aten.diff", args, &[&[4, 16]]);
        assert_rules(&got, &["sharded G0,G0 -> G0 sharded", "partial R,R -> R full"]);
        assert_eq!(got.flops, 64.0);
        let args = vec![("self", T(&[4, 16, 3])), ("n", int(2)), ("dim", int(1))];
        let got = rules("aten.diff", args, &[&[4, 14, 3]]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded", "partial R -> R full"]);
        assert_eq!(got.flops, 2.0 * 4.0 * 14.0 * 3.0);
    }
}
