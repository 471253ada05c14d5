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

mod attention;
mod binary;
mod conv;
mod embedding;
mod loss;
mod matmul;
mod norm;
mod pointwise;
mod reduction;
mod shape;
mod softmax;
mod unary;

use crate::cost::{Work, WorkClass};
use crate::ir::{Graph, Node, TensorMeta, Value};
use crate::layout::Layout;

/// The op families the core has sharding rules for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Shape-preserving element-wise ops with one tensor input.
    Unary,
    /// Broadcasting element-wise ops with two tensor operands (or one and a scalar).
    Binary,
    /// Element-wise ops that never carry gradients or act along one dim (masks,
    /// comparisons, one_hot, cumsum, topk): the MoE gating vocabulary.
    Pointwise,
    /// `linear`, `matmul`, `bmm`, `einsum`.
    Matmul,
    /// `scaled_dot_product_attention`.
    Attention,
    /// `embedding`.
    Embedding,
    /// `layer_norm`.
    Norm,
    /// `softmax`, `log_softmax`.
    Softmax,
    /// Reductions over some dims: `sum`, `mean`.
    Reduction,
    /// `cross_entropy_loss`, `nll_loss`.
    Loss,
    /// `conv2d`, pools.
    Conv,
    /// Views, reshapes, permutes, concatenation, slicing.
    Shape,
}

/// The family of a canonical op name, or `None` for an opaque op.
pub fn family(op: &str) -> Option<Family> {
    use Family::*;
    Some(match op {
        "aten.relu" | "aten.gelu" | "aten.silu" | "aten.sigmoid" | "aten.tanh" | "aten.dropout"
        | "aten.neg" | "aten.exp" | "aten.rsqrt" | "aten.sqrt" | "aten.pow.Tensor_Scalar"
        | "aten.to.dtype" | "aten._to_copy" | "aten.clone" | "aten.contiguous" | "aten.clamp_min"
        | "aten.type_as" => Unary,
        "aten.add.Tensor" | "aten.sub.Tensor" | "aten.mul.Tensor" | "aten.div.Tensor" => Binary,
        "aten.lt.Scalar" | "aten.gt.Scalar" | "aten.le.Scalar" | "aten.ge.Scalar" | "aten.eq.Scalar"
        | "aten.one_hot" | "aten.cumsum" | "aten.topk" | "aten.argmax" | "aten.zeros_like"
        | "aten.ones_like" | "aten._assert_tensor_metadata" => Pointwise,
        "aten.linear" | "aten.matmul" | "aten.bmm" | "aten.einsum" => Matmul,
        "aten.scaled_dot_product_attention" => Attention,
        "aten.embedding" => Embedding,
        "aten.layer_norm" => Norm,
        "aten.softmax.int" | "aten.log_softmax.int" => Softmax,
        "aten.sum.dim_IntList" | "aten.sum" | "aten.mean.dim" | "aten.mean" => Reduction,
        "aten.cross_entropy_loss" | "aten.nll_loss" => Loss,
        "aten.conv2d" | "aten.max_pool2d" | "aten.adaptive_avg_pool2d" => Conv,
        "aten.view" | "aten.reshape" | "aten._unsafe_view" | "aten.flatten.using_ints"
        | "aten.transpose.int" | "aten.permute" | "aten.t" | "aten.unsqueeze" | "aten.squeeze.dim"
        | "aten.expand" | "aten.cat" | "aten.slice.Tensor" | "aten.select.int" | "aten.chunk"
        | "aten.split.Tensor" => Shape,
        _ => return None,
    })
}

/// One way to run an op: the layout of each tensor input (in `node.inputs` order) and
/// of each output, and how the work divides.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Stable name the plan records and the runtime keys on (`"replicated"`,
    /// `"column-parallel"`, `"row-parallel"`, `"vocab-parallel"`, …).
    pub name: &'static str,
    pub inputs: Vec<Layout>,
    pub outputs: Vec<Layout>,
    pub work: Work,
}

/// The rules of one op plus its forward FLOPs and work class.
#[derive(Debug, Clone, PartialEq)]
pub struct OpRules {
    pub rules: Vec<Rule>,
    /// Forward FLOPs of the whole (single-device) op.
    pub flops: f64,
    pub class: WorkClass,
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
            name: "replicated",
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
}

/// Gather on a dim as a layout (dims beyond what a layout set can hold are not split).
pub fn gather(dim: usize) -> Option<Layout> {
    (dim < crate::layout::MAX_GATHER_DIMS).then_some(Layout::Gather(dim as u8))
}

/// Rules, FLOPs and work class of one op node; the replicated rule always comes first.
pub fn rules_for(graph: &Graph, node: &Node) -> OpRules {
    let ctx = OpCtx::new(graph, node);
    let (mut sharded, flops, class) = match family(&node.op) {
        Some(Family::Unary) => (unary::rules(&ctx), unary::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Binary) => (binary::rules(&ctx), binary::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Pointwise) => (pointwise::rules(&ctx), pointwise::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Matmul) => (matmul::rules(&ctx), matmul::flops(&ctx), WorkClass::Matmul),
        Some(Family::Attention) => (attention::rules(&ctx), attention::flops(&ctx), WorkClass::Matmul),
        Some(Family::Embedding) => (embedding::rules(&ctx), embedding::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Norm) => (norm::rules(&ctx), norm::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Softmax) => (softmax::rules(&ctx), softmax::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Reduction) => (reduction::rules(&ctx), reduction::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Loss) => (loss::rules(&ctx), loss::flops(&ctx), WorkClass::Elementwise),
        Some(Family::Conv) => (conv::rules(&ctx), conv::flops(&ctx), conv::class(&ctx)),
        Some(Family::Shape) => (shape::rules(&ctx), 0.0, WorkClass::Elementwise),
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
    OpRules { rules, flops, class }
}
