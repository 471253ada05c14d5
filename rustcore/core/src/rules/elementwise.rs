//! The generic element-wise family: any op torch tags pointwise (`torch.Tag.pointwise`,
//! recorded by lowering as the node tag [`TAG_POINTWISE`]) that has no hand-written
//! family, plus a few element-wise ops torch leaves untagged ([`FAMILY`]'s `ops`:
//! composite aliases such as `__and__.Tensor` and `where.ScalarOther`, and the functional
//! writes `copy(self, src)` and `fill.Tensor(self, value)`, whose result is the
//! broadcast `src`/`value` in `self`'s shape).
//!
//! Every result element depends only on the operand elements at the same broadcast
//! index, so a split of result dim `d` is the same split of every tensor operand's
//! aligned dim `d` (numpy alignment from the right); an operand broadcast along `d`
//! (missing or of size 1 there) stays replicated (`"sharded"`). At least one operand
//! must be split: a result dim that only broadcasting creates has nothing to split.
//! Whether such an op is linear is not in torch's metadata, so partial-sum operands
//! have no rule here. Ops that draw random numbers (tagged
//! `nondeterministic_seeded`) are not in the family: their pieces, drawn with torch's
//! generator, would not be the single-device values. Dropout, `bernoulli` and
//! `rand_like`/`randn_like` have a family of their own (`random.rs`): the runtime
//! draws them with hapd's counter-based generator.

use super::binary::{aligned_dim, broadcast};
use super::rule_names::SHARDED;
use super::{elementwise_class, gather, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::error::Result;
use crate::ir::{Node, NodeKind, TAG_POINTWISE, TAG_RANDOM};
use crate::layout::Layout;

pub const FAMILY: Family = Family {
    ops: &[
        "aten.__and__.Tensor",
        "aten.__or__.Tensor",
        "aten.__xor__.Tensor",
        "aten.where.ScalarOther",
        "aten.where.ScalarSelf",
        "aten.where.Scalar",
        "aten.hardswish",
        "aten.hardsigmoid",
        "aten.copy",
        "aten.fill.Tensor",
    ],
    rules,
    flops,
    class: elementwise_class,
    check_shapes,
};

/// Whether a node with no hand-written family belongs here by its tags.
pub(crate) fn applies(node: &Node) -> bool {
    node.kind == NodeKind::Op && node.has_tag(TAG_POINTWISE) && !node.has_tag(TAG_RANDOM)
}

/// The broadcast shape of every tensor operand (`None` when they do not broadcast).
fn operands_shape(ctx: &OpCtx) -> Option<Vec<usize>> {
    ctx.inputs.iter().try_fold(Vec::new(), |acc, m| broadcast(&acc, &m.shape))
}

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    let out = ctx.out_shape(0);
    if ctx.n_inputs() == 0 || ctx.n_outputs() != 1 || operands_shape(ctx).as_deref() != Some(out) {
        return Vec::new();
    }
    let mut rules = Vec::new();
    for (d, &size) in out.iter().enumerate() {
        let Some(g_out) = gather(d) else { continue };
        let inputs: Vec<Layout> = ctx
            .inputs
            .iter()
            .map(|m| aligned_dim(&m.shape, out.len(), d, size).and_then(gather).unwrap_or(Layout::Identity))
            .collect();
        if size > 1 && inputs.iter().any(|l| matches!(l, Layout::Gather(_))) {
            rules.push(Rule { name: SHARDED, inputs, outputs: vec![g_out], work: Work::Sharded });
        }
    }
    rules
}

/// One op per result element.
fn flops(ctx: &OpCtx) -> f64 {
    ctx.out_numel()
}

/// The tensor operands broadcast to the (single) result's shape.
fn check_shapes(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    if ctx.n_inputs() == 0 || ctx.n_outputs() != 1 {
        return Ok(());
    }
    let shapes: Vec<&[usize]> = ctx.inputs.iter().map(|m| m.shape.as_slice()).collect();
    if operands_shape(ctx).as_deref() != Some(out.shape.as_slice()) {
        return ctx.shape_error(format!("operands {shapes:?} do not broadcast to the result {:?}", out.shape));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::ir::{DType, TAG_POINTWISE, TAG_RANDOM};
    use crate::rules::testkit::{assert_rules, float, tagged, A::Td, A::T};
    use crate::rules::{check_shapes, rules_for};

    #[test]
    fn tagged_ops_split_like_broadcasting_binaries() {
        // where(cond [2,1,4], x [2,3,4], y scalar tensor [])
        let g = tagged(
            "aten.where.self",
            vec![("condition", Td(&[2, 1, 4], DType::Bool)), ("self", T(&[2, 3, 4])), ("other", T(&[]))],
            &[(&[2, 3, 4], DType::F32)],
            &[TAG_POINTWISE],
        );
        let got = rules_for(&g, g.nodes.last().unwrap());
        assert_rules(
            &got,
            &["sharded G0,G0,I -> G0 sharded", "sharded I,G1,I -> G1 sharded", "sharded G2,G2,I -> G2 sharded"],
        );
        assert_eq!(got.flops, 24.0);
        // one operand: every dim of size > 1
        let g = tagged("aten.log", vec![("self", T(&[4, 1, 8]))], &[(&[4, 1, 8], DType::F32)], &[TAG_POINTWISE]);
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &["sharded G0 -> G0 sharded", "sharded G2 -> G2 sharded"]);
    }

    #[test]
    fn untagged_and_random_ops_stay_opaque() {
        let args = || vec![("self", T(&[4, 8])), ("p", float(0.5))];
        for tags in [&[][..], &[TAG_POINTWISE, TAG_RANDOM][..]] {
            let g = tagged("aten.poisson", args(), &[(&[4, 8], DType::F32)], tags);
            assert!(crate::rules::family_of(g.nodes.last().unwrap()).is_none());
            assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &[]);
        }
        // an untagged alias torch leaves composite is in the family by name
        let g = tagged("aten.__and__.Tensor", vec![("self", Td(&[4, 8], DType::Bool)), ("other", Td(&[8], DType::Bool))],
            &[(&[4, 8], DType::Bool)], &[]);
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &["sharded G0,I -> G0 sharded", "sharded G1,G0 -> G1 sharded"]);
    }

    #[test]
    fn operands_must_broadcast_to_the_result() {
        let g = tagged("aten.abs", vec![("self", T(&[4, 8]))], &[(&[4, 9], DType::F32)], &[TAG_POINTWISE]);
        let err = check_shapes(&g, g.nodes.last().unwrap()).unwrap_err();
        assert!(err.to_string().contains("do not broadcast"), "{err}");
        assert_rules(&rules_for(&g, g.nodes.last().unwrap()), &[]);
    }
}
