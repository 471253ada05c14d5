//! What a search finds: the chosen steps of a program with their sources,
//! communications and cost rows ([`Outcome`]), and why the search stopped. The search
//! ([`crate::search`]) makes them; the memory model ([`crate::memory`]) and the plan
//! ([`crate::plan`]) read them without needing the search.

use crate::comm::Collective;
use crate::cost::Row;
use crate::layout::{Layout, LayoutSet};
use crate::overlap::StepRows;
use crate::problem::TensorId;

/// Why the search stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The returned program is optimal under the cost model.
    Optimal,
    /// A position had more undominated states than the front width; the cheapest were
    /// kept. The program is complete but not proven optimal.
    Bounded,
    /// The state budget ran out; the program was completed greedily.
    StateLimit,
    /// The time budget ran out; the program was completed greedily.
    TimeLimit,
    /// Cancelled by the caller; the program was completed greedily.
    Cancelled,
}

impl StopReason {
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Optimal => "optimal",
            StopReason::Bounded => "bounded",
            StopReason::StateLimit => "state_limit",
            StopReason::TimeLimit => "time_limit",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// A communication inserted before a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Comm {
    pub tensor: TensorId,
    pub from: Layout,
    pub to: Layout,
    pub collective: Collective,
    /// Forward + backward cost.
    pub row: Row,
}

/// A source created for a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub tensor: TensorId,
    pub layout: Layout,
    /// Gradient synchronization of a replicated trainable parameter.
    pub row: Row,
}

/// One step of a found program.
#[derive(Debug, Clone, PartialEq)]
pub struct ChosenStep {
    pub step: usize,
    pub rule: usize,
    pub sources: Vec<Source>,
    pub comms: Vec<Comm>,
    pub comp: Row,
    pub comm: Row,
    /// The step's part in the two-duplica schedule (with the `overlap` option).
    pub overlap: Option<StepRows>,
}

/// A found program and how the search went.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub steps: Vec<ChosenStep>,
    /// Layouts each tensor is held in over the program.
    pub held: Vec<LayoutSet>,
    /// Cost under the ratios the search ran with.
    pub cost: f64,
    pub stop: StopReason,
    pub expanded: usize,
    pub generated: usize,
    pub seconds: f64,
}
