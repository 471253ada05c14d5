//! `hapd.routed_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k],
//! gate_up_proj [E, 2I, H], down_proj [E, H, I], activation, first_expert,
//! num_experts)` → `[T, H]`: a mixture-of-experts layer's routed experts as transformers
//! runs them (each token through the `k` experts its router picked, their outputs
//! weighted and summed), one op for the whole region from the sort of the (token,
//! expert) pairs to the sum of each token's rows (`hapd/ir/experts.py` says why).
//!
//! - `"data-parallel"`: the tokens split (dim 0 of the hidden states, the router's picks
//!   and weights, and the result), expert weights replicated: the region is token-local.
//! - `"expert-parallel"`: the expert weights split on their expert dim (dim 0 of both),
//!   tokens and router outputs replicated → partial sums: each rank runs the pairs
//!   routed to its own experts (the others contribute zero rows), so the ranks' results
//!   add up to the whole.
//! - No split of the intermediate size `I` (tensor parallelism inside the experts):
//!   `gate_up_proj` holds `[gate; up]` concatenated on dim 1, and a contiguous slice of
//!   dim 1 is not a slice of `I`.
//!
//! FLOPs are the routed ones, `2·T·k·(2I·H + I·H)` for the two products plus the gating
//! and weighting, assuming the router spreads the pairs evenly over the experts (so an
//! expert-parallel rank's work is its share of the experts, `Work::Sharded`). A step
//! whose routing is skewed runs slower on the rank holding the popular experts than
//! priced; the result never depends on it (no pair is dropped).

use super::rule_names::{DATA_PARALLEL, EXPERT_PARALLEL};
use super::{by_name, gather, matmul_class, Family, OpCtx, Rule, I};
use crate::cost::Work;
use crate::error::Result;
use crate::layout::Layout;

/// The op's name in the graph IR.
pub const OP: &str = "hapd.routed_experts";

pub const FAMILY: Family = Family { ops: &[OP], rules, flops, class: matmul_class, check_shapes };

/// The token operands (split by `data-parallel`) and the expert weights (split by
/// `expert-parallel`), by schema name.
const TOKENS: [&str; 3] = ["hidden", "top_k_index", "top_k_weights"];
const WEIGHTS: [&str; 2] = ["gate_up_proj", "down_proj"];

/// The sizes the rules and FLOPs read: (T, H, k, E, I), when the operands are shaped
/// as the op's schema says.
fn sizes(ctx: &OpCtx) -> Option<(usize, usize, usize, usize, usize)> {
    let shape = |name: &str| ctx.tensor_arg(name).map(|m| m.shape.as_slice());
    let (hidden, index, gate_up, down) = (shape("hidden")?, shape("top_k_index")?, shape("gate_up_proj")?, shape("down_proj")?);
    match (hidden, index, gate_up, down) {
        (&[t, h], &[_, k], &[e, i2, _], &[_, _, i]) if i2 == 2 * i => Some((t, h, k, e, i)),
        _ => None,
    }
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let (Some(g0), Some(_)) = (gather(0), sizes(ctx)) else { return Vec::new() };
    let named = |names: &[&'static str], layout: Layout| -> Vec<(&'static str, Layout)> {
        names.iter().map(|n| (*n, layout)).collect()
    };
    vec![
        Rule { name: DATA_PARALLEL, inputs: by_name(ctx, &named(&TOKENS, g0), I), outputs: vec![g0], work: Work::Sharded },
        Rule {
            name: EXPERT_PARALLEL,
            inputs: by_name(ctx, &named(&WEIGHTS, g0), I),
            outputs: vec![Layout::Reduce],
            work: Work::Sharded,
        },
    ]
}

/// Whether `rule` is `expert-parallel` with fewer experts than the `world` devices: the
/// experts' integer split leaves some devices without one, idle through the experts
/// while the cost rows (linear in each device's ratio) price them at their share, and
/// the others hold and run a whole expert where the rows price a fraction (Mixtral-8x7B's
/// 8 experts on 64 devices: 23 GiB of one expert's weights on a device priced at 1/64 of
/// them). The free search does not offer it; a forced one still runs, and so does
/// `hapd/compiler/search.py`'s expert-parallel candidate, a forced search judged whole,
/// its memory at the integer split (it does not fit Mixtral-8x7B on 64 devices; it wins
/// for 4 experts on 8 devices, where the experts' compute it misprices is small beside
/// the gradient all-reduce it saves).
pub fn too_few_experts(ctx: &OpCtx, rule: &Rule, world: usize) -> bool {
    rule.name == EXPERT_PARALLEL && ctx.op() == OP && sizes(ctx).is_some_and(|(_, _, _, e, _)| e < world)
}

/// The routed products (`k` of `E` experts per token), the gating (about 5 FLOPs per
/// intermediate element: the activation and the product) and the weighting and sum of
/// each token's rows (2 per output element per pair).
fn flops(ctx: &OpCtx) -> f64 {
    let Some((t, h, k, _, i)) = sizes(ctx) else { return ctx.out_numel() };
    let pairs = (t * k) as f64;
    let (h, i) = (h as f64, i as f64);
    pairs * (2.0 * (2.0 * i * h + i * h) + 5.0 * i + 2.0 * h)
}

/// `hidden [T, H]`, `top_k_index` and `top_k_weights [T, k]`, `gate_up_proj [E, 2I, H]`,
/// `down_proj [E, H, I]`, result `[T, H]`.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let shape = |name: &str| ctx.tensor_arg(name).map(|m| m.shape.clone()).unwrap_or_default();
    let (hidden, index, weights, gate_up, down) =
        (shape("hidden"), shape("top_k_index"), shape("top_k_weights"), shape("gate_up_proj"), shape("down_proj"));
    let sound = match (hidden.as_slice(), index.as_slice(), gate_up.as_slice(), down.as_slice()) {
        (&[t, h], &[t2, _], &[e, i2, h2], &[e2, h3, i]) => {
            t == t2 && weights == index && e == e2 && h == h2 && h == h3 && i2 == 2 * i && out.shape == hidden
        }
        _ => false,
    };
    if !sound {
        return ctx.shape_error(format!(
            "hidden {hidden:?}, top_k_index {index:?}, top_k_weights {weights:?}, gate_up_proj {gate_up:?}, \
             down_proj {down:?} and output {:?} are not [T, H], [T, k], [T, k], [E, 2I, H], [E, H, I] and [T, H]",
            out.shape
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::OP;
    use crate::cost::WorkClass;
    use crate::ir::{DType, Graph};
    use crate::rules::testkit::{assert_rules, graph, int, rules, A, A::Td};
    use crate::rules::check_shapes;

    fn args(t: &'static [usize], gate_up: &'static [usize]) -> Vec<(&'static str, A)> {
        let idx: &'static [usize] = if t[0] == 32 { &[32, 2] } else { &[16, 2] };
        vec![
            ("hidden", A::T(t)),
            ("top_k_index", Td(idx, DType::I64)),
            ("top_k_weights", A::T(idx)),
            ("gate_up_proj", A::T(gate_up)),
            ("down_proj", A::T(&[4, 64, 128])),
            ("activation", A::V(crate::ir::Value::Str("silu".into()))),
            ("first_expert", int(0)),
            ("num_experts", int(4)),
        ]
    }

    #[test]
    fn tokens_or_experts_split() {
        let got = rules(OP, args(&[32, 64], &[4, 256, 64]), &[&[32, 64]]);
        assert_rules(
            &got,
            &["data-parallel G0,G0,G0,I,I -> G0 sharded", "expert-parallel I,I,I,G0,G0 -> R sharded"],
        );
        assert_eq!(got.class, WorkClass::Matmul);
        // routed: 32 tokens × 2 experts, not 4
        let pairs = 64.0;
        assert_eq!(got.flops, pairs * (2.0 * (2.0 * 128.0 * 64.0 + 128.0 * 64.0) + 5.0 * 128.0 + 2.0 * 64.0));
    }

    #[test]
    fn expert_parallelism_needs_an_expert_per_device() {
        use super::too_few_experts;
        use crate::rules::OpCtx;
        let g: Graph = graph(OP, args(&[32, 64], &[4, 256, 64]), &[(&[32, 64], DType::F32)]);
        let node = g.nodes.last().expect("the op node");
        let got = crate::rules::rules_for(&g, node);
        let ctx = OpCtx::new(&g, node);
        let idle = |world: usize| got.rules.iter().filter(|r| too_few_experts(&ctx, r, world)).map(|r| r.name).collect::<Vec<_>>();
        assert_eq!(idle(4), Vec::<&str>::new());
        assert_eq!(idle(8), vec!["expert-parallel"]);
    }

    #[test]
    fn a_gate_up_that_is_not_twice_down_has_no_split_and_fails_the_shape_check() {
        let got = rules(OP, args(&[32, 64], &[4, 200, 64]), &[&[32, 64]]);
        assert_rules(&got, &[]);
        let g: Graph = graph(OP, args(&[32, 64], &[4, 200, 64]), &[(&[32, 64], DType::F32)]);
        let err = check_shapes(&g, g.nodes.last().expect("the op node")).expect_err("a shape error");
        assert!(err.to_string().contains("gate_up_proj [4, 200, 64]"), "{err}");
        let g: Graph = graph(OP, args(&[16, 64], &[4, 256, 64]), &[(&[16, 64], DType::F32)]);
        assert!(check_shapes(&g, g.nodes.last().expect("the op node")).is_ok());
    }
}
