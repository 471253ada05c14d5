//! `layer_norm`: normalizes over the trailing `normalized_shape` dims, so any leading
//! dim (batch, sequence) splits freely while the affine `weight` and `bias` (shaped like
//! the normalized dims) stay replicated.

use super::rule_names::SHARDED;
use super::{by_name, elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::ir::Value;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.layer_norm"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

/// The dims of `input` that are not normalized (those before `normalized_shape`).
fn leading_dims(ctx: &OpCtx) -> Option<usize> {
    let k = ctx.input_index("input")?;
    let rank = ctx.in_shape(k).len();
    let normalized = ctx.ints_arg("normalized_shape")?.len();
    rank.checked_sub(normalized)
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let Some(lead) = leading_dims(ctx) else { return Vec::new() };
    (0..lead)
        .filter_map(gather)
        .map(|g| Rule {
            name: SHARDED,
            inputs: by_name(ctx, &[("input", g)], Layout::Identity),
            outputs: vec![g],
            work: Work::Sharded,
        })
        .collect()
}

/// Mean, variance, normalize, scale and shift: about 8 FLOPs per element.
fn flops(ctx: &OpCtx) -> f64 {
    8.0 * ctx.out_numel()
}

/// `normalized_shape` is the tail of the input's shape, `weight` and `bias` have that
/// shape, and the output the input's.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    let normalized = ctx.arg("normalized_shape").and_then(Value::as_ints).unwrap_or_default();
    let k = normalized.len();
    let tail: Vec<i64> = x.shape.iter().skip(x.rank().saturating_sub(k)).map(|&d| d as i64).collect();
    if k > x.rank() || tail != normalized {
        return ctx.shape_error(format!("normalized_shape {normalized:?} is not the tail of input {:?}", x.shape));
    }
    for name in ["weight", "bias"] {
        if let Some(p) = ctx.tensor_arg(name) {
            if p.shape.iter().map(|&d| d as i64).collect::<Vec<_>>() != normalized {
                return ctx.shape_error(format!("{name} {:?} does not match normalized_shape {normalized:?}", p.shape));
            }
        }
    }
    if out.shape != x.shape {
        return ctx.shape_error(format!("output {:?} differs from input {:?}", out.shape, x.shape));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, float, ints, none, rules, A::T};

    #[test]
    fn layer_norm_splits_leading_dims() {
        let args = |w| {
            vec![
                ("input", T(&[2, 16, 32])),
                ("normalized_shape", ints(&[32])),
                ("weight", w),
                ("bias", T(&[32])),
                ("eps", float(1e-5)),
            ]
        };
        let got = rules("aten.layer_norm", args(T(&[32])), &[&[2, 16, 32]]);
        assert_rules(&got, &["sharded G0,I,I -> G0 sharded", "sharded G1,I,I -> G1 sharded"]);
        assert_eq!(got.flops, 8.0 * 2.0 * 16.0 * 32.0);
        // no weight: the operands are input and bias
        let got = rules("aten.layer_norm", args(none()), &[&[2, 16, 32]]);
        assert_rules(&got, &["sharded G0,I -> G0 sharded", "sharded G1,I -> G1 sharded"]);
    }

    #[test]
    fn layer_norm_over_two_dims() {
        let got = rules(
            "aten.layer_norm",
            vec![("input", T(&[4, 6, 8])), ("normalized_shape", ints(&[6, 8])), ("weight", none()), ("bias", none())],
            &[&[4, 6, 8]],
        );
        assert_rules(&got, &["sharded G0 -> G0 sharded"]);
    }
}
