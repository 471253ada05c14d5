//! The graph IR reader on the fixtures shared with the Python tests
//! (`tests/fixtures/*.hapg`, written by `tests/fixtures/make_fixtures.py`): every
//! benchmark model decodes, validates and summarises sensibly; every hand-made bad file
//! is rejected with its specific error; no input at all makes the reader panic.

use hapd_core::ir::{self, DType, LossReduction, NodeKind, TensorRef};
use hapd_core::rules;
use hapd_core::summary::Summary;
use hapd_core::{Error, Graph};
use proptest::prelude::*;

#[macro_use]
mod common;
use common::MODELS;

const BATCH: usize = 2;

/// (model, ops its graph must contain, buffers (FQN, shape) it must have).
#[allow(clippy::type_complexity)]
const EXPECTED: &[(&str, &[&str], &[(&str, &[usize])])] = &[
    ("mlp", &["aten.linear", "aten.gelu", "aten.cross_entropy_loss"], &[]),
    ("vgg19", &["aten.conv2d", "aten.max_pool2d", "aten.relu", "aten.linear"], &[]),
    ("vit", &["aten.conv2d", "aten.cat", "aten.linear", "aten.layer_norm", "aten.scaled_dot_product_attention"], &[]),
    (
        "bert",
        &["aten.embedding", "aten.linear", "aten.layer_norm", "aten.scaled_dot_product_attention", "aten.relu"],
        &[("positions", &[16, 32])],
    ),
    (
        "bert_moe",
        &[
            "aten.embedding",
            "aten.einsum",
            "aten.softmax.int",
            "aten.topk",
            "aten.one_hot",
            "aten.cumsum",
            "aten.scaled_dot_product_attention",
        ],
        &[("positions", &[16, 32])],
    ),
    (
        "gpt2_block",
        &["aten.embedding", "aten.arange", "aten.layer_norm", "aten.scaled_dot_product_attention", "aten.gelu"],
        &[],
    ),
    (
        "llama_block",
        &["aten.embedding", "aten.linear", "aten.rsqrt", "aten.scaled_dot_product_attention", "aten.silu"],
        &[("rope_cos", &[16, 8]), ("rope_sin", &[16, 8])],
    ),
];

fn load(name: &str, bytes: &[u8]) -> Graph {
    Graph::from_msgpack(bytes).unwrap_or_else(|e| panic!("{name}.hapg does not load: {e} ({e:?})"))
}

// ------------------------------------------------------------------------ good fixtures

#[test]
fn every_model_fixture_is_listed() {
    let names: Vec<_> = MODELS.iter().map(|(n, _)| *n).collect();
    let expected: Vec<_> = EXPECTED.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(names, expected);
}

#[test]
fn models_decode_and_validate() {
    for &(name, bytes) in MODELS {
        let graph = load(name, bytes);
        assert_eq!(graph.name, name);
        assert_eq!(graph.loss_reduction, LossReduction::Sum, "{name}");
        let loss = graph.meta(graph.loss);
        assert!(loss.shape.is_empty() && loss.dtype == DType::F32, "{name}: loss {loss:?}");
        assert_eq!(graph.nodes[graph.loss.node()].op, "aten.cross_entropy_loss", "{name}");
        // decode alone gives the same graph: validation only checks
        assert_eq!(ir::decode(bytes).unwrap(), graph, "{name}");
        for (index, node) in graph.nodes.iter().enumerate() {
            assert!(!node.name.is_empty(), "{name}: node {index}");
            for r in &node.inputs {
                assert!(r.node() < index, "{name}: {} refers forward", node.name);
            }
            match node.kind {
                NodeKind::Op => assert!(node.op.starts_with("aten."), "{name}: {} is {}", node.name, node.op),
                kind => {
                    assert!(node.op.is_empty() && node.inputs.is_empty() && node.outputs.len() == 1);
                    assert_eq!(node.requires_grad, kind == NodeKind::Parameter, "{name}: {}", node.name);
                    assert_eq!(node.outputs[0].name, node.name);
                }
            }
        }
    }
}

#[test]
fn model_summaries() {
    for &(name, bytes) in MODELS {
        let graph = load(name, bytes);
        let s = Summary::of(&graph);
        let (_, must_ops, buffers) = EXPECTED.iter().find(|(n, _, _)| *n == name).unwrap();
        assert_eq!(s.name, name);
        assert_eq!(s.nodes, graph.nodes.len());

        // ops: sorted by name, counted once each, covering every op node
        let op_names: Vec<&str> = s.ops.iter().map(|(op, _)| op.as_str()).collect();
        let mut sorted = op_names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(op_names, sorted, "{name}: ops not sorted or repeated");
        let op_nodes = graph.nodes.iter().filter(|n| n.kind == NodeKind::Op).count();
        assert_eq!(s.ops.iter().map(|(_, c)| c).sum::<usize>(), op_nodes, "{name}");
        for op in *must_ops {
            assert!(op_names.contains(op), "{name}: no {op} in {op_names:?}");
        }
        assert!(s.ops.contains(&("aten.cross_entropy_loss".to_string(), 1)), "{name}");

        // opaque ops: exactly the ops without a sharding family
        let opaque: Vec<_> = s.ops.iter().filter(|(op, _)| rules::family(op).is_none()).cloned().collect();
        assert_eq!(s.opaque_ops, opaque, "{name}");

        // parameters: FQNs, trainable, element count of a tiny model
        assert!(!s.parameters.is_empty(), "{name}");
        for (fqn, shape, trains) in &s.parameters {
            assert!(*trains, "{name}: {fqn} frozen");
            assert!(!fqn.is_empty() && !fqn.starts_with("p_"), "{name}: parameter FQN {fqn:?}");
            assert!(!shape.is_empty(), "{name}: {fqn} is a scalar");
        }
        let elements: usize = s.parameters.iter().map(|(_, shape, _)| shape.iter().product::<usize>()).sum();
        assert_eq!(s.parameter_elements, elements, "{name}");
        assert!((2_000..=100_000).contains(&elements), "{name}: {elements} parameter elements");

        // buffers and inputs
        let got: Vec<(&str, &[usize])> = s.buffers.iter().map(|(n, shape)| (n.as_str(), shape.as_slice())).collect();
        assert_eq!(got, *buffers, "{name}");
        assert_eq!(s.inputs.len(), 2, "{name}: {:?}", s.inputs);
        let (x, y) = (&s.inputs[0], &s.inputs[1]);
        assert_eq!((x.0.as_str(), y.0.as_str()), ("x", "y"), "{name}");
        for (input, shape, batch_dim) in [x, y] {
            assert_eq!(*batch_dim, Some(0), "{name}: {input}");
            assert_eq!(shape[0], BATCH, "{name}: {input} {shape:?}");
        }
    }
}

#[test]
fn specific_model_details() {
    // gpt2's learned positions come from arange: a source without tensor operands, whose
    // one (replicated) rule is right, so it is not opaque
    let gpt2 = Summary::of(&load("gpt2_block", fixture!("gpt2_block")));
    assert!(gpt2.ops.iter().any(|(op, n)| op == "aten.arange" && *n == 1), "{:?}", gpt2.ops);
    assert!(gpt2.opaque_ops.is_empty(), "{:?}", gpt2.opaque_ops);
    // bert_moe's topk returns (values, indices): both results carry their getitem name
    let moe = load("bert_moe", fixture!("bert_moe"));
    let topk = moe.nodes.iter().find(|n| n.op == "aten.topk").unwrap();
    assert_eq!(topk.outputs.len(), 2);
    assert_eq!(topk.outputs[0].shape, [BATCH, 16, 2]);
    assert_eq!((topk.outputs[0].dtype, topk.outputs[1].dtype), (DType::F32, DType::I64));
    assert!(topk.outputs.iter().all(|o| o.name.starts_with("getitem")), "{:?}", topk.outputs);
    assert_ne!(topk.outputs[0].name, topk.outputs[1].name);
    assert_eq!(topk.arg("k").and_then(|v| v.as_int()), Some(2));
    // mlp: the first linear reads x, the first weight and bias, by schema argument
    let mlp = load("mlp", fixture!("mlp"));
    let linear = mlp.nodes.iter().find(|n| n.name == "linear").unwrap();
    let target = |r: Option<TensorRef>| mlp.nodes[r.unwrap().node()].target.clone();
    assert_eq!(target(linear.tensor_arg("input")), "x");
    assert_eq!(target(linear.tensor_arg("weight")), "body.0.weight");
    assert_eq!(target(linear.tensor_arg("bias")), "body.0.bias");
}

// ------------------------------------------------------------------------- bad fixtures

/// `reject!(test: "fixture" => pattern [if guard], kind, node, field)`: the fixture
/// fails with an error matching `pattern`, of Python class `kind`, naming `node`/`field`.
macro_rules! reject {
    ($($test:ident: $fixture:literal => $pattern:pat $(if $guard:expr)?, $kind:literal, $node:expr, $field:expr;)*) => {
        $(
            #[test]
            fn $test() {
                let err = Graph::from_msgpack(fixture!($fixture)).expect_err(concat!($fixture, ".hapg loaded"));
                assert!(matches!(&err, $pattern $(if $guard)?), "{}.hapg: unexpected {err:?}", $fixture);
                assert_eq!(err.kind(), $kind, "{err:?}");
                assert_eq!(err.node(), $node, "{err:?}");
                assert_eq!(err.field(), $field, "{err:?}");
                assert!(!err.to_string().is_empty());
            }
        )*
        /// Every bad fixture has a test above.
        const BAD: &[&str] = &[$($fixture),*];
        /// Their bytes.
        const BAD_BYTES: &[(&str, &[u8])] = fixtures![$($fixture),*];
    };
}

reject! {
    truncated: "truncated" => Error::Decode { what: "graph", .. }, "GraphFormatError", None, None;
    garbage: "garbage" => Error::Decode { what: "graph", .. }, "GraphFormatError", None, None;
    empty: "empty" => Error::Decode { message, .. } if message.contains("empty"), "GraphFormatError", None, None;
    wrong_version: "wrong_version"
        => Error::UnsupportedVersion { format: "hapd.graph", found: 99, supported: 1 },
        "GraphVersionError", None, None;
    wrong_format: "wrong_format"
        => Error::UnknownFormat { found, expected: "hapd.graph" } if found == "hapd.plan",
        "GraphFormatError", None, None;
    dangling: "dangling"
        => Error::DanglingRef { index: 11, name, input: 0, target, .. } if name == "linear_1" && target == "[23, 0]",
        "GraphValidationError", Some("linear_1"), Some("inputs");
    forward_ref: "forward_ref"
        => Error::DanglingRef { name, input: 0, message, .. } if name == "linear_1" && message.contains("topological"),
        "GraphValidationError", Some("linear_1"), Some("inputs");
    shape_mismatch: "shape_mismatch"
        => Error::ShapeMismatch { name, op, message } if name == "linear" && op == "aten.linear" && message.contains("[64, 33]"),
        "ShapeError", Some("linear"), None;
    not_scalar_loss: "not_scalar_loss"
        => Error::InvalidGraph { field, message } if field == "loss" && message.contains("scalar"),
        "GraphValidationError", None, Some("loss");
    bad_kind: "bad_kind"
        => Error::InvalidNode { index: 9, name, field, .. } if name == "gelu" && field == "kind",
        "GraphValidationError", Some("gelu"), Some("kind");
    negative_dim: "negative_dim"
        => Error::InvalidNode { name, field, .. } if name == "gelu" && field == "outputs[0].shape",
        "GraphValidationError", Some("gelu"), Some("outputs[0].shape");
}

#[test]
fn bad_fixtures_are_rejected_by_decode_or_validate() {
    // the header and per-node errors come from decode, the rest from validate
    for (name, decodes) in
        [("dangling", true), ("shape_mismatch", true), ("not_scalar_loss", true), ("wrong_version", false)]
    {
        let bytes = BAD_BYTES.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(ir::decode(bytes).is_ok(), decodes, "{name}");
    }
    assert_eq!(BAD.len(), BAD_BYTES.len());
}

#[test]
fn every_fixture_file_is_tested() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "hapg"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut tested: Vec<String> =
        MODELS.iter().map(|(n, _)| n.to_string()).chain(BAD.iter().map(|n| n.to_string())).collect();
    tested.sort();
    assert_eq!(on_disk, tested, "a fixture in {} has no test here", dir.display());
    for (name, bytes) in MODELS.iter().chain(BAD_BYTES) {
        assert_eq!(std::fs::read(dir.join(format!("{name}.hapg"))).unwrap(), *bytes, "{name}");
    }
}

// ------------------------------------------------------- edits of a good document

/// The mlp fixture as a msgpack value, to edit.
fn mlp_doc() -> rmpv::Value {
    rmpv::decode::read_value(&mut fixture!("mlp")).unwrap()
}

fn encode(doc: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, doc).unwrap();
    out
}

fn entry<'a>(map: &'a mut rmpv::Value, key: &str) -> &'a mut rmpv::Value {
    &mut entries(map).iter_mut().find(|(k, _)| k.as_str() == Some(key)).unwrap_or_else(|| panic!("no {key}")).1
}

fn node<'a>(doc: &'a mut rmpv::Value, name: &str) -> &'a mut rmpv::Value {
    items(entry(doc, "nodes"))
        .iter_mut()
        .find(|n| {
            n.as_map().is_some_and(|m| m.iter().any(|(k, v)| k.as_str() == Some("name") && v.as_str() == Some(name)))
        })
        .unwrap()
}

/// The entries of a map.
fn entries(map: &mut rmpv::Value) -> &mut Vec<(rmpv::Value, rmpv::Value)> {
    let rmpv::Value::Map(entries) = map else { panic!("not a map") };
    entries
}

/// `map` without its entry `key`.
fn without(map: &mut rmpv::Value, key: &str) {
    entries(map).retain(|(k, _)| k.as_str() != Some(key));
}

/// The items of a list.
fn items(list: &mut rmpv::Value) -> &mut Vec<rmpv::Value> {
    let rmpv::Value::Array(items) = list else { panic!("not a list") };
    items
}

/// Node `name`'s first result gets shape `dims`.
fn set_shape(doc: &mut rmpv::Value, name: &str, dims: &[i64]) {
    *entry(&mut items(entry(node(doc, name), "outputs"))[0], "shape") = ints(dims);
}

/// Node `name`'s first schema argument gets the value `{tag: value}`.
fn set_first_arg(doc: &mut rmpv::Value, name: &str, tag: &str, value: i64) {
    let value = rmpv::Value::Map(vec![(rmpv::Value::from(tag), rmpv::Value::from(value))]);
    *entry(&mut items(entry(node(doc, name), "args"))[0], "value") = value;
}

fn ints(values: &[i64]) -> rmpv::Value {
    rmpv::Value::Array(values.iter().map(|&v| rmpv::Value::from(v)).collect())
}

fn edited(edit: impl FnOnce(&mut rmpv::Value)) -> Result<Graph, Error> {
    let mut doc = mlp_doc();
    edit(&mut doc);
    Graph::from_msgpack(&encode(&doc))
}

#[test]
fn unedited_document_loads() {
    assert_eq!(encode(&mlp_doc()), fixture!("mlp"), "rmpv re-encodes the canonical bytes");
    edited(|_| {}).unwrap();
}

/// An edit of the mlp document.
type Edit = Box<dyn FnOnce(&mut rmpv::Value)>;
/// (what, edit, Python class, node, field) of the error.
type Case = (&'static str, Edit, &'static str, Option<&'static str>, Option<&'static str>);

/// The case that sets `field` of node `name` to `value`, an error naming that node and field.
fn node_field(what: &'static str, name: &'static str, field: &'static str, value: rmpv::Value) -> Case {
    (what, Box::new(move |d| *entry(node(d, name), field) = value), "GraphValidationError", Some(name), Some(field))
}

/// The case that sets the document's `field` to `value`, an error naming that field.
fn graph_field(what: &'static str, field: &'static str, value: rmpv::Value) -> Case {
    (what, Box::new(move |d| *entry(d, field) = value), "GraphValidationError", None, Some(field))
}

/// Edits of a node's fields that fail to decode: one missing, a count out of range or not a number.
fn node_field_cases() -> Vec<Case> {
    vec![
        (
            "missing kind",
            Box::new(|d| without(node(d, "gelu"), "kind")),
            "GraphValidationError",
            Some("gelu"),
            Some("kind"),
        ),
        (
            "negative flops",
            Box::new(|d| entries(node(d, "gelu")).push((rmpv::Value::from("flops"), rmpv::Value::from(-1.0)))),
            "GraphValidationError",
            Some("gelu"),
            Some("flops"),
        ),
        (
            "flops not a number",
            Box::new(|d| entries(node(d, "gelu")).push((rmpv::Value::from("flops"), rmpv::Value::from("many")))),
            "GraphValidationError",
            Some("gelu"),
            Some("flops"),
        ),
    ]
}

/// Edits of a node's values that fail to decode: references, arguments, results.
fn node_value_cases() -> Vec<Case> {
    vec![
        node_field("inputs not refs", "gelu", "inputs", rmpv::Value::from("x")),
        (
            "bad arg value",
            Box::new(|d| set_first_arg(d, "gelu", "zz", 1)),
            "GraphValidationError",
            Some("gelu"),
            Some("args"),
        ),
        (
            "output without dtype",
            Box::new(|d| without(&mut items(entry(node(d, "gelu"), "outputs"))[0], "dtype")),
            "GraphValidationError",
            Some("gelu"),
            Some("outputs"),
        ),
    ]
}

/// Edits that make a node wrong in its graph: references, names, sources.
fn node_check_cases() -> Vec<Case> {
    vec![
        (
            "tensor arg out of range",
            Box::new(|d| set_first_arg(d, "gelu", "t", 7)),
            "GraphValidationError",
            Some("gelu"),
            Some("args[0] (self)"),
        ),
        (
            "duplicate name",
            Box::new(|d| *entry(node(d, "gelu_1"), "name") = rmpv::Value::from("gelu")),
            "GraphValidationError",
            Some("gelu"),
            Some("name"),
        ),
        node_field("source with inputs", "x", "inputs", rmpv::Value::Array(vec![ints(&[0, 0])])),
        node_field("batch dim past rank", "y", "batch_dim", rmpv::Value::from(1)),
        node_field("batch dim on a parameter", "p_head_bias", "batch_dim", rmpv::Value::from(0)),
        node_field("op without name", "gelu", "op", rmpv::Value::from("")),
        node_field("output index past the end", "gelu", "inputs", rmpv::Value::Array(vec![ints(&[8, 3])])),
    ]
}

/// Edits of the document around the nodes: the loss, the node list, the header.
fn graph_cases() -> Vec<Case> {
    vec![
        graph_field("loss past the end", "loss", ints(&[99, 0])),
        graph_field("integer loss", "loss", ints(&[7, 0])),
        graph_field("loss not a ref", "loss", rmpv::Value::from("cross_entropy_loss")),
        graph_field("bad loss reduction", "loss_reduction", rmpv::Value::from("max")),
        graph_field("no nodes", "nodes", rmpv::Value::Array(vec![])),
        graph_field("nodes not a list", "nodes", rmpv::Value::from(3)),
        graph_field("version not an int", "version", rmpv::Value::from("1")),
        ("missing format", Box::new(|d| without(d, "format")), "GraphFormatError", None, None),
    ]
}

/// Edits the shape checks of the op families catch: (what, node, its result's new
/// shape, the node named).
fn shape_cases() -> Vec<Case> {
    const CASES: &[(&str, &str, &[i64], &str)] = &[
        ("bias of the wrong size", "p_body_0_bias", &[63], "linear"),
        ("reshape changes the size", "reshape", &[2, 11], "reshape"),
        ("non-broadcasting output", "gelu", &[2, 65], "gelu"),
    ];
    let case = |&(what, edited, dims, named): &(&'static str, &'static str, &'static [i64], &'static str)| -> Case {
        (what, Box::new(move |d| set_shape(d, edited, dims)), "ShapeError", Some(named), None)
    };
    CASES.iter().map(case).collect()
}

#[test]
fn edits_name_the_node_and_field() {
    let groups = [node_field_cases(), node_value_cases(), node_check_cases(), graph_cases(), shape_cases()];
    for (what, edit, kind, node_name, field) in groups.into_iter().flatten() {
        let err = edited(edit).expect_err(what);
        assert_eq!((err.kind(), err.node(), err.field()), (kind, node_name, field), "{what}: {err}");
    }
}

#[test]
fn huge_dimensions_are_errors_not_overflows() {
    // element counts past usize must not overflow (a panic in debug builds)
    for dims in [vec![1_i64 << 32, 1 << 32], vec![i64::MAX, 2], vec![1 << 62, 1 << 62, 1 << 62]] {
        let err = edited(|d| set_shape(d, "y", &dims)).expect_err("a tensor of more than 2^64 elements loaded");
        assert_eq!(err.kind(), "GraphValidationError", "{dims:?}: {err}");
    }
}

#[test]
fn deeply_nested_args_are_errors_not_stack_overflows() {
    for depth in [0, 10, 40, 300, 2_000, 100_000] {
        let mut value = rmpv::Value::Map(vec![(rmpv::Value::from("i"), rmpv::Value::from(1))]);
        for _ in 0..depth {
            value = rmpv::Value::Map(vec![(rmpv::Value::from("l"), rmpv::Value::Array(vec![value]))]);
        }
        let mut doc = mlp_doc();
        items(entry(node(&mut doc, "gelu"), "args")).push(rmpv::Value::Map(vec![
            (rmpv::Value::from("name"), rmpv::Value::from("deep")),
            (rmpv::Value::from("value"), value),
        ]));
        // encoded by hand: rmpv's writer (and drop) recurse once per level
        let result = Graph::from_msgpack(&encode_deep(&doc));
        std::mem::forget(doc);
        match result {
            Ok(graph) => assert!(depth <= 10, "{depth} levels loaded: {:?}", graph.nodes[9].args.last()),
            Err(err) => {
                assert!(depth > 10, "{depth} levels: {err}");
                assert!(matches!(&err, Error::Decode { message, .. } if message.contains("depth")), "{err:?}");
            }
        }
    }
}

/// Encode a value iteratively (rmpv's writer and drop recurse per level).
fn encode_deep(value: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            rmpv::Value::Array(items) => {
                out.push(0xdd); // array 32
                out.extend_from_slice(&(items.len() as u32).to_be_bytes());
                stack.extend(items.iter().rev());
            }
            rmpv::Value::Map(entries) => {
                out.push(0xdf); // map 32
                out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
                for (k, v) in entries.iter().rev() {
                    stack.push(v);
                    stack.push(k);
                }
            }
            leaf => rmpv::encode::write_value(&mut out, leaf).unwrap(),
        }
    }
    out
}

// ----------------------------------------------------------------------- no panics

#[test]
fn every_prefix_of_a_fixture_is_an_error() {
    // about 300 cuts per model (a debug build decodes ~1000 fixtures a second)
    for &(name, bytes) in MODELS {
        for len in (0..bytes.len()).step_by(bytes.len() / 300 + 1).chain([1, bytes.len() - 1]) {
            let err = Graph::from_msgpack(&bytes[..len]).expect_err("a prefix loaded");
            assert_eq!(err.kind(), "GraphFormatError", "{name}[..{len}]: {err}");
        }
    }
}

#[test]
fn bit_flips_of_the_small_fixture_are_handled() {
    // one flip per byte of mlp (every bit of the header's bytes): each gives Ok or an
    // Err, never a panic
    let mut bytes = fixture!("mlp").to_vec();
    for i in 0..bytes.len() {
        let bits = if i < 64 { 0..8 } else { i % 8..i % 8 + 1 };
        for bit in bits {
            bytes[i] ^= 1 << bit;
            if let Ok(graph) = Graph::from_msgpack(&bytes) {
                let _ = Summary::of(&graph);
            }
            bytes[i] ^= 1 << bit;
        }
    }
}

fn config() -> ProptestConfig {
    ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = Graph::from_msgpack(&bytes);
    }

    #[test]
    fn random_msgpack_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        // a map header with `format`/`version` first, so the node decoder is reached
        let mut doc = vec![0x85]; // fixmap of 5 entries: format, version, nodes, then whatever follows
        for value in ["format", "hapd.graph", "version"] {
            rmpv::encode::write_value(&mut doc, &rmpv::Value::from(value)).unwrap();
        }
        doc.push(0x01);
        rmpv::encode::write_value(&mut doc, &rmpv::Value::from("nodes")).unwrap();
        doc.extend_from_slice(&bytes);
        let _ = Graph::from_msgpack(&doc);
    }

    #[test]
    fn mutated_fixtures_never_panic(
        model in 0..MODELS.len(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = MODELS[model].1.to_vec();
        for (at, byte, how) in edits {
            let i = at.index(bytes.len());
            match how {
                0 => bytes[i] ^= 1 << (byte % 8),
                1 => bytes[i] = byte,
                _ => { bytes.remove(i); }
            }
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        if let Ok(graph) = Graph::from_msgpack(&bytes) {
            let _ = Summary::of(&graph);
        }
    }
}
