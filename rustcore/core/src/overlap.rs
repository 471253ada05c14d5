//! The overlap-aware cost: a program run as **two duplicas** interleaved (HiDup,
//! SoCC'22), so that one duplica computes while the other communicates
//! (`hapd.spmd.duplicas` runs it).
//!
//! The program is searched on the graph of one duplica (half the global batch). Each
//! rank runs it twice, duplicas A and B. Every collective on a batch-dependent tensor is
//! a **communication point**; the computation between two points is an **interval**. At
//! point `k` the runtime does `start comm_k(A); compute interval k-1 (B); finish;
//! start comm_k(B); compute interval k (A); finish`, so the forward pass costs
//!
//! ```text
//! S^A_0  +  Σ_k  max(S^B_{k-1}, c_k) + max(S^A_k, c_k)  +  S^B_last
//! ```
//!
//! with `S^A_k`/`S^B_k` duplica A's/B's compute of interval `k` and `c_k` the point's
//! collective (the same for both duplicas). This is HiDup's stage cost
//! `max(debt, fwd_comm) + max(fwd_comp, fwd_comm)` with a stage per communication point
//! instead of per op: consecutive ops without a collective run as one interval, and
//! consecutive collectives (two operands of one op) as points with empty intervals between
//! them, whose collectives nothing hides.
//!
//! What both duplicas share runs once: ops that depend on no input (a parameter's cast)
//! compute in A's interval only, and collectives of such tensors (a ZeRO parameter's
//! all-gather and its reduce-scatter) and the replicated parameters' gradient all-reduce
//! are issued once and charged serially, not overlapped.
//!
//! The backward pass is charged **like the forward**, mirrored, not serially as HiDup
//! charges it: the runtime's collectives are start/finish pairs whose backward starts the
//! dual collective (at the finish's backward) and waits for it (at the start's), and
//! autograd runs the nodes created in between meanwhile — the other duplica's interval,
//! in reverse. By that symmetry the backward pass costs the same sum with each interval's
//! backward compute and each collective's dual. `bench/overlap_search.py` prints the
//! forward and backward estimates apart, for a measurement to check them against.
//!
//! A recomputed span ([`crate::recompute`]) runs under activation checkpointing, its
//! collectives blocking: they make no point, and count serially for each duplica, forward
//! and backward; its forward runs again in the backward pass, the compute as backward
//! compute and the collectives once more, serially.
//!
//! Every time is the slowest device's, as in the bulk-synchronous model of
//! [`crate::cost`]: a step's compute `max_d`, each collective `max_d`.
//!
//! During the search a partial program's cost is a [`Clock`]: per pass three numbers, not
//! one, since what the next steps cost depends on how much of the last point's collective
//! is still uncovered and how much compute duplica B still owes.

use serde::Serialize;

use crate::comm::{one_way_row, Collective};
use crate::cost::{Row, RowOut};
use crate::ir::NodeKind;
use crate::problem::{Problem, TensorId};
use crate::profile::Profile;

/// How many duplicas an overlapped program runs (each one micro-batch of half the
/// global batch).
pub const DUPLICAS: usize = 2;

/// Whether a conversion moves data between ranks. Dynamic slices and masks are local:
/// they make no communication point.
pub fn is_collective(collective: Collective) -> bool {
    !matches!(collective, Collective::DynamicSlice | Collective::MaskToRankZero)
}

/// Per tensor of the problem: whether it depends on the batch (a user input, or an op
/// result with such an input). The others (parameters, and what is computed from
/// parameters alone) are computed and communicated once for both duplicas.
pub fn batch_dependent(problem: &Problem) -> Vec<bool> {
    let mut dependent: Vec<bool> = problem.tensors.iter().map(|t| t.kind == NodeKind::Input).collect();
    for step in &problem.steps {
        if step.inputs.iter().any(|&t| dependent[t as usize]) {
            for t in step.outputs.iter().flatten() {
                dependent[*t as usize] = true;
            }
        }
    }
    dependent
}

/// The share of step `pos`'s compute row that its forward pass takes: the row prices
/// the forward once, the backward at twice the forward when the step carries a gradient
/// ([`crate::cost::compute_row`]), and the forward once more in a recomputed span
/// (the backward pass runs it again).
pub fn forward_share(problem: &Problem, pos: usize) -> f64 {
    let step = &problem.steps[pos];
    let backward = if step.inputs.iter().any(|&t| problem.tensor(t).requires_grad) { 2.0 } else { 0.0 };
    let again = if step.span.is_some() { 1.0 } else { 0.0 };
    1.0 / (1.0 + backward + again)
}

/// Forward and backward rows of one collective on a tensor of `bytes` bytes (the
/// backward is its dual, when the tensor carries a gradient): the two halves of
/// [`crate::comm::collective_row`].
pub fn collective_rows(profile: &Profile, collective: Collective, bytes: f64, with_grad: bool) -> (Row, Option<Row>) {
    let forward = one_way_row(profile, collective, bytes);
    let backward = collective.backward().filter(|_| with_grad).map(|back| one_way_row(profile, back, bytes));
    (forward, backward)
}

/// One step's part in the two-duplica schedule, per device, with rows of type `R`:
/// [`Row`] in the search, [`RowOut`] on the wire ([`OverlapOut`], which leaves
/// `recomputed` out).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRows<R = Row> {
    /// Whether the step depends on the batch (each duplica runs it; else A only, once).
    pub batch: bool,
    /// Whether the step is in a recomputed span (its collectives block).
    #[serde(skip)]
    pub recomputed: bool,
    /// Forward compute of one duplica.
    pub comp_forward: R,
    /// Backward compute of one duplica.
    pub comp_backward: R,
    /// The batch collectives before the step, one duplica's, in order: each a
    /// communication point of the forward pass.
    pub comm_forward: Vec<R>,
    /// Their duals (those whose tensor carries a gradient), in the same order: the
    /// backward pass's points.
    pub comm_backward: Vec<R>,
    /// Collectives run once for both duplicas (parameters', forward and backward, and
    /// the replicated gradients' all-reduce), not overlapped.
    pub serial: R,
}

impl StepRows {
    /// A step with compute row `comp` (forward + backward, one duplica) whose forward is
    /// `share` of it, and no communication yet.
    pub fn new(comp: &Row, share: f64, batch: bool, recomputed: bool) -> StepRows {
        let scaled = |s: f64| Row {
            constant: comp.constant.iter().map(|v| v * s).collect(),
            coef: comp.coef.iter().map(|v| v * s).collect(),
        };
        StepRows {
            batch,
            recomputed,
            comp_forward: scaled(share),
            comp_backward: scaled(1.0 - share),
            comm_forward: Vec::new(),
            comm_backward: Vec::new(),
            serial: Row::zeros(comp.constant.len()),
        }
    }

    /// Add a collective with forward row `forward` and backward row `backward`: a point
    /// run by each duplica when `per_duplica` (it moves batch data), else once, serially;
    /// in a recomputed span serially for each duplica.
    pub fn add_collective(&mut self, forward: Row, backward: Option<Row>, per_duplica: bool) {
        if per_duplica && self.recomputed {
            for _ in 0..DUPLICAS {
                self.serial.add(&forward);
                if let Some(back) = &backward {
                    self.serial.add(back);
                }
            }
        } else if per_duplica {
            self.comm_forward.push(forward);
            self.comm_backward.extend(backward);
        } else {
            self.serial.add(&forward);
            if let Some(back) = backward {
                self.serial.add(&back);
            }
        }
    }

    /// Add communication run once, serially (a replicated parameter's gradient
    /// all-reduce).
    pub fn add_serial(&mut self, row: &Row) {
        self.serial.add(row);
    }

    /// Add the forward of a collective that a recomputed span's backward runs again:
    /// each duplica recomputes its own, inside its backward compute, so it is serial.
    pub fn add_recomputed(&mut self, forward: &Row) {
        for _ in 0..DUPLICAS {
            self.serial.add(forward);
        }
    }

    /// The step's times under `ratios` (each the slowest device's).
    pub fn times(&self, ratios: &[f64]) -> StepTimes {
        let pass = |comp: &Row, comms: &[Row]| {
            let mut pass = PassTimes::chain(&comms.iter().map(|c| c.max(ratios)).collect::<Vec<_>>());
            pass.compute = comp.max(ratios);
            pass
        };
        StepTimes {
            batch: self.batch,
            forward: pass(&self.comp_forward, &self.comm_forward),
            backward: pass(&self.comp_backward, &self.comm_backward),
            serial: self.serial.max(ratios),
        }
    }
}

/// One pass (forward or backward) of one step, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassTimes {
    /// One duplica's compute.
    pub compute: f64,
    /// Whether a collective runs before the step.
    pub point: bool,
    /// The first collective's time: A's runs under B's compute of the previous interval.
    pub first: f64,
    /// The last collective's time: B's runs under A's compute of the step's interval.
    pub last: f64,
    /// What the collectives between cost exposed (both duplicas' of all but A's first
    /// and B's last: their intervals are empty); 0 for one collective.
    pub inner: f64,
}

impl PassTimes {
    /// The communication of a chain of collectives of these times (no compute yet).
    pub fn chain(times: &[f64]) -> PassTimes {
        match times {
            [] => PassTimes::default(),
            [only] => PassTimes { compute: 0.0, point: true, first: *only, last: *only, inner: 0.0 },
            [first, .., last] => PassTimes {
                compute: 0.0,
                point: true,
                first: *first,
                last: *last,
                inner: 2.0 * times.iter().sum::<f64>() - first - last,
            },
        }
    }
}

/// One step's times in seconds (see [`StepRows`], whose maxima over devices they are).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    pub batch: bool,
    pub forward: PassTimes,
    pub backward: PassTimes,
    pub serial: f64,
}

/// One pass's cost of a program prefix under the two-duplica schedule.
///
/// With `acc` the time of every closed interval, `S^B` duplica B's compute of the open
/// interval and `c` the collective at its point: `closed = acc + max(S^A, c)` (A's compute
/// of the open interval and B's collective both done), `debt = S^B` (what B still owes)
/// and `slack = max(0, c - S^A)` (B's collective still uncovered: it hides A's compute
/// of the next steps). The prefix costs `closed + debt` if the program ends there.
///
/// What the rest of the program adds is non-decreasing in `closed`, in
/// `closed - slack` and in `debt`, and grows by exactly `x` when both of the first two
/// grow by `x`; [`Clock::dominates`] rests on that.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pass {
    pub closed: f64,
    pub debt: f64,
    pub slack: f64,
}

impl Pass {
    pub fn cost(&self) -> f64 {
        self.closed + self.debt
    }

    /// The pass after one more step (`batch`: duplica B runs it too).
    pub fn advance(self, t: &PassTimes, batch: bool) -> Pass {
        let owed = if batch { t.compute } else { 0.0 };
        if t.point {
            // B computes the open interval under A's first collective; then the chain;
            // then A computes the step under B's last collective
            let acc = self.closed + self.debt.max(t.first) + t.inner;
            Pass { closed: acc + t.compute.max(t.last), debt: owed, slack: (t.last - t.compute).max(0.0) }
        } else {
            // the step joins the open interval; A's part of it hides under B's collective
            Pass {
                closed: self.closed + (t.compute - self.slack).max(0.0),
                debt: self.debt + owed,
                slack: (self.slack - t.compute).max(0.0),
            }
        }
    }

    /// Whether every completion of `other` costs no less than one of `self` that first
    /// pays `extra` more seconds.
    fn dominates(&self, other: &Pass, extra: f64) -> bool {
        self.closed + extra <= other.closed
            && self.closed - self.slack + extra <= other.closed - other.slack
            && self.debt <= other.debt
    }

    /// What this pass may pay at most for collectives of `switch` seconds (one duplica's,
    /// forward + backward) inserted before its next step: both duplicas run them, and they
    /// may close the open interval early (at most `debt + slack`).
    fn switch_extra(&self, switch: f64) -> f64 {
        if switch <= 0.0 {
            0.0
        } else {
            2.0 * switch + self.debt + self.slack
        }
    }
}

/// The cost of a program prefix: both passes, the serial time folded into the forward
/// pass (a serial charge shifts a pass's future without changing it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Clock {
    pub forward: Pass,
    pub backward: Pass,
}

impl Clock {
    /// A clock of plain (bulk-synchronous) seconds: no duplicas.
    pub fn plain(seconds: f64) -> Clock {
        Clock { forward: Pass { closed: seconds, debt: 0.0, slack: 0.0 }, backward: Pass::default() }
    }

    /// Seconds of the prefix if the program ends here.
    pub fn cost(&self) -> f64 {
        self.forward.cost() + self.backward.cost()
    }

    /// The clock after one more step.
    pub fn advance(self, t: &StepTimes) -> Clock {
        let forward = self.forward.advance(&t.forward, t.batch);
        Clock {
            forward: Pass { closed: forward.closed + t.serial, ..forward },
            backward: self.backward.advance(&t.backward, t.batch),
        }
    }

    /// The clock with `seconds` more of serial time (memory charges).
    pub fn delayed(self, seconds: f64) -> Clock {
        Clock { forward: Pass { closed: self.forward.closed + seconds, ..self.forward }, ..self }
    }

    /// Whether every completion of `other` costs no less than one of `self` whose
    /// passes first pay `extra` (forward, backward) more seconds.
    pub fn dominates(&self, other: &Clock, extra: (f64, f64)) -> bool {
        self.forward.dominates(&other.forward, extra.0) && self.backward.dominates(&other.backward, extra.1)
    }

    /// The `extra` of [`Clock::dominates`] for a state that must first run collectives
    /// of `switch` seconds (forward + backward, the slowest device's, one duplica) to
    /// reach another's layouts.
    pub fn switch_extra(&self, switch: f64) -> (f64, f64) {
        (self.forward.switch_extra(switch), self.backward.switch_extra(switch))
    }

    /// A lower bound on the whole program's cost from this prefix when the rest of the
    /// program computes at least `compute_left` seconds in duplica A (both passes) and
    /// `batch_left` of them in duplica B too: only A's compute can hide, under the
    /// collectives still uncovered.
    pub fn lower_bound(&self, compute_left: f64, batch_left: f64) -> f64 {
        self.cost() + compute_left + batch_left - (self.forward.slack + self.backward.slack).min(compute_left)
    }
}

/// A step's overlap rows on the wire: [`StepRows`] without `recomputed`.
pub type OverlapOut = StepRows<RowOut>;

impl From<&StepRows> for OverlapOut {
    fn from(rows: &StepRows) -> Self {
        StepRows {
            batch: rows.batch,
            recomputed: rows.recomputed,
            comp_forward: (&rows.comp_forward).into(),
            comp_backward: (&rows.comp_backward).into(),
            comm_forward: rows.comm_forward.iter().map(Into::into).collect(),
            comm_backward: rows.comm_backward.iter().map(Into::into).collect(),
            serial: (&rows.serial).into(),
        }
    }
}

/// What the search needs to price a problem's steps under the schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Per tensor: [`batch_dependent`].
    pub batch: Vec<bool>,
    /// Per step: whether it depends on the batch.
    pub step_batch: Vec<bool>,
    /// Per step: [`forward_share`].
    pub share: Vec<f64>,
}

impl Schedule {
    pub fn new(problem: &Problem) -> Schedule {
        let batch = batch_dependent(problem);
        let step_batch = problem.steps.iter().map(|s| s.inputs.iter().any(|&t| batch[t as usize])).collect();
        let share = (0..problem.steps.len()).map(|i| forward_share(problem, i)).collect();
        Schedule { batch, step_batch, share }
    }

    /// Rows of step `pos` run with rule `rule`, before any communication.
    pub fn step(&self, problem: &Problem, pos: usize, rule: usize) -> StepRows {
        let step = &problem.steps[pos];
        StepRows::new(&step.comp[rule], self.share[pos], self.step_batch[pos], step.span.is_some())
    }

    /// Add `collective` on tensor `t` to `rows` (nothing for a local re-layout).
    pub fn add_comm(&self, problem: &Problem, rows: &mut StepRows, t: TensorId, collective: Collective) {
        if !is_collective(collective) {
            return;
        }
        let tensor = problem.tensor(t);
        let (forward, backward) = collective_rows(problem.profile, collective, tensor.bytes(), tensor.requires_grad);
        rows.add_collective(forward, backward, self.batch[t as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch step of forward compute `f` (backward `2f`) after collectives `comms`
    /// (backward: the same times).
    fn step(f: f64, comms: &[f64]) -> StepTimes {
        let mut forward = PassTimes::chain(comms);
        forward.compute = f;
        let mut backward = PassTimes::chain(comms);
        backward.compute = 2.0 * f;
        StepTimes { batch: true, forward, backward, serial: 0.0 }
    }

    fn run(steps: &[StepTimes]) -> f64 {
        steps.iter().fold(Clock::default(), |c, t| c.advance(t)).cost()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn no_communication_costs_both_duplicas_back_to_back() {
        let steps = [step(1.0, &[]), step(2.0, &[]), step(3.0, &[])];
        // forward 2 × 6, backward 2 × 12
        assert_eq!(run(&steps), 36.0);
    }

    #[test]
    fn hidup_stage_cost_by_hand() {
        // interval 0: 1 s; point 1: a 3 s collective; interval 1: 2 + 1 s; point 2: 0.5 s;
        // interval 2: 4 s
        let steps = [step(1.0, &[]), step(2.0, &[3.0]), step(1.0, &[]), step(4.0, &[0.5])];
        // A seg 0 (1) + max(B seg 0 = 1, 3) + max(A seg 1 = 3, 3) + max(B seg 1 = 3, 0.5)
        // + max(A seg 2 = 4, 0.5) + B seg 2 (4)
        let forward = 1.0 + 3.0 + 3.0 + 3.0 + 4.0 + 4.0;
        // the same with compute doubled: 2 + max(2, 3) + max(6, 3) + max(6, .5) + max(8, .5) + 8
        let backward = 2.0 + 3.0 + 6.0 + 6.0 + 8.0 + 8.0;
        assert!(close(run(&steps), forward + backward), "{}", run(&steps));
    }

    #[test]
    fn a_slow_collective_hides_the_next_steps_of_duplica_a() {
        // B's 10 s collective covers A's 2 + 3 s of forward; B still computes them
        let steps = [step(2.0, &[10.0]), step(3.0, &[])];
        // forward: max(0, 10) + max(5, 10) + 5; backward: max(0, 10) + max(10, 10) + 10
        assert!(close(run(&steps), 25.0 + 30.0));
    }

    #[test]
    fn consecutive_collectives_are_points_with_empty_intervals() {
        // two collectives before one step: A's first under B's 1 s, B's first and A's
        // second exposed, B's second under A's 2 s
        let one = [step(1.0, &[]), step(2.0, &[0.5, 0.75])];
        let forward = 1.0 + 1.0 + (0.5 + 0.75) + 2.0 + 2.0;
        let backward = 2.0 + 2.0 + (0.5 + 0.75) + 4.0 + 4.0;
        assert!(close(run(&one), forward + backward));
    }

    #[test]
    fn shared_steps_run_once_and_serial_time_adds() {
        let mut shared = step(1.0, &[]);
        shared.batch = false;
        shared.serial = 0.7;
        // forward: A's 1 s only; backward: A's 2 s only; the serial 0.7 s
        assert!(close(run(&[shared]), 1.0 + 2.0 + 0.7));
        // a shared step after a point hides under B's collective; B owes nothing for it
        let steps = [step(1.0, &[5.0]), shared];
        let forward = 5.0 + 5.0 + 1.0; // max(0, 5) + max(1 + 1, 5) + B's 1
        let backward = 5.0 + 5.0 + 2.0; // max(0, 5) + max(2 + 2, 5) + B's 2
        assert!(close(run(&steps), forward + backward + 0.7));
    }

    #[test]
    fn dominance_and_bound() {
        let pass = |closed, debt, slack| Pass { closed, debt, slack };
        let clock = |f: Pass| Clock { forward: f, backward: Pass::default() };
        let a = clock(pass(5.0, 1.0, 0.0));
        let b = clock(pass(6.0, 1.0, 0.5));
        assert!(a.dominates(&b, (0.0, 0.0)));
        assert!(!a.dominates(&b, (1.0, 0.0)));
        // later, with more slack: neither dominates the other
        let c = clock(pass(5.5, 1.0, 2.0));
        assert!(!a.dominates(&c, (0.0, 0.0)) && !c.dominates(&a, (0.0, 0.0)));
        assert_eq!(a.switch_extra(0.0), (0.0, 0.0));
        assert_eq!(c.switch_extra(1.0), (2.0 + 1.0 + 2.0, 2.0));
        // the bound never exceeds a completion's cost
        let rest = [step(1.0, &[]), step(1.0, &[0.2])];
        let end = rest.iter().fold(c, |k, t| k.advance(t)).cost();
        assert!(c.lower_bound(6.0, 6.0) <= end + 1e-12, "{} > {end}", c.lower_bound(6.0, 6.0));
    }

    #[test]
    fn step_rows_count_parameter_collectives_once() {
        let comp = Row { constant: vec![3.0, 3.0], coef: vec![0.0, 0.0] };
        let mut rows = StepRows::new(&comp, 1.0 / 3.0, true, false);
        let fwd = Row { constant: vec![1.0, 1.0], coef: vec![0.0, 0.0] };
        let bwd = Row { constant: vec![0.5, 0.5], coef: vec![0.0, 0.0] };
        rows.add_collective(fwd.clone(), Some(bwd.clone()), true);
        rows.add_collective(fwd.clone(), Some(bwd.clone()), false);
        rows.add_serial(&bwd);
        let t = rows.times(&[0.5, 0.5]);
        assert!(t.forward.point && t.backward.point);
        assert!(close(t.forward.compute, 1.0) && close(t.backward.compute, 2.0));
        assert_eq!((t.forward.first, t.forward.last, t.forward.inner), (1.0, 1.0, 0.0));
        assert_eq!((t.backward.first, t.serial), (0.5, 2.0));
        // in a recomputed span a batch collective blocks, in each duplica
        let mut again = StepRows::new(&comp, 0.25, true, true);
        again.add_collective(fwd.clone(), Some(bwd.clone()), true);
        let t = again.times(&[0.5, 0.5]);
        assert!(!t.forward.point && !t.backward.point);
        assert_eq!(t.serial, 3.0);
    }
}
