//! `linear`, `matmul`, `bmm`, two-operand `einsum`, and the fused multiply-adds
//! `addmm(self, mat1 [M, K], mat2 [K, N])` (GPT-2's `Conv1D`: `self` the bias) and
//! `baddbmm(self, batch1 [B, M, K], batch2 [B, K, N])`: data-parallel splits of free
//! dims, column-parallel (split the output features), row-parallel (split the
//! contraction → partial sums), and partial-sum inputs through a bilinear op. An
//! `einsum` splits any one letter; the split of the letter that indexes stacked expert
//! weights is named `expert-parallel`.
//!
//! For `addmm`/`baddbmm` the added `self` broadcasts to the result: it is split where
//! its aligned dim is (replicated where it broadcasts), and added on rank 0 only when
//! the product is a partial sum (the runtime adds `0 · self` on the other ranks).

use super::rule_names::{
    COLUMN_PARALLEL, COLUMN_SPLIT, CONTRACTION_SPLIT, DATA_PARALLEL, EXPERT_PARALLEL, PARTIAL, ROW_PARALLEL, ROW_SPLIT,
    SPLIT,
};
use super::binary::aligned_dim;
use super::{by_name, gather, matmul_class, Family, OpCtx, Rule, I};
use crate::cost::Work;
use crate::error::Result;
use crate::ir::{NodeKind, Value};
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.linear", "aten.matmul", "aten.bmm", "aten.einsum", "aten.addmm", "aten.baddbmm"],
    rules,
    flops,
    class: matmul_class,
    check_shapes,
};

const R: Layout = Layout::Reduce;

fn g(dim: usize) -> Option<Layout> {
    gather(dim)
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    match ctx.op() {
        "aten.linear" => linear(ctx),
        "aten.matmul" | "aten.bmm" => matmul(ctx),
        "aten.einsum" => einsum(ctx).unwrap_or_default(),
        "aten.addmm" | "aten.baddbmm" => add_product(ctx).unwrap_or_default(),
        _ => Vec::new(),
    }
}

fn linear(ctx: &OpCtx) -> Vec<Rule> {
    let x_rank = ctx.in_shape(0).len();
    if x_rank == 0 {
        return Vec::new();
    }
    let last = x_rank - 1;
    let mut rules = Vec::new();
    // data / sequence parallel: split any dim of x but the features
    for d in 0..last {
        let Some(gd) = g(d) else { continue };
        rules.push(Rule {
            name: DATA_PARALLEL,
            inputs: by_name(ctx, &[("input", gd)], I),
            outputs: vec![gd],
            work: Work::Sharded,
        });
    }
    if let (Some(g0), Some(g1), Some(glast)) = (g(0), g(1), g(last)) {
        // column parallel: split the output features (weight rows, bias)
        rules.push(Rule {
            name: COLUMN_PARALLEL,
            inputs: by_name(ctx, &[("input", I), ("weight", g0), ("bias", g0)], I),
            outputs: vec![glast],
            work: Work::Sharded,
        });
        // row parallel: split the contraction; the bias is added on rank 0 only
        rules.push(Rule {
            name: ROW_PARALLEL,
            inputs: by_name(ctx, &[("input", glast), ("weight", g1), ("bias", I)], I),
            outputs: vec![R],
            work: Work::Sharded,
        });
    }
    // a partial-sum input stays partial; the bias is added on rank 0 only
    rules.push(Rule { name: PARTIAL, inputs: by_name(ctx, &[("input", R)], I), outputs: vec![R], work: Work::Full });
    rules
}

fn matmul(ctx: &OpCtx) -> Vec<Rule> {
    let (a, b, out) = (ctx.in_shape(0), ctx.in_shape(1), ctx.out_shape(0));
    if ctx.n_inputs() != 2 || a.len() < 2 || b.len() < 2 || out.len() < 2 {
        return Vec::new();
    }
    let (ra, rb, ro) = (a.len(), b.len(), out.len());
    let mut rules = Vec::new();
    let mut push = |name, la: Option<Layout>, lb: Option<Layout>, lo: Option<Layout>, work| {
        if let (Some(la), Some(lb), Some(lo)) = (la, lb, lo) {
            rules.push(Rule { name, inputs: vec![la, lb], outputs: vec![lo], work });
        }
    };
    // batch dims (aligned from the right, broadcast operands replicated)
    for (d, &size) in out[..ro - 2].iter().enumerate() {
        let da = aligned_dim(&a[..ra - 2], ro - 2, d, size);
        let db = aligned_dim(&b[..rb - 2], ro - 2, d, size);
        if da.is_none() && db.is_none() {
            continue;
        }
        let la = da.map_or(Some(I), g);
        let lb = db.map_or(Some(I), g);
        push(DATA_PARALLEL, la, lb, g(d), Work::Sharded);
    }
    push(ROW_SPLIT, g(ra - 2), Some(I), g(ro - 2), Work::Sharded);
    push(COLUMN_SPLIT, Some(I), g(rb - 1), g(ro - 1), Work::Sharded);
    push(CONTRACTION_SPLIT, g(ra - 1), g(rb - 2), Some(R), Work::Sharded);
    push(PARTIAL, Some(R), Some(I), Some(R), Work::Full);
    push(PARTIAL, Some(I), Some(R), Some(R), Work::Full);
    rules
}

/// `addmm`/`baddbmm`: `self + mat1 @ mat2` with the product's last two dims `[M, N]`
/// contracted over `K` (and a leading batch dim for `baddbmm`).
fn add_product(ctx: &OpCtx) -> Option<Vec<Rule>> {
    let names = if ctx.op() == "aten.addmm" { ["self", "mat1", "mat2"] } else { ["self", "batch1", "batch2"] };
    let [bias, a, b] = names.map(|n| ctx.input_index(n));
    let (bias, a, b) = (bias?, a?, b?);
    let out = ctx.out_shape(0);
    let ro = out.len();
    if ro < 2 || ctx.in_shape(a).len() != ro || ctx.in_shape(b).len() != ro {
        return None;
    }
    // the layout of `self` for a split of result dim d
    let bias_for = |d: usize| aligned_dim(ctx.in_shape(bias), ro, d, out[d]).map_or(Some(I), g);
    let rule = |name, lb: Option<Layout>, la: Option<Layout>, lm: Option<Layout>, lo: Option<Layout>, work| {
        let mut inputs = vec![I; ctx.n_inputs()];
        inputs[bias] = lb?;
        inputs[a] = la?;
        inputs[b] = lm?;
        Some(Rule { name, inputs, outputs: vec![lo?], work })
    };
    let (m, n, k_a, k_b) = (ro - 2, ro - 1, ro - 1, ro - 2);
    let mut rules = Vec::new();
    // baddbmm's batch
    if ro == 3 {
        rules.push(rule(DATA_PARALLEL, bias_for(0), g(0), g(0), g(0), Work::Sharded));
    }
    // the rows of the product (addmm: the tokens)
    let rows = if ro == 2 { DATA_PARALLEL } else { ROW_SPLIT };
    rules.push(rule(rows, bias_for(m), g(m), Some(I), g(m), Work::Sharded));
    rules.push(rule(COLUMN_PARALLEL, bias_for(n), Some(I), g(n), g(n), Work::Sharded));
    // the contraction: partial sums, `self` added on rank 0 only
    rules.push(rule(ROW_PARALLEL, Some(I), g(k_a), g(k_b), Some(R), Work::Sharded));
    rules.push(rule(PARTIAL, Some(I), Some(R), Some(I), Some(R), Work::Full));
    Some(rules.into_iter().flatten().collect())
}

/// The equation of a two-operand einsum: (letters of a, letters of b, letters of out).
fn parse_equation(ctx: &OpCtx) -> Option<(Vec<char>, Vec<char>, Vec<char>)> {
    let Some(Value::Str(eq)) = ctx.arg("equation") else { return None };
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, out) = eq.split_once("->")?;
    let (a, b) = lhs.split_once(',')?;
    if b.contains(',') || eq.contains('.') {
        return None;
    }
    Some((a.chars().collect(), b.chars().collect(), out.chars().collect()))
}

fn einsum(ctx: &OpCtx) -> Option<Vec<Rule>> {
    if ctx.n_inputs() != 2 {
        return None;
    }
    let (a, b, out) = parse_equation(ctx)?;
    if a.len() != ctx.in_shape(0).len() || b.len() != ctx.in_shape(1).len() || out.len() != ctx.out_shape(0).len() {
        return None;
    }
    let pos = |s: &[char], c: char| {
        let mut hits = s.iter().enumerate().filter(|(_, x)| **x == c).map(|(i, _)| i);
        match (hits.next(), hits.next()) {
            (Some(i), None) => Some(Some(i)),
            (None, _) => Some(None),
            _ => None, // repeated letter (a diagonal): not split
        }
    };
    let mut letters: Vec<char> = a.iter().chain(&b).copied().collect();
    letters.sort_unstable();
    letters.dedup();
    let mut rules = Vec::new();
    for c in letters {
        let (Some(ia), Some(ib), Some(io)) = (pos(&a, c), pos(&b, c), pos(&out, c)) else { continue };
        let la = match ia {
            Some(i) => g(i),
            None => Some(I),
        };
        let lb = match ib {
            Some(i) => g(i),
            None => Some(I),
        };
        let lo = match io {
            Some(i) => g(i),
            None => Some(R),
        };
        if let (Some(la), Some(lb), Some(lo)) = (la, lb, lo) {
            let name = if indexes_expert_weights(ctx, [&a, &b], c) { EXPERT_PARALLEL } else { SPLIT };
            rules.push(Rule { name, inputs: vec![la, lb], outputs: vec![lo], work: Work::Sharded });
        }
    }
    rules.push(Rule { name: PARTIAL, inputs: vec![R, I], outputs: vec![R], work: Work::Full });
    rules.push(Rule { name: PARTIAL, inputs: vec![I, R], outputs: vec![R], work: Work::Full });
    Some(rules)
}

/// Whether einsum letter `c` indexes stacked expert weights: it is the leading dim of an
/// operand of rank 3 or more that is a parameter (`[E, out, in]` in Mixtral and
/// Qwen2-MoE, `[E, in, out]` in GShard-style layers). Splitting it is expert
/// parallelism: each rank holds and runs only its experts.
fn indexes_expert_weights(ctx: &OpCtx, operands: [&[char]; 2], c: char) -> bool {
    operands.iter().enumerate().any(|(k, letters)| {
        letters.len() >= 3
            && letters.first() == Some(&c)
            && ctx
                .node
                .inputs
                .get(k)
                .and_then(|r| ctx.graph.nodes.get(r.node()))
                .is_some_and(|n| n.kind == NodeKind::Parameter)
    })
}

fn flops(ctx: &OpCtx) -> f64 {
    match ctx.op() {
        "aten.linear" => {
            let x = ctx.in_shape(0);
            let k = x.last().copied().unwrap_or(1) as f64;
            2.0 * ctx.out_numel() * k + ctx.out_numel()
        }
        "aten.einsum" => match parse_equation(ctx) {
            Some((a, b, _)) => {
                let mut sizes = std::collections::BTreeMap::new();
                for (letters, shape) in [(&a, ctx.in_shape(0)), (&b, ctx.in_shape(1))] {
                    for (c, s) in letters.iter().zip(shape) {
                        sizes.insert(*c, *s as f64);
                    }
                }
                2.0 * sizes.values().product::<f64>()
            }
            None => ctx.out_numel(),
        },
        "aten.addmm" | "aten.baddbmm" => {
            let a = ctx.in_shape(1);
            let k = a.last().copied().unwrap_or(1) as f64;
            2.0 * ctx.out_numel() * k + ctx.out_numel()
        }
        _ => {
            let a = ctx.in_shape(0);
            let k = a.last().copied().unwrap_or(1) as f64;
            2.0 * ctx.out_numel() * k
        }
    }
}

/// `linear`: weight `[out, in]`, input `[…, in]`, bias `[out]`, output `[…, out]`;
/// `addmm`/`baddbmm`: `[(B,) M, K] @ [(B,) K, N]` is the result `[(B,) M, N]` and `self`
/// broadcasts to it.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    if matches!(ctx.op(), "aten.addmm" | "aten.baddbmm") {
        return check_add_product(ctx);
    }
    if ctx.op() != "aten.linear" {
        return Ok(());
    }
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    let w = ctx.require_input(1)?;
    if w.rank() != 2 {
        return ctx.shape_error(format!("weight must be 2-D, got shape {:?}", w.shape));
    }
    if x.rank() == 0 || x.shape[x.rank() - 1] != w.shape[1] {
        return ctx.shape_error(format!("input {:?} does not match weight {:?} (in features)", x.shape, w.shape));
    }
    if let Some(b) = ctx.tensor_arg("bias") {
        if b.shape != [w.shape[0]] {
            return ctx.shape_error(format!("bias {:?} does not match weight {:?}", b.shape, w.shape));
        }
    }
    let mut expect = x.shape.clone();
    *expect.last_mut().unwrap_or(&mut 0) = w.shape[0];
    if out.shape != expect {
        return ctx.shape_error(format!(
            "output {:?} but input {:?} × weight {:?} gives {:?}",
            out.shape, x.shape, w.shape, expect
        ));
    }
    Ok(())
}

fn check_add_product(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let (bias, a, b) = (ctx.require_input(0)?, ctx.require_input(1)?, ctx.require_input(2)?);
    let rank = if ctx.op() == "aten.addmm" { 2 } else { 3 };
    if a.rank() != rank || b.rank() != rank {
        return ctx.shape_error(format!("operands {:?} and {:?} must be {rank}-D", a.shape, b.shape));
    }
    let (ra, rb) = (&a.shape, &b.shape);
    let mut expect = ra[..rank - 1].to_vec();
    expect.push(rb[rank - 1]);
    if ra[rank - 1] != rb[rank - 2] || ra[..rank - 2] != rb[..rank - 2] || out.shape != expect {
        return ctx.shape_error(format!("{ra:?} @ {rb:?} does not give the result {:?}", out.shape));
    }
    if super::binary::broadcast(&bias.shape, &out.shape).as_deref() != Some(out.shape.as_slice()) {
        return ctx.shape_error(format!("self {:?} does not broadcast to the result {:?}", bias.shape, out.shape));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::cost::WorkClass;
    use crate::ir::{DType, NodeKind, Value};
    use crate::rules::testkit::{assert_rules, float, graph, rules, A, A::T};
    use crate::rules::{check_shapes, rules_for};

    #[test]
    fn addmm_like_linear() {
        // GPT-2's Conv1D: bias [N] + x [M, K] @ w [K, N]
        let args = vec![("self", T(&[96])), ("mat1", T(&[32, 64])), ("mat2", T(&[64, 96])), ("beta", float(1.0)), ("alpha", float(1.0))];
        let got = rules("aten.addmm", args, &[&[32, 96]]);
        assert_rules(
            &got,
            &[
                "data-parallel I,G0,I -> G0 sharded",
                "column-parallel G0,I,G1 -> G1 sharded",
                "row-parallel I,G1,G0 -> R sharded",
                "partial I,R,I -> R full",
            ],
        );
        assert_eq!(got.flops, 2.0 * 32.0 * 96.0 * 64.0 + 32.0 * 96.0);
        assert_eq!(got.class, WorkClass::Matmul);
        // a full [M, N] self splits with the rows and the columns
        let args = vec![("self", T(&[32, 96])), ("mat1", T(&[32, 64])), ("mat2", T(&[64, 96]))];
        let got = rules("aten.addmm", args, &[&[32, 96]]);
        assert_rules(
            &got,
            &[
                "data-parallel G0,G0,I -> G0 sharded",
                "column-parallel G1,I,G1 -> G1 sharded",
                "row-parallel I,G1,G0 -> R sharded",
                "partial I,R,I -> R full",
            ],
        );
    }

    #[test]
    fn baddbmm_splits() {
        let args = vec![("self", T(&[1, 8, 8])), ("batch1", T(&[4, 8, 16])), ("batch2", T(&[4, 16, 8]))];
        let got = rules("aten.baddbmm", args, &[&[4, 8, 8]]);
        assert_rules(
            &got,
            &[
                "data-parallel I,G0,G0 -> G0 sharded",
                "row-split G1,G1,I -> G1 sharded",
                "column-parallel G2,I,G2 -> G2 sharded",
                "row-parallel I,G2,G1 -> R sharded",
                "partial I,R,I -> R full",
            ],
        );
        assert_eq!(got.flops, 2.0 * 4.0 * 64.0 * 16.0 + 4.0 * 64.0);
    }

    #[test]
    fn einsum_names_the_split_of_stacked_expert_weights() {
        // Mixtral's up projection run densely: x [T, H], gate_up_proj [E, 2I, H] -> [E, T, 2I]
        let eq = || A::V(Value::Str("th,eih->eti".into()));
        let args = || vec![("equation", eq()), ("x", T(&[16, 8])), ("w", T(&[4, 32, 8]))];
        let mut g = graph("aten.einsum", args(), &[(&[4, 16, 32], DType::F32)]);
        let splits = |experts: &'static str| {
            [
                "split G0,I -> G1 sharded",
                experts,
                "split I,G1 -> G2 sharded",
                "split G1,G2 -> R sharded",
                "partial R,I -> R full",
                "partial I,R -> R full",
            ]
        };
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &splits("split I,G0 -> G0 sharded"));
        g.nodes[1].kind = NodeKind::Parameter; // the weights are a parameter: the split of `e` is expert parallelism
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &splits("expert-parallel I,G0 -> G0 sharded"));
    }

    #[test]
    fn add_product_shape_checks() {
        let bad = |bias: &'static [usize], out: &'static [usize]| {
            let g = graph(
                "aten.addmm",
                vec![("self", T(bias)), ("mat1", T(&[32, 64])), ("mat2", T(&[64, 96]))],
                &[(out, DType::F32)],
            );
            check_shapes(&g, g.nodes.last().unwrap()).map_err(|e| e.to_string())
        };
        assert!(bad(&[96], &[32, 96]).is_ok());
        assert!(bad(&[95], &[32, 96]).unwrap_err().contains("does not broadcast"));
        assert!(bad(&[96], &[32, 95]).unwrap_err().contains("does not give"));
    }
}
