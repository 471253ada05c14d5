//! Activation recomputation: blocks of the model (the graph's `block` labels) whose
//! activations the backward pass does not keep but rebuilds by running the block's
//! forward again from its inputs (`torch.utils.checkpoint`).
//!
//! The options name the recomputed blocks ([`crate::problem::Options::recompute`]).
//! Each maximal run of consecutive steps of one of them is a **span**: it keeps only
//! its inputs, and the backward pass runs its forward again — compute
//! ([`crate::problem::Problem::new`] adds a forward to each recomputed step's compute
//! rows) and the collectives before its steps (the search adds their forward again) —
//! holding one span's activations at a time ([`largest_span`]).

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::ir::{Graph, NodeKind};
use crate::layout::{Layout, LayoutSet};
use crate::problem::{Problem, Step, Tensor, TensorId};
use crate::search::Outcome;

/// The recomputed span of each op of `op_nodes` (program order): maximal runs of
/// consecutive ops of one block in `recompute`, numbered from 0. Every block named must
/// have an op that leads to the loss or a buffer update.
pub fn spans(graph: &Graph, op_nodes: &[usize], recompute: &BTreeSet<String>) -> Result<Vec<Option<usize>>> {
    let mut out = Vec::with_capacity(op_nodes.len());
    let mut seen = BTreeSet::new();
    let mut count = 0;
    let mut previous: Option<&str> = None;
    for &n in op_nodes {
        let block = graph.nodes[n].block.as_deref().filter(|b| recompute.contains(*b));
        if let Some(b) = block {
            if previous != Some(b) {
                count += 1;
            }
            seen.insert(b);
        }
        out.push(block.map(|_| count - 1));
        previous = block;
    }
    if let Some(missing) = recompute.iter().find(|b| !seen.contains(b.as_str())) {
        return Err(Error::InvalidOption {
            field: format!("recompute.{missing}"),
            message: "no op of that block leads to the loss or a buffer update".into(),
        });
    }
    Ok(out)
}

/// Per tensor, whether the backward pass keeps it once the recomputed spans keep
/// only their inputs (`None` where recomputation changes nothing):
/// - a result of a recomputed step is kept when a step outside its span reads it (a
///   span's output: the next span's input, or read by an op that may keep it) or
///   the program ends with it (the loss, a buffer's new value), and dropped otherwise;
/// - another op result that a recomputed span reads is kept (a span keeps its
///   inputs, to run its forward again);
/// - a parameter, buffer or constant read only by recomputed steps is not kept in a
///   layout gathered for them (the gathering collective runs again);
/// - everything else is as the graph's traced `saved` flags say.
pub fn keeps(tensors: &[Tensor], steps: &[Step]) -> Vec<Option<bool>> {
    let mut out = vec![None; tensors.len()];
    if steps.iter().all(|s| s.span.is_none()) {
        return out;
    }
    let producer = |t: &Tensor| if t.kind == NodeKind::Op { steps[t.first].span } else { None };
    let mut read_elsewhere = vec![false; tensors.len()]; // by a step outside the producer's span
    let mut read_in_span = vec![false; tensors.len()];
    let mut read_outside_spans = vec![false; tensors.len()];
    for step in steps {
        for &t in &step.inputs {
            let i = t as usize;
            read_elsewhere[i] |= step.span != producer(&tensors[i]);
            read_in_span[i] |= step.span.is_some();
            read_outside_spans[i] |= step.span.is_none();
        }
    }
    for (i, tensor) in tensors.iter().enumerate() {
        out[i] = match tensor.kind {
            NodeKind::Op if producer(tensor).is_some() => Some(read_elsewhere[i] || tensor.last == steps.len()),
            NodeKind::Op => read_in_span[i].then_some(true),
            NodeKind::Parameter | NodeKind::Buffer | NodeKind::Constant => {
                (read_in_span[i] && !read_outside_spans[i]).then_some(false)
            }
            NodeKind::Input => None,
        };
    }
    out
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
            let sharded = step.rules[chosen.rule].work == crate::cost::Work::Sharded;
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
