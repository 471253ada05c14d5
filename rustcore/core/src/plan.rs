//! The program as data: what the core hands to Python after a search. Python adds the
//! sharding ratios from the LP, the integer lengths and the estimates, and writes the
//! `.hplan` file.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cost::Work;
use crate::ir::NodeKind;
use crate::layout::Layout;
use crate::memory;
use crate::outcome::{ChosenStep, Comm, Outcome, Source};
use crate::overlap::{OverlapOut, DUPLICAS};
use crate::problem::{Problem, TensorId};

/// The wire form of a cost row, defined beside [`crate::cost::Row`] (below `overlap`,
/// whose schedule rows carry it too) and re-exported with the plan types that carry it.
pub use crate::cost::RowOut;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayoutOut {
    pub tensor: String,
    pub layout: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommOut {
    pub tensor: String,
    pub from: String,
    pub to: String,
    pub collective: String,
    pub bytes: f64,
    /// Whether the backward pass runs the dual collective.
    pub grad: bool,
    pub cost: RowOut,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SourceOut {
    pub tensor: String,
    /// `input`, `parameter`, `buffer` or `constant`.
    pub kind: String,
    pub target: String,
    pub layout: String,
    pub bytes: f64,
    /// Whether a replicated trainable parameter all-reduces its gradient.
    pub grad_sync: bool,
    pub cost: RowOut,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepOut {
    pub node: String,
    pub op: String,
    pub rule: String,
    /// `sharded`, `full` or `free`.
    pub work: String,
    pub flops: f64,
    pub sources: Vec<SourceOut>,
    pub comms: Vec<CommOut>,
    pub inputs: Vec<LayoutOut>,
    pub outputs: Vec<LayoutOut>,
    pub comp: RowOut,
    pub comm: RowOut,
    /// The step's part in the two-duplica schedule ([`crate::overlap`]); nil unless the
    /// program was searched with overlap.
    pub overlap: Option<OverlapOut>,
    /// The recomputed span the step is in (see [`crate::recompute`]): the runtime
    /// runs each span's steps under activation checkpointing; nil when kept.
    pub recompute_span: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorOut {
    pub name: String,
    pub node: String,
    pub output: u32,
    pub kind: String,
    pub target: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub requires_grad: bool,
    pub layouts: Vec<String>,
}

/// Tensor dims split by one partition: their per-rank lengths are
/// `L[d] · size / units` with `L` the integer split of `units` by the ratios.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitOut {
    pub units: usize,
    /// (tensor, dim, size)
    pub members: Vec<(String, usize, usize)>,
}

/// Memory bytes by split ([`memory::Bytes`]): `replica` bytes whole on every device,
/// `shards` as (split class: an index into `splits`, or nil: split by the ratios;
/// bytes), and `largest` groups of such shards of which only the largest counts. Device
/// `d` holds `replica + Σ bytes · s[d] + Σ over groups of max bytes · s[d]`, where a
/// class's share `s[d]` is its integer length `L[d] / units` (the ratio `r[d]` for nil).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitBytesOut {
    pub replica: f64,
    pub shards: Vec<(Option<usize>, f64)>,
    pub largest: Vec<Vec<(Option<usize>, f64)>>,
}

/// The memory rows by split: what a finished plan prices at its integer lengths.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemorySplitOut {
    /// `memory` by split.
    pub backward: SplitBytesOut,
    /// `memory_update` by split.
    pub update: SplitBytesOut,
    /// `memory_parts` by split.
    pub parts: BTreeMap<String, SplitBytesOut>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatsOut {
    pub stop_reason: String,
    pub expanded: usize,
    pub generated: usize,
    pub seconds: f64,
}

/// What one synthesis returns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProgramOut {
    pub graph: String,
    pub devices: usize,
    pub steps: Vec<StepOut>,
    pub tensors: Vec<TensorOut>,
    pub splits: Vec<SplitOut>,
    pub loss: String,
    /// How many duplicas the runtime interleaves: 2 for a program searched with
    /// overlap ([`crate::overlap`]), else 1.
    pub duplicas: usize,
    /// The blocks whose activations the backward pass recomputes (sorted).
    pub recompute: Vec<String>,
    /// Bytes per device held while the backward pass runs ([`memory`]).
    pub memory: RowOut,
    /// Bytes per device held during the optimizer step; a step's peak is the larger
    /// of this and `memory`.
    pub memory_update: RowOut,
    /// The parts both are sums of (see [`memory::Breakdown`]).
    pub memory_parts: BTreeMap<String, RowOut>,
    /// The same bytes by split class, priced at the integer lengths.
    pub memory_split: MemorySplitOut,
    /// Cost under the ratios the search ran with.
    pub cost: f64,
    pub stats: StatsOut,
}

fn kind_name(kind: NodeKind) -> &'static str {
    match kind {
        NodeKind::Input => "input",
        NodeKind::Parameter => "parameter",
        NodeKind::Buffer => "buffer",
        NodeKind::Constant => "constant",
        NodeKind::Op => "op",
    }
}

fn work_name(work: Work) -> &'static str {
    match work {
        Work::Sharded => "sharded",
        Work::Full => "full",
        Work::Free => "free",
    }
}

/// Union-find over (tensor, dim) keys of Gather layouts.
#[derive(Default)]
struct Splits {
    index: BTreeMap<(TensorId, usize), usize>,
    parent: Vec<usize>,
}

impl Splits {
    fn id(&mut self, key: (TensorId, usize)) -> usize {
        let next = self.parent.len();
        let id = *self.index.entry(key).or_insert(next);
        if id == next {
            self.parent.push(next);
        }
        id
    }
    fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] != x {
            self.parent[x] = self.parent[self.parent[x]];
            x = self.parent[x];
        }
        x
    }
    fn union(&mut self, a: usize, b: usize) {
        let (a, b) = (self.find(a), self.find(b));
        if a != b {
            self.parent[a.max(b)] = a.min(b);
        }
    }

    /// The split dims of one step: every Gather operand and result of its rule shares
    /// one partition; the sources it creates and its communication add their own.
    fn add_step(&mut self, problem: &Problem, chosen: &ChosenStep) {
        let step = &problem.steps[chosen.step];
        let rule = &step.rules[chosen.rule];
        let mut keys = Vec::new();
        for (slot, &t) in step.inputs.iter().enumerate() {
            if let Some(d) = rule.inputs[slot].gather_dim() {
                keys.push((t, d));
            }
        }
        for (k, out) in step.outputs.iter().enumerate() {
            if let (Some(t), Some(d)) = (out, rule.outputs[k].gather_dim()) {
                keys.push((*t, d));
            }
        }
        let ids: Vec<usize> = keys.iter().map(|k| self.id(*k)).collect();
        for w in ids.windows(2) {
            self.union(w[0], w[1]);
        }
        for s in &chosen.sources {
            if let Some(d) = s.layout.gather_dim() {
                self.id((s.tensor, d));
            }
        }
        for c in &chosen.comms {
            for l in [c.from, c.to] {
                if let Some(d) = l.gather_dim() {
                    self.id((c.tensor, d));
                }
            }
        }
    }

    /// The partitions, each with units = the gcd of its member sizes, and the index of
    /// each (tensor, dim)'s partition among them.
    fn classes(mut self, problem: &Problem) -> (Vec<SplitOut>, BTreeMap<(TensorId, usize), usize>) {
        let mut classes: BTreeMap<usize, Vec<(TensorId, usize)>> = BTreeMap::new();
        let keys: Vec<((TensorId, usize), usize)> = self.index.iter().map(|(k, id)| (*k, *id)).collect();
        for (key, id) in keys {
            let root = self.find(id);
            classes.entry(root).or_default().push(key);
        }
        let index = classes.values().enumerate().flat_map(|(i, members)| members.iter().map(move |k| (*k, i))).collect();
        let classes = classes
            .into_values()
            .map(|members| {
                let sizes: Vec<usize> = members.iter().map(|&(t, d)| problem.tensor(t).meta.shape[d]).collect();
                let units = sizes.iter().copied().fold(0, gcd).max(1);
                SplitOut {
                    units,
                    members: members.iter().zip(&sizes).map(|(&(t, d), &s)| (tensor_name(problem, t), d, s)).collect(),
                }
            })
            .collect();
        (classes, index)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Turn a search outcome into the program the runtime applies.
pub fn program(problem: &Problem, outcome: &Outcome) -> ProgramOut {
    let mut splits = Splits::default();
    let mut steps = Vec::with_capacity(outcome.steps.len());
    let parts = memory::breakdown(problem, outcome);
    for chosen in &outcome.steps {
        splits.add_step(problem, chosen);
        steps.push(step_out(problem, chosen));
    }
    let n = problem.profile.world();
    let (splits, class_of) = splits.classes(problem);
    let by_class = |bytes: &memory::Bytes| split_bytes_out(bytes, &class_of);
    ProgramOut {
        graph: problem.graph.name.clone(),
        devices: problem.profile.world(),
        steps,
        tensors: tensors_out(problem, outcome),
        splits,
        loss: tensor_name(problem, problem.loss),
        duplicas: if problem.options.overlap { DUPLICAS } else { 1 },
        recompute: problem.options.recompute.iter().cloned().collect(),
        memory: (&parts.backward().row(n)).into(),
        memory_update: (&parts.update().row(n)).into(),
        memory_parts: parts.parts().into_iter().map(|(k, bytes)| (k.to_string(), (&bytes.row(n)).into())).collect(),
        memory_split: MemorySplitOut {
            backward: by_class(&parts.backward()),
            update: by_class(&parts.update()),
            parts: parts.parts().into_iter().map(|(k, bytes)| (k.to_string(), by_class(bytes))).collect(),
        },
        cost: outcome.cost,
        stats: StatsOut {
            stop_reason: outcome.stop.name().to_string(),
            expanded: outcome.expanded,
            generated: outcome.generated,
            seconds: outcome.seconds,
        },
    }
}

/// `bytes` with each split key replaced by its class's index in `splits` (a key in no
/// class: nil), shards of one class summed and the largest of a group's kept.
fn split_bytes_out(bytes: &memory::Bytes, class_of: &BTreeMap<(TensorId, usize), usize>) -> SplitBytesOut {
    let class = |key: &memory::SplitKey| key.and_then(|k| class_of.get(&k).copied());
    let merge = |shards: &BTreeMap<memory::SplitKey, f64>, combine: fn(f64, f64) -> f64| {
        let mut out: BTreeMap<Option<usize>, f64> = BTreeMap::new();
        for (key, v) in shards {
            let slot = out.entry(class(key)).or_insert(0.0);
            *slot = combine(*slot, *v);
        }
        out.into_iter().collect::<Vec<_>>()
    };
    SplitBytesOut {
        replica: bytes.replica,
        shards: merge(&bytes.shards, |a, b| a + b),
        largest: bytes.largest.iter().map(|g| merge(g, f64::max)).collect(),
    }
}

fn tensor_name(problem: &Problem, t: TensorId) -> String {
    problem.tensor(t).meta.name.clone()
}

/// One chosen step as data: its rule, the sources it creates, the communication before
/// it, its operand layouts and its cost rows.
fn step_out(problem: &Problem, chosen: &ChosenStep) -> StepOut {
    let step = &problem.steps[chosen.step];
    let rule = &step.rules[chosen.rule];
    let node = &problem.graph.nodes[step.node];
    StepOut {
        node: node.name.clone(),
        op: node.op.clone(),
        rule: rule.name.to_string(),
        work: work_name(rule.work).to_string(),
        flops: step.flops,
        sources: chosen.sources.iter().map(|s| source_out(problem, s)).collect(),
        comms: chosen.comms.iter().map(|c| comm_out(problem, c)).collect(),
        inputs: layouts_out(problem, step.inputs.iter().copied().zip(rule.inputs.iter().copied())),
        outputs: layouts_out(problem, step.outputs.iter().zip(&rule.outputs).filter_map(|(t, l)| t.map(|t| (t, *l)))),
        comp: (&chosen.comp).into(),
        comm: (&chosen.comm).into(),
        overlap: chosen.overlap.as_ref().map(Into::into),
        recompute_span: step.span,
    }
}

fn layouts_out(problem: &Problem, pairs: impl Iterator<Item = (TensorId, Layout)>) -> Vec<LayoutOut> {
    pairs.map(|(t, layout)| LayoutOut { tensor: tensor_name(problem, t), layout: layout.to_string() }).collect()
}

fn source_out(problem: &Problem, s: &Source) -> SourceOut {
    let t = problem.tensor(s.tensor);
    SourceOut {
        tensor: tensor_name(problem, s.tensor),
        kind: kind_name(t.kind).to_string(),
        target: t.target.clone(),
        layout: s.layout.to_string(),
        bytes: t.bytes(),
        grad_sync: !s.row.is_zero(),
        cost: (&s.row).into(),
    }
}

fn comm_out(problem: &Problem, c: &Comm) -> CommOut {
    let t = problem.tensor(c.tensor);
    CommOut {
        tensor: tensor_name(problem, c.tensor),
        from: c.from.to_string(),
        to: c.to.to_string(),
        collective: c.collective.name().to_string(),
        bytes: t.bytes(),
        grad: t.requires_grad && c.collective.backward().is_some(),
        cost: (&c.row).into(),
    }
}

/// Every tensor the program holds, with the layouts it is held in.
fn tensors_out(problem: &Problem, outcome: &Outcome) -> Vec<TensorOut> {
    problem
        .tensors
        .iter()
        .enumerate()
        .filter(|(id, _)| !outcome.held[*id].is_empty())
        .map(|(id, t)| TensorOut {
            name: t.meta.name.clone(),
            node: problem.graph.nodes[t.r.node()].name.clone(),
            output: t.r.1,
            kind: kind_name(t.kind).to_string(),
            target: t.target.clone(),
            shape: t.meta.shape.clone(),
            dtype: t.meta.dtype.name().to_string(),
            requires_grad: t.requires_grad,
            layouts: outcome.held[id].iter().map(|l| l.to_string()).collect(),
        })
        .collect()
}
