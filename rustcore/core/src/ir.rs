//! The graph IR (`.hapg`, `docs/formats.md`): what hapd lowers an exported PyTorch
//! program to. [`decode`] checks the header first (format, version), then each node on
//! its own so that an error names the node; [`crate::validate`] checks references and
//! shapes afterwards (`Graph::from_msgpack`, in `validate`, does both).
//!
//! The ground floor of the crate's graph side: it uses nothing of the crate but
//! [`crate::error`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// `format` of a graph file.
pub const GRAPH_FORMAT: &str = "hapd.graph";
/// The graph IR version this build reads and writes.
pub const GRAPH_VERSION: u32 = 1;

/// A reference to result `output` of node `node`; written as `[node, output]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorRef(pub u32, pub u32);

impl TensorRef {
    pub fn node(self) -> usize {
        self.0 as usize
    }
    pub fn output(self) -> usize {
        self.1 as usize
    }
}

/// What a node stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    /// A user input (a batch of data or labels).
    Input,
    /// A trainable (or frozen) parameter of the module.
    Parameter,
    /// A buffer of the module: state without gradient.
    Buffer,
    /// A tensor constant lifted out of the module.
    Constant,
    /// An ATen op.
    Op,
}

impl NodeKind {
    /// Sources have no inputs and exactly one result.
    pub fn is_source(self) -> bool {
        !matches!(self, NodeKind::Op)
    }
}

/// A schema argument value; tensors are indices into the node's `inputs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    #[serde(rename = "t")]
    Tensor(u32),
    #[serde(rename = "i")]
    Int(i64),
    #[serde(rename = "f")]
    Float(f64),
    #[serde(rename = "b")]
    Bool(bool),
    #[serde(rename = "s")]
    Str(String),
    #[serde(rename = "l")]
    List(Vec<Value>),
    #[serde(rename = "n")]
    None(()),
}

impl Value {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    pub fn as_float(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_ints(&self) -> Option<Vec<i64>> {
        match self {
            Value::List(items) => items.iter().map(Value::as_int).collect(),
            _ => None,
        }
    }
    pub fn is_none(&self) -> bool {
        matches!(self, Value::None(()))
    }
}

/// One named schema argument.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arg {
    pub name: String,
    pub value: Value,
}

/// Element types, with their size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
    /// Complex and other exotic types: carried, never sharded by size.
    Other,
    /// The result is not a tensor (an int, a None in a tuple).
    NotATensor,
}

impl DType {
    pub fn parse(name: &str) -> DType {
        match name {
            "float64" => DType::F64,
            "float32" => DType::F32,
            "float16" => DType::F16,
            "bfloat16" => DType::BF16,
            "int64" => DType::I64,
            "int32" => DType::I32,
            "int16" => DType::I16,
            "int8" => DType::I8,
            "uint8" => DType::U8,
            "bool" => DType::Bool,
            "none" => DType::NotATensor,
            _ => DType::Other,
        }
    }

    /// The torch name without its prefix (`float32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::Other => "other",
            DType::NotATensor => "none",
        }
    }

    /// Bytes per element (8 for the unknown kinds: an upper bound for costs).
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::Other => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::NotATensor => 0,
        }
    }

    /// Floating-point tensors carry gradients; integer ones never do.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }
}

/// Shape, dtype and fx name of one result, as written in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMetaFile {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
}

/// One node as written in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeFile {
    pub name: String,
    pub kind: NodeKind,
    #[serde(default)]
    pub op: String,
    #[serde(default)]
    pub target: String,
    #[serde(default)]
    pub inputs: Vec<TensorRef>,
    #[serde(default)]
    pub args: Vec<Arg>,
    pub outputs: Vec<TensorMetaFile>,
    #[serde(default)]
    pub requires_grad: bool,
    #[serde(default)]
    pub batch_dim: Option<i64>,
    /// torch's tags of the op that matter to sharding (`"pointwise"`); absent in files
    /// written before the field existed.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Forward FLOPs torch's FLOP counter counts for the op (matrix products,
    /// convolutions, attention); absent when it counts none, and in files written
    /// before the field existed.
    #[serde(default)]
    pub flops: Option<f64>,
    /// Indices of the results whose storage the backward pass keeps (traced at
    /// lowering); absent when none, and in files written before the field existed.
    #[serde(default)]
    pub saved: Vec<u32>,
    /// Bytes the op's backward keeps that are no node's result (attention's
    /// log-sum-exp); absent when none.
    #[serde(default)]
    pub saved_bytes: Option<f64>,
    /// Bytes the op's backward keeps beyond `saved_bytes` where hapd's counter-based
    /// generator draws its dropout (a plan of several devices: an attention with dropout
    /// then runs as the math attention and keeps its probabilities); absent when none.
    #[serde(default)]
    pub counter_saved_bytes: Option<f64>,
    /// The repeated block of the model the op belongs to (the outermost module held at
    /// an index of a container, `layers.3`, from the exported program's module stack):
    /// the unit activation recomputation works in. Absent outside such blocks, and in
    /// files written before the field existed.
    #[serde(default)]
    pub block: Option<String>,
}

/// A result of a node, after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    /// fx node holding this result.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorMeta {
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

/// A node after decoding: the file's node with typed shapes and dtypes.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub kind: NodeKind,
    pub op: String,
    pub target: String,
    pub inputs: Vec<TensorRef>,
    pub args: Vec<Arg>,
    pub outputs: Vec<TensorMeta>,
    pub requires_grad: bool,
    pub batch_dim: Option<usize>,
    /// torch's tags of the op that matter to sharding (see [`TAG_POINTWISE`]).
    pub tags: Vec<String>,
    /// Forward FLOPs of the whole op as torch's FLOP counter counts them (finite, ≥ 0);
    /// `None` when lowering recorded none. [`crate::rules::rules_for`] prices the op by
    /// the larger of this and its family's formula.
    pub flops: Option<f64>,
    /// Per result, whether the backward pass keeps its storage (an activation); all
    /// `false` when the graph's saved tensors were not traced ([`Graph::saved_traced`]).
    pub saved: Vec<bool>,
    /// Bytes the op's backward keeps that are no node's result (finite, ≥ 0).
    pub saved_bytes: f64,
    /// Bytes kept beyond `saved_bytes` on a plan of several devices (see
    /// [`NodeFile::counter_saved_bytes`]; finite, ≥ 0).
    pub counter_saved_bytes: f64,
    /// The repeated block of the model the op belongs to (see [`NodeFile::block`]).
    pub block: Option<String>,
}

/// The tag torch gives element-wise ops (`torch.Tag.pointwise`): every result element
/// depends only on the operand elements at the same (broadcast) index.
pub const TAG_POINTWISE: &str = "pointwise";

/// The tag torch gives ops that draw random numbers (`torch.Tag.nondeterministic_seeded`).
pub const TAG_RANDOM: &str = "nondeterministic_seeded";

impl Node {
    /// Whether lowering recorded torch tag `tag` for this node's op.
    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    /// The value of the schema argument `name`, if present.
    pub fn arg(&self, name: &str) -> Option<&Value> {
        self.args.iter().find(|a| a.name == name).map(|a| &a.value)
    }

    /// The tensor operand passed as schema argument `name`, if it is a tensor.
    pub fn tensor_arg(&self, name: &str) -> Option<TensorRef> {
        match self.arg(name) {
            Some(Value::Tensor(k)) => self.inputs.get(*k as usize).copied(),
            _ => None,
        }
    }
}

/// How the loss reduces over the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReduction {
    Sum,
    Mean,
    Unknown,
}

/// A buffer the step updates: an effect of the program besides the loss. The core keeps
/// every op its value depends on and ends the program with the value in `Identity`
/// layout, so every rank holds the whole new buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mutation {
    /// Fully qualified name of the buffer (`layer1.0.bn1.running_mean`).
    pub target: String,
    /// The op result that is the buffer's new value.
    pub value: TensorRef,
}

/// A decoded graph. [`crate::validate::validate`] checks one; `Graph::from_msgpack`
/// (defined there) decodes and checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub loss: TensorRef,
    pub loss_reduction: LossReduction,
    /// Buffer updates, in the program's output order (empty when absent in the file).
    pub mutations: Vec<Mutation>,
    /// Whether lowering traced which results the backward pass keeps (the nodes'
    /// `saved`); when not, the memory model assumes every result with a gradient.
    pub saved_traced: bool,
}

impl Graph {
    /// Shape, dtype and name of a tensor; the reference must be valid.
    pub fn meta(&self, t: TensorRef) -> &TensorMeta {
        &self.nodes[t.node()].outputs[t.output()]
    }

    /// Ops that appear in the graph, with how many times.
    pub fn op_counts(&self) -> Vec<(String, usize)> {
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for node in self.nodes.iter().filter(|n| n.kind == NodeKind::Op) {
            *counts.entry(node.op.as_str()).or_default() += 1;
        }
        counts.into_iter().map(|(op, n)| (op.to_string(), n)).collect()
    }
}

/// How deep msgpack values may nest (rmpv counts about two levels per list or map). A
/// graph needs about ten; the bound keeps the recursive decoders well inside a thread's
/// stack on any input (rmpv's default of 1024 overflows a 2 MiB stack in debug builds).
const MAX_DEPTH: usize = 128;

/// The most elements a tensor may have (about 2.8e14, far above any real tensor), so
/// that element and byte counts, and sums of them, never overflow.
const MAX_ELEMENTS: u64 = 1 << 48;

fn decode_error(message: impl ToString) -> Error {
    Error::Decode { what: "graph", message: message.to_string() }
}

/// The value under `key` in a msgpack map.
fn get<'a>(map: &'a [(rmpv::Value, rmpv::Value)], key: &str) -> Option<&'a rmpv::Value> {
    map.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

fn graph_field(field: &str, message: impl Into<String>) -> Error {
    Error::InvalidGraph { field: field.to_string(), message: message.into() }
}

/// Decode a graph file without validating references or shapes.
pub fn decode(bytes: &[u8]) -> Result<Graph> {
    if bytes.is_empty() {
        return Err(decode_error("the file is empty"));
    }
    let mut reader = bytes;
    let root = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH).map_err(decode_error)?;
    if !reader.is_empty() {
        return Err(decode_error(format!("{} trailing bytes after the document", reader.len())));
    }
    let map = root.as_map().ok_or_else(|| decode_error("the document is not a map"))?;

    let format = get(map, "format").and_then(rmpv::Value::as_str);
    match format {
        Some(GRAPH_FORMAT) => {}
        Some(other) => {
            return Err(Error::UnknownFormat { found: other.to_string(), expected: GRAPH_FORMAT })
        }
        None => return Err(Error::UnknownFormat { found: "<missing>".into(), expected: GRAPH_FORMAT }),
    }
    let version = get(map, "version")
        .and_then(rmpv::Value::as_i64)
        .ok_or_else(|| graph_field("version", "missing or not an integer"))?;
    if version != GRAPH_VERSION as i64 {
        return Err(Error::UnsupportedVersion { format: GRAPH_FORMAT, found: version, supported: GRAPH_VERSION });
    }

    let name = get(map, "name").and_then(rmpv::Value::as_str).unwrap_or("").to_string();
    let nodes_value = get(map, "nodes").ok_or_else(|| graph_field("nodes", "missing"))?;
    let raw_nodes = nodes_value.as_array().ok_or_else(|| graph_field("nodes", "not a list"))?;
    let mut nodes = Vec::with_capacity(raw_nodes.len());
    for (index, raw) in raw_nodes.iter().enumerate() {
        nodes.push(decode_node(index, raw)?);
    }

    let loss_value = get(map, "loss").ok_or_else(|| graph_field("loss", "missing"))?;
    let loss: TensorRef = rmpv::ext::from_value(loss_value.clone())
        .map_err(|e| graph_field("loss", format!("not a tensor reference [node, output]: {e}")))?;
    let loss_reduction = match get(map, "loss_reduction").and_then(rmpv::Value::as_str) {
        Some("sum") => LossReduction::Sum,
        Some("mean") => LossReduction::Mean,
        Some("unknown") | None => LossReduction::Unknown,
        Some(other) => {
            return Err(graph_field("loss_reduction", format!("{other:?} is not one of sum, mean, unknown")))
        }
    };
    let mutations = match get(map, "mutations") {
        None => Vec::new(),
        Some(value) => rmpv::ext::from_value::<Vec<Mutation>>(value.clone()).map_err(|e| {
            graph_field("mutations", format!("not a list of {{target, value: [node, output]}}: {e}"))
        })?,
    };
    let saved_traced = match get(map, "saved_traced") {
        None => false,
        Some(value) => value.as_bool().ok_or_else(|| graph_field("saved_traced", "not true or false"))?,
    };
    Ok(Graph { name, nodes, loss, loss_reduction, mutations, saved_traced })
}

fn decode_node(index: usize, raw: &rmpv::Value) -> Result<Node> {
    let name = raw
        .as_map()
        .and_then(|m| get(m, "name"))
        .and_then(rmpv::Value::as_str)
        .unwrap_or("<unnamed>")
        .to_string();
    if raw.as_map().is_none() {
        return Err(Error::node_field(index, &name, "<node>", "not a map"));
    }
    // rmp-serde (not rmpv's value deserializer) reads enums as hapd writes them:
    // unit variants as strings, others as one-key maps.
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, raw).map_err(decode_error)?;
    let file: NodeFile = rmp_serde::from_slice(&buf).map_err(|e| {
        let message = e.to_string();
        let field = raw.as_map().map_or_else(|| "<node>".to_string(), |m| failing_field(m, &message));
        Error::node_field(index, &name, field, message)
    })?;
    let outputs = decode_outputs(index, &name, &file.outputs)?;
    check_counts(index, &name, &file)?;
    let saved = saved_flags(index, &name, &file.saved, outputs.len())?;
    let batch_dim = match file.batch_dim {
        None => None,
        Some(d) if d >= 0 => Some(d as usize),
        Some(d) => return Err(Error::node_field(index, &name, "batch_dim", format!("negative ({d})"))),
    };
    Ok(Node {
        name: file.name,
        kind: file.kind,
        op: file.op,
        target: file.target,
        inputs: file.inputs,
        args: file.args,
        outputs,
        requires_grad: file.requires_grad,
        batch_dim,
        tags: file.tags,
        flops: file.flops,
        saved,
        saved_bytes: file.saved_bytes.unwrap_or(0.0),
        counter_saved_bytes: file.counter_saved_bytes.unwrap_or(0.0),
        block: file.block,
    })
}

/// The results of node `index` (`name`) with typed shapes and dtypes: no negative
/// dimension, at most 2^48 elements each.
fn decode_outputs(index: usize, name: &str, outputs: &[TensorMetaFile]) -> Result<Vec<TensorMeta>> {
    let mut metas = Vec::with_capacity(outputs.len());
    for (k, out) in outputs.iter().enumerate() {
        let mut shape = Vec::with_capacity(out.shape.len());
        for &d in &out.shape {
            if d < 0 {
                return Err(Error::node_field(
                    index,
                    name,
                    format!("outputs[{k}].shape"),
                    format!("negative dimension {d} in {:?}", out.shape),
                ));
            }
            shape.push(d as usize);
        }
        let elements = out.shape.iter().try_fold(1_u64, |n, &d| n.checked_mul(d as u64));
        if elements.is_none_or(|n| n > MAX_ELEMENTS) {
            return Err(Error::node_field(
                index,
                name,
                format!("outputs[{k}].shape"),
                format!("{:?} has more than 2^48 elements", out.shape),
            ));
        }
        metas.push(TensorMeta { name: out.name.clone(), shape, dtype: DType::parse(&out.dtype) });
    }
    Ok(metas)
}

/// The node's FLOP and byte counts, where present, are finite and ≥ 0.
fn check_counts(index: usize, name: &str, file: &NodeFile) -> Result<()> {
    if let Some(flops) = file.flops.filter(|f| !(f.is_finite() && *f >= 0.0)) {
        return Err(Error::node_field(index, name, "flops", format!("{flops} is not a finite count ≥ 0")));
    }
    if let Some(bytes) = file.saved_bytes.filter(|b| !(b.is_finite() && *b >= 0.0)) {
        return Err(Error::node_field(index, name, "saved_bytes", format!("{bytes} is not a finite byte count ≥ 0")));
    }
    if let Some(bytes) = file.counter_saved_bytes.filter(|b| !(b.is_finite() && *b >= 0.0)) {
        return Err(Error::node_field(
            index,
            name,
            "counter_saved_bytes",
            format!("{bytes} is not a finite byte count ≥ 0"),
        ));
    }
    Ok(())
}

/// Per result of `results`, whether `saved` (the file's indices) names it.
fn saved_flags(index: usize, name: &str, saved: &[u32], results: usize) -> Result<Vec<bool>> {
    let mut flags = vec![false; results];
    for &k in saved {
        match flags.get_mut(k as usize) {
            Some(flag) => *flag = true,
            None => {
                return Err(Error::node_field(
                    index,
                    name,
                    "saved",
                    format!("result {k} out of range for {results} results"),
                ))
            }
        }
    }
    Ok(flags)
}

/// The node field a decode error is about. serde's own message names a value, not
/// the field, for most errors ("unknown variant `weird`"), so each present field is
/// decoded on its own and the first that fails is the culprit; when all present ones
/// decode, a required field is missing and serde's "missing field `kind`" names it.
fn failing_field(map: &[(rmpv::Value, rmpv::Value)], message: &str) -> String {
    for (key, value) in map {
        let Some(key) = key.as_str() else { continue };
        let fits = match key {
            "name" | "op" | "target" => fits::<String>(value),
            "kind" => fits::<NodeKind>(value),
            "inputs" => fits::<Vec<TensorRef>>(value),
            "args" => fits::<Vec<Arg>>(value),
            "outputs" => fits::<Vec<TensorMetaFile>>(value),
            "requires_grad" => fits::<bool>(value),
            "batch_dim" => fits::<Option<i64>>(value),
            "tags" => fits::<Vec<String>>(value),
            "flops" | "saved_bytes" | "counter_saved_bytes" => fits::<Option<f64>>(value),
            "saved" => fits::<Vec<u32>>(value),
            "block" => fits::<Option<String>>(value),
            _ => true,
        };
        if !fits {
            return key.to_string();
        }
    }
    message
        .split_once("missing field `")
        .and_then(|(_, rest)| rest.split('`').next())
        .filter(|f| !f.is_empty())
        .map_or_else(|| "<node>".to_string(), str::to_string)
}

/// Whether `value` decodes as a `T` (the way [`decode_node`] decodes a whole node).
fn fits<T: serde::de::DeserializeOwned>(value: &rmpv::Value) -> bool {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, value).is_ok() && rmp_serde::from_slice::<T>(&buf).is_ok()
}
