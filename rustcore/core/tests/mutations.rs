//! Buffer updates are effects: the core keeps the ops they depend on even when the loss
//! does not read them, and ends the program with each new value whole (`Identity`).

use hapd_core::problem::{Mode, Options, Problem};
mod common;
use common::profile;
use hapd_core::{Error, Graph, Limits};
use rmpv::Value;

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

fn tensor_ref(node: u32, output: u32) -> Value {
    Value::Array(vec![Value::from(node), Value::from(output)])
}

fn meta(name: &str, shape: &[i64]) -> Value {
    let shape = shape.iter().map(|&d| Value::from(d)).collect();
    Value::Array(vec![map(vec![("name", Value::from(name)), ("shape", Value::Array(shape)), ("dtype", Value::from("float32"))])])
}

fn source(name: &str, kind: &str, target: &str, shape: &[i64], batch_dim: Option<i64>) -> Value {
    map(vec![
        ("name", Value::from(name)),
        ("kind", Value::from(kind)),
        ("target", Value::from(target)),
        ("outputs", meta(name, shape)),
        ("requires_grad", Value::from(kind == "parameter")),
        ("batch_dim", batch_dim.map_or(Value::Nil, Value::from)),
    ])
}

/// An op whose tensor arguments are `(schema name, [node, output])` and whose other
/// arguments are given as msgpack values.
fn op(name: &str, op: &str, tensors: &[(&str, u32)], others: Vec<(&str, Value)>, shape: &[i64]) -> Value {
    let inputs = tensors.iter().map(|&(_, n)| tensor_ref(n, 0)).collect();
    let mut args: Vec<Value> = tensors
        .iter()
        .enumerate()
        .map(|(k, &(arg, _))| map(vec![("name", Value::from(arg)), ("value", map(vec![("t", Value::from(k as u32))]))]))
        .collect();
    args.extend(others.into_iter().map(|(arg, v)| map(vec![("name", Value::from(arg)), ("value", v)])));
    map(vec![
        ("name", Value::from(name)),
        ("kind", Value::from("op")),
        ("op", Value::from(op)),
        ("inputs", Value::Array(inputs)),
        ("args", Value::Array(args)),
        ("outputs", meta(name, shape)),
    ])
}

/// `loss = sum(linear(x, w))`, and buffer `bn.running_mean` set to
/// `running_mean + mean(linear, dim 0)`, which the loss does not read (with `per_row`:
/// a buffer of the batch's shape set to `buffer + linear * linear`).
fn graph_bytes(mutations: Option<Value>, per_row: bool) -> Vec<u8> {
    let ints = |v: &[i64]| map(vec![("l", Value::Array(v.iter().map(|&i| map(vec![("i", Value::from(i))])).collect()))]);
    let none = || map(vec![("n", Value::Nil)]);
    let shape: &[i64] = if per_row { &[8, 16] } else { &[16] };
    let statistic = if per_row {
        op("mean", "aten.mul.Tensor", &[("self", 3), ("other", 3)], vec![], shape)
    } else {
        op(
            "mean",
            "aten.mean.dim",
            &[("self", 3)],
            vec![("dim", ints(&[0])), ("keepdim", map(vec![("b", Value::from(false))])), ("dtype", none())],
            shape,
        )
    };
    let nodes = vec![
        source("x", "input", "x", &[8, 16], Some(0)),
        source("b_running_mean", "buffer", "bn.running_mean", shape, None),
        source("p_weight", "parameter", "weight", &[16, 16], None),
        op("linear", "aten.linear", &[("input", 0), ("weight", 2)], vec![("bias", none())], &[8, 16]),
        statistic,
        op("add", "aten.add.Tensor", &[("self", 1), ("other", 4)], vec![("alpha", map(vec![("i", Value::from(1))]))], shape),
        op("sum", "aten.sum", &[("self", 3)], vec![("dtype", none())], &[]),
    ];
    let mut doc = vec![
        ("format", Value::from("hapd.graph")),
        ("version", Value::from(1)),
        ("name", Value::from("bn_like")),
        ("nodes", Value::Array(nodes)),
        ("loss", tensor_ref(6, 0)),
        ("loss_reduction", Value::from("sum")),
    ];
    if let Some(m) = mutations {
        doc.push(("mutations", m));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &map(doc)).expect("encode");
    out
}

fn update(target: &str, node: u32) -> Value {
    Value::Array(vec![map(vec![("target", Value::from(target)), ("value", tensor_ref(node, 0))])])
}

fn step_names(graph: &Graph, world: usize) -> Vec<String> {
    let p = profile(&vec![1e12; world], 1e-5, 1e9);
    let problem = Problem::new(graph, &p, Options::default()).expect("problem");
    problem.steps.iter().map(|s| graph.nodes[s.node].name.clone()).collect()
}

#[test]
fn a_buffer_update_nobody_reads_is_kept() {
    let with = Graph::from_msgpack(&graph_bytes(Some(update("bn.running_mean", 5)), false)).expect("decode");
    assert_eq!(with.mutations.len(), 1);
    assert_eq!(step_names(&with, 2), ["linear", "mean", "add", "sum"]);
    // without the update recorded, only the loss's ancestors are steps
    let without = Graph::from_msgpack(&graph_bytes(None, false)).expect("decode");
    assert!(without.mutations.is_empty());
    assert_eq!(step_names(&without, 2), ["linear", "sum"]);
}

/// Searches the graph on 1, 2 and 4 devices in both modes; per run, whether the update
/// was made whole by a collective at the end (else a step produced it whole). Slow
/// devices and free communication make sharded steps the cheapest.
fn ends_whole(per_row: bool) -> Vec<bool> {
    let graph = Graph::from_msgpack(&graph_bytes(Some(update("bn.running_mean", 5)), per_row)).expect("decode");
    let mut gathered_at_end = Vec::new();
    for (world, mode) in [(1, Mode::Auto), (2, Mode::Auto), (4, Mode::Auto), (2, Mode::DataParallel), (4, Mode::DataParallel)] {
        let p = profile(&vec![1e6; world], 0.0, 1e15);
        let ratios = vec![1.0 / world as f64; world];
        let options = Options { mode, ..Options::default() };
        let program = hapd_core::search_program(&graph, &p, &ratios, options, Limits::default(), None).expect("search");
        let add = program.tensors.iter().find(|t| t.name == "add").expect("the update is a tensor of the program");
        assert!(add.layouts.iter().any(|l| l == "Identity"), "{world} devices, {mode:?}: the update ends as {:?}", add.layouts);
        let last = program.steps.last().expect("steps");
        let produced_whole = program.steps.iter().any(|s| s.outputs.iter().any(|o| o.tensor == "add" && o.layout == "Identity"));
        let gathered = last.comms.iter().any(|c| c.tensor == "add" && c.to == "Identity");
        assert!(produced_whole || gathered, "{world} devices, {mode:?}: nothing makes the update whole");
        gathered_at_end.push(gathered);
    }
    gathered_at_end
}

#[test]
fn every_program_ends_with_the_new_buffer_whole() {
    ends_whole(false);
    // a per-row update of a batch-split program is computed split and gathered at the end
    let gathered = ends_whole(true);
    assert!(gathered.iter().skip(1).any(|&g| g), "no multi-device program gathers the update: {gathered:?}");
}

#[test]
fn an_update_must_be_computed_by_an_op() {
    for (mutations, needle) in [
        (update("bn.running_mean", 1), "not computed by an op"),
        (update("bn.running_mean", 42), "refers to node 42"),
        (
            Value::Array(vec![
                map(vec![("target", Value::from("a")), ("value", tensor_ref(5, 0))]),
                map(vec![("target", Value::from("a")), ("value", tensor_ref(4, 0))]),
            ]),
            "updated twice",
        ),
        (Value::from("no list"), "not a list"),
    ] {
        match Graph::from_msgpack(&graph_bytes(Some(mutations), false)) {
            Err(Error::InvalidGraph { field, message }) => {
                assert!(field.starts_with("mutations"), "{field}");
                assert!(message.contains(needle), "{message}");
            }
            other => panic!("expected an invalid graph with {needle:?}, got {other:?}"),
        }
    }
}
