//! Sharding rules, one file per op family.
//!
//! For an op node, [`rules_for`] lists its **rules**: Hoare triples `{inputs} op
//! {outputs}` over layouts, with how the work divides among devices. Every op can run
//! replicated (all `Identity`); a family adds the sharded ways. An op with no family is
//! *opaque*: replicated only, and reported by name.
//!
//! All `Gather` operands of one rule are split by one partition (the batch, the heads,
//! the hidden features…): their per-rank lengths are proportional to their sizes. The
//! plan derives integer lengths from that (see `plan.rs`).
//!
//! A family's file owns everything the core knows of its ops: their names, their rules,
//! their FLOPs and work class, and the shape checks the validator runs on them, gathered
//! in its `FAMILY` ([`Family`]); [`FAMILIES`] lists the families. Rule names are the
//! constants of [`rule_names`]. Helpers the families share ([`OpCtx`], [`gather`],
//! `by_name`, the unit tests' `testkit`) live here.

mod attention;
mod binary;
mod conv;
mod creation;
mod elementwise;
mod embedding;
mod experts;
mod histogram;
mod index;
mod loss;
mod matmul;
mod norm;
mod padding;
mod pointwise;
mod random;
mod reduction;
pub mod rule_names;
mod shape;
mod softmax;
#[cfg(test)]
pub(crate) mod testkit;
mod unary;

use crate::cost::{Work, WorkClass};
use crate::error::{Error, Result};
use crate::ir::{Graph, Node, TensorMeta, Value};
use crate::layout::Layout;

/// Every op family the core has sharding rules for; an op belongs to at most one. A new
/// family is a new file defining its `FAMILY` plus one line here.
pub const FAMILIES: &[Family] = &[
    unary::FAMILY,
    binary::FAMILY,
    pointwise::FAMILY,
    matmul::FAMILY,
    attention::FAMILY,
    embedding::FAMILY,
    experts::FAMILY,
    histogram::FAMILY,
    norm::FAMILY,
    softmax::FAMILY,
    reduction::FAMILY,
    loss::FAMILY,
    conv::FAMILY,
    shape::FAMILY,
    padding::FAMILY,
    creation::FAMILY,
    index::FAMILY,
    random::FAMILY,
    elementwise::FAMILY,
];

/// What the core knows of one op family: its ops, and for one op node of the family
/// its sharded rules, its FLOPs, its work class and its shape checks. Each family file
/// defines one as `FAMILY`.
#[derive(Debug)]
pub struct Family {
    /// The canonical op names of the family.
    pub ops: &'static [&'static str],
    /// The sharded rules of an op ([`rules_for`] adds the replicated rule first).
    pub rules: fn(&OpCtx) -> Vec<Rule>,
    /// Forward FLOPs of the whole (single-device) op.
    pub flops: fn(&OpCtx) -> f64,
    /// The achieved FLOP/s of a device the op runs at.
    pub class: fn(&OpCtx) -> WorkClass,
    /// Checks of the operand and result shapes the rules rely on, run by
    /// [`crate::validate`] once the graph's structure is sound.
    pub check_shapes: fn(&OpCtx) -> Result<()>,
}

/// The family of a canonical op name, or `None` for an op without a hand-written one.
pub fn family(op: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.ops.contains(&op))
}

/// The family of an op node: its op name's family, else for an op torch tags pointwise
/// (and that draws no random numbers) the generic element-wise family; `None` for an
/// opaque op.
pub fn family_of(node: &Node) -> Option<&'static Family> {
    family(&node.op).or_else(|| elementwise::applies(node).then_some(&elementwise::FAMILY))
}

/// [`Family::class`] of families of dense linear algebra.
pub(crate) fn matmul_class(_: &OpCtx) -> WorkClass {
    WorkClass::Matmul
}

/// [`Family::class`] of the other families.
pub(crate) fn elementwise_class(_: &OpCtx) -> WorkClass {
    WorkClass::Elementwise
}

/// [`Family::check_shapes`] of families whose rules check the shapes they need.
pub(crate) fn no_shape_checks(_: &OpCtx) -> Result<()> {
    Ok(())
}

/// A shape check: result 0 has the shape of input 0.
pub(crate) fn check_same_shape(ctx: &OpCtx) -> Result<()> {
    let out = ctx.require_out()?;
    let x = ctx.require_input(0)?;
    if out.shape != x.shape {
        return ctx.shape_error(format!("output {:?} differs from input {:?}", out.shape, x.shape));
    }
    Ok(())
}

/// One way to run an op: the layout of each tensor input (in `node.inputs` order) and
/// of each output, and how the work divides.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Stable name the plan records and the runtime keys on: one of [`rule_names`].
    pub name: &'static str,
    pub inputs: Vec<Layout>,
    pub outputs: Vec<Layout>,
    pub work: Work,
}

/// The rules of one op plus its forward FLOPs and work class.
#[derive(Debug, Clone, PartialEq)]
pub struct OpRules {
    pub rules: Vec<Rule>,
    /// Forward FLOPs of the whole (single-device) op, at the rate of its `class`.
    pub flops: f64,
    pub class: WorkClass,
    /// Forward FLOPs beyond `flops` that run at the element-wise rate whatever the op's
    /// class: an attention's dropout, its draws and the math attention's passes over
    /// the probabilities ([`attention::dropout_flops`]). A CPU's element-wise rate is a
    /// fraction of its matmul rate, and priced at the matmul rate these passes left a
    /// GPT-2 block's step 28% short of its measured time.
    pub elementwise_flops: f64,
}

impl OpRules {
    /// Forward FLOPs at either rate.
    pub fn total_flops(&self) -> f64 {
        self.flops + self.elementwise_flops
    }
}

/// What a family sees of one op node.
pub struct OpCtx<'g> {
    pub graph: &'g Graph,
    pub node: &'g Node,
    pub inputs: Vec<&'g TensorMeta>,
}

impl<'g> OpCtx<'g> {
    pub fn new(graph: &'g Graph, node: &'g Node) -> Self {
        let inputs = node.inputs.iter().map(|r| graph.meta(*r)).collect();
        OpCtx { graph, node, inputs }
    }

    pub fn op(&self) -> &str {
        &self.node.op
    }

    /// Shape of tensor input `k` (empty when absent).
    pub fn in_shape(&self, k: usize) -> &[usize] {
        self.inputs.get(k).map(|m| m.shape.as_slice()).unwrap_or(&[])
    }

    pub fn out(&self, k: usize) -> Option<&'g TensorMeta> {
        self.node.outputs.get(k)
    }

    pub fn out_shape(&self, k: usize) -> &[usize] {
        self.out(k).map(|m| m.shape.as_slice()).unwrap_or(&[])
    }

    pub fn n_inputs(&self) -> usize {
        self.inputs.len()
    }

    pub fn n_outputs(&self) -> usize {
        self.node.outputs.len()
    }

    pub fn arg(&self, name: &str) -> Option<&'g Value> {
        self.node.arg(name)
    }

    pub fn int_arg(&self, name: &str) -> Option<i64> {
        self.arg(name).and_then(Value::as_int)
    }

    pub fn ints_arg(&self, name: &str) -> Option<Vec<i64>> {
        self.arg(name).and_then(Value::as_ints)
    }

    pub fn float_arg(&self, name: &str) -> Option<f64> {
        self.arg(name).and_then(Value::as_float)
    }

    pub fn bool_arg(&self, name: &str) -> Option<bool> {
        self.arg(name).and_then(Value::as_bool)
    }

    /// Which tensor input a schema argument names (`None` if it is not a tensor).
    pub fn input_index(&self, name: &str) -> Option<usize> {
        match self.arg(name) {
            Some(Value::Tensor(k)) => Some(*k as usize),
            _ => None,
        }
    }

    /// Normalize a possibly negative dim for a tensor of `rank`.
    pub fn norm_dim(dim: i64, rank: usize) -> Option<usize> {
        let d = if dim < 0 { dim + rank as i64 } else { dim };
        (0..rank as i64).contains(&d).then_some(d as usize)
    }

    /// All inputs and outputs replicated, full work.
    pub fn replicated(&self) -> Rule {
        Rule {
            name: rule_names::REPLICATED,
            inputs: vec![Layout::Identity; self.n_inputs()],
            outputs: vec![Layout::Identity; self.n_outputs()],
            work: Work::Full,
        }
    }

    /// A rule with every input in `input` and every output in `output`.
    pub fn uniform(&self, name: &'static str, input: Layout, output: Layout, work: Work) -> Rule {
        Rule { name, inputs: vec![input; self.n_inputs()], outputs: vec![output; self.n_outputs()], work }
    }

    /// Elements of output 0.
    pub fn out_numel(&self) -> f64 {
        self.out_shape(0).iter().product::<usize>() as f64
    }

    /// For shape checks: tensor input `k`, or an error saying the op needs it.
    pub fn require_input(&self, k: usize) -> Result<&'g TensorMeta> {
        self.inputs.get(k).copied().ok_or_else(|| self.mismatch(format!("expects at least {} tensor inputs", k + 1)))
    }

    /// For shape checks: result 0 (every op node that passed the structural checks has
    /// one).
    pub fn require_out(&self) -> Result<&'g TensorMeta> {
        self.out(0).ok_or_else(|| self.mismatch("has no result".to_string()))
    }

    /// For shape checks: the tensor passed as schema argument `name`, if it is one.
    pub fn tensor_arg(&self, name: &str) -> Option<&'g TensorMeta> {
        self.input_index(name).and_then(|k| self.inputs.get(k)).copied()
    }

    /// A shape error about this op node.
    pub fn mismatch(&self, message: String) -> Error {
        Error::shape(&self.node.name, &self.node.op, message)
    }

    /// `Err` of [`Self::mismatch`].
    pub fn shape_error<T>(&self, message: String) -> Result<T> {
        Err(self.mismatch(message))
    }
}

/// Layouts for a node's tensor inputs from (schema name → layout) pairs; tensor inputs
/// not named (and names that are not tensors in this call, like an absent bias) get
/// `fill`.
pub(crate) fn by_name(ctx: &OpCtx, named: &[(&str, Layout)], fill: Layout) -> Vec<Layout> {
    let mut layouts = vec![fill; ctx.n_inputs()];
    for (name, layout) in named {
        if let Some(k) = ctx.input_index(name).filter(|&k| k < layouts.len()) {
            layouts[k] = *layout;
        }
    }
    layouts
}

/// The replicated layout, as the families' rule tables write it.
pub(crate) const I: Layout = Layout::Identity;

/// Gather on a dim as a layout (dims beyond what a layout set can hold are not split).
pub fn gather(dim: usize) -> Option<Layout> {
    (dim < crate::layout::MAX_GATHER_DIMS).then_some(Layout::Gather(dim as u8))
}

/// Rules, FLOPs and work class of one op node; the replicated rule always comes first.
///
/// The FLOPs are the larger of the family's formula and the count lowering recorded
/// from torch's FLOP counter ([`Node::flops`]). torch counts only matrix products,
/// convolutions and attention, so element-wise ops keep their formula, while an op the
/// formula undercounts is priced at torch's count. An opaque op costs one FLOP per
/// result element unless torch counts more; then it is dense linear algebra and runs at
/// the matmul rate.
pub fn rules_for(graph: &Graph, node: &Node) -> OpRules {
    let ctx = OpCtx::new(graph, node);
    let counted = node.flops.unwrap_or(0.0);
    let (mut sharded, flops, class) = match family_of(node) {
        Some(f) => ((f.rules)(&ctx), (f.flops)(&ctx).max(counted), (f.class)(&ctx)),
        None if counted > ctx.out_numel() => (Vec::new(), counted, WorkClass::Matmul),
        None => (Vec::new(), ctx.out_numel(), WorkClass::Elementwise),
    };
    // a rule must give every tensor operand and result a layout
    sharded.retain(|r| r.inputs.len() == ctx.n_inputs() && r.outputs.len() == ctx.n_outputs());
    let mut rules = vec![ctx.replicated()];
    for rule in sharded {
        if !rules.contains(&rule) {
            rules.push(rule);
        }
    }
    let elementwise_flops = if attention::FAMILY.ops.contains(&node.op.as_str()) {
        attention::dropout_flops(&ctx).unwrap_or(0.0)
    } else {
        0.0
    };
    OpRules { rules, flops, class, elementwise_flops }
}

/// The element-wise forward FLOPs ([`OpRules::elementwise_flops`]) of op node `node`
/// where every device runs hapd's fused attention kernel
/// ([`crate::profile::Profile::fused_attention`]): `Some` only for an attention with
/// dropout ([`attention::fused_dropout_flops`]: its own two draws per score, none of the
/// math attention's passes over the probabilities). Every other op costs what
/// [`rules_for`] says.
pub fn fused_attention_flops(graph: &Graph, node: &Node) -> Option<f64> {
    if !attention::FAMILY.ops.contains(&node.op.as_str()) {
        return None;
    }
    attention::fused_dropout_flops(&OpCtx::new(graph, node))
}

/// Seconds per device of the collectives a rule runs inside its op (forward, and
/// backward when `with_grad`), beyond the layout changes between ops the search prices
/// itself: today only the synchronized batch norm's statistics
/// ([`norm::synced_statistics_row`]). `None` when the rule communicates only through
/// its operands' and results' layouts.
pub fn internal_comm_row(graph: &Graph, node: &Node, rule: &Rule, profile: &crate::profile::Profile, with_grad: bool) -> Option<crate::cost::Row> {
    norm::synced_statistics_row(&OpCtx::new(graph, node), rule, profile, with_grad)
}

/// Whether `rule` of op node `node` leaves devices of `world` without a piece of a split
/// the cost rows price as a share ([`experts::too_few_experts`]: expert parallelism of
/// routed experts with fewer experts than devices); the search leaves such a rule out
/// unless the options force it.
pub fn idles_devices(graph: &Graph, node: &Node, rule: &Rule, world: usize) -> bool {
    experts::too_few_experts(&OpCtx::new(graph, node), rule, world)
}

/// The shape checks of an op node's family (none for an opaque op). The graph's
/// structure must be sound: references valid, at least one result.
pub fn check_shapes(graph: &Graph, node: &Node) -> Result<()> {
    match family_of(node) {
        Some(f) => (f.check_shapes)(&OpCtx::new(graph, node)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::{graph, A};
    use super::{rules_for, FAMILIES};
    use crate::cost::WorkClass;
    use crate::ir::{DType, Graph};

    /// [`graph`] of one op with the FLOPs lowering recorded for it.
    fn counted(op: &str, args: Vec<(&str, A)>, out: &'static [usize], flops: Option<f64>) -> Graph {
        let mut g = graph(op, args, &[(out, DType::F32)]);
        if let Some(node) = g.nodes.last_mut() {
            node.flops = flops;
        }
        g
    }

    #[test]
    fn an_opaque_op_costs_torchs_count_when_it_counts_more_than_its_elements() {
        let args = || vec![("self", A::T(&[4, 8, 16])), ("other", A::T(&[4, 16, 8]))];
        let g = counted("aten.some_opaque_bmm", args(), &[4, 8, 8], Some(8192.0));
        let op = rules_for(&g, g.nodes.last().unwrap());
        assert_eq!((op.flops, op.class, op.rules.len()), (8192.0, WorkClass::Matmul, 1));
        let g = counted("aten.some_opaque_bmm", args(), &[4, 8, 8], None);
        let op = rules_for(&g, g.nodes.last().unwrap());
        assert_eq!((op.flops, op.class), (256.0, WorkClass::Elementwise));
        let g = counted("aten.some_opaque_bmm", args(), &[4, 8, 8], Some(10.0));
        assert_eq!(rules_for(&g, g.nodes.last().unwrap()).flops, 256.0);
    }

    #[test]
    fn a_family_op_costs_the_larger_of_its_formula_and_torchs_count() {
        let args = || vec![("input", A::T(&[2, 3])), ("weight", A::T(&[5, 3]))];
        let formula = 2.0 * 2.0 * 5.0 * 3.0 + 2.0 * 5.0; // the product and the bias add
        for (recorded, want) in [(None, formula), (Some(1.0), formula), (Some(1000.0), 1000.0)] {
            let g = counted("aten.linear", args(), &[2, 5], recorded);
            let op = rules_for(&g, g.nodes.last().unwrap());
            assert_eq!((op.flops, op.class), (want, WorkClass::Matmul), "recorded {recorded:?}");
        }
    }

    #[test]
    fn an_op_has_at_most_one_family() {
        let mut ops: Vec<&str> = FAMILIES.iter().flat_map(|f| f.ops.iter().copied()).collect();
        let n = ops.len();
        ops.sort_unstable();
        ops.dedup();
        assert_eq!(ops.len(), n, "an op is listed by two families");
    }
}
