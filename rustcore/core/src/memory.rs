//! The memory model: the bytes a program keeps on each device, linear in the sharding
//! ratios like the cost model's seconds (a [`Row`] of bytes: `constant[d] + coef[d] ·
//! r[d]`).
//!
//! A tensor the program holds counts once per device: as a replica (`constant`) when it
//! is held in any layout but `Gather`, else as a shard (`coef`). Trainable parameters
//! count four times (value, gradient, two Adam moments); op results count when they
//! carry a gradient (activations kept for the backward pass); results of free ops
//! (views) alias their input and count nothing.

use crate::cost::{Row, Work};
use crate::ir::NodeKind;
use crate::layout::Layout;
use crate::problem::{Problem, Tensor};
use crate::search::Outcome;

/// Bytes per device of the program `outcome` found.
pub fn footprint(problem: &Problem, outcome: &Outcome) -> Row {
    let n = problem.profile.world();
    let mut memory = Row::zeros(n);
    let free = free_outputs(problem, outcome);
    for (id, t) in problem.tensors.iter().enumerate() {
        let held = outcome.held[id];
        if held.is_empty() || free[id] {
            continue;
        }
        let bytes = copies(t) * t.bytes();
        // the largest layout it is held in: a replica, else a shard
        let replicated = held.iter().any(|l| !matches!(l, Layout::Gather(_)));
        for d in 0..n {
            if replicated {
                memory.constant[d] += bytes;
            } else {
                memory.coef[d] += bytes;
            }
        }
    }
    memory
}

/// How many tensor-sized buffers a tensor keeps.
fn copies(t: &Tensor) -> f64 {
    match t.kind {
        NodeKind::Parameter if t.requires_grad => 4.0,
        NodeKind::Op if t.requires_grad => 1.0,
        NodeKind::Op => 0.0,
        _ => 1.0,
    }
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
