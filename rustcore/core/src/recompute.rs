//! Activation recomputation: blocks of the model (the graph's `block` labels) whose
//! activations the backward pass does not keep but rebuilds by running the block's
//! forward again from its inputs (`torch.utils.checkpoint`).
//!
//! The options name the recomputed blocks ([`crate::problem::Options::recompute`]).
//! Each maximal run of consecutive steps of one of them is a **span** ([`spans`]): it
//! keeps only its inputs (the problem's `recompute_keep`), and the backward pass runs
//! its forward again — compute ([`crate::problem::Problem::new`] adds a forward to each
//! recomputed step's compute rows) and the collectives before its steps (the search
//! adds their forward again) — holding one span's activations at a time
//! ([`crate::memory::largest_span`]).
//!
//! This module finds the spans from the graph alone, below the problem that is built
//! on them.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::ir::Graph;

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
