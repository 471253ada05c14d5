//! # hapd-core
//!
//! The synthesis core of hapd: reads a graph IR, enumerates the ways each op can run
//! across devices, searches for the fastest SPMD program and returns it as data (a
//! plan plus its cost rows). It never touches torch objects or Python.
//!
//! ## Glossary (the same words in Rust, Python, on the wire and in the docs)
//!
//! - **rank** — one process of the distributed job, `0..world`; one per **device**.
//! - **device** — one accelerator (or CPU rank) with its achieved FLOP/s and memory.
//! - **profile** — the cluster description: devices plus the α (s) / β (bytes/s) of each
//!   collective; everything in bytes and seconds.
//! - **layout** — how a rank's tensor relates to the single-device tensor:
//!   `Gather(dim)` (a slice along `dim`, possibly uneven), `Reduce` (a partial sum) or
//!   `Identity` (a full replica).
//! - **segment** — a group of tensors that share one vector of sharding ratios.
//! - **sharding ratio** — the fraction of a sharded dim a device holds; the ratios of a
//!   segment sum to 1 and round to integer **sharding lengths**.
//! - **triple** — a Hoare triple `{pre} instruction {post}` over tensor layouts: one way
//!   to compute or communicate a tensor.
//! - **step** — one triple chosen by the search, in program order.
//! - **plan** — the chosen steps, their layouts and collectives, the ratios and the
//!   cost estimate: what the runtime applies to a module for each rank.

pub mod error;
pub mod ir;
pub mod rules;
pub mod summary;
pub mod validate;

pub use error::{Error, Result};
pub use ir::Graph;
