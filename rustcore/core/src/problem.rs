//! The search problem built from a graph and a profile: the ops that lead to the loss
//! or to a buffer update in program order, the tensors live between them, every op's rules with their
//! compute rows, and the options that restrict the search.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::comm::Collective;
use crate::cost::{compute_row, Row, WorkClass};
use crate::error::{Error, Result};
use crate::ir::{Graph, NodeKind, TensorMeta, TensorRef};
use crate::layout::Layout;
use crate::profile::Profile;
use crate::rules::{fused_attention_flops, idles_devices, internal_comm_row, rules_for, Rule};

/// Dense id of a tensor that matters to the program.
pub type TensorId = u32;

/// Which programs the search may return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Any program the rules allow.
    #[default]
    Auto,
    /// The data-parallel baseline: inputs split on their batch dim, parameters and
    /// buffers replicated, no all-to-all or reduce-scatter.
    DataParallel,
}

/// Options of one synthesis.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options {
    pub mode: Mode,
    /// Restrict an op (by fx node name) to one rule (by rule name).
    pub force: BTreeMap<String, String>,
    /// Allow ZeRO-style parameters (stored split on one dim, all-gathered on use: see
    /// `zero_dim`).
    pub zero: bool,
    /// Price programs as two duplicas interleaved so that one computes while the other
    /// communicates ([`crate::overlap`]); the graph is one duplica's.
    pub overlap: bool,
    /// Blocks (the graph's `block` labels) whose activations the backward pass
    /// recomputes instead of keeping: each run of consecutive steps of one of them is a
    /// span that keeps only its inputs, and its forward (compute and collectives) runs
    /// again in the backward pass.
    pub recompute: BTreeSet<String>,
}

/// A tensor of the program.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub r: TensorRef,
    pub meta: TensorMeta,
    pub kind: NodeKind,
    /// Fully qualified name for parameters/buffers, input name for inputs.
    pub target: String,
    /// Whether a gradient flows through it (parameters that train, and what they touch).
    pub requires_grad: bool,
    pub batch_dim: Option<usize>,
    /// Step that produces it; for sources, the step of its first use.
    pub first: usize,
    /// Last step that reads it (`steps.len()` for the loss).
    pub last: usize,
}

impl Tensor {
    pub fn is_source(&self) -> bool {
        self.kind.is_source()
    }
    pub fn bytes(&self) -> f64 {
        self.meta.bytes() as f64
    }
}

/// One op of the program with its candidate rules.
#[derive(Debug, Clone)]
pub struct Step {
    pub node: usize,
    /// Tensor of each input slot.
    pub inputs: Vec<TensorId>,
    /// Tensor of each output (`None` for results nobody reads or that are not tensors).
    pub outputs: Vec<Option<TensorId>>,
    pub rules: Vec<Rule>,
    /// Compute row of each rule (with the forward again for a recomputed step).
    pub comp: Vec<Row>,
    pub flops: f64,
    /// The recomputed span the step is in (numbered in program order), if any.
    pub span: Option<usize>,
}

/// Everything the search needs, independent of the sharding ratios.
#[derive(Debug, Clone)]
pub struct Problem<'a> {
    pub graph: &'a Graph,
    pub profile: &'a Profile,
    pub options: Options,
    pub tensors: Vec<Tensor>,
    pub steps: Vec<Step>,
    /// Tensors live before step `i` (sorted); `live[steps.len()]` holds the loss and
    /// the new values of updated buffers.
    pub live: Vec<Vec<TensorId>>,
    pub loss: TensorId,
    /// The new value of each buffer update (`graph.mutations`, same order): effects the
    /// program must end with in `Identity` layout.
    pub mutations: Vec<TensorId>,
    /// Per tensor, whether the backward pass keeps it as recomputation decides
    /// (`recompute_keeps`, below); `None` where recomputation changes nothing.
    pub recompute_keep: Vec<Option<bool>>,
    /// How many recomputed spans the program has.
    pub spans: usize,
}

impl<'a> Problem<'a> {
    /// Bytes node `node`'s backward keeps that are no node's result: its `saved_bytes`
    /// plus its `counter_saved_bytes`, what the math attention keeps where hapd's
    /// counter-based generator draws its dropout (every plan's default, one device's too)
    /// — unless every device runs hapd's fused attention kernel
    /// ([`Profile::fused_attention`]), which keeps nothing of size queries × keys.
    pub fn saved_inside(&self, node: usize) -> f64 {
        let n = &self.graph.nodes[node];
        let counter = if self.profile.fused_attention() { 0.0 } else { n.counter_saved_bytes };
        n.saved_bytes + counter
    }

    pub fn new(graph: &'a Graph, profile: &'a Profile, options: Options) -> Result<Problem<'a>> {
        let needed = ancestors_of_effects(graph);
        let op_nodes: Vec<usize> =
            (0..graph.nodes.len()).filter(|&i| needed[i] && graph.nodes[i].kind == NodeKind::Op).collect();
        let span_of = crate::recompute::spans(graph, &op_nodes, &options.recompute)?;
        // tensors in order of first appearance
        let mut builder = Builder { graph, profile, options: &options, ids: HashMap::new(), tensors: Vec::new() };
        let mut steps = Vec::with_capacity(op_nodes.len());
        for (s, &n) in op_nodes.iter().enumerate() {
            steps.push(builder.step(s, n, span_of[s])?);
        }
        let (loss, mutations) = builder.effects(steps.len())?;
        let tensors = builder.tensors;
        check_forced(graph, &op_nodes, &options)?;
        let live = live_tensors(&tensors, steps.len());
        let recompute_keep = recompute_keeps(&tensors, &steps);
        let spans = span_of.iter().flatten().max().map_or(0, |s| s + 1);
        Ok(Problem { graph, profile, options, tensors, steps, live, loss, mutations, recompute_keep, spans })
    }

    pub fn tensor(&self, t: TensorId) -> &Tensor {
        &self.tensors[t as usize]
    }

    /// Layouts a source can be created in for a consumer that needs `need`, with the
    /// communication that follows (ZeRO: stored split on one dim, all-gathered).
    pub fn source_options(&self, t: TensorId, need: Layout) -> Vec<(Layout, Option<Layout>)> {
        let tensor = self.tensor(t);
        let forced = match (self.options.mode, tensor.kind) {
            (Mode::DataParallel, NodeKind::Input) => Some(tensor.batch_dim.map_or(Layout::Identity, |d| {
                crate::rules::gather(d).unwrap_or(Layout::Identity)
            })),
            (Mode::DataParallel, _) => Some(Layout::Identity),
            _ => None,
        };
        if let Some(layout) = forced {
            return vec![(layout, (layout != need).then_some(need))];
        }
        let mut options = Vec::with_capacity(2);
        match need {
            Layout::Reduce => options.push((Layout::Identity, Some(Layout::Reduce))),
            _ => options.push((need, None)),
        }
        let zero_ok = self.options.zero && need == Layout::Identity && tensor.requires_grad;
        if let Some(g) = zero_ok.then(|| zero_dim(&tensor.meta.shape, self.profile.world())).flatten() {
            options.push((g, Some(Layout::Identity)));
        }
        options
    }

    /// Whether the mode allows a collective.
    pub fn allows(&self, collective: Collective) -> bool {
        match self.options.mode {
            Mode::Auto => true,
            Mode::DataParallel => !matches!(
                collective,
                Collective::AllToAll | Collective::ReduceScatter | Collective::ReduceScatterGrouped
            ),
        }
    }
}

/// The dim a ZeRO-style parameter of `shape` is stored split on among `world` devices:
/// dim 0 when it has a slice for every device, else the first dim that does (stacked
/// expert weights `[E, 2I, H]` with fewer experts than devices split on `2I`), else
/// dim 0 when it splits at all; `None` for a parameter no dim of which splits.
fn zero_dim(shape: &[usize], world: usize) -> Option<Layout> {
    let d = shape.iter().position(|&s| s >= world).or_else(|| shape.iter().position(|&s| s > 1))?;
    crate::rules::gather(d)
}

/// The tensors and steps of a problem while [`Problem::new`] builds them.
/// What an op's compute costs: its FLOPs at its class's rate and those at the
/// element-wise rate ([`crate::rules::OpRules`]).
#[derive(Debug, Clone, Copy)]
struct OpWork {
    flops: f64,
    class: WorkClass,
    elementwise_flops: f64,
}

impl OpWork {
    /// The compute row under `rule` (forward and backward when `with_grad`).
    fn row(&self, profile: &Profile, rule: &Rule, with_grad: bool) -> Row {
        let mut row = compute_row(profile, self.flops, self.class, rule.work, with_grad);
        if self.elementwise_flops > 0.0 {
            row.add(&compute_row(profile, self.elementwise_flops, WorkClass::Elementwise, rule.work, with_grad));
        }
        row
    }
}

struct Builder<'g> {
    graph: &'g Graph,
    profile: &'g Profile,
    options: &'g Options,
    ids: HashMap<TensorRef, TensorId>,
    tensors: Vec<Tensor>,
}

impl Builder<'_> {
    /// The step of op node `n`, the `s`-th in program order, in recomputed span `span`
    /// (if any): its operands and results registered as tensors, its rules (only the
    /// forced one, if the options force one) and their compute rows.
    fn step(&mut self, s: usize, n: usize, span: Option<usize>) -> Result<Step> {
        let graph = self.graph;
        let node = &graph.nodes[n];
        let inputs: Vec<TensorId> = node.inputs.iter().map(|r| self.input(*r, s)).collect();
        let grad_in = inputs.iter().any(|&t| self.tensors[t as usize].requires_grad);
        let outputs = self.outputs(n, s, grad_in);
        let mut op = rules_for(graph, node);
        if self.profile.fused_attention() {
            // an attention with dropout runs as hapd's fused kernel on every device
            op.elementwise_flops = fused_attention_flops(graph, node).unwrap_or(op.elementwise_flops);
        }
        let mut rules = op.rules;
        if let Some(forced) = self.options.force.get(&node.name) {
            rules.retain(|r| r.name == forced);
            if rules.is_empty() {
                return Err(Error::InvalidOption {
                    field: format!("force.{}", node.name),
                    message: format!("{} has no rule named {forced:?}", node.op),
                });
            }
        } else {
            let world = self.profile.world();
            rules.retain(|r| !idles_devices(graph, node, r, world));
        }
        let work = OpWork { flops: op.flops, class: op.class, elementwise_flops: op.elementwise_flops };
        let comp = rules.iter().map(|r| self.comp_row(n, work, r, grad_in, span)).collect();
        Ok(Step { node: n, inputs, outputs, rules, comp, flops: work.flops + work.elementwise_flops, span })
    }

    /// The tensor operand `r` of step `s` is: a new one at its first use.
    fn input(&mut self, r: TensorRef, s: usize) -> TensorId {
        let graph = self.graph;
        let tensors = &mut self.tensors;
        let id = *self.ids.entry(r).or_insert_with(|| {
            let producer = &graph.nodes[r.node()];
            tensors.push(Tensor {
                r,
                meta: graph.meta(r).clone(),
                kind: producer.kind,
                target: producer.target.clone(),
                requires_grad: producer.kind == NodeKind::Parameter
                    && producer.requires_grad
                    && graph.meta(r).dtype.is_float(),
                batch_dim: producer.batch_dim,
                first: s,
                last: s,
            });
            (tensors.len() - 1) as TensorId
        });
        self.tensors[id as usize].last = s;
        id
    }

    /// The results of op node `n` (step `s`) as new tensors, `None` for those that are
    /// not tensors; they carry a gradient when an operand does (`grad_in`).
    fn outputs(&mut self, n: usize, s: usize, grad_in: bool) -> Vec<Option<TensorId>> {
        let node = &self.graph.nodes[n];
        let mut outputs = Vec::with_capacity(node.outputs.len());
        for (k, meta) in node.outputs.iter().enumerate() {
            let r = TensorRef(n as u32, k as u32);
            if meta.dtype == crate::ir::DType::NotATensor {
                outputs.push(None);
                continue;
            }
            self.tensors.push(Tensor {
                r,
                meta: meta.clone(),
                kind: NodeKind::Op,
                target: String::new(),
                requires_grad: grad_in && meta.dtype.is_float(),
                batch_dim: None,
                first: s,
                last: s,
            });
            let id = (self.tensors.len() - 1) as TensorId;
            self.ids.insert(r, id);
            outputs.push(Some(id));
        }
        outputs
    }

    /// The compute row of op node `n` under `rule`: a rule's own collectives
    /// (synchronized statistics) count with its compute; a recomputed step runs its
    /// forward once more.
    fn comp_row(&self, n: usize, work: OpWork, rule: &Rule, grad_in: bool, span: Option<usize>) -> Row {
        let (graph, profile, node) = (self.graph, self.profile, &self.graph.nodes[n]);
        let mut row = work.row(profile, rule, grad_in);
        if let Some(inside) = internal_comm_row(graph, node, rule, profile, grad_in) {
            row.add(&inside);
        }
        if span.is_some() {
            row.add(&work.row(profile, rule, false));
            if let Some(inside) = internal_comm_row(graph, node, rule, profile, false) {
                row.add(&inside);
            }
        }
        row
    }

    /// The loss and the new value of each buffer update, each live to the end of the
    /// program's `n_steps` steps; an error when an op of the program computes none.
    fn effects(&mut self, n_steps: usize) -> Result<(TensorId, Vec<TensorId>)> {
        let graph = self.graph;
        let loss = *self.ids.get(&graph.loss).ok_or_else(|| Error::InvalidGraph {
            field: "loss".into(),
            message: "the loss is not computed by any op".into(),
        })?;
        self.tensors[loss as usize].last = n_steps;
        let mut mutations = Vec::with_capacity(graph.mutations.len());
        for m in &graph.mutations {
            let id = *self.ids.get(&m.value).ok_or_else(|| Error::InvalidGraph {
                field: "mutations".into(),
                message: format!("the new value of buffer {} is not computed by any op", m.target),
            })?;
            self.tensors[id as usize].last = n_steps;
            mutations.push(id);
        }
        Ok((loss, mutations))
    }
}

/// Forced rules name nodes that must exist: ops of the program (`op_nodes`).
fn check_forced(graph: &Graph, op_nodes: &[usize], options: &Options) -> Result<()> {
    for name in options.force.keys() {
        if !op_nodes.iter().any(|&n| &graph.nodes[n].name == name) {
            return Err(Error::InvalidOption {
                field: format!("force.{name}"),
                message: "no op of that name leads to the loss or a buffer update".into(),
            });
        }
    }
    Ok(())
}

/// The tensors live before each of `n_steps` steps (and after the last), sorted: from
/// after the step that creates one (a source: its first use) up to its last use.
fn live_tensors(tensors: &[Tensor], n_steps: usize) -> Vec<Vec<TensorId>> {
    let mut live = vec![Vec::new(); n_steps + 1];
    for (id, t) in tensors.iter().enumerate() {
        for slot in live.iter_mut().take(t.last + 1).skip(t.first + 1) {
            slot.push(id as TensorId);
        }
    }
    live
}

/// Nodes the step's effects depend on: the loss and every buffer update (an update
/// nobody reads is an effect all the same; dropping it would change the model).
fn ancestors_of_effects(graph: &Graph) -> Vec<bool> {
    let mut needed = vec![false; graph.nodes.len()];
    needed[graph.loss.node()] = true;
    for m in &graph.mutations {
        needed[m.value.node()] = true;
    }
    for i in (0..graph.nodes.len()).rev() {
        if needed[i] {
            for r in &graph.nodes[i].inputs {
                needed[r.node()] = true;
            }
        }
    }
    needed
}

/// Per tensor, whether the backward pass keeps it once the recomputed spans
/// ([`crate::recompute::spans`]) keep only their inputs (`None` where recomputation
/// changes nothing):
/// - a result of a recomputed step is kept when a step outside its span reads it (a
///   span's output: the next span's input, or read by an op that may keep it) or
///   the program ends with it (the loss, a buffer's new value), and dropped otherwise;
/// - another op result that a recomputed span reads is kept (a span keeps its
///   inputs, to run its forward again);
/// - a parameter, buffer or constant read only by recomputed steps is not kept in a
///   layout gathered for them (the gathering collective runs again);
/// - everything else is as the graph's traced `saved` flags say.
fn recompute_keeps(tensors: &[Tensor], steps: &[Step]) -> Vec<Option<bool>> {
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

#[cfg(test)]
mod tests {
    use super::{Options, Problem};
    use crate::ir::{DType, Graph};
    use crate::profile::{CollectiveCost, Collectives, Device, Link, Profile};
    use crate::rules::testkit::{boolean, float, graph, none, A::T};

    const QKV: &[usize] = &[2, 4, 16, 8];

    #[test]
    fn zero_splits_a_dim_that_has_a_slice_for_every_device() {
        use super::zero_dim;
        use crate::layout::Layout::Gather;
        let cases: &[(&[usize], usize, Option<crate::layout::Layout>)] = &[
            (&[1024, 64], 64, Some(Gather(0))),
            (&[8, 28672, 4096], 64, Some(Gather(1))), // Mixtral-8x7B's experts on 64 devices
            (&[8, 28672, 4096], 8, Some(Gather(0))),
            (&[4, 3], 64, Some(Gather(0))),           // no dim has 64 slices: dim 0 still splits
            (&[1, 512, 64], 4, Some(Gather(1))),
            (&[1], 4, None),
        ];
        for (shape, world, want) in cases {
            assert_eq!(zero_dim(shape, *world), *want, "{shape:?} on {world}");
        }
    }

    /// An attention with dropout whose math path keeps 1 KiB beyond the fused kernel.
    fn attention() -> Graph {
        let args = vec![
            ("query", T(QKV)),
            ("key", T(QKV)),
            ("value", T(QKV)),
            ("attn_mask", none()),
            ("dropout_p", float(0.1)),
            ("is_causal", boolean(false)),
        ];
        let mut g = graph("aten.scaled_dot_product_attention", args, &[(QKV, DType::F32)]);
        g.nodes.last_mut().unwrap().counter_saved_bytes = 1024.0;
        g
    }

    /// Two devices on one host, each running the fused attention kernel or not.
    fn profile(fused: [bool; 2]) -> Profile {
        let cost = CollectiveCost { inter: Link { alpha: 1e-5, beta: 1e9 }, intra: None };
        let device = |rank: u32| Device {
            rank,
            host: "h0".into(),
            model: "test".into(),
            flops: 1e12,
            elementwise_flops: None,
            memory: 1e10,
            fused_attention: fused[rank as usize],
        };
        Profile {
            name: "test".into(),
            devices: vec![device(0), device(1)],
            collectives: Collectives {
                all_gather: cost,
                all_gather_grouped: cost,
                reduce_scatter: cost,
                reduce_scatter_grouped: cost,
                all_reduce: cost,
                all_to_all: cost,
                broadcast: cost,
                grad_sync: None,
                p2p: None,
            },
        }
    }

    #[test]
    fn the_fused_kernel_keeps_no_probabilities_and_draws_twice() {
        let g = attention();
        let node = g.nodes.len() - 1;
        let scores = 2.0 * 4.0 * 16.0 * 16.0;
        let priced = |fused| {
            let p = profile(fused);
            let problem = Problem::new(&g, &p, Options::default()).unwrap();
            (problem.saved_inside(node), problem.steps[0].flops)
        };
        let (math_bytes, math_flops) = priced([false, false]);
        let (fused_bytes, fused_flops) = priced([true, true]);
        assert_eq!((math_bytes, fused_bytes), (1024.0, 0.0));
        // the math attention's draw and passes (24 FLOPs a score) against the fused
        // kernel's two draws (12 as forward FLOPs)
        assert_eq!(math_flops - fused_flops, 12.0 * scores);
        // one device on the math path: the cluster is priced as the math attention
        assert_eq!(priced([true, false]), (math_bytes, math_flops));
    }

    #[test]
    fn dropout_passes_run_at_the_elementwise_rate() {
        let g = attention();
        let scores = 2.0 * 4.0 * 16.0 * 16.0;
        let seconds = |elementwise: Option<f64>| {
            let mut p = profile([false, false]);
            for d in &mut p.devices {
                d.elementwise_flops = elementwise;
            }
            let problem = Problem::new(&g, &p, Options::default()).unwrap();
            problem.steps[0].comp[0].constant[0] // replicated: the whole op on device 0
        };
        // an element-wise rate 10× slower than the matmul rate: the dropout's FLOPs (the
        // forward alone: nothing here carries a gradient) cost 10× as much, the rest the same
        let extra = seconds(Some(1e11)) - seconds(None);
        let dropout = 24.0 * scores; // the math attention's draw and passes, 24 FLOPs a score
        assert!((extra - dropout * (1.0 / 1e11 - 1.0 / 1e12)).abs() < 1e-15, "{extra}");
    }
}
