//! # hapd-core
//!
//! The synthesis core of hapd: reads a graph IR, enumerates the ways each op can run
//! across devices, searches for the fastest SPMD program and returns it as data (a
//! plan plus its cost rows). It never touches torch objects or Python.
//!
//! ## Modules, ground floor up
//!
//! Each module uses only modules listed before it: the modules form no cycle
//! (`tests/module_cycles.rs` checks both from the sources).
//!
//! - [`error`] — the one error type of the core.
//! - [`hashing`] — the search's maps hashed by `rustc-hash` (keys from the search itself).
//! - [`layout`] — layouts (`Gather(dim)`, `Reduce`, `Identity`) and sets of them.
//! - [`ir`] — the graph IR and its decoding ([`ir::decode`]), unchecked.
//! - [`profile`] — the cluster profile: devices and the α-β cost of each collective.
//! - [`cost`] — the cost model: per-device rows linear in the sharding ratios, and
//!   their wire form ([`cost::RowOut`]).
//! - [`comm`] — collectives: how a tensor held in one layout becomes another, and its
//!   cost rows.
//! - [`rules`] — the sharding rules of each op family, and its shape checks.
//! - [`validate`] — checks a decoded graph; checked decoding (`Graph::from_msgpack`).
//! - [`summary`] — a human-sized summary of a graph (`hapd inspect`).
//! - [`recompute`] — activation recomputation: the recomputed spans of the program.
//! - [`problem`] — the search problem: steps with their rules and compute rows, the
//!   tensors live between them, the options.
//! - [`overlap`] — the overlap-aware cost: the two-duplica schedule.
//! - [`outcome`] — what a search finds: the chosen steps and why it stopped.
//! - [`memory`] — the memory model: the peak bytes per device of a found program.
//! - [`search`] — the best-first search for the cheapest program.
//! - [`plan`] — the program as data, what the core hands to Python.
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
//! - **segment** — a group of tensors that share one vector of sharding ratios (and
//!   only that: the words below name the other groupings).
//! - **sharding ratio** — the fraction of a sharded dim a device holds; the ratios of a
//!   segment sum to 1 and round to integer **sharding lengths**.
//! - **block** — a labelled part of the model graph (a transformer layer); the unit that
//!   recomputation chooses.
//! - **recompute span** — a maximal run of consecutive steps of one recomputed block: it
//!   keeps only its inputs and its forward runs again in the backward pass.
//! - **interval** — in an overlapped program, the computation between two consecutive
//!   communication points.
//! - **stage** — a contiguous part of the model that one group of devices runs in a
//!   pipeline; a **micro-batch** is the share of the batch a stage processes at once
//!   (and, in a mixed-length training step, the rows one forward and backward runs).
//! - **row** — in mixed-length data, one sample of a micro-batch: several documents
//!   packed one after another, padded to a length from the run's pool of shapes.
//! - **host** — one machine; its devices share a fast link, hosts a slow one. A **host
//!   group** is the set of ranks on one host.
//! - **triple** — a Hoare triple `{pre} instruction {post}` over tensor layouts: one way
//!   to compute or communicate a tensor.
//! - **plan step** — one triple chosen by the search, in program order (a plan's
//!   `program.steps`; `ChosenStep` here). Python says "plan step" in full.
//! - **plan** — the chosen plan steps, their layouts and collectives, the ratios and
//!   the cost estimate: what `hapd.spmd` applies to a module for each rank; a `.hplan`
//!   file. Only this is a plan: how a mixed-length training step is cut into rows is its
//!   **packing**, torch's checkpoint "planners" keep torch's word, and a pipeline plan
//!   is the plan of the pipeline technique.
//! - **program** — an exported torch program (`torch.export`'s `ExportedProgram`, a
//!   `.pt2`): a model has several (its training forward, its eval forward, other batch
//!   sizes). A **rank program** is the module one rank runs (`hapd.spmd.rewrite`'s
//!   `distribute`); a plan's **plan program** (`plan.program`) is its plan steps as data.
//! - **technique** — how a plan splits the work: SPMD (one program on every device),
//!   pipeline (stages on host groups) or overlap.
//! - **overlap** — the technique (HiDup) that runs a rank program as two interleaved
//!   **duplicas**, half the batch each, so one's communication hides under the other's
//!   compute (`hapd.spmd.duplicas`). A profile's `sync_overlap` is another thing: the
//!   share of a gradient sync hidden behind the backward pass, "sync hiding" in prose.
//! - **training step** — one optimizer update (what checkpoints, snapshots, the loader
//!   and the launcher's timings count); "step" alone in Python means this one.
//! - **generation** — one run of an elastic job on one set of hosts (`JOB-g0`,
//!   `JOB-g1`, …); a host lost or joining starts the next.
//! - **snapshot** — each rank's files of a checkpoint of one training step, kept in the
//!   daemons' memory for an elastic job to resume from.

pub mod comm;
pub mod cost;
pub mod error;
pub mod hashing;
pub mod ir;
pub mod layout;
pub mod memory;
pub mod outcome;
pub mod overlap;
pub mod plan;
pub mod problem;
pub mod profile;
pub mod recompute;
pub mod rules;
pub mod search;
pub mod summary;
pub mod validate;

pub use error::{Error, Result};
pub use ir::Graph;

use outcome::{Outcome, StopReason};

/// Limits of one search.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_states: usize,
    /// Undominated states kept per position (see [`search::Search::with_front_width`]).
    pub front_width: usize,
    pub max_seconds: Option<f64>,
    /// Seconds per byte held on each device (see [`search::Search::with_memory_price`]);
    /// `None`: the search ignores memory.
    pub memory_price: Option<Vec<f64>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_states: 2_000_000, front_width: 24, max_seconds: None, memory_price: None }
    }
}

/// Decode a graph and a profile, search under `ratios`, and return the program.
pub fn synthesize(
    graph: &[u8],
    profile: &[u8],
    ratios: &[f64],
    options: problem::Options,
    limits: Limits,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<plan::ProgramOut> {
    let graph = Graph::from_msgpack(graph)?;
    let profile = profile::Profile::from_msgpack(profile)?;
    search_program(&graph, &profile, ratios, options, limits, cancel)
}

/// Search `graph` on `profile` under `ratios` and return the program.
///
/// A search bounded by its front width can lose the data-parallel program, which is
/// always in the automatic search space (its early steps look dearer than partial
/// sums that are paid for later). So when an automatic, unforced search was bounded,
/// the data-parallel search runs too and the cheaper program is returned: the result
/// never costs more than data parallelism under the same ratios. With overlap, an
/// unproven search also prices the plain search's program as duplicas
/// ([`plain_as_overlapped`]) and keeps the cheaper.
pub fn search_program(
    graph: &Graph,
    profile: &profile::Profile,
    ratios: &[f64],
    options: problem::Options,
    limits: Limits,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<plan::ProgramOut> {
    // under a memory price the cheaper data-parallel program is not the better one
    let free = options.mode == problem::Mode::Auto && options.force.is_empty() && limits.memory_price.is_none();
    let fallback = free.then(|| problem::Options { mode: problem::Mode::DataParallel, ..options.clone() });
    let plain = (free && options.overlap).then(|| options.clone());
    let problem = problem::Problem::new(graph, profile, options)?;
    let outcome = limited(search::Search::new(&problem, ratios)?, limits.clone(), cancel).run()?;
    if outcome.stop == StopReason::Bounded {
        if let Some(dp_options) = fallback {
            let dp_problem = problem::Problem::new(graph, profile, dp_options)?;
            let dp = limited(search::Search::new(&dp_problem, ratios)?, limits.clone(), cancel).run()?;
            if dp.cost < outcome.cost {
                if let Some(options) = plain {
                    let (p, o) = plain_as_overlapped(graph, profile, ratios, options, &limits, cancel)?;
                    if o.cost < dp.cost {
                        return Ok(candidate(&p, &o, &[&outcome, &dp]));
                    }
                }
                return Ok(candidate(&dp_problem, &dp, &[&outcome]));
            }
        }
    }
    if outcome.stop != StopReason::Optimal {
        if let Some(options) = plain {
            let (p, o) = plain_as_overlapped(graph, profile, ratios, options, &limits, cancel)?;
            if o.cost < outcome.cost {
                return Ok(candidate(&p, &o, &[&outcome]));
            }
        }
    }
    Ok(plan::program(&problem, &outcome))
}

/// The program of a search that won over the searches `others`: not proven optimal,
/// with their states and seconds counted in.
fn candidate(problem: &problem::Problem, outcome: &Outcome, others: &[&Outcome]) -> plan::ProgramOut {
    let mut program = plan::program(problem, outcome);
    for other in others {
        program.stats.expanded += other.expanded;
        program.stats.generated += other.generated;
        program.stats.seconds += other.seconds;
    }
    program.stats.stop_reason = StopReason::Bounded.name().to_string();
    program
}

/// With overlap: the program the plain (bulk-synchronous) search finds, searched again
/// under the two-duplica schedule with its rules forced — what it costs run as duplicas.
/// A bounded search under the schedule can lose programs whose collectives pay off only
/// later (tensor parallelism's all-gathers, before the compute that hides them); this one
/// is compared whole, so an overlapped program never costs more than the plain one's.
fn plain_as_overlapped<'a>(
    graph: &'a Graph,
    profile: &'a profile::Profile,
    ratios: &[f64],
    options: problem::Options,
    limits: &Limits,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<(problem::Problem<'a>, Outcome)> {
    let plain_problem = problem::Problem::new(graph, profile, problem::Options { overlap: false, ..options.clone() })?;
    let plain = limited(search::Search::new(&plain_problem, ratios)?, limits.clone(), cancel).run()?;
    let force = plain
        .steps
        .iter()
        .map(|chosen| {
            let step = &plain_problem.steps[chosen.step];
            (graph.nodes[step.node].name.clone(), step.rules[chosen.rule].name.to_string())
        })
        .collect();
    let problem = problem::Problem::new(graph, profile, problem::Options { force, ..options })?;
    let mut outcome = limited(search::Search::new(&problem, ratios)?, limits.clone(), cancel).run()?;
    outcome.expanded += plain.expanded;
    outcome.generated += plain.generated;
    outcome.seconds += plain.seconds;
    Ok((problem, outcome))
}

fn limited<'p, 'a>(
    search: search::Search<'p, 'a>,
    limits: Limits,
    cancel: Option<&'p std::sync::atomic::AtomicBool>,
) -> search::Search<'p, 'a> {
    let mut search = search.with_state_limit(limits.max_states).with_front_width(limits.front_width);
    if let Some(seconds) = limits.max_seconds {
        search = search.with_time_limit(std::time::Duration::from_secs_f64(seconds.max(0.0)));
    }
    if let Some(flag) = cancel {
        search = search.with_cancel(flag);
    }
    if let Some(price) = limits.memory_price {
        search = search.with_memory_price(price);
    }
    search
}
