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
//! as kept, except results of free ops (views).

use crate::comm::GRAD_BUCKET_BYTES;
use crate::cost::{Row, Work};
use crate::ir::NodeKind;
use crate::layout::{Layout, LayoutSet};
use crate::problem::{Problem, TensorId};
use crate::search::Outcome;

/// How many optimizer-state buffers a trainable parameter has (Adam: two moments).
pub const OPTIMIZER_STATES: f64 = 2.0;

/// Parameter-sized temporaries of the optimizer step (torch's Adam: the square root
/// of the second moment).
pub const OPTIMIZER_TEMPORARIES: f64 = 1.0;

/// How many tensor-sized gradients the backward pass holds at once beside the kept
/// activations (an op's result gradient and its input's).
pub const WORKSPACE_RESULTS: f64 = 2.0;

/// The bytes per device a training step holds, by what holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    /// Parameter values, buffers and constants.
    pub parameters: Row,
    /// Gradients of trainable parameters.
    pub gradients: Row,
    /// Adam's moments.
    pub optimizer: Row,
    /// The optimizer step's temporaries.
    pub optimizer_temporaries: Row,
    /// The batch inputs.
    pub inputs: Row,
    /// What the backward pass keeps.
    pub activations: Row,
    /// The largest collective's buffer.
    pub communication: Row,
    /// Transient gradients of the backward pass.
    pub workspace: Row,
}

impl Breakdown {
    /// The bytes held while the backward pass runs.
    pub fn backward(&self) -> Row {
        sum(&[&self.parameters, &self.optimizer, &self.inputs, &self.activations, &self.communication, &self.workspace])
    }

    /// The bytes held during the optimizer step.
    pub fn update(&self) -> Row {
        sum(&[&self.parameters, &self.gradients, &self.optimizer, &self.optimizer_temporaries, &self.inputs])
    }

    /// The parts by name, as the plan reports them.
    pub fn parts(&self) -> [(&'static str, &Row); 8] {
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

fn sum(rows: &[&Row]) -> Row {
    let mut total = rows[0].clone();
    for row in &rows[1..] {
        total.add(row);
    }
    total
}

/// The peak bytes per device of the program `outcome` found, by part.
pub fn breakdown(problem: &Problem, outcome: &Outcome) -> Breakdown {
    let n = problem.profile.world();
    let stored = stored_layouts(problem, outcome);
    let free = free_outputs(problem, outcome);
    let mut parameters = Row::zeros(n);
    let mut trainable = Row::zeros(n);
    let mut inputs = Row::zeros(n);
    let mut activations = Row::zeros(n);
    let mut largest = Row::zeros(n);
    let mut synced = 0.0;
    for (id, t) in problem.tensors.iter().enumerate() {
        let held = outcome.held[id];
        if held.is_empty() {
            continue;
        }
        let bytes = t.bytes();
        match t.kind {
            NodeKind::Parameter | NodeKind::Buffer | NodeKind::Constant => {
                let layout = stored[id].map_or(held, LayoutSet::single);
                add(&mut parameters, bytes, layout);
                if t.kind == NodeKind::Parameter && t.requires_grad {
                    add(&mut trainable, bytes, layout);
                    if !layout.iter().all(|l| matches!(l, Layout::Gather(_))) {
                        synced += bytes;
                    }
                }
                // a copy gathered in another layout that an op's backward keeps
                let gathered = LayoutSet(held.0 & !layout.0);
                if !gathered.is_empty() && kept(problem, id as TensorId) {
                    add(&mut activations, bytes, gathered);
                }
            }
            NodeKind::Input => add(&mut inputs, bytes, held),
            NodeKind::Op => {
                let traced = problem.graph.saved_traced;
                if (traced && kept(problem, id as TensorId)) || (!traced && t.requires_grad && !free[id]) {
                    add(&mut activations, bytes, held);
                }
                largest_of(&mut largest, bytes, held);
            }
        }
    }
    for chosen in &outcome.steps {
        let step = &problem.steps[chosen.step];
        let inside = problem.graph.nodes[step.node].saved_bytes;
        if inside > 0.0 {
            let sharded = step.rules[chosen.rule].work == Work::Sharded;
            add_part(&mut activations, inside, sharded);
        }
    }
    Breakdown {
        parameters,
        gradients: trainable.clone(),
        optimizer: scaled(&trainable, OPTIMIZER_STATES),
        optimizer_temporaries: scaled(&trainable, OPTIMIZER_TEMPORARIES),
        inputs,
        activations,
        communication: communication(problem, outcome, synced),
        workspace: scaled(&largest, WORKSPACE_RESULTS),
    }
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

/// Whether the backward pass keeps tensor `t`'s storage (the graph's traced flag).
fn kept(problem: &Problem, t: TensorId) -> bool {
    let r = problem.tensor(t).r;
    problem.graph.nodes[r.node()].saved.get(r.output()).copied().unwrap_or(false)
}

/// Add `bytes` held in `layouts`: a replica unless every layout is a `Gather`.
fn add(row: &mut Row, bytes: f64, layouts: LayoutSet) {
    add_part(row, bytes, layouts.iter().all(|l| matches!(l, Layout::Gather(_))));
}

fn add_part(row: &mut Row, bytes: f64, sharded: bool) {
    let target = if sharded { &mut row.coef } else { &mut row.constant };
    target.iter_mut().for_each(|v| *v += bytes);
}

/// Keep in `row` the larger of itself and `bytes` held in `layouts` (compared as a
/// replica against a replica and a shard against a shard: the larger of each).
fn largest_of(row: &mut Row, bytes: f64, layouts: LayoutSet) {
    let sharded = layouts.iter().all(|l| matches!(l, Layout::Gather(_)));
    let target = if sharded { &mut row.coef } else { &mut row.constant };
    target.iter_mut().for_each(|v| *v = v.max(bytes));
}

fn scaled(row: &Row, factor: f64) -> Row {
    Row {
        constant: row.constant.iter().map(|v| v * factor).collect(),
        coef: row.coef.iter().map(|v| v * factor).collect(),
    }
}

/// The largest buffer one collective needs: the largest tensor communicated (whole
/// on every device: an all-gather's result, an all-reduce's operand), or one bucket
/// of the `synced` bytes of replicated gradients summed over ranks.
fn communication(problem: &Problem, outcome: &Outcome, synced: f64) -> Row {
    let mut largest: f64 = synced.min(GRAD_BUCKET_BYTES);
    for chosen in &outcome.steps {
        for c in &chosen.comms {
            largest = largest.max(problem.tensor(c.tensor).bytes());
        }
    }
    let mut row = Row::zeros(problem.profile.world());
    row.constant.iter_mut().for_each(|v| *v = largest);
    row
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
