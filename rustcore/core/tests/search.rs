//! Synthesis end to end in Rust (no Python): decode a shared fixture, build a profile
//! by hand, search under fixed ratios and turn the outcome into a program.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use hapd_core::plan::{self, ProgramOut};
use hapd_core::problem::{Mode, Options, Problem};
use hapd_core::profile::{CollectiveCost, Link, Profile};
use hapd_core::search::{Search, StopReason};
use hapd_core::{Error, Graph, Limits};

/// The bytes of `tests/fixtures/<name>.hapg`.
#[macro_use]
mod common;
use common::{profile, MODELS};

fn bytes_of(name: &str) -> &'static [u8] {
    MODELS.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no fixture {name}")).1
}

fn graph(name: &str) -> Graph {
    Graph::from_msgpack(bytes_of(name)).unwrap_or_else(|e| panic!("{name}.hapg does not load: {e}"))
}

fn even(n: usize) -> Vec<f64> {
    vec![1.0 / n as f64; n]
}

/// Search `graph` on `profile` under `ratios`; the program.
fn run(graph: &Graph, profile: &Profile, ratios: &[f64], options: Options) -> ProgramOut {
    hapd_core::search_program(graph, profile, ratios, options, Limits::default(), None).expect("search")
}

/// Σ over steps of max comp + max comm under `ratios` (the cost model).
fn cost(program: &ProgramOut, ratios: &[f64]) -> f64 {
    let max = |row: &plan::RowOut| {
        row.constant.iter().zip(&row.coef).zip(ratios).map(|((c, k), r)| c + k * r).fold(0.0, f64::max)
    };
    program.steps.iter().map(|s| max(&s.comp) + max(&s.comm)).sum()
}

fn comm_max(program: &ProgramOut, ratios: &[f64]) -> f64 {
    program
        .steps
        .iter()
        .map(|s| s.comm.constant.iter().zip(&s.comm.coef).zip(ratios).map(|((c, k), r)| c + k * r).fold(0.0, f64::max))
        .fold(0.0, f64::max)
}

/// Every op that leads to the loss has exactly one step, in order.
fn assert_complete(name: &str, graph: &Graph, profile: &Profile, program: &ProgramOut) {
    let problem = Problem::new(graph, profile, Options::default()).unwrap();
    let expected: Vec<&str> = problem.steps.iter().map(|s| graph.nodes[s.node].name.as_str()).collect();
    let got: Vec<&str> = program.steps.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(got, expected, "{name}: the program does not have one step per op");
    assert!(!program.loss.is_empty(), "{name}: no loss");
    assert!(program.cost.is_finite() && program.cost >= 0.0, "{name}: cost {}", program.cost);
}

fn sharded_heavy_step(program: &ProgramOut) -> bool {
    program.steps.iter().any(|s| s.op == "aten.linear" && s.rule != "replicated" && s.work == "sharded")
}

// --------------------------------------------------------------- (a) and (b): tables

/// (fixture, device FLOP/s, α, β, expect a sharded linear, expect zero communication)
#[allow(clippy::type_complexity)]
const CASES: &[(&str, &[f64], f64, f64, bool, bool)] = &[
    // near-free communication on 4 equal devices: the heavy linears shard
    ("mlp", &[1e12; 4], 0.0, 1e30, true, false),
    ("bert", &[1e12; 4], 0.0, 1e30, true, false),
    // one device: no collective costs anything, every rule is legal
    ("mlp", &[1e12], 1e-3, 1.0, false, true),
    ("bert", &[1e12], 1e-3, 1.0, false, true),
    ("vgg19", &[1e12], 1e-3, 1.0, false, true),
    ("gpt2_block", &[1e12], 1e-3, 1.0, false, true),
    ("llama_block", &[1e12], 1e-3, 1.0, false, true),
];

#[test]
fn table_of_profiles() {
    for &(name, flops, alpha, beta, sharded, no_comm) in CASES {
        let g = graph(name);
        let p = profile(flops, alpha, beta);
        let ratios = even(flops.len());
        let program = run(&g, &p, &ratios, Options::default());
        assert_complete(name, &g, &p, &program);
        assert_eq!(program.devices, flops.len());
        if sharded {
            assert!(
                sharded_heavy_step(&program),
                "{name} on {} devices with free communication shards no linear: {:?}",
                flops.len(),
                program.steps.iter().map(|s| (&s.op, &s.rule)).collect::<Vec<_>>()
            );
        }
        if no_comm {
            assert_eq!(comm_max(&program, &ratios), 0.0, "{name}: one device communicates");
            for s in &program.steps {
                assert!(s.comms.iter().all(|c| c.cost.constant.iter().chain(&c.cost.coef).all(|v| *v == 0.0)));
                assert!(s.sources.iter().all(|src| !src.grad_sync), "{name}: one device syncs gradients");
            }
        }
    }
}

/// With ruinously expensive communication on 4 devices, the program still completes and
/// costs no more than data parallelism.
#[test]
fn expensive_communication_is_no_worse_than_data_parallel() {
    for name in ["mlp", "bert"] {
        let g = graph(name);
        let p = profile(&[1e12; 4], 1.0, 1.0);
        let ratios = even(4);
        let auto = run(&g, &p, &ratios, Options::default());
        let dp = run(&g, &p, &ratios, Options { mode: Mode::DataParallel, ..Options::default() });
        assert_complete(name, &g, &p, &auto);
        assert!(cost(&auto, &ratios) <= cost(&dp, &ratios) * (1.0 + 1e-9));
    }
}

// --------------------------------------------------------------- (c) determinism

fn stable_bytes(program: &ProgramOut) -> Vec<u8> {
    let mut p = program.clone();
    p.stats.seconds = 0.0;
    rmp_serde::to_vec_named(&p).expect("serialize")
}

#[test]
fn search_is_deterministic() {
    for (name, flops) in [("mlp", &[2e12, 1e12][..]), ("bert", &[1e12; 4][..]), ("gpt2_block", &[3e12, 1e12, 1e12][..])] {
        let g = graph(name);
        let p = profile(flops, 3e-5, 1e9);
        let total: f64 = flops.iter().sum();
        let ratios: Vec<f64> = flops.iter().map(|f| f / total).collect();
        let a = run(&g, &p, &ratios, Options::default());
        let b = run(&g, &p, &ratios, Options::default());
        assert_eq!(stable_bytes(&a), stable_bytes(&b), "{name}: two runs differ");
    }
}

// --------------------------------------------------------------- (d) forced rules

#[test]
fn forcing_a_rule_is_obeyed() {
    let g = graph("mlp");
    let p = profile(&[1e12; 4], 3e-5, 1e9);
    let first_linear = {
        let problem = Problem::new(&g, &p, Options::default()).unwrap();
        problem
            .steps
            .iter()
            .map(|s| &g.nodes[s.node])
            .find(|n| n.op == "aten.linear")
            .expect("mlp has a linear")
            .name
            .clone()
    };
    for rule in ["column-parallel", "row-parallel", "replicated"] {
        let options = Options { force: BTreeMap::from([(first_linear.clone(), rule.to_string())]), ..Options::default() };
        let program = run(&g, &p, &even(4), options);
        let step = program.steps.iter().find(|s| s.node == first_linear).unwrap();
        assert_eq!(step.rule, rule, "forced {first_linear} to {rule}");
    }
    let bad = Options { force: BTreeMap::from([(first_linear.clone(), "no-such-rule".to_string())]), ..Options::default() };
    match Problem::new(&g, &p, bad) {
        Err(Error::InvalidOption { field, .. }) => assert_eq!(field, format!("force.{first_linear}")),
        other => panic!("unknown rule: expected InvalidOption, got {:?}", other.map(|_| ())),
    }
    let missing = Options { force: BTreeMap::from([("no_such_node".to_string(), "replicated".to_string())]), ..Options::default() };
    assert!(matches!(Problem::new(&g, &p, missing), Err(Error::InvalidOption { .. })));
}

// --------------------------------------------------------------- (e) opaque ops

#[test]
fn opaque_ops_still_yield_a_complete_program() {
    let g = graph("gpt2_block");
    assert!(g.nodes.iter().any(|n| n.op == "aten.arange"));
    let p = profile(&[1e12; 4], 3e-5, 1e9);
    let program = run(&g, &p, &even(4), Options::default());
    assert_complete("gpt2_block", &g, &p, &program);
}

// --------------------------------------------------------------- (f) stop reasons

#[test]
fn state_limit_returns_a_complete_program() {
    for name in ["mlp", "bert"] {
        let g = graph(name);
        let p = profile(&[1e12; 4], 3e-5, 1e9);
        let problem = Problem::new(&g, &p, Options::default()).unwrap();
        let outcome = Search::new(&problem, &even(4)).unwrap().with_state_limit(5).run().unwrap();
        assert_eq!(outcome.stop, StopReason::StateLimit, "{name}");
        let program = plan::program(&problem, &outcome);
        assert_eq!(program.stats.stop_reason, "state_limit");
        assert_complete(name, &g, &p, &program);
    }
}

#[test]
fn cancel_and_time_limit_return_a_complete_program() {
    let g = graph("bert");
    let p = profile(&[1e12; 4], 3e-5, 1e9);
    let problem = Problem::new(&g, &p, Options::default()).unwrap();
    let cancelled = AtomicBool::new(true);
    let search = || Search::new(&problem, &even(4)).unwrap();
    let cases = [
        (search().with_cancel(&cancelled), StopReason::Cancelled),
        (search().with_time_limit(Duration::ZERO), StopReason::TimeLimit),
    ];
    for (search, stop) in cases {
        let outcome = search.run().unwrap();
        assert_eq!(outcome.stop, stop);
        assert_eq!(outcome.expanded, 1024, "limits are polled every 1024 expansions");
        let program = plan::program(&problem, &outcome);
        assert_eq!(program.stats.stop_reason, stop.name());
        assert_complete("bert", &g, &p, &program);
    }
}

#[test]
fn bad_ratios_are_rejected() {
    let g = graph("mlp");
    let p = profile(&[1e12; 2], 3e-5, 1e9);
    let problem = Problem::new(&g, &p, Options::default()).unwrap();
    for ratios in [&[1.0][..], &[0.5, f64::NAN][..], &[1.5, -0.5][..]] {
        assert!(matches!(Search::new(&problem, ratios), Err(Error::InvalidOption { .. })), "{ratios:?}");
    }
}

// --------------------------------------------------------------- (g) vs data parallel

#[test]
fn search_is_no_worse_than_data_parallel() {
    let profiles = [
        profile(&[1e12; 4], 3e-5, 1e9),
        profile(&[4e12, 2e12, 1e12, 1e12], 3e-5, 5e8),
        profile(&[1e12; 4], 0.0, 1e30),
    ];
    for (name, _) in MODELS {
        let g = graph(name);
        for p in &profiles {
            let total: f64 = p.devices.iter().map(|d| d.flops).sum();
            let ratios: Vec<f64> = p.devices.iter().map(|d| d.flops / total).collect();
            let auto = run(&g, p, &ratios, Options::default());
            let dp = run(&g, p, &ratios, Options { mode: Mode::DataParallel, ..Options::default() });
            assert_complete(name, &g, p, &auto);
            let (a, d) = (cost(&auto, &ratios), cost(&dp, &ratios));
            assert!((auto.cost - a).abs() <= 1e-9 * a.max(1e-30), "{name}: reported cost {} vs rows {a}", auto.cost);
            assert!(a <= d * (1.0 + 1e-9), "{name}: search {a} > data parallel {d}");
        }
    }
}

// --------------------------------------------------------------- (e) gradient buckets

/// Replicated parameters' gradients are all-reduced in buckets (as the runtime sends
/// them): a data-parallel program is charged their bytes over β plus α per *bucket* of
/// bytes, not one α per parameter.
#[test]
fn gradient_sync_is_charged_per_bucket_not_per_parameter() {
    use hapd_core::comm::GRAD_BUCKET_BYTES;
    let g = graph("bert");
    let (alpha, beta) = (5e-3, 2e7);
    let p = profile(&[1e12; 4], alpha, beta);
    let ratios = even(4);
    let dp = run(&g, &p, &ratios, Options { mode: Mode::DataParallel, ..Options::default() });
    let synced: Vec<_> = dp.steps.iter().flat_map(|s| &s.sources).filter(|s| s.grad_sync).collect();
    assert!(synced.len() > 10, "data-parallel bert syncs {} parameters", synced.len());
    let bytes: f64 = synced.iter().map(|s| s.bytes).sum();
    let charged: f64 = synced.iter().map(|s| s.cost.constant[0]).sum();
    let expected = alpha * bytes / GRAD_BUCKET_BYTES + bytes / beta;
    assert!((charged - expected).abs() <= 1e-9 * expected, "charged {charged} s, expected {expected} s");
    // one α per parameter would have been more than the whole charge
    assert!(charged < synced.len() as f64 * alpha);
    for s in &synced {
        assert!(s.cost.constant.iter().all(|c| *c == s.cost.constant[0]), "every rank pays the same");
        assert!(s.cost.coef.iter().all(|k| *k == 0.0), "a replica's sync does not scale with its ratio");
    }
}

/// A profile's `grad_sync` link (the runtime's two-level all-reduce across hosts) prices
/// the gradient buckets instead of `all_reduce`.
#[test]
fn gradient_sync_uses_the_grad_sync_link_when_given() {
    use hapd_core::comm::{grad_sync_row, GRAD_BUCKET_BYTES};
    let mut p = profile(&[1e12; 4], 5e-3, 2e7);
    let bytes = 4.0 * (1u64 << 20) as f64;
    let flat = grad_sync_row(&p, bytes).constant[0];
    assert!((flat - (5e-3 * bytes / GRAD_BUCKET_BYTES + bytes / 2e7)).abs() < 1e-12);
    p.collectives.grad_sync = Some(CollectiveCost { inter: Link { alpha: 1e-3, beta: 3e7 }, intra: None });
    let two_level = grad_sync_row(&p, bytes).constant[0];
    assert!((two_level - (1e-3 * bytes / GRAD_BUCKET_BYTES + bytes / 3e7)).abs() < 1e-12);
    assert!(two_level < flat);
}
