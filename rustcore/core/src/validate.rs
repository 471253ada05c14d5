//! Checks a decoded graph: unique names, references to earlier results that exist and
//! are tensors, well-formed sources, a scalar loss, and the shapes of the ops whose
//! shape semantics the core relies on. Ops the core does not know are not checked
//! (they become opaque, replicated-only ops).

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Node, NodeKind, TensorMeta, Value};

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
    for node in graph.nodes.iter().filter(|n| n.kind == NodeKind::Op) {
        check_shapes(graph, node)?;
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

fn input<'g>(graph: &'g Graph, node: &Node, k: usize) -> Result<&'g TensorMeta> {
    node.inputs
        .get(k)
        .map(|r| graph.meta(*r))
        .ok_or_else(|| Error::shape(&node.name, &node.op, format!("expects at least {} tensor inputs", k + 1)))
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Shape checks for the ops whose rules depend on their operand shapes.
fn check_shapes(graph: &Graph, node: &Node) -> Result<()> {
    let out = &node.outputs[0];
    let err = |m: String| Err(Error::shape(&node.name, &node.op, m));
    match node.op.as_str() {
        "aten.linear" => {
            let x = input(graph, node, 0)?;
            let w = input(graph, node, 1)?;
            if w.rank() != 2 {
                return err(format!("weight must be 2-D, got shape {:?}", w.shape));
            }
            if x.rank() == 0 || x.shape[x.rank() - 1] != w.shape[1] {
                return err(format!("input {:?} does not match weight {:?} (in features)", x.shape, w.shape));
            }
            if let Some(b) = node.tensor_arg("bias") {
                let b = graph.meta(b);
                if b.shape != [w.shape[0]] {
                    return err(format!("bias {:?} does not match weight {:?}", b.shape, w.shape));
                }
            }
            let mut expect = x.shape.clone();
            *expect.last_mut().unwrap_or(&mut 0) = w.shape[0];
            if out.shape != expect {
                return err(format!("output {:?} but input {:?} × weight {:?} gives {:?}", out.shape, x.shape, w.shape, expect));
            }
        }
        "aten.view" | "aten.reshape" | "aten._unsafe_view" | "aten.flatten.using_ints" => {
            let x = input(graph, node, 0)?;
            if numel(&x.shape) != numel(&out.shape) {
                return err(format!("{:?} ({} elements) cannot become {:?} ({} elements)", x.shape, numel(&x.shape), out.shape, numel(&out.shape)));
            }
        }
        "aten.transpose.int" | "aten.permute" | "aten.t" => {
            let x = input(graph, node, 0)?;
            if x.rank() != out.rank() || numel(&x.shape) != numel(&out.shape) {
                return err(format!("input {:?} and output {:?} differ in rank or size", x.shape, out.shape));
            }
        }
        "aten.layer_norm" => {
            let x = input(graph, node, 0)?;
            let normalized = node.arg("normalized_shape").and_then(Value::as_ints).unwrap_or_default();
            let k = normalized.len();
            let tail: Vec<i64> = x.shape.iter().skip(x.rank().saturating_sub(k)).map(|&d| d as i64).collect();
            if k > x.rank() || tail != normalized {
                return err(format!("normalized_shape {normalized:?} is not the tail of input {:?}", x.shape));
            }
            for name in ["weight", "bias"] {
                if let Some(p) = node.tensor_arg(name) {
                    let p = graph.meta(p);
                    if p.shape.iter().map(|&d| d as i64).collect::<Vec<_>>() != normalized {
                        return err(format!("{name} {:?} does not match normalized_shape {normalized:?}", p.shape));
                    }
                }
            }
            if out.shape != x.shape {
                return err(format!("output {:?} differs from input {:?}", out.shape, x.shape));
            }
        }
        "aten.embedding" => {
            let w = input(graph, node, 0)?;
            let idx = input(graph, node, 1)?;
            if w.rank() != 2 {
                return err(format!("weight must be 2-D, got {:?}", w.shape));
            }
            let mut expect = idx.shape.clone();
            expect.push(w.shape[1]);
            if out.shape != expect {
                return err(format!("output {:?} but indices {:?} with weight {:?} give {:?}", out.shape, idx.shape, w.shape, expect));
            }
        }
        "aten.scaled_dot_product_attention" => {
            let q = input(graph, node, 0)?;
            let k = input(graph, node, 1)?;
            let v = input(graph, node, 2)?;
            if q.rank() < 2 || k.rank() != q.rank() || v.rank() != q.rank() {
                return err(format!("q {:?}, k {:?}, v {:?} must have one rank ≥ 2", q.shape, k.shape, v.shape));
            }
            let r = q.rank();
            if q.shape[r - 1] != k.shape[r - 1] || k.shape[r - 2] != v.shape[r - 2] {
                return err(format!("q {:?}, k {:?}, v {:?} do not agree", q.shape, k.shape, v.shape));
            }
        }
        "aten.add.Tensor" | "aten.sub.Tensor" | "aten.mul.Tensor" | "aten.div.Tensor" => {
            let a = input(graph, node, 0)?;
            if let Some(b) = node.inputs.get(1).map(|r| graph.meta(*r)) {
                if broadcast(&a.shape, &b.shape).as_deref() != Some(out.shape.as_slice()) {
                    return err(format!("operands {:?} and {:?} do not broadcast to output {:?}", a.shape, b.shape, out.shape));
                }
            } else if a.shape != out.shape {
                return err(format!("output {:?} differs from input {:?}", out.shape, a.shape));
            }
        }
        "aten.relu" | "aten.gelu" | "aten.silu" | "aten.dropout" | "aten.sigmoid" | "aten.tanh"
        | "aten.softmax.int" | "aten.log_softmax.int" | "aten.rsqrt" | "aten.neg" | "aten.exp" => {
            let x = input(graph, node, 0)?;
            if out.shape != x.shape {
                return err(format!("output {:?} differs from input {:?}", out.shape, x.shape));
            }
        }
        "aten.cross_entropy_loss" | "aten.nll_loss" => {
            let x = input(graph, node, 0)?;
            let y = input(graph, node, 1)?;
            let batch_ok = match (x.rank(), y.rank()) {
                (1, 0) => true,
                (rx, ry) if rx >= 2 && ry == rx - 1 => y.shape[0] == x.shape[0] && y.shape[1..] == x.shape[2..],
                _ => false,
            };
            if !batch_ok {
                return err(format!("input {:?} and target {:?} do not match", x.shape, y.shape));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Numpy-style broadcast of two shapes, or None when they do not broadcast.
pub fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}
