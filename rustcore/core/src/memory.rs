//! The memory model: the peak bytes a training step holds on each device, linear in the
//! sharding ratios like the cost model's seconds (a [`Row`] of bytes: `constant[d] +
//! coef[d] · r[d]`).
//!
//! A step (`zero_grad(set_to_none=True)`, forward, backward, Adam's step) peaks at one
//! of two moments, and the model gives both; the peak is their maximum:
//! - **while the backward pass runs** ([`Breakdown::backward`]): the parameters and
//!   Adam's two moments, the batch inputs, every op result the backward pass keeps
//!   (traced at lowering: the graph's `saved` flags; a linear keeps its input, an add
//!   nothing, a view its base) with the bytes an op's backward keeps inside it
//!   (attention's log-sum-exp), the largest collective's buffer, and the transient
//!   gradients of the backward pass (twice the largest op result: its gradient and its
//!   input's). Parameter gradients grow as kept activations are freed, so they are not
//!   added at this moment;
//! - **during the optimizer step** ([`Breakdown::update`]): the parameters, their
//!   gradients, the two moments and the one parameter-sized temporary torch's Adam
//!   makes (the square root of the second moment), with the batch inputs.
//!
//! Trainable parameters count in the layout they are stored in (a ZeRO parameter: its
//! shard); a parameter gathered whole for an op that keeps it counts once more as an
//! activation; frozen parameters, buffers and constants count once. A tensor counts as
//! a replica (`constant`) when any layout it is held in is not `Gather` (replicated and
//! partial-sum tensors are whole on every device), else as a shard (`coef`). A graph
//! lowered without traced saved tensors counts every op result that carries a gradient
//! as kept, except results of free ops (views). Under activation recomputation
//! ([`crate::recompute`]) a recomputed span keeps only its inputs, and the backward pass
//! holds one span's rebuilt activations at a time ([`largest_span`]).
//!
//! Each part is also kept by split ([`Bytes`]): a shard remembers the tensor dim it is
//! split on, so that a finished plan prices it at the integer lengths the runtime
//! splits that dim into (a device holding 2 of 4 experts holds half of them, whatever
//! its ratio), while the search and the ratio LP use the linear [`Row`] (`Bytes::row`).

use std::collections::BTreeMap;

use crate::comm::GRAD_BUCKET_BYTES;
use crate::cost::{Row, Work};
use crate::ir::NodeKind;
use crate::layout::{Layout, LayoutSet};
use crate::outcome::{ChosenStep, Outcome};
use crate::problem::{Problem, TensorId};

/// How many optimizer-state buffers a trainable parameter has (Adam: two moments).
pub const OPTIMIZER_STATES: f64 = 2.0;

/// Parameter-sized temporaries of the optimizer step (torch's Adam: the square root
/// of the second moment).
pub const OPTIMIZER_TEMPORARIES: f64 = 1.0;

/// How many tensor-sized gradients the backward pass holds at once beside the kept
/// activations (an op's result gradient and its input's).
pub const WORKSPACE_RESULTS: f64 = 2.0;

/// The tensor dim a shard is split on (its split class decides each device's share);
/// `None`: split by the ratios themselves.
pub type SplitKey = Option<(TensorId, usize)>;

/// Bytes per device by how they are split: `replica` bytes whole on every device, the
/// `shards` summed per split key, and groups of shards of which only the largest counts
/// (`largest`: the backward's transient gradients). Under ratios `r` (every split key's
/// share `r[d]`) it is the linear [`Row`] `replica + (Σ shards + Σ max group) · r[d]`;
/// under integer lengths each key's share is its own.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Bytes {
    pub replica: f64,
    pub shards: BTreeMap<SplitKey, f64>,
    pub largest: Vec<BTreeMap<SplitKey, f64>>,
}

/// How a term's bytes are held: whole on every device, or split on a key.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Share {
    Replica,
    Shard(SplitKey),
}

impl Bytes {
    /// Add `bytes` held as `share`.
    fn add(&mut self, bytes: f64, share: Share) {
        match share {
            Share::Replica => self.replica += bytes,
            Share::Shard(key) => *self.shards.entry(key).or_insert(0.0) += bytes,
        }
    }

    /// Keep the larger of `bytes` held as `share` and what this part holds so far, as a
    /// replica against the replica and a shard against the shards of its one group.
    fn keep_largest(&mut self, bytes: f64, share: Share) {
        match share {
            Share::Replica => self.replica = self.replica.max(bytes),
            Share::Shard(key) => {
                if self.largest.is_empty() {
                    self.largest.push(BTreeMap::new());
                }
                let v = self.largest[0].entry(key).or_insert(0.0);
                *v = v.max(bytes);
            }
        }
    }

    /// `factor` times these bytes.
    fn scaled(&self, factor: f64) -> Bytes {
        let scale = |m: &BTreeMap<SplitKey, f64>| m.iter().map(|(k, v)| (*k, v * factor)).collect();
        Bytes { replica: self.replica * factor, shards: scale(&self.shards), largest: self.largest.iter().map(scale).collect() }
    }

    /// The sum of `parts`.
    fn sum(parts: &[&Bytes]) -> Bytes {
        let mut total = Bytes::default();
        for part in parts {
            total.replica += part.replica;
            for (key, v) in &part.shards {
                *total.shards.entry(*key).or_insert(0.0) += v;
            }
            total.largest.extend(part.largest.iter().cloned());
        }
        total
    }

    /// The linear row over `devices` devices: every shard's share is the device's ratio.
    pub fn row(&self, devices: usize) -> Row {
        let largest: f64 = self.largest.iter().map(|g| g.values().copied().fold(0.0, f64::max)).sum();
        let coef = self.shards.values().sum::<f64>() + largest;
        Row { constant: vec![self.replica; devices], coef: vec![coef; devices] }
    }
}

/// The bytes per device a training step holds, by what holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    /// Parameter values, buffers and constants.
    pub parameters: Bytes,
    /// Gradients of trainable parameters.
    pub gradients: Bytes,
    /// Adam's moments.
    pub optimizer: Bytes,
    /// The optimizer step's temporaries.
    pub optimizer_temporaries: Bytes,
    /// The batch inputs.
    pub inputs: Bytes,
    /// What the backward pass keeps.
    pub activations: Bytes,
    /// The largest collective's buffer.
    pub communication: Bytes,
    /// Transient gradients of the backward pass.
    pub workspace: Bytes,
}

impl Breakdown {
    /// The bytes held while the backward pass runs.
    pub fn backward(&self) -> Bytes {
        Bytes::sum(&[&self.parameters, &self.optimizer, &self.inputs, &self.activations, &self.communication, &self.workspace])
    }

    /// The bytes held during the optimizer step.
    pub fn update(&self) -> Bytes {
        Bytes::sum(&[&self.parameters, &self.gradients, &self.optimizer, &self.optimizer_temporaries, &self.inputs])
    }

    /// The parts by name, as the plan reports them.
    pub fn parts(&self) -> [(&'static str, &Bytes); 8] {
        [
            ("parameters", &self.parameters),
            ("gradients", &self.gradients),
            ("optimizer", &self.optimizer),
            ("optimizer_temporaries", &self.optimizer_temporaries),
            ("inputs", &self.inputs),
            ("activations", &self.activations),
            ("communication", &self.communication),
            ("workspace", &self.workspace),
        ]
    }
}

/// The peak bytes per device of the program `outcome` found, by part.
pub fn breakdown(problem: &Problem, outcome: &Outcome) -> Breakdown {
    let stored = stored_layouts(problem, outcome);
    let free = free_outputs(problem, outcome);
    let mut parameters = Bytes::default();
    let mut trainable = Bytes::default();
    let mut inputs = Bytes::default();
    let mut activations = Bytes::default();
    let mut largest = Bytes::default();
    let mut synced = 0.0;
    for (id, t) in problem.tensors.iter().enumerate() {
        let held = outcome.held[id];
        if held.is_empty() {
            continue;
        }
        let bytes = t.bytes();
        let tensor = id as TensorId;
        match t.kind {
            NodeKind::Parameter | NodeKind::Buffer | NodeKind::Constant => {
                let layout = stored[id].map_or(held, LayoutSet::single);
                parameters.add(bytes, share(tensor, layout));
                if t.kind == NodeKind::Parameter && t.requires_grad {
                    trainable.add(bytes, share(tensor, layout));
                    if share(tensor, layout) == Share::Replica {
                        synced += bytes;
                    }
                }
                // a copy gathered in another layout that an op's backward keeps
                let gathered = LayoutSet(held.0 & !layout.0);
                if !gathered.is_empty() && kept(problem, tensor) {
                    activations.add(bytes, share(tensor, gathered));
                }
            }
            NodeKind::Input => inputs.add(bytes, share(tensor, held)),
            NodeKind::Op => {
                let traced = problem.graph.saved_traced;
                if (traced && kept(problem, tensor)) || (!traced && t.requires_grad && !free[id]) {
                    activations.add(bytes, share(tensor, held));
                }
                largest.keep_largest(bytes, share(tensor, held));
            }
        }
    }
    add_inside_and_span(problem, outcome, &mut activations);
    Breakdown {
        parameters,
        gradients: trainable.clone(),
        optimizer: trainable.scaled(OPTIMIZER_STATES),
        optimizer_temporaries: trainable.scaled(OPTIMIZER_TEMPORARIES),
        inputs,
        activations,
        communication: communication(problem, outcome, synced),
        workspace: largest.scaled(WORKSPACE_RESULTS),
    }
}

/// Add to `activations` what each op's backward keeps inside it (no node's result)
/// outside recomputed spans, split like the step's work, and one recomputed span's
/// activations, rebuilt during the backward pass ([`largest_span`]).
fn add_inside_and_span(problem: &Problem, outcome: &Outcome, activations: &mut Bytes) {
    for chosen in &outcome.steps {
        let step = &problem.steps[chosen.step];
        let inside = problem.saved_inside(step.node);
        if inside > 0.0 && step.span.is_none() {
            let sharded = step.rules[chosen.rule].work == Work::Sharded;
            activations.add(inside, if sharded { Share::Shard(step_split(problem, chosen)) } else { Share::Replica });
        }
    }
    // one recomputed span's activations, rebuilt during the backward pass
    let (replica, shard) = largest_span(problem, outcome);
    activations.add(replica, Share::Replica);
    activations.add(shard, Share::Shard(None));
}

/// Whether an op result `t` counts as an activation the backward pass keeps: the
/// graph's traced flag, or, in a graph lowered without tracing, whether it carries a
/// gradient (the caller then leaves out results of free ops).
pub fn is_activation(problem: &Problem, t: TensorId) -> bool {
    if problem.graph.saved_traced {
        kept(problem, t)
    } else {
        problem.tensor(t).requires_grad
    }
}

/// Whether the backward pass keeps tensor `t`'s storage (the graph's traced flag, as
/// activation recomputation changes it: [`Problem::recompute_keep`]).
fn kept(problem: &Problem, t: TensorId) -> bool {
    problem.recompute_keep[t as usize].unwrap_or_else(|| saved_flag(problem, t))
}

/// How tensor `t` held in `layouts` is held: a replica unless every layout is a
/// `Gather`, else a shard split on the first layout's dim.
fn share(t: TensorId, layouts: LayoutSet) -> Share {
    if layouts.iter().all(|l| matches!(l, Layout::Gather(_))) {
        Share::Shard(layouts.iter().find_map(Layout::gather_dim).map(|d| (t, d)))
    } else {
        Share::Replica
    }
}

/// The dim a sharded step splits its work on: its first split result's, else its first
/// split operand's (what an op's backward keeps inside it is split alike).
fn step_split(problem: &Problem, chosen: &ChosenStep) -> SplitKey {
    let step = &problem.steps[chosen.step];
    let rule = &step.rules[chosen.rule];
    let outputs = step.outputs.iter().zip(&rule.outputs).filter_map(|(t, l)| Some(((*t)?, l.gather_dim()?)));
    let inputs = step.inputs.iter().zip(&rule.inputs).filter_map(|(t, l)| Some((*t, l.gather_dim()?)));
    outputs.chain(inputs).next()
}

/// The largest buffer one collective needs: the largest tensor communicated (whole
/// on every device: an all-gather's result, an all-reduce's operand), or one bucket
/// of the `synced` bytes of replicated gradients summed over ranks.
fn communication(problem: &Problem, outcome: &Outcome, synced: f64) -> Bytes {
    let mut largest: f64 = synced.min(GRAD_BUCKET_BYTES);
    for chosen in &outcome.steps {
        for c in &chosen.comms {
            largest = largest.max(problem.tensor(c.tensor).bytes());
        }
    }
    Bytes { replica: largest, ..Bytes::default() }
}

/// The layout each source was created in (its stored layout), `None` for other tensors.
fn stored_layouts(problem: &Problem, outcome: &Outcome) -> Vec<Option<Layout>> {
    let mut stored = vec![None; problem.tensors.len()];
    for chosen in &outcome.steps {
        for s in &chosen.sources {
            stored[s.tensor as usize] = Some(s.layout);
        }
    }
    stored
}

/// Per tensor, whether it is the result of a step that runs a free rule (a view).
fn free_outputs(problem: &Problem, outcome: &Outcome) -> Vec<bool> {
    let mut free = vec![false; problem.tensors.len()];
    for chosen in &outcome.steps {
        let step = &problem.steps[chosen.step];
        if step.rules[chosen.rule].work == Work::Free {
            for t in step.outputs.iter().flatten() {
                free[*t as usize] = true;
            }
        }
    }
    free
}

/// The bytes per device one span's activations take while the backward pass
/// rebuilds them: of every span, the op results it would keep without
/// recomputation (traced `saved` flags) but drops, and what its ops' backward keeps
/// inside them, as (bytes whole on every device, bytes split by the ratios); the
/// span with the most bytes on an even split. Spans are rebuilt one at a time.
pub fn largest_span(problem: &Problem, outcome: &Outcome) -> (f64, f64) {
    if problem.spans == 0 {
        return (0.0, 0.0);
    }
    let mut rebuilt = vec![(0.0, 0.0); problem.spans];
    let add = |rebuilt: &mut Vec<(f64, f64)>, span: usize, bytes: f64, sharded: bool| {
        let entry = &mut rebuilt[span];
        if sharded {
            entry.1 += bytes;
        } else {
            entry.0 += bytes;
        }
    };
    for (id, t) in problem.tensors.iter().enumerate() {
        let dropped = problem.recompute_keep[id] == Some(false) && t.kind == NodeKind::Op;
        let held = outcome.held[id];
        if !dropped || held.is_empty() || !saved_flag(problem, id as TensorId) {
            continue;
        }
        if let Some(span) = problem.steps[t.first].span {
            add(&mut rebuilt, span, t.bytes(), all_gathered(held));
        }
    }
    for chosen in &outcome.steps {
        let step = &problem.steps[chosen.step];
        let inside = problem.saved_inside(step.node);
        if let (Some(span), true) = (step.span, inside > 0.0) {
            let sharded = step.rules[chosen.rule].work == Work::Sharded;
            add(&mut rebuilt, span, inside, sharded);
        }
    }
    let n = problem.profile.world().max(1) as f64;
    rebuilt.into_iter().fold((0.0, 0.0), |best, s| if s.0 + s.1 / n > best.0 + best.1 / n { s } else { best })
}

/// The graph's traced flag: whether the backward pass keeps tensor `t`'s storage
/// without recomputation.
fn saved_flag(problem: &Problem, t: TensorId) -> bool {
    let r = problem.tensor(t).r;
    problem.graph.nodes[r.node()].saved.get(r.output()).copied().unwrap_or(false)
}

/// Whether every layout is a `Gather` (the tensor is held as a shard).
fn all_gathered(layouts: LayoutSet) -> bool {
    layouts.iter().all(|l| matches!(l, Layout::Gather(_)))
}
