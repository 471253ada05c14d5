//! `linear`, `matmul`, `bmm` and two-operand `einsum`: data-parallel splits of free
//! dims, column-parallel (split the output features), row-parallel (split the
//! contraction → partial sums), and partial-sum inputs through a bilinear op.

use super::rule_names::{
    COLUMN_PARALLEL, COLUMN_SPLIT, CONTRACTION_SPLIT, DATA_PARALLEL, PARTIAL, ROW_PARALLEL, ROW_SPLIT, SPLIT,
};
use super::binary::aligned_dim;
use super::{by_name, gather, matmul_class, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::ir::Value;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &["aten.linear", "aten.matmul", "aten.bmm", "aten.einsum"],
    rules,
    flops,
    class: matmul_class,
    check_shapes,
};

const I: Layout = Layout::Identity;
const R: Layout = Layout::Reduce;

fn g(dim: usize) -> Option<Layout> {
    gather(dim)
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    match ctx.op() {
        "aten.linear" => linear(ctx),
        "aten.matmul" | "aten.bmm" => matmul(ctx),
        "aten.einsum" => einsum(ctx).unwrap_or_default(),
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
            rules.push(Rule { name: SPLIT, inputs: vec![la, lb], outputs: vec![lo], work: Work::Sharded });
        }
    }
    rules.push(Rule { name: PARTIAL, inputs: vec![R, I], outputs: vec![R], work: Work::Full });
    rules.push(Rule { name: PARTIAL, inputs: vec![I, R], outputs: vec![R], work: Work::Full });
    Some(rules)
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
        _ => {
            let a = ctx.in_shape(0);
            let k = a.last().copied().unwrap_or(1) as f64;
            2.0 * ctx.out_numel() * k
        }
    }
}

/// `linear`: weight `[out, in]`, input `[…, in]`, bias `[out]`, output `[…, out]`.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
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
