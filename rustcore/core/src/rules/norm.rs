//! Normalizations.
//!
//! - `layer_norm`, `native_layer_norm`, `rms_norm`: normalize over the trailing
//!   `normalized_shape` dims, so any leading dim (batch, sequence) splits freely while
//!   the affine `weight` and `bias` (shaped like the normalized dims) stay replicated;
//!   `native_layer_norm`'s mean and rstd (leading dims, then ones) split alike.
//! - Batch norms (`batch_norm`, `native_batch_norm`, `_native_batch_norm_legit_functional`,
//!   `_native_batch_norm_legit_no_training`) on `[N, C, …]`: statistics are per channel,
//!   so a split of the channels (input and result dim 1; weight, bias, running and saved
//!   statistics — every `[C]` operand and result — dim 0) is exact (`"sharded"`). In
//!   training the statistics are over the whole batch: `_native_batch_norm_legit_functional`
//!   (what export gives for a batch norm in training) splits the batch with the
//!   statistics synchronized (`"data-parallel-synced"`: the runtime all-reduces the
//!   per-channel sums for the mean, then for the variance, so every rank normalizes
//!   with the whole batch's statistics and updates the running ones alike; the two
//!   all-reduces each way are charged by [`synced_statistics_row`]). In evaluation
//!   (`training` false, or `_no_training`) the running statistics are used and the
//!   batch splits (`"data-parallel"`).
//! - Group norms (`group_norm`, `native_group_norm`) on `[N, C, …]`: statistics are per
//!   sample and group, so the batch splits (`"data-parallel"`; `native_group_norm`'s
//!   `[N, groups]` mean and rstd with it — the runtime passes the local `N`). A channel
//!   split would have to fall on whole groups, which uneven split lengths do not: left
//!   out.

use super::rule_names::{DATA_PARALLEL, DATA_PARALLEL_SYNCED, SHARDED};
use super::{by_name, elementwise_class, gather, Family, OpCtx, Rule};
use crate::comm::{collective_row, Collective};
use crate::cost::{Row, Work};
use crate::profile::Profile;
use crate::error::Result;
use crate::ir::{TensorMeta, Value};
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.layer_norm",
        "aten.native_layer_norm",
        "aten.rms_norm",
        "aten.batch_norm",
        "aten.native_batch_norm",
        "aten._native_batch_norm_legit_functional",
        "aten._native_batch_norm_legit_no_training",
        "aten.group_norm",
        "aten.native_group_norm",
    ],
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

fn is_batch_norm(op: &str) -> bool {
    matches!(
        op,
        "aten.batch_norm"
            | "aten.native_batch_norm"
            | "aten._native_batch_norm_legit_functional"
            | "aten._native_batch_norm_legit_no_training"
    )
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    match ctx.op() {
        op if is_batch_norm(op) => batch_norm(ctx).unwrap_or_default(),
        "aten.group_norm" | "aten.native_group_norm" => group_norm(ctx).unwrap_or_default(),
        _ => layer_norm(ctx),
    }
}

/// Every result split on the same dim `g` (mean and rstd keep the input's rank).
fn layer_norm(ctx: &OpCtx) -> Vec<Rule> {
    let Some(lead) = leading_dims(ctx) else { return Vec::new() };
    (0..lead)
        .filter_map(gather)
        .map(|g| Rule {
            name: SHARDED,
            inputs: by_name(ctx, &[("input", g)], Layout::Identity),
            outputs: vec![g; ctx.n_outputs()],
            work: Work::Sharded,
        })
        .collect()
}

/// The channel split, and in evaluation the batch split.
fn batch_norm(ctx: &OpCtx) -> Option<Vec<Rule>> {
    let x = ctx.in_shape(ctx.input_index("input")?);
    let channels = *x.get(1)?;
    let (g0, g1) = (gather(0)?, gather(1)?);
    let per_channel = |shape: &[usize]| shape == [channels];
    let mut rules = Vec::new();
    if channels > 1 {
        let inputs = ctx.inputs.iter().enumerate().map(|(k, m)| match k {
            _ if Some(k) == ctx.input_index("input") => g1,
            _ if per_channel(&m.shape) => g0,
            _ => Layout::Identity,
        });
        let outputs = (0..ctx.n_outputs()).map(|k| match k {
            0 => g1,
            _ if per_channel(ctx.out_shape(k)) => g0,
            _ => Layout::Identity,
        });
        rules.push(Rule { name: SHARDED, inputs: inputs.collect(), outputs: outputs.collect(), work: Work::Sharded });
    }
    let evaluating = ctx.op() == "aten._native_batch_norm_legit_no_training" || ctx.bool_arg("training") == Some(false);
    let functional = ctx.op() == "aten._native_batch_norm_legit_functional";
    // the batch split: the result split on dim 0, every other operand and result whole
    let batch_split = |name| {
        let mut outputs = vec![Layout::Identity; ctx.n_outputs()];
        outputs[0] = g0;
        Rule { name, inputs: by_name(ctx, &[("input", g0)], Layout::Identity), outputs, work: Work::Sharded }
    };
    if functional && !evaluating && x[0] > 1 && ctx.n_outputs() == 5 {
        rules.push(batch_split(DATA_PARALLEL_SYNCED));
    }
    // evaluation: the saved statistics of the native ops are empty ([0])
    if evaluating && x[0] > 1 && (1..ctx.n_outputs()).all(|k| ctx.out_shape(k).iter().product::<usize>() == 0) {
        rules.push(batch_split(DATA_PARALLEL));
    }
    Some(rules)
}

/// The batch split; `native_group_norm`'s mean and rstd (`[N, groups]`) split with it.
fn group_norm(ctx: &OpCtx) -> Option<Vec<Rule>> {
    let x = ctx.in_shape(ctx.input_index("input")?);
    if x.len() < 2 || x[0] < 2 {
        return Some(Vec::new());
    }
    let g0 = gather(0)?;
    Some(vec![Rule {
        name: DATA_PARALLEL,
        inputs: by_name(ctx, &[("input", g0)], Layout::Identity),
        outputs: vec![g0; ctx.n_outputs()],
        work: Work::Sharded,
    }])
}

/// The communication inside a `"data-parallel-synced"` batch norm, on top of its
/// compute: two all-reduces of the `[C]` per-channel sums forward (for the mean, then
/// for the variance), and, when a gradient flows, their two backward all-reduces.
/// `None` for any other rule.
pub fn synced_statistics_row(ctx: &OpCtx, rule: &Rule, profile: &Profile, with_grad: bool) -> Option<Row> {
    if rule.name != DATA_PARALLEL_SYNCED {
        return None;
    }
    let x = ctx.inputs.get(ctx.input_index("input")?)?;
    let channels = *x.shape.get(1)? as f64;
    let mut row = collective_row(profile, Collective::AllReduce, channels * x.dtype.size() as f64, with_grad);
    row.add(&row.clone());
    Some(row)
}

/// Mean, variance, normalize, scale and shift: about 8 FLOPs per element of the input.
fn flops(ctx: &OpCtx) -> f64 {
    8.0 * ctx.in_shape(0).iter().product::<usize>() as f64
}

fn check_shapes(ctx: &OpCtx) -> Result<()> {
    match ctx.op() {
        op if is_batch_norm(op) => check_per_channel(ctx),
        "aten.group_norm" | "aten.native_group_norm" => check_group_norm(ctx),
        _ => check_normalized_tail(ctx),
    }
}

/// Batch norms: the input is `[N, C, …]`, the result has its shape, and weight, bias and
/// running statistics (where given) are `[C]`.
fn check_per_channel(ctx: &OpCtx) -> Result<()> {
    let x = channels_first_input(ctx)?;
    check_channel_operands(ctx, x, &["weight", "bias", "running_mean", "running_var"])
}

/// The input of a norm on `[N, C, …]`, checked to be so and the result alike.
fn channels_first_input<'g>(ctx: &OpCtx<'g>) -> Result<&'g TensorMeta> {
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    if x.rank() < 2 || out.shape != x.shape {
        return ctx.shape_error(format!("input {:?} must be [N, C, …] and the result {:?} alike", x.shape, out.shape));
    }
    Ok(x)
}

/// The operands `names` (where given) of a norm on input `x` (`[N, C, …]`) are `[C]`.
fn check_channel_operands(ctx: &OpCtx, x: &TensorMeta, names: &[&str]) -> Result<()> {
    for &name in names {
        if let Some(p) = ctx.tensor_arg(name) {
            if p.shape != [x.shape[1]] {
                return ctx.shape_error(format!("{name} {:?} is not [C] for input {:?}", p.shape, x.shape));
            }
        }
    }
    Ok(())
}

/// Group norms: `[N, C, …]` input, result alike, `num_groups` divides `C`, and weight
/// and bias (where given) are `[C]`.
fn check_group_norm(ctx: &OpCtx) -> Result<()> {
    let x = channels_first_input(ctx)?;
    let groups = ctx.int_arg("num_groups").or_else(|| ctx.int_arg("group")).unwrap_or(1);
    if groups < 1 || x.shape[1] % groups as usize != 0 {
        return ctx.shape_error(format!("{groups} groups do not divide {} channels", x.shape[1]));
    }
    check_channel_operands(ctx, x, &["weight", "bias"])
}

/// Layer norms: `normalized_shape` is the tail of the input's shape, `weight` and `bias`
/// have that shape, and the output the input's.
fn check_normalized_tail(ctx: &OpCtx) -> Result<()> {
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
    use crate::rules::testkit::{assert_rules, boolean, float, int, ints, none, rules, A, A::T};

    fn bn(op: &str, training: Option<bool>, outputs: &[&[usize]]) -> crate::rules::OpRules {
        let mut args: Vec<(&str, A)> = vec![
            ("input", T(&[4, 8, 6, 6])),
            ("weight", T(&[8])),
            ("bias", T(&[8])),
            ("running_mean", T(&[8])),
            ("running_var", T(&[8])),
        ];
        if let Some(t) = training {
            args.push(("training", boolean(t)));
        }
        args.push(("momentum", float(0.1)));
        args.push(("eps", float(1e-5)));
        rules(op, args, outputs)
    }

    #[test]
    fn batch_norm_splits_channels() {
        const X: &[usize] = &[4, 8, 6, 6];
        const C: &[usize] = &[8];
        // training, functional (what export gives): the channel split, and the batch
        // split with synchronized statistics (saved and running statistics whole)
        let got = bn("aten._native_batch_norm_legit_functional", Some(true), &[X, C, C, C, C]);
        assert_rules(
            &got,
            &["data-parallel-synced G0,I,I,I,I -> G0,I,I,I,I sharded", "sharded G1,G0,G0,G0,G0 -> G1,G0,G0,G0,G0 sharded"],
        );
        assert_eq!(got.flops, 8.0 * (4 * 8 * 36) as f64);
        let got = bn("aten.batch_norm", Some(true), &[X]);
        assert_rules(&got, &["sharded G1,G0,G0,G0,G0 -> G1 sharded"]);
        // evaluation: the batch splits too
        let got = bn("aten._native_batch_norm_legit_no_training", None, &[X, &[0], &[0]]);
        assert_rules(
            &got,
            &["sharded G1,G0,G0,G0,G0 -> G1,I,I sharded", "data-parallel G0,I,I,I,I -> G0,I,I sharded"],
        );
        let got = bn("aten.batch_norm", Some(false), &[X]);
        assert_rules(&got, &["sharded G1,G0,G0,G0,G0 -> G1 sharded", "data-parallel G0,I,I,I,I -> G0 sharded"]);
    }

    #[test]
    fn group_norm_splits_the_batch() {
        let args = vec![
            ("input", T(&[4, 8, 6, 6])),
            ("num_groups", int(2)),
            ("weight", T(&[8])),
            ("bias", T(&[8])),
            ("eps", float(1e-5)),
        ];
        assert_rules(&rules("aten.group_norm", args, &[&[4, 8, 6, 6]]), &["data-parallel G0,I,I -> G0 sharded"]);
        let args = vec![
            ("input", T(&[4, 8, 6, 6])),
            ("weight", T(&[8])),
            ("bias", T(&[8])),
            ("N", int(4)),
            ("C", int(8)),
            ("HxW", int(36)),
            ("group", int(2)),
            ("eps", float(1e-5)),
        ];
        let got = rules("aten.native_group_norm", args, &[&[4, 8, 6, 6], &[4, 2], &[4, 2]]);
        assert_rules(&got, &["data-parallel G0,I,I -> G0,G0,G0 sharded"]);
    }

    #[test]
    fn rms_and_native_layer_norm_split_leading_dims() {
        let args = vec![("input", T(&[2, 16, 32])), ("normalized_shape", ints(&[32])), ("weight", T(&[32])), ("eps", none())];
        let got = rules("aten.rms_norm", args, &[&[2, 16, 32]]);
        assert_rules(&got, &["sharded G0,I -> G0 sharded", "sharded G1,I -> G1 sharded"]);
        let args = vec![
            ("input", T(&[2, 16, 32])),
            ("normalized_shape", ints(&[32])),
            ("weight", T(&[32])),
            ("bias", T(&[32])),
            ("eps", float(1e-5)),
        ];
        let got = rules("aten.native_layer_norm", args, &[&[2, 16, 32], &[2, 16, 1], &[2, 16, 1]]);
        assert_rules(&got, &["sharded G0,I,I -> G0,G0,G0 sharded", "sharded G1,I,I -> G1,G1,G1 sharded"]);
    }

    #[test]
    fn norm_shape_checks() {
        use crate::ir::DType;
        use crate::rules::{check_shapes, testkit::graph};
        let g = graph(
            "aten.batch_norm",
            vec![("input", T(&[4, 8, 6, 6])), ("weight", T(&[7])), ("training", boolean(true))],
            &[(&[4, 8, 6, 6], DType::F32)],
        );
        assert!(check_shapes(&g, g.nodes.last().unwrap()).unwrap_err().to_string().contains("weight [7]"));
        let g = graph(
            "aten.group_norm",
            vec![("input", T(&[4, 8, 6, 6])), ("num_groups", int(3))],
            &[(&[4, 8, 6, 6], DType::F32)],
        );
        assert!(check_shapes(&g, g.nodes.last().unwrap()).unwrap_err().to_string().contains("3 groups"));
    }

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
