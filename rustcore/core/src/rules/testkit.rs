//! A tiny graph builder and rule-table assertions for the families' unit tests.

use crate::cost::Work;
use crate::ir::{DType, Graph, LossReduction, Node, NodeKind, TensorMeta, TensorRef, Value};
use crate::layout::Layout;
use crate::rules::{rules_for, OpRules, Rule};

/// One schema argument of the op under test.
#[derive(Clone)]
pub enum A {
    /// A tensor operand of this shape (float32).
    T(&'static [usize]),
    /// A tensor operand of this shape and dtype.
    Td(&'static [usize], DType),
    /// A non-tensor value.
    V(Value),
}

pub fn int(i: i64) -> A {
    A::V(Value::Int(i))
}
pub fn ints(v: &[i64]) -> A {
    A::V(Value::List(v.iter().map(|&i| Value::Int(i)).collect()))
}
pub fn boolean(b: bool) -> A {
    A::V(Value::Bool(b))
}
pub fn float(f: f64) -> A {
    A::V(Value::Float(f))
}
pub fn none() -> A {
    A::V(Value::None(()))
}

fn meta(name: String, shape: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta { name, shape: shape.to_vec(), dtype }
}

/// A graph of one source node per tensor argument (in argument order) and the op
/// as the last node, with results `outputs`.
pub fn graph(op: &str, args: Vec<(&str, A)>, outputs: &[(&[usize], DType)]) -> Graph {
    let mut nodes = Vec::new();
    let mut inputs = Vec::new();
    let mut node_args = Vec::new();
    for (name, a) in args {
        let (shape, dtype) = match a {
            A::T(shape) => (shape, DType::F32),
            A::Td(shape, dtype) => (shape, dtype),
            A::V(v) => {
                node_args.push(crate::ir::Arg { name: name.to_string(), value: v });
                continue;
            }
        };
        nodes.push(Node {
            name: name.to_string(),
            kind: NodeKind::Input,
            op: String::new(),
            target: name.to_string(),
            inputs: vec![],
            args: vec![],
            outputs: vec![meta(name.to_string(), shape, dtype)],
            requires_grad: false,
            batch_dim: None,
            tags: vec![],
            flops: None,
            saved: vec![false],
            saved_bytes: 0.0,
            counter_saved_bytes: 0.0,
            block: None,
        });
        inputs.push(TensorRef(nodes.len() as u32 - 1, 0));
        let value = Value::Tensor(inputs.len() as u32 - 1);
        node_args.push(crate::ir::Arg { name: name.to_string(), value });
    }
    let outputs: Vec<_> = outputs.iter().enumerate().map(|(k, (s, d))| meta(format!("out{k}"), s, *d)).collect();
    let saved = vec![false; outputs.len()];
    nodes.push(Node {
        name: "op".into(),
        kind: NodeKind::Op,
        op: op.to_string(),
        target: String::new(),
        inputs,
        args: node_args,
        outputs,
        requires_grad: false,
        batch_dim: None,
        tags: vec![],
        flops: None,
        saved,
        saved_bytes: 0.0,
        counter_saved_bytes: 0.0,
        block: None,
    });
    let loss = TensorRef(nodes.len() as u32 - 1, 0);
    Graph { name: "test".into(), nodes, loss, loss_reduction: LossReduction::Sum, mutations: vec![], saved_traced: false }
}

/// `rules_for` the op of [`graph`] with float32 results of shapes `outputs`.
pub fn rules(op: &str, args: Vec<(&str, A)>, outputs: &[&[usize]]) -> OpRules {
    let outputs: Vec<(&[usize], DType)> = outputs.iter().map(|s| (*s, DType::F32)).collect();
    let g = graph(op, args, &outputs);
    rules_for(&g, g.nodes.last().unwrap())
}

fn layout(l: &Layout) -> String {
    match l {
        Layout::Identity => "I".into(),
        Layout::Reduce => "R".into(),
        Layout::Gather(d) => format!("G{d}"),
    }
}

/// A rule as one line: `name in,in -> out work`, layouts as `I`, `R`, `G<dim>`.
pub fn line(r: &Rule) -> String {
    let ls = |v: &[Layout]| v.iter().map(layout).collect::<Vec<_>>().join(",");
    let work = match r.work {
        Work::Full => "full",
        Work::Sharded => "sharded",
        Work::Free => "free",
    };
    format!("{} {} -> {} {}", r.name, ls(&r.inputs), ls(&r.outputs), work)
}

/// The rules are `replicated` first, then exactly `expected` (in any order).
#[track_caller]
pub fn assert_rules(got: &OpRules, expected: &[&str]) {
    let first = got.rules.first().map(line);
    let n_in = got.rules[0].inputs.len();
    let n_out = got.rules[0].outputs.len();
    let replicated = format!("replicated {} -> {} full", vec!["I"; n_in].join(","), vec!["I"; n_out].join(","));
    assert_eq!(first.as_deref(), Some(replicated.as_str()));
    let mut got: Vec<String> = got.rules[1..].iter().map(line).collect();
    let mut want: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

/// [`graph`] with the op node carrying torch tags `tags` (as lowering records them).
pub fn tagged(op: &str, args: Vec<(&str, A)>, outputs: &[(&[usize], DType)], tags: &[&str]) -> Graph {
    let mut g = graph(op, args, outputs);
    if let Some(node) = g.nodes.last_mut() {
        node.tags = tags.iter().map(|t| t.to_string()).collect();
    }
    g
}
