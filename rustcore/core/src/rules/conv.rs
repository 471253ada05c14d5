//! `conv1d`/`conv2d`/`conv3d(input [N, C, *spatial], weight [O, C/groups, *kernel],
//! bias?)`, `max_pool2d` and `adaptive_avg_pool2d` on batched inputs (rank spatial + 2);
//! unbatched inputs get only the replicated rule.
//!
//! Convolutions (Whisper's audio stem is two `conv1d`s, a ViT's patches one `conv2d`):
//! - `"data-parallel"`: split the batch, weight and bias replicated → output split on
//!   dim 0.
//! - `"column-parallel"` (`groups == 1`): split the output channels (weight and bias
//!   dim 0), input replicated → output split on dim 1.
//! - `"row-parallel"` (`groups == 1`): split the input channels (input dim 1, weight
//!   dim 1) → partial sums; the bias is added on rank 0 only.
//!
//! With `groups > 1` a rank's slice of channels would not line up with whole groups of
//! the grouped convolution it runs locally, so channel splits are left out.
//!
//! Pools act per sample and per channel: batch and channel splits (`"sharded"`), and an
//! average pool is linear, so it also keeps partial sums partial (`"partial"`).

use super::rule_names::{COLUMN_PARALLEL, DATA_PARALLEL, PARTIAL, ROW_PARALLEL, SHARDED};
use super::{by_name, gather, no_shape_checks, Family, OpCtx, Rule, I};
use crate::cost::{Work, WorkClass};
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.max_pool2d", "aten.adaptive_avg_pool2d"],
    rules,
    flops,
    class,
    check_shapes: no_shape_checks,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    match ctx.op() {
        "aten.conv1d" | "aten.conv2d" | "aten.conv3d" => conv(ctx),
        "aten.max_pool2d" | "aten.adaptive_avg_pool2d" => pool(ctx),
        _ => Vec::new(),
    }
}

/// The rank of a batched input of convolution `op`: its spatial dims plus batch and
/// channels.
fn batched_rank(op: &str) -> Option<usize> {
    match op {
        "aten.conv1d" => Some(3),
        "aten.conv2d" => Some(4),
        "aten.conv3d" => Some(5),
        _ => None,
    }
}

fn conv(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(xi), Some(wi)) = (ctx.input_index("input"), ctx.input_index("weight")) else { return Vec::new() };
    let Some(rank) = batched_rank(ctx.op()) else { return Vec::new() };
    if ctx.in_shape(xi).len() != rank || ctx.in_shape(wi).len() != rank || ctx.out_shape(0).len() != rank {
        return Vec::new();
    }
    let (Some(g0), Some(g1)) = (gather(0), gather(1)) else { return Vec::new() };
    let rule = |name, named: &[(&str, Layout)], out| Rule {
        name,
        inputs: by_name(ctx, named, I),
        outputs: vec![out],
        work: Work::Sharded,
    };
    let mut rules = vec![rule(DATA_PARALLEL, &[("input", g0)], g0)];
    if ctx.int_arg("groups").unwrap_or(1) == 1 {
        rules.push(rule(COLUMN_PARALLEL, &[("input", I), ("weight", g0), ("bias", g0)], g1));
        rules.push(rule(ROW_PARALLEL, &[("input", g1), ("weight", g1), ("bias", I)], Layout::Reduce));
    }
    rules
}

fn pool(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 || ctx.in_shape(0).len() != 4 || ctx.out_shape(0).len() != 4 {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = (0..2).filter_map(gather).map(|g| ctx.uniform(SHARDED, g, g, Work::Sharded)).collect();
    if ctx.op() == "aten.adaptive_avg_pool2d" {
        rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full));
    }
    rules
}

/// Convolutions: a multiply-add per output element and weight tap,
/// `2·numel(out)·(C/groups)·∏kernel`; pools: one op per input element.
fn flops(ctx: &OpCtx) -> f64 {
    if let Some(rank) = batched_rank(ctx.op()) {
        let w = ctx.input_index("weight").map_or(&[][..], |k| ctx.in_shape(k));
        if w.len() == rank {
            return 2.0 * ctx.out_numel() * w[1..].iter().product::<usize>() as f64;
        }
        return ctx.out_numel();
    }
    ctx.in_shape(0).iter().product::<usize>() as f64
}

fn class(ctx: &OpCtx) -> WorkClass {
    if batched_rank(ctx.op()).is_some() {
        WorkClass::Matmul
    } else {
        WorkClass::Elementwise
    }
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, boolean, int, ints, none, rules, A, A::T};
    use crate::cost::WorkClass;
    use crate::rules::OpRules;

    #[test]
    fn conv1d_and_conv3d_split_as_conv2d() {
        let conv1d = rules(
            "aten.conv1d",
            vec![
                ("input", T(&[2, 80, 128])),
                ("weight", T(&[16, 80, 3])),
                ("bias", T(&[16])),
                ("stride", ints(&[1])),
                ("padding", ints(&[1])),
                ("dilation", ints(&[1])),
                ("groups", int(1)),
            ],
            &[&[2, 16, 128]],
        );
        let expected = [
            "data-parallel G0,I,I -> G0 sharded",
            "column-parallel I,G0,G0 -> G1 sharded",
            "row-parallel G1,G1,I -> R sharded",
        ];
        assert_rules(&conv1d, &expected);
        assert_eq!(conv1d.flops, 2.0 * (2 * 16 * 128) as f64 * (80 * 3) as f64);
        let conv3d = rules(
            "aten.conv3d",
            vec![("input", T(&[2, 3, 4, 8, 8])), ("weight", T(&[4, 3, 1, 3, 3])), ("bias", T(&[4])), ("groups", int(1))],
            &[&[2, 4, 4, 8, 8]],
        );
        assert_rules(&conv3d, &expected);
        // a conv1d's unbatched input: replicated only
        let unbatched = rules("aten.conv1d", vec![("input", T(&[80, 128])), ("weight", T(&[16, 80, 3]))], &[&[16, 128]]);
        assert_rules(&unbatched, &[]);
    }

    fn conv(x: &'static [usize], w: &'static [usize], bias: A, groups: i64, out: &[usize]) -> OpRules {
        let args = vec![
            ("input", T(x)),
            ("weight", T(w)),
            ("bias", bias),
            ("stride", ints(&[1, 1])),
            ("padding", ints(&[1, 1])),
            ("dilation", ints(&[1, 1])),
            ("groups", int(groups)),
        ];
        rules("aten.conv2d", args, &[out])
    }

    #[test]
    fn conv2d_splits() {
        let got = conv(&[2, 3, 32, 32], &[4, 3, 3, 3], T(&[4]), 1, &[2, 4, 32, 32]);
        assert_rules(
            &got,
            &[
                "data-parallel G0,I,I -> G0 sharded",
                "column-parallel I,G0,G0 -> G1 sharded",
                "row-parallel G1,G1,I -> R sharded",
            ],
        );
        assert_eq!(got.flops, 2.0 * (2 * 4 * 32 * 32) as f64 * (3 * 3 * 3) as f64);
        assert_eq!(got.class, WorkClass::Matmul);
        // no bias
        let got = conv(&[2, 3, 32, 32], &[4, 3, 3, 3], none(), 1, &[2, 4, 32, 32]);
        assert_rules(
            &got,
            &[
                "data-parallel G0,I -> G0 sharded",
                "column-parallel I,G0 -> G1 sharded",
                "row-parallel G1,G1 -> R sharded",
            ],
        );
    }

    #[test]
    fn grouped_and_unbatched_conv() {
        let got = conv(&[2, 4, 8, 8], &[4, 1, 3, 3], T(&[4]), 4, &[2, 4, 8, 8]);
        assert_rules(&got, &["data-parallel G0,I,I -> G0 sharded"]);
        assert_eq!(got.flops, 2.0 * (2 * 4 * 8 * 8) as f64 * 9.0);
        let got = conv(&[3, 32, 32], &[4, 3, 3, 3], T(&[4]), 1, &[4, 32, 32]);
        assert_rules(&got, &[]);
    }

    #[test]
    fn pools() {
        let max = |x: &'static [usize], out: &[usize]| {
            let args = vec![
                ("self", T(x)),
                ("kernel_size", ints(&[2, 2])),
                ("stride", ints(&[2, 2])),
                ("padding", ints(&[0, 0])),
                ("dilation", ints(&[1, 1])),
                ("ceil_mode", boolean(false)),
            ];
            rules("aten.max_pool2d", args, &[out])
        };
        let got = max(&[2, 4, 32, 32], &[2, 4, 16, 16]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded"]);
        assert_eq!(got.flops, (2 * 4 * 32 * 32) as f64);
        assert_eq!(got.class, WorkClass::Elementwise);
        assert_rules(&max(&[4, 32, 32], &[4, 16, 16]), &[]);

        let got = rules(
            "aten.adaptive_avg_pool2d",
            vec![("self", T(&[2, 8, 7, 7])), ("output_size", ints(&[1, 1]))],
            &[&[2, 8, 1, 1]],
        );
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "partial R -> R full"]);
    }
}
