//! Indexing by tensors of positions: `gather(self, dim, index)`,
//! `index_select(self, dim, index)` and advanced indexing `index.Tensor(self, indices)`
//! (a list with a tensor or `None` per leading dim of `self`).
//!
//! A dim that is not indexed splits freely: each rank indexes its own slice of it, and
//! the positions (which address only the indexed dims) stay valid.
//!
//! - `gather`: a dim `d ≠ dim` where `self` and `index` have the same size splits on
//!   both and on the result (`"sharded"`; a batch split when both share the batch).
//! - `index_select`: a dim `d ≠ dim` of `self` splits with `index` replicated
//!   (`"sharded"`), or `index` splits with `self` replicated → the result is split on
//!   `dim` (`"data-parallel"`, like an embedding lookup).
//! - `index.Tensor` with consecutive indexed dims `p…p+k` (the result is
//!   `self[:p] + B + self[p+k:]`, `B` the index tensors' broadcast shape): a dim of
//!   `self` outside them splits with the indices replicated (`"sharded"`), or a dim of
//!   `B` splits on every index tensor that has it (broadcast ones replicated) with `self`
//!   replicated (`"data-parallel"`). Boolean masks and non-consecutive indexed dims
//!   (whose `B` moves to the front) have no split.
//!
//! - `slice_scatter(self, src, dim, …)`/`select_scatter(self, src, dim, index)` (the
//!   functional write of `src` into a slice of `self`): a dim `d ≠ dim` splits on
//!   `self`, on `src`'s matching dim and on the result (`"sharded"`).
//!
//! None of these is linear in its indices, and `index_select`/`gather` are linear in
//! `self` only where the indices are replicated; partial sums are left out.

use super::binary::{aligned_dim, broadcast};
use super::rule_names::{DATA_PARALLEL, SHARDED};
use super::{elementwise_class, gather, Family, OpCtx, Rule, I};
use crate::cost::Work;
use crate::error::Result;
use crate::ir::{DType, Value};
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.gather", "aten.index_select", "aten.index.Tensor", "aten.slice_scatter", "aten.select_scatter"],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.n_outputs() != 1 {
        return Vec::new();
    }
    match ctx.op() {
        "aten.gather" => gather_rules(ctx),
        "aten.index_select" => index_select_rules(ctx),
        "aten.index.Tensor" => index_rules(ctx).unwrap_or_default(),
        "aten.slice_scatter" | "aten.select_scatter" => scatter_rules(ctx).unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Layouts of every tensor operand: `self_layout` for `self`, `other` for the rest.
fn with_self(ctx: &OpCtx, self_index: usize, self_layout: Layout, other: impl Fn(usize) -> Layout) -> Vec<Layout> {
    (0..ctx.n_inputs()).map(|k| if k == self_index { self_layout } else { other(k) }).collect()
}

fn gather_rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(si), Some(ii)) = (ctx.input_index("self"), ctx.input_index("index")) else { return Vec::new() };
    let (x, idx) = (ctx.in_shape(si), ctx.in_shape(ii));
    let Some(dim) = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len())) else { return Vec::new() };
    if idx.len() != x.len() || ctx.out_shape(0) != idx {
        return Vec::new();
    }
    (0..x.len())
        .filter(|&d| d != dim && x[d] == idx[d] && x[d] > 1)
        .filter_map(gather)
        .map(|g| Rule { name: SHARDED, inputs: with_self(ctx, si, g, |_| g), outputs: vec![g], work: Work::Sharded })
        .collect()
}

fn index_select_rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(si), Some(ii)) = (ctx.input_index("self"), ctx.input_index("index")) else { return Vec::new() };
    let x = ctx.in_shape(si);
    let Some(dim) = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len())) else { return Vec::new() };
    if ctx.in_shape(ii).len() > 1 || ctx.out_shape(0).len() != x.len() {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = (0..x.len())
        .filter(|&d| d != dim && x[d] > 1)
        .filter_map(gather)
        .map(|g| Rule { name: SHARDED, inputs: with_self(ctx, si, g, |_| I), outputs: vec![g], work: Work::Sharded })
        .collect();
    if let (Some(g0), Some(g_dim)) = (gather(0), gather(dim)) {
        if ctx.in_shape(ii).len() == 1 {
            rules.push(Rule { name: DATA_PARALLEL, inputs: with_self(ctx, si, I, |_| g0), outputs: vec![g_dim], work: Work::Sharded });
        }
    }
    rules
}

/// For `index.Tensor`: the first indexed dim `p`, the number `k` of indexed dims, the
/// tensor operands of the indices (by operand index) and their broadcast shape; `None`
/// unless the indexed dims are consecutive and indexed by integer tensors.
fn indexing(ctx: &OpCtx) -> Option<(usize, usize, Vec<usize>, Vec<usize>)> {
    let Some(Value::List(items)) = ctx.arg("indices") else { return None };
    let positions: Vec<(usize, usize)> = items
        .iter()
        .enumerate()
        .filter_map(|(p, v)| match v {
            Value::Tensor(k) => Some((p, *k as usize)),
            _ => None,
        })
        .collect();
    let (&(first, _), &(last, _)) = (positions.first()?, positions.last()?);
    let k = positions.len();
    if last + 1 - first != k || k > ctx.in_shape(ctx.input_index("self")?).len() {
        return None;
    }
    let operands: Vec<usize> = positions.iter().map(|&(_, t)| t).collect();
    let mut shape = Vec::new();
    for &t in &operands {
        let meta = ctx.inputs.get(t)?;
        if matches!(meta.dtype, DType::Bool | DType::U8) {
            return None;
        }
        shape = broadcast(&shape, &meta.shape)?;
    }
    Some((first, k, operands, shape))
}

fn index_rules(ctx: &OpCtx) -> Option<Vec<Rule>> {
    let si = ctx.input_index("self")?;
    let x = ctx.in_shape(si);
    let (p, k, operands, b) = indexing(ctx)?;
    let out = ctx.out_shape(0);
    if out.len() != x.len() - k + b.len() {
        return None;
    }
    let mut rules = Vec::new();
    // a dim of self that is not indexed
    for d in (0..x.len()).filter(|&d| (d < p || d >= p + k) && x[d] > 1) {
        let o = if d < p { d } else { d - k + b.len() };
        if let (Some(gi), Some(go)) = (gather(d), gather(o)) {
            rules.push(Rule { name: SHARDED, inputs: with_self(ctx, si, gi, |_| I), outputs: vec![go], work: Work::Sharded });
        }
    }
    // a dim of the indices' broadcast shape
    for (j, &size) in b.iter().enumerate().filter(|(_, &s)| s > 1) {
        let Some(go) = gather(p + j) else { continue };
        let layouts: Vec<Layout> = (0..ctx.n_inputs())
            .map(|t| {
                if operands.contains(&t) && t != si {
                    aligned_dim(ctx.in_shape(t), b.len(), j, size).and_then(gather).unwrap_or(I)
                } else {
                    I
                }
            })
            .collect();
        if layouts.iter().any(|l| matches!(l, Layout::Gather(_))) {
            rules.push(Rule { name: DATA_PARALLEL, inputs: layouts, outputs: vec![go], work: Work::Sharded });
        }
    }
    Some(rules)
}

fn scatter_rules(ctx: &OpCtx) -> Option<Vec<Rule>> {
    let (si, ci) = (ctx.input_index("self")?, ctx.input_index("src")?);
    let (x, src) = (ctx.in_shape(si), ctx.in_shape(ci));
    let dim = OpCtx::norm_dim(ctx.int_arg("dim")?, x.len())?;
    let select = ctx.op() == "aten.select_scatter";
    if src.len() + usize::from(select) != x.len() || ctx.out_shape(0) != x {
        return None;
    }
    let mut rules = Vec::new();
    for d in (0..x.len()).filter(|&d| d != dim && x[d] > 1) {
        let ds = if select && d > dim { d - 1 } else { d };
        if src[ds] != x[d] {
            continue;
        }
        if let (Some(gx), Some(gs)) = (gather(d), gather(ds)) {
            let inputs = (0..ctx.n_inputs()).map(|k| if k == si { gx } else if k == ci { gs } else { I }).collect();
            rules.push(Rule { name: SHARDED, inputs, outputs: vec![gx], work: Work::Sharded });
        }
    }
    Some(rules)
}

/// A copy per result element.
fn flops(ctx: &OpCtx) -> f64 {
    ctx.out_numel()
}

/// `gather`: `index` has `self`'s rank and the result `index`'s shape; `index_select`:
/// the result is `self` with `dim` resized to the index count; `index.Tensor` (when
/// its indexed dims are consecutive): `self[:p] + B + self[p+k:]`.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    match ctx.op() {
        "aten.gather" => {
            let idx = ctx.require_input(1)?;
            if idx.rank() != x.rank() || out.shape != idx.shape {
                return ctx.shape_error(format!(
                    "self {:?}, index {:?} and result {:?} do not match",
                    x.shape, idx.shape, out.shape
                ));
            }
        }
        "aten.index_select" => {
            let idx = ctx.require_input(1)?;
            let dim = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.rank()));
            let mut expect = x.shape.clone();
            if let Some(d) = dim {
                expect[d] = idx.numel();
            }
            if dim.is_none() || idx.rank() > 1 || out.shape != expect {
                return ctx.shape_error(format!(
                    "self {:?} indexed by {:?} gives {:?}, not {:?}",
                    x.shape, idx.shape, expect, out.shape
                ));
            }
        }
        "aten.slice_scatter" | "aten.select_scatter" => {
            if out.shape != x.shape {
                return ctx.shape_error(format!("result {:?} differs from self {:?}", out.shape, x.shape));
            }
        }
        _ => {
            if let Some((p, k, _, b)) = indexing(ctx) {
                let expect: Vec<usize> = x.shape[..p].iter().chain(&b).chain(&x.shape[p + k..]).copied().collect();
                if out.shape != expect {
                    return ctx.shape_error(format!(
                        "self {:?} indexed at dims {p}..{} by shape {b:?} gives {expect:?}, not {:?}",
                        x.shape,
                        p + k,
                        out.shape
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::ir::{DType, Value};
    use crate::rules::testkit::{assert_rules, boolean, graph, int, rules, A, A::Td, A::T};
    use crate::rules::{check_shapes, rules_for};

    fn indices(items: &[Option<u32>]) -> A {
        A::V(Value::List(items.iter().map(|i| i.map_or(Value::None(()), Value::Tensor)).collect()))
    }

    #[test]
    fn gather_splits_dims_self_and_index_share() {
        // a loss's pick of the target's log-probability: [8, 5] by [8, 1] along dim 1
        let args = vec![("self", T(&[8, 5])), ("dim", int(1)), ("index", Td(&[8, 1], DType::I64)), ("sparse_grad", boolean(false))];
        let got = rules("aten.gather", args, &[&[8, 1]]);
        assert_rules(&got, &["sharded G0,G0 -> G0 sharded"]);
        assert_eq!(got.flops, 8.0);
    }

    #[test]
    fn index_select_splits_self_or_index() {
        let args = vec![("self", T(&[10, 6])), ("dim", int(0)), ("index", Td(&[4], DType::I64))];
        let got = rules("aten.index_select", args, &[&[4, 6]]);
        assert_rules(&got, &["sharded G1,I -> G1 sharded", "data-parallel I,G0 -> G0 sharded"]);
    }

    #[test]
    fn advanced_indexing() {
        // the tensor operands are ordered self, then the indices (as lowering lists them)
        let tokens = || Td(&[4, 16], DType::I64);
        // table[ids]: an embedding-like lookup
        let got = rules("aten.index.Tensor", vec![("self", T(&[128, 8])), ("ids", tokens()), ("indices", indices(&[Some(1)]))], &[&[4, 16, 8]]);
        assert_rules(
            &got,
            &["sharded G1,I -> G2 sharded", "data-parallel I,G0 -> G0 sharded", "data-parallel I,G1 -> G1 sharded"],
        );
        // x[:, pos] with x [4, 16, 8] and pos [3]: batch and features split
        let args = vec![("self", T(&[4, 16, 8])), ("pos", Td(&[3], DType::I64)), ("indices", indices(&[None, Some(1)]))];
        let got = rules("aten.index.Tensor", args, &[&[4, 3, 8]]);
        assert_rules(&got, &["sharded G0,I -> G0 sharded", "sharded G2,I -> G2 sharded", "data-parallel I,G0 -> G1 sharded"]);
        // x[rows, cols] with broadcast index tensors [4, 1] and [1, 3]
        let args = vec![
            ("self", T(&[6, 7, 8])),
            ("rows", Td(&[4, 1], DType::I64)),
            ("cols", Td(&[1, 3], DType::I64)),
            ("indices", indices(&[Some(1), Some(2)])),
        ];
        let got = rules("aten.index.Tensor", args, &[&[4, 3, 8]]);
        assert_rules(
            &got,
            &["sharded G2,I,I -> G2 sharded", "data-parallel I,G0,I -> G0 sharded", "data-parallel I,I,G1 -> G1 sharded"],
        );
        // non-consecutive indexed dims and masks: no split
        let args = vec![("self", T(&[4, 5, 6])), ("a", Td(&[3], DType::I64)), ("b", Td(&[3], DType::I64)), ("indices", indices(&[Some(1), None, Some(2)]))];
        assert_rules(&rules("aten.index.Tensor", args, &[&[3, 5]]), &[]);
        let args = vec![("self", T(&[4, 5])), ("m", Td(&[4], DType::Bool)), ("indices", indices(&[Some(1)]))];
        assert_rules(&rules("aten.index.Tensor", args, &[&[2, 5]]), &[]);
    }

    #[test]
    fn scatters_into_slices() {
        // T5's shift right: labels [4, 16] written into [4, 16] at columns 1..
        let args = vec![("self", Td(&[4, 16], DType::I64)), ("src", Td(&[4, 15], DType::I64)), ("dim", int(1)), ("start", int(1))];
        assert_rules(&rules("aten.slice_scatter", args, &[&[4, 16]]), &["sharded G0,G0 -> G0 sharded"]);
        let args = vec![("self", Td(&[4, 16], DType::I64)), ("src", Td(&[4], DType::I64)), ("dim", int(1)), ("index", int(0))];
        assert_rules(&rules("aten.select_scatter", args, &[&[4, 16]]), &["sharded G0,G0 -> G0 sharded"]);
    }

    #[test]
    fn shape_checks() {
        let g = graph(
            "aten.index.Tensor",
            vec![("self", T(&[128, 8])), ("ids", Td(&[4, 16], DType::I64)), ("indices", indices(&[Some(1)]))],
            &[(&[4, 8], DType::F32)],
        );
        let err = check_shapes(&g, g.nodes.last().unwrap()).unwrap_err();
        assert!(err.to_string().contains("gives [4, 16, 8]"), "{err}");
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &[]);
        let g = graph(
            "aten.gather",
            vec![("self", T(&[8, 5])), ("dim", int(1)), ("index", Td(&[8], DType::I64))],
            &[(&[8], DType::F32)],
        );
        assert!(check_shapes(&g, g.nodes.last().unwrap()).is_err());
    }
}
