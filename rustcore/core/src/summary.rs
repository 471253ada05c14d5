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
}

impl Summary {
    pub fn of(graph: &Graph) -> Summary {
        let ops = graph.op_counts();
        let opaque_ops = ops.iter().filter(|(op, _)| rules::family(op).is_none()).cloned().collect();
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
        Summary { name: graph.name.clone(), nodes: graph.nodes.len(), ops, parameters, parameter_elements, buffers, inputs, opaque_ops }
    }
}
