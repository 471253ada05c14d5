//! Checks a decoded graph: unique names, references to earlier results that exist and
//! are tensors, well-formed sources, a scalar loss; then, once the structure is sound,
//! the shapes of every op as its family checks them (`Family::check_shapes` in
//! `rules/`). Ops the core does not know are not checked (they become opaque,
//! replicated-only ops).
//!
//! Checked decoding lives here too: `Graph::from_msgpack` decodes with
//! [`crate::ir::decode`] and validates, so that `ir` needs neither this module nor the
//! rules.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Node, NodeKind, Value};
use crate::rules;

impl Graph {
    /// Decode ([`crate::ir::decode`]) and validate a `.hapg` document.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Graph> {
        let graph = crate::ir::decode(bytes)?;
        validate(&graph)?;
        Ok(graph)
    }
}

/// Validate every node, then the loss.
pub fn validate(graph: &Graph) -> Result<()> {
    if graph.nodes.is_empty() {
        return Err(Error::InvalidGraph { field: "nodes".into(), message: "the graph has no nodes".into() });
    }
    let mut names = HashSet::with_capacity(graph.nodes.len());
    for (index, node) in graph.nodes.iter().enumerate() {
        if node.name.is_empty() {
            return Err(Error::node_field(index, "<unnamed>", "name", "empty"));
        }
        if !names.insert(node.name.as_str()) {
            return Err(Error::node_field(index, &node.name, "name", "duplicate node name"));
        }
        check_refs(graph, index, node)?;
        check_kind(index, node)?;
    }
    check_loss(graph)?;
    check_mutations(graph)?;
    for node in graph.nodes.iter().filter(|n| n.kind == NodeKind::Op) {
        rules::check_shapes(graph, node)?;
    }
    Ok(())
}

fn check_refs(graph: &Graph, index: usize, node: &Node) -> Result<()> {
    for (k, r) in node.inputs.iter().enumerate() {
        let dangling = |message: String| Error::DanglingRef {
            index,
            name: node.name.clone(),
            input: k,
            target: format!("[{}, {}]", r.0, r.1),
            message,
        };
        if r.node() >= index {
            let message = if r.node() >= graph.nodes.len() {
                format!("but the graph has {} nodes", graph.nodes.len())
            } else {
                "which is not an earlier node (nodes must be in topological order)".to_string()
            };
            return Err(dangling(message));
        }
        let producer = &graph.nodes[r.node()];
        match producer.outputs.get(r.output()) {
            None => {
                return Err(dangling(format!(
                    "but node {} ({}) has {} outputs",
                    r.0,
                    producer.name,
                    producer.outputs.len()
                )))
            }
            Some(meta) if meta.dtype == DType::NotATensor => {
                return Err(dangling(format!("which is not a tensor (output of {})", producer.name)))
            }
            Some(_) => {}
        }
    }
    for (k, arg) in node.args.iter().enumerate() {
        check_value_refs(index, node, &format!("args[{k}] ({})", arg.name), &arg.value)?;
    }
    Ok(())
}

fn check_value_refs(index: usize, node: &Node, field: &str, value: &Value) -> Result<()> {
    match value {
        Value::Tensor(k) if *k as usize >= node.inputs.len() => Err(Error::node_field(
            index,
            &node.name,
            field,
            format!("tensor operand {k} but the node has {} inputs", node.inputs.len()),
        )),
        Value::List(items) => items.iter().try_for_each(|v| check_value_refs(index, node, field, v)),
        _ => Ok(()),
    }
}

fn check_kind(index: usize, node: &Node) -> Result<()> {
    let field = |f: &str, m: String| Err(Error::node_field(index, &node.name, f, m));
    match node.kind {
        NodeKind::Op => {
            if node.op.is_empty() {
                return field("op", "an op node needs an op name".into());
            }
            if node.outputs.is_empty() {
                return field("outputs", "an op node needs at least one output".into());
            }
        }
        _ => {
            if !node.inputs.is_empty() {
                return field("inputs", format!("a {:?} node takes no inputs", node.kind).to_lowercase());
            }
            if node.outputs.len() != 1 {
                return field("outputs", format!("a source has exactly one output, found {}", node.outputs.len()));
            }
            if node.outputs[0].dtype == DType::NotATensor {
                return field("outputs[0].dtype", "a source must be a tensor".into());
            }
            if node.kind == NodeKind::Input {
                if let Some(d) = node.batch_dim {
                    let rank = node.outputs[0].rank();
                    if d >= rank {
                        return field("batch_dim", format!("{d} but the input has rank {rank}"));
                    }
                }
            } else if node.batch_dim.is_some() {
                return field("batch_dim", "only inputs have a batch dim".into());
            }
        }
    }
    Ok(())
}

/// Every buffer update names a buffer once and refers to a tensor an op computes.
fn check_mutations(graph: &Graph) -> Result<()> {
    let mut targets = HashSet::with_capacity(graph.mutations.len());
    for (k, m) in graph.mutations.iter().enumerate() {
        let bad = |message: String| Err(Error::InvalidGraph { field: format!("mutations[{k}]"), message });
        if !targets.insert(m.target.as_str()) {
            return bad(format!("buffer {} is updated twice", m.target));
        }
        let Some(node) = graph.nodes.get(m.value.node()) else {
            return bad(format!("{}: refers to node {} but the graph has {} nodes", m.target, m.value.0, graph.nodes.len()));
        };
        match node.outputs.get(m.value.output()) {
            None => return bad(format!("{}: refers to output {} of {} which has {}", m.target, m.value.1, node.name, node.outputs.len())),
            Some(meta) if meta.dtype == DType::NotATensor => {
                return bad(format!("{}: the new value {} is not a tensor", m.target, meta.name))
            }
            Some(_) => {}
        }
        if node.kind != NodeKind::Op {
            return bad(format!("{}: the new value {} is not computed by an op", m.target, node.name));
        }
    }
    Ok(())
}

fn check_loss(graph: &Graph) -> Result<()> {
    let loss = graph.loss;
    let bad = |m: String| Err(Error::InvalidGraph { field: "loss".into(), message: m });
    let Some(node) = graph.nodes.get(loss.node()) else {
        return bad(format!("refers to node {} but the graph has {} nodes", loss.0, graph.nodes.len()));
    };
    let Some(meta) = node.outputs.get(loss.output()) else {
        return bad(format!("refers to output {} of {} which has {}", loss.1, node.name, node.outputs.len()));
    };
    if !meta.shape.is_empty() {
        return bad(format!("must be a scalar, but {} has shape {:?}", meta.name, meta.shape));
    }
    if !meta.dtype.is_float() {
        return bad(format!("must be floating point, but {} is {:?}", meta.name, meta.dtype));
    }
    Ok(())
}
