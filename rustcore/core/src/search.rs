//! Best-first (A*) search for the cheapest program.
//!
//! Ops are taken in program order; a **state** is the position plus the set of layouts
//! each live tensor is held in. Expanding a state picks a rule for the next op, brings
//! each of its inputs into the layout the rule needs (creating sources, or the
//! cheapest communication from a layout already held), and adds the step's cost
//! `max_d comp + max_d comm`. The heuristic — the sum over the remaining ops of their
//! cheapest compute — never overestimates (every op must still run, and communication
//! costs ≥ 0), so the first goal popped is optimal. Each state stores only its parent and
//! its choice: an expansion costs O(live tensors), not O(program length).
//!
//! With the `overlap` option a program's cost is the two-duplica schedule's
//! ([`crate::overlap`]): a state's cost is a [`Clock`], the dominance between states
//! compares each of its numbers, and the heuristic counts the rest of the program's
//! compute for both duplicas less what the last points' collectives can still hide.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::comm::{collective_row, conversions, one_way_row, Collective};
use crate::cost::Row;
use crate::error::{Error, Result};
use crate::ir::NodeKind;
use crate::hashing::FastMap;
use crate::layout::{Layout, LayoutSet};
use crate::memory;
use crate::overlap::{Clock, Schedule, StepRows, StepTimes};
use crate::problem::{Problem, TensorId};

/// The search's result types, defined in [`crate::outcome`] (below the memory model and
/// the plan, which read a found program without the search), re-exported where they
/// were first defined.
pub use crate::outcome::{ChosenStep, Comm, Outcome, Source, StopReason};

/// Search limits and cancellation, set with a builder.
pub struct Search<'p, 'a> {
    problem: &'p Problem<'a>,
    ratios: Vec<f64>,
    max_states: usize,
    front_width: usize,
    time_limit: Option<Duration>,
    cancel: Option<&'p AtomicBool>,
    /// Seconds charged per byte a state adds on each device (see
    /// [`Search::with_memory_price`]); `None`: memory is free.
    memory_price: Option<Vec<f64>>,
    /// The two-duplica schedule, when the problem's options ask for overlap.
    schedule: Option<Schedule>,
}

struct Entry {
    /// Dominated by a state found later; skipped when popped.
    dead: bool,
    parent: u32,
    pos: u32,
    rule: u16,
    choice: u16,
    g: f64,
    /// The state's cost in full (`g` is its total): with overlap, what the rest of the
    /// program costs depends on more than the total.
    clock: Clock,
    held: Box<[LayoutSet]>,
}

/// The outcome of applying one rule at one state.
struct Transition {
    held: Box<[LayoutSet]>,
    /// Seconds added (with overlap: the memory charge only; the step's times are in
    /// `times`).
    cost: f64,
    times: StepTimes,
    choice: u16,
}

/// What one way of applying a rule adds up to while its [`Transition`] is built.
struct Tally {
    /// The layouts of the step's inputs after their creation and communication.
    local: Vec<(TensorId, LayoutSet)>,
    /// Seconds of the step's communication per device.
    comm: Vec<f64>,
    /// The memory charge (see [`Search::with_memory_price`]).
    charge: f64,
    /// With overlap: the step's part in the two-duplica schedule.
    rows: Option<StepRows>,
}

/// The program [`Search::replay`] rebuilds, as far as it got.
struct Replayed {
    /// The layouts each tensor is held in (canonical: forgets slices).
    held: Vec<LayoutSet>,
    /// Every layout the program materializes.
    created: Vec<LayoutSet>,
    memo: CommMemo,
}

/// How many of the cheapest states of a position a new state is compared against for
/// dominance (exact duplicates are always caught).
const FRONT_CHECKS: usize = 32;

/// The states of one (position, held layouts): each clock and the state's id.
type Kept = Vec<(Clock, u32)>;

/// Memo of the cheapest communication for (tensor, from set, to).
type CommMemo = FastMap<(TensorId, LayoutSet, Layout), Option<(Layout, Collective, Vec<f64>)>>;

/// Memo of [`Search::switch_cost`] per (tensor, from set, to set).
type SetMemo = FastMap<(TensorId, LayoutSet, LayoutSet), f64>;

/// The state of one run of [`Search::run`].
struct Run {
    start: Instant,
    /// Max over devices of each rule's compute row, per step.
    comp_values: Vec<Vec<f64>>,
    /// Lower bound on the cost from each position to the end.
    heuristic: Vec<f64>,
    /// With overlap: the part of `heuristic` duplica B runs too (its batch steps).
    batch_left: Vec<f64>,
    /// Every state generated; a state's index is its id.
    arena: Vec<Entry>,
    /// Per position, the states no other state dominates, cheapest first.
    fronts: Vec<Vec<u32>>,
    /// The states kept per (position, held layouts) (see [`Search::admit_same_layouts`]).
    exact: FastMap<(u32, Box<[LayoutSet]>), Kept>,
    /// States to expand by `g + heuristic`, then deepest, then oldest.
    heap: BinaryHeap<(Reverse<u64>, u32, Reverse<u32>)>,
    memo: CommMemo,
    set_memo: SetMemo,
    expanded: usize,
    /// Whether the front width dropped a state.
    bounded: bool,
    /// The deepest state expanded: where a stopped run is completed from.
    deepest: u32,
}

/// How the main loop of a run ended.
enum End {
    /// A goal state was popped.
    Goal(u32),
    /// A limit was hit or the run was cancelled.
    Stopped(StopReason),
    /// No state was left to expand.
    Exhausted,
}

impl<'p, 'a> Search<'p, 'a> {
    pub fn new(problem: &'p Problem<'a>, ratios: &[f64]) -> Result<Self> {
        let n = problem.profile.world();
        if ratios.len() != n || ratios.iter().any(|r| !r.is_finite() || *r < 0.0) {
            return Err(Error::InvalidOption {
                field: "ratios".into(),
                message: format!("need {n} finite non-negative sharding ratios, got {ratios:?}"),
            });
        }
        Ok(Search {
            problem,
            ratios: ratios.to_vec(),
            max_states: 2_000_000,
            front_width: usize::MAX,
            time_limit: None,
            cancel: None,
            memory_price: None,
            schedule: problem.options.overlap.then(|| Schedule::new(problem)),
        })
    }

    pub fn with_state_limit(mut self, states: usize) -> Self {
        self.max_states = states.max(1);
        self
    }

    /// Keep at most `width` undominated states per position (a beam); unbounded by default.
    pub fn with_front_width(mut self, width: usize) -> Self {
        self.front_width = width.max(1);
        self
    }

    pub fn with_time_limit(mut self, limit: Duration) -> Self {
        self.time_limit = Some(limit);
        self
    }

    pub fn with_cancel(mut self, flag: &'p AtomicBool) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// Charge each byte a step makes a device hold (a parameter with its gradient and
    /// Adam state, an activation the backward pass keeps: [`memory::is_activation`]) at
    /// `price[d]` seconds on device `d`: the Lagrangian relaxation of per-device memory
    /// caps, so the search trades time for memory where a device runs short. The
    /// heuristic stays admissible (charges are ≥ 0); the program's reported cost does
    /// not include them.
    pub fn with_memory_price(mut self, price: Vec<f64>) -> Self {
        let n = self.problem.profile.world();
        if price.len() == n && price.iter().all(|p| p.is_finite() && *p >= 0.0) && price.iter().any(|p| *p > 0.0) {
            self.memory_price = Some(price);
        }
        self
    }

    /// Seconds charged for holding `bytes` (a shard when `sharded`) on every device.
    fn memory_charge(&self, bytes: f64, sharded: bool) -> f64 {
        let Some(price) = &self.memory_price else { return 0.0 };
        price.iter().zip(&self.ratios).map(|(p, r)| p * if sharded { bytes * r } else { bytes }).sum()
    }

    fn max(&self, row: &Row) -> f64 {
        row.max(&self.ratios)
    }

    fn add_values(acc: &mut [f64], values: &[f64]) {
        for (a, v) in acc.iter_mut().zip(values) {
            *a += v;
        }
    }

    /// Run the search to the end or to a limit: expand the cheapest state until a goal
    /// is popped or a limit is hit, then complete and replay the program.
    pub fn run(&self) -> Result<Outcome> {
        let mut run = self.init();
        let end = loop {
            if let Some(end) = self.run_one(&mut run) {
                break end;
            }
        };
        self.complete(run, end)
    }

    /// The run's starting point: per-rule compute costs, the heuristic, and the root
    /// state (position 0, nothing held) queued.
    fn init(&self) -> Run {
        let p = self.problem;
        let n_steps = p.steps.len();
        let comp_values: Vec<Vec<f64>> = p
            .steps
            .iter()
            .map(|s| s.comp.iter().map(|row| self.max(row)).collect())
            .collect();
        let mut heuristic = vec![0.0; n_steps + 1];
        let mut batch_left = vec![0.0; n_steps + 1];
        for i in (0..n_steps).rev() {
            let cheapest = comp_values[i].iter().copied().fold(f64::INFINITY, f64::min);
            let cheapest = if cheapest.is_finite() { cheapest } else { 0.0 };
            heuristic[i] = heuristic[i + 1] + cheapest;
            let batch = self.schedule.as_ref().is_some_and(|s| s.step_batch[i]);
            batch_left[i] = batch_left[i + 1] + if batch { cheapest } else { 0.0 };
        }
        let root = Entry {
            dead: false,
            parent: u32::MAX,
            pos: 0,
            rule: 0,
            choice: 0,
            g: 0.0,
            clock: Clock::default(),
            held: vec![LayoutSet::default(); p.live[0].len()].into_boxed_slice(),
        };
        let mut heap = BinaryHeap::new();
        heap.push((Reverse(key(heuristic[0] + batch_left[0])), 0u32, Reverse(0u32)));
        Run {
            start: Instant::now(),
            comp_values,
            heuristic,
            batch_left,
            arena: vec![root],
            fronts: vec![Vec::new(); n_steps + 1],
            exact: FastMap::default(),
            heap,
            memo: FastMap::default(),
            set_memo: FastMap::default(),
            expanded: 0,
            bounded: false,
            deepest: 0,
        }
    }

    /// One iteration: pop the cheapest live state; stop at a goal or a limit, else
    /// expand it.
    fn run_one(&self, run: &mut Run) -> Option<End> {
        let Some((_, _, Reverse(idx))) = run.heap.pop() else { return Some(End::Exhausted) };
        let entry = &run.arena[idx as usize];
        if entry.dead {
            return None; // dominated after it was queued
        }
        let pos = entry.pos;
        if pos as usize == self.problem.steps.len() {
            return Some(End::Goal(idx));
        }
        if run.arena[run.deepest as usize].pos < pos {
            run.deepest = idx;
        }
        run.expanded += 1;
        if let Some(stop) = self.check_limits(run) {
            return Some(End::Stopped(stop));
        }
        self.expand(run, idx);
        None
    }

    /// Cancellation and the time limit (polled every 1024 expansions), then the state
    /// budget.
    fn check_limits(&self, run: &Run) -> Option<StopReason> {
        let mut stop = None;
        if run.expanded % 1024 == 0 {
            if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                stop = Some(StopReason::Cancelled);
            } else if self.time_limit.is_some_and(|t| run.start.elapsed() > t) {
                stop = Some(StopReason::TimeLimit);
            }
        }
        if run.arena.len() >= self.max_states {
            stop = Some(StopReason::StateLimit);
        }
        stop
    }

    /// Queue every state one step past state `idx` that no known state dominates.
    fn expand(&self, run: &mut Run, idx: u32) {
        let pos = run.arena[idx as usize].pos as usize;
        for rule in 0..self.problem.steps[pos].rules.len() {
            let held = &run.arena[idx as usize].held;
            for t in self.transitions(pos, rule, held, &run.comp_values, &mut run.memo) {
                self.add_state(run, idx, rule, t);
            }
        }
    }

    /// Add the child of state `idx` reached by `rule` and transition `t`, unless a
    /// state of its position is known to reach it for less; drop the states it
    /// dominates and, past the front width, the dearest of its position.
    fn add_state(&self, run: &mut Run, idx: u32, rule: usize, t: Transition) {
        let parent = &run.arena[idx as usize];
        let pos = parent.pos;
        let clock = self.child_clock(parent, &t);
        let g2 = clock.cost();
        let next = pos as usize + 1;
        let live = &self.problem.live[next];
        let key_held = (next as u32, t.held.clone());
        let left = run.heuristic[next];
        if !self.admit_same_layouts(run, &key_held, &clock, left) {
            return;
        }
        if !self.admit_to_front(run, next, live, &clock, &t.held) {
            return; // an existing state reaches this one for less
        }
        let child = run.arena.len() as u32;
        let kept = run.exact.entry(key_held).or_default();
        if self.schedule.is_none() {
            kept.clear(); // the cheapest so far
        }
        kept.push((clock, child));
        run.arena.push(Entry {
            dead: false,
            parent: idx,
            pos: pos + 1,
            rule: rule as u16,
            choice: t.choice,
            g: g2,
            clock,
            held: t.held,
        });
        let child = (run.arena.len() - 1) as u32;
        self.insert_in_front(run, next, child, left);
        let bound = self.lower_bound(&clock, run.heuristic[next], run.batch_left[next]);
        run.heap.push((Reverse(key(bound)), pos + 1, Reverse(child)));
    }

    /// Whether a new state of position `next` with clock `clock` holding `held` may join
    /// its front: not when one of the front's cheapest states dominates it (reaches its
    /// layouts for less); those it dominates are dropped.
    fn admit_to_front(&self, run: &mut Run, next: usize, live: &[TensorId], clock: &Clock, held: &[LayoutSet]) -> bool {
        // dominance against the cheapest states of the front (sorted by cost)
        let front = &run.fronts[next];
        let checked = front.len().min(FRONT_CHECKS);
        if front[..checked].iter().any(|&k| {
            let e = &run.arena[k as usize];
            let switch = self.switch_cost(live, &e.held, held, &mut run.set_memo, &mut run.memo);
            e.clock.dominates(clock, self.switch_extra(&e.clock, switch))
        }) {
            return false;
        }
        let mut dead = Vec::new();
        for (j, &k) in front[..checked].iter().enumerate() {
            let e = &run.arena[k as usize];
            let switch = self.switch_cost(live, held, &e.held, &mut run.set_memo, &mut run.memo);
            if clock.dominates(&e.clock, self.switch_extra(clock, switch)) {
                dead.push(j);
            }
        }
        for &j in dead.iter().rev() {
            let k = run.fronts[next].remove(j);
            run.arena[k as usize].dead = true;
        }
        true
    }

    /// Put state `child` into its position `next`'s front by rank (`left` seconds of
    /// compute after it); past the front width, drop the dearest.
    fn insert_in_front(&self, run: &mut Run, next: usize, child: u32, left: f64) {
        let arena = &mut run.arena;
        let front = &mut run.fronts[next];
        let rank = self.rank(&arena[child as usize].clock, left);
        let at = front.partition_point(|&k| self.rank(&arena[k as usize].clock, left) <= rank);
        front.insert(at, child);
        if front.len() > self.front_width {
            // keep the cheapest states of this position; the result is no longer
            // proven optimal
            if let Some(k) = front.pop() {
                arena[k as usize].dead = true;
                run.bounded = true;
            }
        }
    }

    /// Finish the run: the stop reason, the program to the goal (or completed greedily
    /// from the deepest state reached), replayed with full cost rows, and the report.
    fn complete(&self, mut run: Run, end: End) -> Result<Outcome> {
        let generated = run.arena.len();
        let (last, stop) = match end {
            End::Goal(idx) if run.bounded => (idx, StopReason::Bounded),
            End::Goal(idx) => (idx, StopReason::Optimal),
            End::Stopped(stop) => {
                let deepest = run.deepest;
                (self.complete_greedily(&mut run, deepest), stop)
            }
            End::Exhausted => (self.complete_greedily(&mut run, 0), StopReason::StateLimit),
        };
        let choices = path(&run.arena, last);
        let (steps, held, cost) = self.replay(&choices)?;
        Ok(Outcome {
            steps,
            held,
            cost,
            stop,
            expanded: run.expanded,
            generated,
            seconds: run.start.elapsed().as_secs_f64(),
        })
    }

    /// Finish a program from state `from` taking the cheapest next step each time; the
    /// last state.
    fn complete_greedily(&self, run: &mut Run, from: u32) -> u32 {
        let mut cur = from;
        while (run.arena[cur as usize].pos as usize) < self.problem.steps.len() {
            let pos = run.arena[cur as usize].pos as usize;
            let mut pick: Option<(Clock, usize, Transition)> = None;
            for rule in 0..self.problem.steps[pos].rules.len() {
                let held = &run.arena[cur as usize].held;
                for t in self.transitions(pos, rule, held, &run.comp_values, &mut run.memo) {
                    let clock = self.child_clock(&run.arena[cur as usize], &t);
                    if pick.as_ref().is_none_or(|(c, _, _)| clock.cost() < c.cost()) {
                        pick = Some((clock, rule, t));
                    }
                }
            }
            let Some((clock, rule, t)) = pick else { break };
            run.arena.push(Entry {
                dead: false,
                parent: cur,
                pos: pos as u32 + 1,
                rule: rule as u16,
                choice: t.choice,
                g: clock.cost(),
                clock,
                held: t.held,
            });
            cur = (run.arena.len() - 1) as u32;
        }
        cur
    }

    /// An upper bound on the cost of turning a state holding `from` into one holding
    /// `to` (every missing layout communicated at once). If a state reaches another's
    /// layouts for no more than that one's cost, the other is dominated: the step cost
    /// `max_d (a + b) ≤ max_d a + max_d b` makes the bound sound.
    fn switch_cost(
        &self,
        live: &[TensorId],
        from: &[LayoutSet],
        to: &[LayoutSet],
        set_memo: &mut SetMemo,
        memo: &mut CommMemo,
    ) -> f64 {
        let mut total = 0.0;
        for (i, &t) in live.iter().enumerate() {
            let (a, b) = (from[i], to[i]);
            if a == b || (a.0 & b.0) == b.0 {
                continue;
            }
            let cost = *set_memo.entry((t, a, b)).or_insert_with(|| {
                let mut sum = 0.0;
                for l in b.iter().filter(|l| !a.contains(*l)) {
                    match self.cheapest_comm(t, a, l, memo) {
                        Some((_, _, values)) => sum += values.iter().copied().fold(0.0, f64::max),
                        None => return f64::INFINITY,
                    }
                }
                sum
            });
            total += cost;
            if total.is_infinite() {
                break;
            }
        }
        total
    }

    /// The cheapest single communication giving `to` from any layout in `held`.
    fn cheapest_comm(
        &self,
        t: TensorId,
        held: LayoutSet,
        to: Layout,
        memo: &mut CommMemo,
    ) -> Option<(Layout, Collective, Vec<f64>)> {
        memo.entry((t, held, to))
            .or_insert_with(|| {
                let tensor = self.problem.tensor(t);
                let mut best: Option<(f64, Layout, Collective, Vec<f64>)> = None;
                for from in held.iter() {
                    for &c in conversions(from, to) {
                        if !self.problem.allows(c) {
                            continue;
                        }
                        let row = collective_row(self.problem.profile, c, tensor.bytes(), tensor.requires_grad);
                        let values = row.values(&self.ratios);
                        let m = values.iter().copied().fold(0.0, f64::max);
                        if best.as_ref().is_none_or(|b| m < b.0) {
                            best = Some((m, from, c, values));
                        }
                    }
                }
                best.map(|(_, from, c, v)| (from, c, v))
            })
            .clone()
    }

    /// Every way to apply `rule` of step `pos` at a state holding `held` (one per choice
    /// of how new sources are created).
    fn transitions(
        &self,
        pos: usize,
        rule_index: usize,
        held: &[LayoutSet],
        comp_values: &[Vec<f64>],
        memo: &mut CommMemo,
    ) -> Vec<Transition> {
        let p = self.problem;
        let rule = &p.steps[pos].rules[rule_index];
        let new_sources = self.new_sources(pos);
        let options: Vec<Vec<(Layout, Option<Layout>)>> =
            new_sources.iter().map(|&(t, slot)| p.source_options(t, rule.inputs[slot])).collect();
        let combos: usize = options.iter().map(Vec::len).product();
        let mut out = Vec::with_capacity(combos);
        for choice in 0..combos {
            let mut tally = self.create_sources(pos, rule_index, &new_sources, &options, choice);
            if self.bring_inputs(pos, rule_index, held, &mut tally, memo).is_none() {
                continue; // an input not available: cannot happen for a valid problem
            }
            let mut next_held = self.held_after(pos, rule_index, held, &tally.local);
            if pos + 1 == p.steps.len() && self.reach_goal(&mut next_held, &mut tally, memo).is_none() {
                continue;
            }
            if self.memory_price.is_some() {
                tally.charge += self.outputs_charge(pos, rule_index);
            }
            let comm_max = tally.comm.iter().copied().fold(0.0, f64::max);
            let (cost, times) = match &tally.rows {
                Some(rows) => (tally.charge, rows.times(&self.ratios)),
                None => (comp_values[pos][rule_index] + comm_max + tally.charge, StepTimes::default()),
            };
            out.push(Transition { held: next_held.into_boxed_slice(), cost, times, choice: choice as u16 });
        }
        out
    }

    /// The start of transition `choice` of `rule_index` at step `pos`: its new sources
    /// created (`new_sources`, each in its option of `options` that `choice` picks, the
    /// first varying fastest), with their gradient synchronization and memory charge.
    fn create_sources(
        &self,
        pos: usize,
        rule_index: usize,
        new_sources: &[(TensorId, usize)],
        options: &[Vec<(Layout, Option<Layout>)>],
        choice: usize,
    ) -> Tally {
        let p = self.problem;
        let mut tally = Tally {
            local: Vec::with_capacity(p.steps[pos].inputs.len()),
            comm: vec![0.0; p.profile.world()],
            charge: 0.0,
            rows: self.schedule.as_ref().map(|s| s.step(p, pos, rule_index)),
        };
        let mut c = choice;
        for (k, &(t, _)) in new_sources.iter().enumerate() {
            let (created, _) = options[k][c % options[k].len()];
            c /= options[k].len();
            tally.local.push((t, LayoutSet::single(created)));
            if let Some(values) = self.source_values(t, created) {
                Self::add_values(&mut tally.comm, &values);
            }
            if let (Some(rows), Some(row)) = (tally.rows.as_mut(), self.source_row(t, created)) {
                rows.add_serial(&row);
            }
            if self.memory_price.is_some() {
                let tensor = p.tensor(t);
                let copies = if tensor.requires_grad { 2.0 + memory::OPTIMIZER_STATES } else { 1.0 };
                tally.charge += self.memory_charge(copies * tensor.bytes(), created.gather_dim().is_some());
            }
        }
        tally
    }

    /// Bring each input of step `pos` into the layout rule `rule_index` needs, from the
    /// layouts `held` (or just created), by the cheapest communication; `None` when one
    /// cannot be.
    fn bring_inputs(
        &self,
        pos: usize,
        rule_index: usize,
        held: &[LayoutSet],
        tally: &mut Tally,
        memo: &mut CommMemo,
    ) -> Option<()> {
        let p = self.problem;
        let step = &p.steps[pos];
        for (slot, &t) in step.inputs.iter().enumerate() {
            let need = step.rules[rule_index].inputs[slot];
            let current = match tally.local.iter().find(|(x, _)| *x == t) {
                Some((_, set)) => *set,
                None => held[p.live[pos].binary_search(&t).ok()?],
            };
            if current.contains(need) {
                continue;
            }
            if let (Some(rows), Some(schedule)) = (tally.rows.as_mut(), &self.schedule) {
                if let Some((_, collective, _)) = self.cheapest_comm(t, current, need, memo) {
                    schedule.add_comm(p, rows, t, collective);
                }
            }
            let (_, collective, values) = self.cheapest_comm(t, current, need, memo)?;
            Self::add_values(&mut tally.comm, &values);
            if let Some(again) = self.recomputed_comm(pos, t, collective) {
                Self::add_values(&mut tally.comm, &again.values(&self.ratios));
                if let Some(rows) = tally.rows.as_mut() {
                    rows.add_recomputed(&again);
                }
            }
            if self.memory_price.is_some() && need.gather_dim().is_none() && memory::is_activation(p, t) {
                tally.charge += self.memory_charge(p.tensor(t).bytes(), false);
            }
            let updated = current.with(need);
            match tally.local.iter_mut().find(|(x, _)| *x == t) {
                Some(entry) => entry.1 = updated,
                None => tally.local.push((t, updated)),
            }
        }
        Some(())
    }

    /// The layouts of the tensors live after step `pos` runs rule `rule_index`: its
    /// results in the rule's, its inputs as `local` left them, the others as `held`.
    fn held_after(&self, pos: usize, rule_index: usize, held: &[LayoutSet], local: &[(TensorId, LayoutSet)]) -> Vec<LayoutSet> {
        let p = self.problem;
        let step = &p.steps[pos];
        let live = &p.live[pos];
        let next = &p.live[pos + 1];
        let mut next_held = Vec::with_capacity(next.len());
        for &t in next {
            let set = if let Some(k) = step.outputs.iter().position(|o| *o == Some(t)) {
                LayoutSet::single(step.rules[rule_index].outputs[k])
            } else if let Some((_, set)) = local.iter().find(|(x, _)| *x == t) {
                *set
            } else {
                match live.binary_search(&t) {
                    Ok(i) => held[i],
                    Err(_) => LayoutSet::default(),
                }
            };
            next_held.push(set);
        }
        next_held
    }

    /// The goal, after the last step: every updated buffer whole on every rank (the last
    /// step pays the collectives), and the loss as a partial sum (a replicated loss is
    /// masked to rank 0). `None` when the layouts `next_held` cannot reach it.
    fn reach_goal(&self, next_held: &mut [LayoutSet], tally: &mut Tally, memo: &mut CommMemo) -> Option<()> {
        let p = self.problem;
        let next = &p.live[p.steps.len()];
        for &t in &p.mutations {
            let i = next.binary_search(&t).ok()?;
            let set = next_held[i];
            if set.contains(Layout::Identity) {
                continue;
            }
            let (_, collective, values) = self.cheapest_comm(t, set, Layout::Identity, memo)?;
            Self::add_values(&mut tally.comm, &values);
            if let (Some(rows), Some(schedule)) = (tally.rows.as_mut(), &self.schedule) {
                schedule.add_comm(p, rows, t, collective);
            }
            next_held[i] = set.with(Layout::Identity);
        }
        if let Ok(i) = next.binary_search(&p.loss) {
            let set = next_held[i];
            if !(set.contains(Layout::Reduce) || set.contains(Layout::Identity)) {
                return None;
            }
            next_held[i] = LayoutSet::single(Layout::Reduce);
        }
        Some(())
    }

    /// Seconds charged for the activations step `pos` keeps when it runs rule
    /// `rule_index`: its kept results in the rule's layouts, and what its backward keeps
    /// inside (a shard when the rule splits the work).
    fn outputs_charge(&self, pos: usize, rule_index: usize) -> f64 {
        let p = self.problem;
        let step = &p.steps[pos];
        let rule = &step.rules[rule_index];
        let mut charge = 0.0;
        for (k, out) in step.outputs.iter().enumerate() {
            if let Some(t) = out {
                if memory::is_activation(p, *t) && (p.graph.saved_traced || rule.work != crate::cost::Work::Free) {
                    charge += self.memory_charge(p.tensor(*t).bytes(), rule.outputs[k].gather_dim().is_some());
                }
            }
        }
        let inside = p.saved_inside(step.node);
        if inside > 0.0 && step.span.is_none() {
            charge += self.memory_charge(inside, rule.work == crate::cost::Work::Sharded);
        }
        charge
    }

    /// The forward of `collective` on tensor `t` once more, when it brings an operand to
    /// step `pos` of a recomputed span (the backward pass runs the span's forward,
    /// collectives included, again).
    fn recomputed_comm(&self, pos: usize, t: TensorId, collective: Collective) -> Option<Row> {
        let p = self.problem;
        p.steps[pos].span.map(|_| one_way_row(p.profile, collective, p.tensor(t).bytes()))
    }

    /// The sources step `pos` creates (those first used there), each with the input slot
    /// of its first use, in input order. A transition's `choice` numbers the ways to
    /// create them, the first source's option varying fastest.
    fn new_sources(&self, pos: usize) -> Vec<(TensorId, usize)> {
        let p = self.problem;
        let mut sources: Vec<(TensorId, usize)> = Vec::new();
        for (slot, &t) in p.steps[pos].inputs.iter().enumerate() {
            let tensor = p.tensor(t);
            if tensor.is_source() && tensor.first == pos && !sources.iter().any(|&(s, _)| s == t) {
                sources.push((t, slot));
            }
        }
        sources
    }

    /// Per-device seconds of creating a source in `layout` (gradient all-reduce of a
    /// replicated trainable parameter), if any.
    fn source_values(&self, t: TensorId, layout: Layout) -> Option<Vec<f64>> {
        self.source_row(t, layout).map(|r| r.values(&self.ratios))
    }

    fn source_row(&self, t: TensorId, layout: Layout) -> Option<Row> {
        let tensor = self.problem.tensor(t);
        (tensor.kind == NodeKind::Parameter && tensor.requires_grad && layout == Layout::Identity)
            .then(|| crate::comm::grad_sync_row(self.problem.profile, tensor.bytes()))
    }

    /// Rebuild the program (with full cost rows) from the chosen (rule, choice) per step.
    fn replay(&self, choices: &[(usize, u16)]) -> Result<(Vec<ChosenStep>, Vec<LayoutSet>, f64)> {
        let p = self.problem;
        let mut state = Replayed {
            held: vec![LayoutSet::default(); p.tensors.len()],
            created: vec![LayoutSet::default(); p.tensors.len()],
            memo: FastMap::default(),
        };
        let mut steps = Vec::with_capacity(choices.len());
        let mut total = 0.0;
        let mut clock = Clock::default();
        for (pos, &(rule_index, choice)) in choices.iter().enumerate() {
            let chosen = self.replay_step(&mut state, pos, rule_index, choice)?;
            total += self.max(&chosen.comp) + self.max(&chosen.comm);
            if let Some(rows) = &chosen.overlap {
                clock = clock.advance(&rows.times(&self.ratios));
            }
            steps.push(chosen);
        }
        // a replicated loss becomes a partial sum by keeping it on rank 0
        if let Some(last) = steps.last_mut() {
            let loss = p.loss;
            if !state.created[loss as usize].contains(Layout::Reduce) {
                let row = Row::zeros(p.profile.world());
                last.comms.push(Comm { tensor: loss, from: Layout::Identity, to: Layout::Reduce, collective: Collective::MaskToRankZero, row });
                state.created[loss as usize] = state.created[loss as usize].with_raw(Layout::Reduce);
            }
        }
        if choices.len() != p.steps.len() {
            return Err(Error::Synthesis {
                message: format!("the search ended after {} of {} steps", choices.len(), p.steps.len()),
            });
        }
        let total = if self.schedule.is_some() { clock.cost() } else { total };
        Ok((steps, state.created, total))
    }

    /// Step `pos` of the replayed program, running rule `rule_index` with its sources
    /// created as `choice` says: its sources, the communications before it (after the
    /// last step, those that end the program with every updated buffer whole), and its
    /// cost rows.
    fn replay_step(&self, state: &mut Replayed, pos: usize, rule_index: usize, choice: u16) -> Result<ChosenStep> {
        let p = self.problem;
        let step = &p.steps[pos];
        let rule = &step.rules[rule_index];
        let mut comm = Row::zeros(p.profile.world());
        let mut rows = self.schedule.as_ref().map(|s| s.step(p, pos, rule_index));
        let sources = self.replay_sources(state, pos, rule_index, choice, &mut comm, &mut rows);
        let mut comms = self.replay_comms(state, pos, rule_index, &mut comm, &mut rows)?;
        for (k, out) in step.outputs.iter().enumerate() {
            if let Some(t) = out {
                state.held[*t as usize] = LayoutSet::single(rule.outputs[k]);
                state.created[*t as usize] = LayoutSet::single(rule.outputs[k]);
            }
        }
        if pos + 1 == p.steps.len() {
            for c in self.whole_buffers(&state.held, &mut state.memo)? {
                comm.add(&c.row);
                if let (Some(rows), Some(schedule)) = (rows.as_mut(), &self.schedule) {
                    schedule.add_comm(p, rows, c.tensor, c.collective);
                }
                let t = c.tensor as usize;
                state.held[t] = state.held[t].with(Layout::Identity);
                state.created[t] = state.created[t].with_raw(Layout::Identity);
                comms.push(c);
            }
        }
        let comp = step.comp[rule_index].clone();
        Ok(ChosenStep { step: pos, rule: rule_index, sources, comms, comp, comm, overlap: rows })
    }

    /// The sources step `pos` creates for rule `rule_index` as `choice` picks their
    /// layouts; their rows (gradient synchronization) added to `comm` and `rows`.
    fn replay_sources(
        &self,
        state: &mut Replayed,
        pos: usize,
        rule_index: usize,
        choice: u16,
        comm: &mut Row,
        rows: &mut Option<StepRows>,
    ) -> Vec<Source> {
        let p = self.problem;
        let rule = &p.steps[pos].rules[rule_index];
        let mut sources = Vec::new();
        let mut c = choice as usize;
        for (t, slot) in self.new_sources(pos) {
            let options = p.source_options(t, rule.inputs[slot]);
            let (created_layout, _) = options[c % options.len()];
            c /= options.len();
            state.held[t as usize] = LayoutSet::single(created_layout);
            state.created[t as usize] = state.created[t as usize].with_raw(created_layout);
            let row = self.source_row(t, created_layout).unwrap_or_else(|| Row::zeros(p.profile.world()));
            comm.add(&row);
            if let Some(rows) = rows.as_mut() {
                rows.add_serial(&row);
            }
            sources.push(Source { tensor: t, layout: created_layout, row });
        }
        sources
    }

    /// The communications that bring step `pos`'s inputs into the layouts rule
    /// `rule_index` needs (the cheapest from those held), their rows added to `comm` and
    /// `rows`.
    fn replay_comms(
        &self,
        state: &mut Replayed,
        pos: usize,
        rule_index: usize,
        comm: &mut Row,
        rows: &mut Option<StepRows>,
    ) -> Result<Vec<Comm>> {
        let p = self.problem;
        let step = &p.steps[pos];
        let mut comms = Vec::new();
        for (slot, &t) in step.inputs.iter().enumerate() {
            let need = step.rules[rule_index].inputs[slot];
            let current = state.held[t as usize];
            if current.contains(need) {
                continue;
            }
            let (from, collective, _) = self.cheapest_comm(t, current, need, &mut state.memo).ok_or_else(|| {
                Error::Synthesis { message: format!("replay: no communication gives {need} at step {pos}") }
            })?;
            let tensor = p.tensor(t);
            let mut row = collective_row(p.profile, collective, tensor.bytes(), tensor.requires_grad);
            if let (Some(rows), Some(schedule)) = (rows.as_mut(), &self.schedule) {
                schedule.add_comm(p, rows, t, collective);
            }
            if let Some(again) = self.recomputed_comm(pos, t, collective) {
                if let Some(rows) = rows.as_mut() {
                    rows.add_recomputed(&again);
                }
                row.add(&again);
            }
            comm.add(&row);
            comms.push(Comm { tensor: t, from, to: need, collective, row });
            state.held[t as usize] = current.with(need);
            state.created[t as usize] = state.created[t as usize].with_raw(need);
        }
        Ok(comms)
    }
}

/// The two-duplica schedule's part of the search ([`crate::overlap`]).
impl Search<'_, '_> {
    /// The clock of state `parent`'s child by transition `t`.
    fn child_clock(&self, parent: &Entry, t: &Transition) -> Clock {
        if self.schedule.is_some() {
            parent.clock.advance(&t.times).delayed(t.cost)
        } else {
            Clock::plain(parent.g + t.cost)
        }
    }

    /// What a state with clock `from` pays at most to reach another's layouts with
    /// collectives of `switch` seconds ([`Search::switch_cost`]).
    fn switch_extra(&self, from: &Clock, switch: f64) -> (f64, f64) {
        if self.schedule.is_some() {
            from.switch_extra(switch)
        } else {
            (switch, 0.0)
        }
    }

    /// Whether a new state with clock `clock` may join the states that hold the same
    /// layouts at the same position (`key`): not when one of them dominates it.
    ///
    /// Without overlap the dominance is by cost, and only the cheapest is kept. With
    /// overlap, clocks that do not dominate each other are all kept while the position's
    /// front has room (the search stays exact); a full front would fill with clocks of one
    /// set of layouts and lose the other sets (the overlapped BERT-MoE of two layers on
    /// paper-8 ran data parallel at 1.6 s where tensor parallelism costs 1.2 s), so then
    /// only the best-ranked ([`Search::rank`]) is kept, and the search is bounded.
    fn admit_same_layouts(&self, run: &mut Run, key: &(u32, Box<[LayoutSet]>), clock: &Clock, left: f64) -> bool {
        let Some(kept) = run.exact.get_mut(key) else { return true };
        if self.schedule.is_none() {
            return !kept.iter().any(|(b, _)| b.cost() <= clock.cost());
        }
        kept.retain(|&(_, k)| !run.arena[k as usize].dead);
        if kept.iter().any(|(b, _)| b.dominates(clock, (0.0, 0.0))) {
            return false;
        }
        if kept.is_empty() || run.fronts[key.0 as usize].len() < self.front_width {
            return true;
        }
        run.bounded = true;
        if kept.iter().any(|(b, _)| self.rank(b, left) <= self.rank(clock, left)) {
            return false;
        }
        for (_, k) in kept.drain(..) {
            run.arena[k as usize].dead = true;
            let front = &mut run.fronts[key.0 as usize];
            if let Some(j) = front.iter().position(|&x| x == k) {
                front.remove(j);
            }
        }
        true
    }

    /// Where a state with clock `clock` ranks in its position's front (cheapest first),
    /// `compute_left` seconds of compute before the end: by cost, less (with overlap) the
    /// compute its uncovered collectives can still hide, as [`Clock::lower_bound`].
    fn rank(&self, clock: &Clock, compute_left: f64) -> f64 {
        if self.schedule.is_some() {
            clock.cost() - (clock.forward.slack + clock.backward.slack).min(compute_left)
        } else {
            clock.cost()
        }
    }

    /// A lower bound on the program's cost through a state with clock `clock`, when the
    /// rest of the program computes at least `compute_left` seconds, `batch_left` of
    /// them in steps each duplica runs.
    fn lower_bound(&self, clock: &Clock, compute_left: f64, batch_left: f64) -> f64 {
        if self.schedule.is_some() {
            clock.lower_bound(compute_left, batch_left)
        } else {
            clock.cost() + compute_left
        }
    }

}

impl Search<'_, '_> {
    /// The collectives that end the program with every updated buffer in `Identity`
    /// layout (the goal's: the cheapest from the layouts `held`).
    fn whole_buffers(&self, held: &[LayoutSet], memo: &mut CommMemo) -> Result<Vec<Comm>> {
        let p = self.problem;
        let mut comms: Vec<Comm> = Vec::new();
        for &t in &p.mutations {
            let current = held[t as usize];
            if current.contains(Layout::Identity) || comms.iter().any(|c| c.tensor == t) {
                continue;
            }
            let (from, collective, _) = self.cheapest_comm(t, current, Layout::Identity, memo).ok_or_else(|| {
                Error::Synthesis { message: format!("replay: no communication gives buffer update {} whole", p.tensor(t).meta.name) }
            })?;
            let tensor = p.tensor(t);
            let row = collective_row(p.profile, collective, tensor.bytes(), tensor.requires_grad);
            comms.push(Comm { tensor: t, from, to: Layout::Identity, collective, row });
        }
        Ok(comms)
    }
}

/// The (rule, choice) of every step from the root to state `last`.
fn path(arena: &[Entry], last: u32) -> Vec<(usize, u16)> {
    let mut choices = Vec::new();
    let mut cur = last;
    while arena[cur as usize].parent != u32::MAX {
        let e = &arena[cur as usize];
        choices.push((e.rule as usize, e.choice));
        cur = e.parent;
    }
    choices.reverse();
    choices
}

/// Non-negative floats order like their bit patterns.
fn key(f: f64) -> u64 {
    f.max(0.0).to_bits()
}
