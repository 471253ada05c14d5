//! A human-sized summary of a graph: what `hapd inspect` prints.

use crate::ir::{Graph, NodeKind};
use crate::rules;

/// Counts and names that describe a graph at a glance.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub name: String,
    pub nodes: usize,
    /// (op, count), sorted by op name.
    pub ops: Vec<(String, usize)>,
    /// (fully qualified name, shape, trainable) of every parameter.
    pub parameters: Vec<(String, Vec<usize>, bool)>,
    /// Number of elements over all parameters.
    pub parameter_elements: usize,
    /// (name, shape) of every buffer and lifted constant.
    pub buffers: Vec<(String, Vec<usize>)>,
    /// (name, shape, batch dim) of every user input.
    pub inputs: Vec<(String, Vec<usize>, Option<usize>)>,
    /// (op, count) of the ops without sharding rules: they run replicated.
    pub opaque_ops: Vec<(String, usize)>,
    /// Forward FLOPs of all op nodes, as the cost model prices them
    /// ([`rules::rules_for`]).
    pub flops: f64,
    /// The part of [`Self::flops`] that opaque ops account for.
    pub opaque_flops: f64,
    /// Names of the op nodes that can run expert-parallel (the `expert-parallel` rule:
    /// stacked expert weights), in graph order.
    pub expert_parallel: Vec<String>,
}

impl Summary {
    pub fn of(graph: &Graph) -> Summary {
        let ops = graph.op_counts();
        let opaque_ops = opaque_ops(graph);
        let mut parameters = Vec::new();
        let mut buffers = Vec::new();
        let mut inputs = Vec::new();
        for node in &graph.nodes {
            let shape = node.outputs[0].shape.clone();
            match node.kind {
                NodeKind::Parameter => parameters.push((node.target.clone(), shape, node.requires_grad)),
                NodeKind::Buffer | NodeKind::Constant => buffers.push((node.target.clone(), shape)),
                NodeKind::Input => inputs.push((node.name.clone(), shape, node.batch_dim)),
                NodeKind::Op => {}
            }
        }
        let parameter_elements = parameters.iter().map(|(_, s, _)| s.iter().product::<usize>()).sum();
        let (flops, opaque_flops) = flops(graph);
        let expert_parallel = graph
            .nodes
            .iter()
            .filter(|n| n.kind == NodeKind::Op && rules::family_of(n).is_some())
            .filter(|n| rules::rules_for(graph, n).rules.iter().any(|r| r.name == rules::rule_names::EXPERT_PARALLEL))
            .map(|n| n.name.clone())
            .collect();
        Summary {
            name: graph.name.clone(),
            nodes: graph.nodes.len(),
            ops,
            parameters,
            parameter_elements,
            buffers,
            inputs,
            opaque_ops,
            flops,
            opaque_flops,
            expert_parallel,
        }
    }
}

/// (op, count) of the op nodes without a family (rules are per node: an op torch tags
/// pointwise is element-wise wherever it appears).
fn opaque_ops(graph: &Graph) -> Vec<(String, usize)> {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for node in graph.nodes.iter().filter(|n| n.kind == NodeKind::Op && rules::family_of(n).is_none()) {
        *counts.entry(node.op.as_str()).or_default() += 1;
    }
    counts.into_iter().map(|(op, n)| (op.to_string(), n)).collect()
}

/// Forward FLOPs of all op nodes and of the opaque ones, as the cost model prices them.
fn flops(graph: &Graph) -> (f64, f64) {
    let (mut all, mut opaque) = (0.0, 0.0);
    for node in graph.nodes.iter().filter(|n| n.kind == NodeKind::Op) {
        let flops = rules::rules_for(graph, node).total_flops();
        all += flops;
        if rules::family_of(node).is_none() {
            opaque += flops;
        }
    }
    (all, opaque)
}
