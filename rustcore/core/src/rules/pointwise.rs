//! Ops without gradients or that act along one dim: the MoE gating vocabulary.
//!
//! - Comparisons with a scalar (`lt`/`gt`/`le`/`ge`/`eq.Scalar`) → bool, and
//!   `zeros_like`/`ones_like`: every dim splits (`"sharded"`). Comparisons are not
//!   linear: a partial-sum input has no rule. `zeros_like`/`ones_like` ignore the
//!   input's values, so a partial-sum input gives the full (replicated) constant
//!   (`"fill"`).
//! - `one_hot(self, num_classes)` (adds a last dim): every input dim splits, when
//!   `num_classes` is given (with -1 each rank would infer its own class count).
//! - `cumsum`, `topk` (both outputs split alike), `argmax(dim)`: every dim but `dim`
//!   splits; `argmax` without `keepdim` drops `dim`, so later dims shift down by one;
//!   `argmax` over all dims (`dim=None`) has no split. `cumsum` is linear, so it keeps
//!   partial sums partial (`"partial"`).
//! - `_assert_tensor_metadata` only checks metadata and returns nothing (one result of
//!   dtype `NotATensor`): replicated only, zero FLOPs.

use super::rule_names::{FILL, PARTIAL, SHARDED};
use super::{elementwise_class, gather, no_shape_checks, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::ir::Value;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.lt.Scalar",
        "aten.gt.Scalar",
        "aten.le.Scalar",
        "aten.ge.Scalar",
        "aten.eq.Scalar",
        "aten.one_hot",
        "aten.cumsum",
        "aten.topk",
        "aten.argmax",
        "aten.zeros_like",
        "aten.ones_like",
        "aten._assert_tensor_metadata",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes: no_shape_checks,
};

fn is_comparison(op: &str) -> bool {
    matches!(op, "aten.lt.Scalar" | "aten.gt.Scalar" | "aten.le.Scalar" | "aten.ge.Scalar" | "aten.eq.Scalar")
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_inputs() != 1 {
        return Vec::new();
    }
    let rank = ctx.in_shape(0).len();
    let op = ctx.op();
    // (input dim, output dim) pairs that split
    let dims: Vec<(usize, usize)> = match op {
        _ if is_comparison(op) => (0..rank).map(|d| (d, d)).collect(),
        "aten.zeros_like" | "aten.ones_like" => (0..rank).map(|d| (d, d)).collect(),
        "aten.one_hot" => {
            if ctx.int_arg("num_classes").is_none_or(|n| n < 0) || ctx.out_shape(0).len() != rank + 1 {
                return Vec::new();
            }
            (0..rank).map(|d| (d, d)).collect()
        }
        "aten.cumsum" | "aten.topk" => {
            let dim = ctx.int_arg("dim").unwrap_or(-1);
            let Some(dim) = OpCtx::norm_dim(dim, rank) else { return Vec::new() };
            (0..rank).filter(|&d| d != dim).map(|d| (d, d)).collect()
        }
        "aten.argmax" => {
            let dim = match ctx.arg("dim") {
                Some(Value::Int(d)) => *d,
                _ => return Vec::new(),
            };
            let Some(dim) = OpCtx::norm_dim(dim, rank) else { return Vec::new() };
            let keepdim = ctx.bool_arg("keepdim").unwrap_or(false);
            (0..rank).filter(|&d| d != dim).map(|d| (d, if d > dim && !keepdim { d - 1 } else { d })).collect()
        }
        _ => return Vec::new(),
    };
    let mut rules: Vec<Rule> = dims
        .into_iter()
        .filter_map(|(i, o)| Some(ctx.uniform(SHARDED, gather(i)?, gather(o)?, Work::Sharded)))
        .collect();
    match op {
        "aten.zeros_like" | "aten.ones_like" => {
            rules.push(ctx.uniform(FILL, Layout::Reduce, Layout::Identity, Work::Full))
        }
        "aten.cumsum" => rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Full)),
        _ => {}
    }
    rules
}

/// One op per output element; `topk` a partial sort, `numel(input)·log2(k+1)`;
/// `_assert_tensor_metadata` nothing.
fn flops(ctx: &OpCtx) -> f64 {
    match ctx.op() {
        "aten._assert_tensor_metadata" => 0.0,
        "aten.topk" => {
            let k = ctx.int_arg("k").unwrap_or(1).max(0) as f64;
            ctx.in_shape(0).iter().product::<usize>() as f64 * (k + 1.0).log2()
        }
        _ => ctx.out_numel(),
    }
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, boolean, graph, int, none, rules, A, A::Td, A::T};
    use crate::ir::{DType, Value};
    use crate::rules::rules_for;

    const X: &[usize] = &[2, 16, 4];
    const ALL: &[&str] = &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "sharded G2 -> G2 sharded"];

    #[test]
    fn comparisons_and_fills() {
        for op in ["aten.lt.Scalar", "aten.gt.Scalar", "aten.le.Scalar", "aten.ge.Scalar", "aten.eq.Scalar"] {
            let got = rules(op, vec![("self", T(X)), ("other", int(10))], &[X]);
            assert_rules(&got, ALL);
            assert_eq!(got.flops, 128.0);
        }
        for op in ["aten.zeros_like", "aten.ones_like"] {
            let got = rules(op, vec![("self", T(X)), ("dtype", none())], &[X]);
            let mut expected = ALL.to_vec();
            expected.push("fill R -> I full");
            assert_rules(&got, &expected);
        }
    }

    #[test]
    fn one_hot() {
        let idx = || Td(&[2, 16], DType::I64);
        let got = rules("aten.one_hot", vec![("self", idx()), ("num_classes", int(4))], &[X]);
        assert_rules(&got, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded"]);
        let got = rules("aten.one_hot", vec![("self", idx()), ("num_classes", int(-1))], &[X]);
        assert_rules(&got, &[]);
    }

    #[test]
    fn along_one_dim() {
        let cases: &[(&str, i64, &[&str])] = &[
            ("aten.cumsum", 1, &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded", "partial R -> R full"]),
            ("aten.cumsum", -1, &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded", "partial R -> R full"]),
        ];
        for (op, dim, expected) in cases {
            let got = rules(op, vec![("self", T(X)), ("dim", int(*dim)), ("dtype", none())], &[X]);
            assert_rules(&got, expected);
        }
        // topk: both results split alike
        let args = vec![
            ("self", T(X)),
            ("k", int(2)),
            ("dim", int(-1)),
            ("largest", boolean(true)),
            ("sorted", boolean(true)),
        ];
        let got = rules("aten.topk", args, &[&[2, 16, 2], &[2, 16, 2]]);
        assert_rules(&got, &["sharded G0 -> G0,G0 sharded", "sharded G1 -> G1,G1 sharded"]);
        assert_eq!(got.flops, 128.0 * 3f64.log2());
    }

    #[test]
    fn argmax() {
        let argmax = |dim, keepdim, out: &[usize]| {
            rules("aten.argmax", vec![("self", T(X)), ("dim", dim), ("keepdim", boolean(keepdim))], &[out])
        };
        assert_rules(&argmax(int(1), false, &[2, 4]), &["sharded G0 -> G0 sharded", "sharded G2 -> G1 sharded"]);
        assert_rules(&argmax(int(1), true, &[2, 1, 4]), &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded"]);
        assert_rules(&argmax(int(-1), false, &[2, 16]), &["sharded G0 -> G0 sharded", "sharded G1 -> G1 sharded"]);
        assert_rules(&argmax(none(), false, &[]), &[]);
    }

    #[test]
    fn assert_tensor_metadata_is_replicated_and_free() {
        let args = vec![
            ("a", Td(&[2, 16, 10], DType::I64)),
            ("size", none()),
            ("stride", none()),
            ("dtype", A::V(Value::Str("torch.int64".into()))),
        ];
        let g = graph("aten._assert_tensor_metadata", args, &[(&[], DType::NotATensor)]);
        let got = rules_for(&g, g.nodes.last().unwrap());
        assert_rules(&got, &[]);
        assert_eq!(got.rules[0].outputs.len(), 1);
        assert_eq!(got.flops, 0.0);
    }
}
