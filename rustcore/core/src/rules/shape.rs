//! Views, reshapes, permutes, concatenation and slicing: free ops that map a split dim
//! of the input onto a split dim of the output (and keep partial sums partial).

use super::rule_names::{BROADCAST_SPLIT, PARTIAL, SHARDED};
use super::{elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.view",
        "aten.reshape",
        "aten._unsafe_view",
        "aten.flatten.using_ints",
        "aten.transpose.int",
        "aten.permute",
        "aten.t",
        "aten.unsqueeze",
        "aten.squeeze.dim",
        "aten.expand",
        "aten.cat",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.chunk",
        "aten.split.Tensor",
        "aten.unflatten.int",
        "aten.alias",
        "aten.detach",
        "aten.lift_fresh_copy",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    if ctx.op() == "aten.cat" {
        return cat_rules(ctx);
    }
    let x = ctx.in_shape(0);
    // an op whose dims cannot be read has no rule at all
    let Some(mapping) = dim_map(ctx) else { return Vec::new() };
    let mut rules: Vec<Rule> = mapping
        .into_iter()
        .filter(|&(i, _)| x.get(i).is_some_and(|&s| s > 1))
        .filter_map(|(i, o)| Some(ctx.uniform(SHARDED, gather(i)?, gather(o)?, Work::Free)))
        .collect();
    if ctx.op() == "aten.expand" {
        rules.extend(broadcast_split(x, ctx.out_shape(0)).into_iter().map(|g| Rule {
            name: BROADCAST_SPLIT,
            inputs: vec![Layout::Identity],
            outputs: vec![g],
            work: Work::Free,
        }));
    }
    rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Free));
    rules
}

/// How a view maps its operand's dims to its result's: (operand dim, result dim) for
/// each dim a slice along stays a slice along; `None` when the op's dims cannot be
/// read (then it has no rule).
fn dim_map(ctx: &OpCtx) -> Option<Vec<(usize, usize)>> {
    let x = ctx.in_shape(0);
    let mapping = match ctx.op() {
        "aten.view" | "aten.reshape" | "aten._unsafe_view" | "aten.flatten.using_ints" | "aten.unflatten.int" => {
            reshape_map(x, ctx.out_shape(0))
        }
        "aten.alias" | "aten.detach" | "aten.lift_fresh_copy" => (0..x.len()).map(|d| (d, d)).collect(),
        "aten.transpose.int" => {
            let rank = x.len();
            let dims = (ctx.int_arg("dim0"), ctx.int_arg("dim1"));
            let (Some(a), Some(b)) = dims else { return None };
            let (Some(a), Some(b)) = (OpCtx::norm_dim(a, rank), OpCtx::norm_dim(b, rank)) else { return None };
            (0..rank).map(|d| (d, if d == a { b } else if d == b { a } else { d })).collect()
        }
        "aten.t" => (0..x.len()).map(|d| (d, x.len() - 1 - d)).collect(),
        "aten.permute" => {
            let dims = ctx.ints_arg("dims")?;
            dims.iter()
                .enumerate()
                .filter_map(|(o, &i)| OpCtx::norm_dim(i, x.len()).map(|i| (i, o)))
                .collect()
        }
        "aten.unsqueeze" => {
            let dim = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len() + 1))?;
            (0..x.len()).map(|d| (d, if d < dim { d } else { d + 1 })).collect()
        }
        "aten.squeeze.dim" => {
            let dim = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len()))?;
            if x[dim] != 1 {
                (0..x.len()).map(|d| (d, d)).collect()
            } else {
                (0..x.len()).filter(|&d| d != dim).map(|d| (d, if d < dim { d } else { d - 1 })).collect()
            }
        }
        "aten.expand" => {
            let out = ctx.out_shape(0);
            let offset = out.len().saturating_sub(x.len());
            (0..x.len()).filter(|&d| x[d] == out[d + offset] && x[d] != 1).map(|d| (d, d + offset)).collect()
        }
        "aten.slice.Tensor" | "aten.chunk" | "aten.split.Tensor" => {
            let dim = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len()))?;
            (0..x.len()).filter(|&d| d != dim).map(|d| (d, d)).collect()
        }
        "aten.select.int" => {
            let dim = ctx.int_arg("dim").and_then(|d| OpCtx::norm_dim(d, x.len()))?;
            (0..x.len()).filter(|&d| d != dim).map(|d| (d, if d < dim { d } else { d - 1 })).collect()
        }
        _ => Vec::new(),
    };
    Some(mapping)
}

/// `expand` from `x` to `out`: the result dims that broadcast makes (a size-1 dim of
/// `x` or a new leading dim, of length > 1), as `Gather` layouts of the result. Each
/// rank expands the whole operand to its own length there.
fn broadcast_split(x: &[usize], out: &[usize]) -> Vec<Layout> {
    let offset = out.len().saturating_sub(x.len());
    (0..out.len())
        .filter(|&d| out[d] > 1 && (d < offset || x.get(d - offset) == Some(&1)))
        .filter_map(gather)
        .collect()
}

/// `cat(tensors, dim)`: any other dim split on every operand and the result, and
/// partial sums kept. A 1-D operand with no elements is left out of the alignment
/// (torch.cat skips it: transformers' legacy caches start as such) and stays whole.
fn cat_rules(ctx: &OpCtx) -> Vec<Rule> {
    let out = ctx.out_shape(0);
    let Some(dim) = OpCtx::norm_dim(ctx.int_arg("dim").unwrap_or(0), out.len()) else { return Vec::new() };
    let skipped: Vec<bool> = (0..ctx.n_inputs()).map(|k| out.len() > 1 && ctx.in_shape(k) == [0]).collect();
    let mut rules: Vec<Rule> = (0..out.len())
        .filter(|&d| d != dim && out[d] > 1)
        .filter_map(gather)
        .map(|g| Rule {
            name: SHARDED,
            inputs: skipped.iter().map(|&s| if s { Layout::Identity } else { g }).collect(),
            outputs: vec![g; ctx.n_outputs()],
            work: Work::Free,
        })
        .collect();
    rules.push(ctx.uniform(PARTIAL, Layout::Reduce, Layout::Reduce, Work::Free));
    rules
}

/// Views and copies move data but do no arithmetic.
fn flops(_: &OpCtx) -> f64 {
    0.0
}

/// Reshapes keep the number of elements; transposes and permutes also the rank.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    match ctx.op() {
        "aten.view" | "aten.reshape" | "aten._unsafe_view" | "aten.flatten.using_ints" | "aten.unflatten.int" => {
            let out = ctx.require_out()?;
            let x = ctx.require_input(0)?;
            if x.numel() != out.numel() {
                return ctx.shape_error(format!(
                    "{:?} ({} elements) cannot become {:?} ({} elements)",
                    x.shape,
                    x.numel(),
                    out.shape,
                    out.numel()
                ));
            }
        }
        "aten.alias" | "aten.detach" | "aten.lift_fresh_copy" => return super::check_same_shape(ctx),
        "aten.transpose.int" | "aten.permute" | "aten.t" => {
            let out = ctx.require_out()?;
            let x = ctx.require_input(0)?;
            if x.rank() != out.rank() || x.numel() != out.numel() {
                return ctx.shape_error(format!("input {:?} and output {:?} differ in rank or size", x.shape, out.shape));
            }
        }
        _ => {}
    }
    Ok(())
}

/// For a reshape from `a` to `b`: pairs (dim of a, dim of b) where a split of the
/// first non-trivial dim of a group of `a` is exactly a split of the first non-trivial
/// dim of the matching group of `b` (groups: runs of dims with equal products).
fn reshape_map(a: &[usize], b: &[usize]) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        // skip size-1 dims at a group start: they hold nothing to split
        if a[i] == 1 {
            i += 1;
            continue;
        }
        if b[j] == 1 {
            j += 1;
            continue;
        }
        let (start_a, start_b) = (i, j);
        let (mut pa, mut pb) = (a[i], b[j]);
        i += 1;
        j += 1;
        while pa != pb {
            if pa < pb {
                let Some(&s) = a.get(i) else { return pairs };
                pa *= s;
                i += 1;
            } else {
                let Some(&s) = b.get(j) else { return pairs };
                pb *= s;
                j += 1;
            }
        }
        pairs.push((start_a, start_b));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::reshape_map;
    use crate::rules::testkit::{assert_rules, int, ints, rules, A::T};

    #[test]
    fn unflatten_maps_like_a_reshape() {
        // ViT's attention: [5, 8, 192] -> [5, 8, 3, 64]
        let args = vec![("self", T(&[5, 8, 192])), ("dim", int(-1)), ("sizes", ints(&[3, 64]))];
        let got = rules("aten.unflatten.int", args, &[&[5, 8, 3, 64]]);
        assert_rules(
            &got,
            &[
                "sharded G0 -> G0 free",
                "sharded G1 -> G1 free",
                "sharded G2 -> G2 free",
                "partial R -> R free",
            ],
        );
        assert_eq!(got.flops, 0.0);
    }

    #[test]
    fn aliases_keep_every_split() {
        for op in ["aten.alias", "aten.detach", "aten.lift_fresh_copy"] {
            let got = rules(op, vec![("self", T(&[4, 1, 6]))], &[&[4, 1, 6]]);
            assert_rules(&got, &["sharded G0 -> G0 free", "sharded G2 -> G2 free", "partial R -> R free"]);
        }
    }

    #[test]
    fn expand_splits_what_it_broadcasts() {
        // ViT's class token: [1, 1, 64] -> [B, 1, 64]
        let args = vec![("self", T(&[1, 1, 64])), ("size", ints(&[8, -1, -1]))];
        let got = rules("aten.expand", args, &[&[8, 1, 64]]);
        assert_rules(&got, &["broadcast-split I -> G0 free", "sharded G2 -> G2 free", "partial R -> R free"]);
        // positions [1, 16] -> [B, 16], and a new leading dim
        let args = vec![("self", T(&[1, 16])), ("size", ints(&[4, -1]))];
        let got = rules("aten.expand", args, &[&[4, 16]]);
        assert_rules(&got, &["broadcast-split I -> G0 free", "sharded G1 -> G1 free", "partial R -> R free"]);
        let args = vec![("self", T(&[16])), ("size", ints(&[3, 4, 16]))];
        let got = rules("aten.expand", args, &[&[3, 4, 16]]);
        assert_rules(
            &got,
            &["broadcast-split I -> G0 free", "broadcast-split I -> G1 free", "sharded G0 -> G2 free", "partial R -> R free"],
        );
    }

    #[test]
    fn cat_leaves_legacy_empty_operands_whole() {
        // T5's legacy cache: cat([empty [0], kv [B, H, S, D]], dim=-2)
        let args = vec![("a", T(&[0])), ("b", T(&[4, 2, 8, 16])), ("dim", int(-2))];
        let got = rules("aten.cat", args, &[&[4, 2, 8, 16]]);
        assert_rules(
            &got,
            &[
                "sharded I,G0 -> G0 free",
                "sharded I,G1 -> G1 free",
                "sharded I,G3 -> G3 free",
                "partial R,R -> R free",
            ],
        );
        // ViT: cat([class token [B, 1, 64], patches [B, 16, 64]], dim=1)
        let args = vec![("a", T(&[4, 1, 64])), ("b", T(&[4, 16, 64])), ("dim", int(1))];
        let got = rules("aten.cat", args, &[&[4, 17, 64]]);
        assert_rules(&got, &["sharded G0,G0 -> G0 free", "sharded G2,G2 -> G2 free", "partial R,R -> R free"]);
    }

    #[test]
    fn identity_and_merging_reshapes_keep_the_leading_split() {
        // Mixtral's router input: [32, 16, 64] -> [512, 64] -> [512, 64]
        assert_eq!(reshape_map(&[32, 16, 64], &[512, 64]), vec![(0, 0), (2, 1)]);
        assert_eq!(reshape_map(&[512, 64], &[512, 64]), vec![(0, 0), (1, 1)]);
        let got = rules("aten.reshape", vec![("self", T(&[512, 64])), ("shape", ints(&[-1, 64]))], &[&[512, 64]]);
        assert_rules(&got, &["sharded G0 -> G0 free", "sharded G1 -> G1 free", "partial R -> R free"]);
    }

    #[test]
    fn reshape_groups() {
        assert_eq!(reshape_map(&[4, 8, 768], &[4, 8, 12, 64]), vec![(0, 0), (1, 1), (2, 2)]);
        assert_eq!(reshape_map(&[4, 8, 50], &[32, 50]), vec![(0, 0), (2, 1)]);
        assert_eq!(reshape_map(&[32], &[4, 8]), vec![(0, 0)]);
        assert_eq!(reshape_map(&[2, 1, 6], &[2, 6]), vec![(0, 0), (2, 1)]);
        assert_eq!(reshape_map(&[6, 4], &[4, 6]), vec![(0, 0)]);
    }
}
