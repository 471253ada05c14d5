//! Activation recomputation in the core: recomputed blocks keep less memory and cost
//! their forward (compute and collectives) again.

use std::collections::{BTreeMap, BTreeSet};

use hapd_core::plan::{ProgramOut, RowOut};
use hapd_core::problem::{Mode, Options, Problem};
use hapd_core::{Error, Graph, Limits};

#[macro_use]
mod common;
use common::{profile, MODELS};

fn graph(name: &str) -> Graph {
    let bytes = MODELS.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no fixture {name}")).1;
    Graph::from_msgpack(bytes).unwrap_or_else(|e| panic!("{name}.hapg does not load: {e}"))
}

fn blocks(g: &Graph) -> BTreeSet<String> {
    g.nodes.iter().filter_map(|n| n.block.clone()).collect()
}

const EVEN: [f64; 2] = [0.5, 0.5];

fn run(g: &Graph, options: Options) -> ProgramOut {
    let p = profile(&[1e12, 1e12], 3e-5, 1e9);
    hapd_core::search_program(g, &p, &EVEN, options, Limits::default(), None).expect("search")
}

fn at(row: &RowOut) -> f64 {
    row.constant.iter().zip(&row.coef).zip(EVEN).map(|((c, k), r)| c + k * r).fold(0.0, f64::max)
}

#[test]
fn recomputed_blocks_keep_less_and_compute_their_forward_again() {
    let g = graph("llama_block");
    let all = blocks(&g);
    assert_eq!(all, BTreeSet::from(["blocks.0".to_string(), "blocks.1".to_string()]));
    let dp = Options { mode: Mode::DataParallel, ..Options::default() };
    let kept = run(&g, dp.clone());
    let rebuilt = run(&g, Options { recompute: all.clone(), ..dp });
    assert_eq!(rebuilt.recompute, all.iter().cloned().collect::<Vec<_>>());
    let block_of: BTreeMap<&str, Option<&str>> = g.nodes.iter().map(|n| (n.name.as_str(), n.block.as_deref())).collect();
    for (k, r) in kept.steps.iter().zip(&rebuilt.steps) {
        assert_eq!(k.node, r.node);
        assert_eq!(k.recompute_span, None);
        let expected = match block_of[r.node.as_str()] {
            Some("blocks.0") => Some(0),
            Some("blocks.1") => Some(1),
            _ => None,
        };
        assert_eq!(r.recompute_span, expected, "{}", r.node);
        if r.recompute_span.is_some() && at(&k.comp) > 0.0 {
            // forward + backward (3 forwards) and one forward more
            assert!((at(&r.comp) / at(&k.comp) - 4.0 / 3.0).abs() < 1e-9, "{}", r.node);
        } else if r.recompute_span.is_none() {
            assert_eq!(at(&r.comp), at(&k.comp), "{}", r.node);
        }
    }
    let activations = |p: &ProgramOut| at(&p.memory_parts["activations"]);
    assert!(activations(&rebuilt) < 0.8 * activations(&kept), "{} vs {}", activations(&rebuilt), activations(&kept));
    assert!(at(&rebuilt.memory) < at(&kept.memory));
}

#[test]
fn a_recomputed_step_runs_its_collectives_again() {
    let g = graph("mlp");
    // the first linear's result split on features, all-gathered for the second (body.3)
    let force = BTreeMap::from([
        ("linear".to_string(), "column-parallel".to_string()),
        ("linear_1".to_string(), "replicated".to_string()),
    ]);
    let kept = run(&g, Options { force: force.clone(), ..Options::default() });
    let rebuilt = run(&g, Options { force, recompute: BTreeSet::from(["body.3".to_string()]), ..Options::default() });
    let step = |p: &ProgramOut| p.steps.iter().find(|s| s.node == "linear_1").cloned().expect("linear_1");
    let (k, r) = (step(&kept), step(&rebuilt));
    assert!(!k.comms.is_empty() && at(&k.comm) > 0.0, "linear_1 receives its input by a collective");
    assert_eq!(r.recompute_span, Some(0));
    assert!(at(&r.comm) > at(&k.comm), "{} vs {}", at(&r.comm), at(&k.comm));
}

#[test]
fn recomputing_an_unknown_block_is_an_invalid_option() {
    let g = graph("mlp");
    let p = profile(&[1e12, 1e12], 3e-5, 1e9);
    let options = Options { recompute: BTreeSet::from(["layers.9".to_string()]), ..Options::default() };
    match Problem::new(&g, &p, options) {
        Err(Error::InvalidOption { field, .. }) => assert_eq!(field, "recompute.layers.9"),
        other => panic!("expected InvalidOption, got {:?}", other.map(|_| ())),
    }
}
