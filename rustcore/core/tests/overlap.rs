//! The overlap-aware search end to end in Rust: on every fixture, the program's cost is
//! the two-duplica clock of its own overlap rows, it is no dearer than the plain
//! search's program run as duplicas, and without collectives it costs both duplicas'
//! compute back to back.

use std::collections::BTreeMap;

use hapd_core::overlap::{Clock, PassTimes, StepTimes};
use hapd_core::plan::{ProgramOut, RowOut};
use hapd_core::problem::Options;
use hapd_core::{Graph, Limits};

#[macro_use]
mod common;
use common::{profile, MODELS};

fn graph(name: &str) -> Graph {
    let bytes = MODELS.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no fixture {name}")).1;
    Graph::from_msgpack(bytes).unwrap_or_else(|e| panic!("{name}.hapg does not load: {e}"))
}

fn max(row: &RowOut, ratios: &[f64]) -> f64 {
    row.constant.iter().zip(&row.coef).zip(ratios).map(|((c, k), r)| c + k * r).fold(0.0, f64::max)
}

/// The clock of a program's overlap rows under `ratios`, from the wire form.
fn clock_of(program: &ProgramOut, ratios: &[f64]) -> f64 {
    let mut clock = Clock::default();
    for step in &program.steps {
        let rows = step.overlap.as_ref().expect("an overlapped program's steps carry overlap rows");
        let pass = |comp: &RowOut, comms: &[RowOut]| {
            let mut pass = PassTimes::chain(&comms.iter().map(|c| max(c, ratios)).collect::<Vec<_>>());
            pass.compute = max(comp, ratios);
            pass
        };
        clock = clock.advance(&StepTimes {
            batch: rows.batch,
            forward: pass(&rows.comp_forward, &rows.comm_forward),
            backward: pass(&rows.comp_backward, &rows.comm_backward),
            serial: max(&rows.serial, ratios),
        });
    }
    clock.cost()
}

fn run(graph: &Graph, ratios: &[f64], options: Options, alpha: f64) -> ProgramOut {
    let p = profile(&vec![1e12; ratios.len()], alpha, 1e9);
    hapd_core::search_program(graph, &p, ratios, options, Limits::default(), None).expect("search")
}

fn overlap() -> Options {
    Options { overlap: true, ..Options::default() }
}

#[test]
fn the_cost_is_the_clock_of_the_programs_rows() {
    let ratios = [0.25; 4];
    for (name, _) in MODELS {
        let program = run(&graph(name), &ratios, overlap(), 1e-5);
        assert_eq!(program.duplicas, 2, "{name}");
        let clock = clock_of(&program, &ratios);
        assert!((clock - program.cost).abs() <= 1e-12 * clock.max(1.0), "{name}: clock {clock} vs cost {}", program.cost);
    }
}

#[test]
fn no_dearer_than_the_plain_program_as_duplicas() {
    let ratios = [0.25; 4];
    for (name, _) in MODELS {
        let g = graph(name);
        let plain = run(&g, &ratios, Options::default(), 1e-5);
        assert_eq!(plain.duplicas, 1);
        assert!(plain.steps.iter().all(|s| s.overlap.is_none()), "{name}");
        let force: BTreeMap<String, String> = plain.steps.iter().map(|s| (s.node.clone(), s.rule.clone())).collect();
        let as_duplicas = run(&g, &ratios, Options { force, ..overlap() }, 1e-5);
        let searched = run(&g, &ratios, overlap(), 1e-5);
        assert!(
            searched.cost <= as_duplicas.cost * (1.0 + 1e-9),
            "{name}: overlap search {} > plain program as duplicas {}",
            searched.cost,
            as_duplicas.cost
        );
    }
}

#[test]
fn one_device_costs_both_duplicas_back_to_back() {
    // one device: no collective costs anything, so nothing overlaps: every step of a
    // batch-dependent op runs twice, the others once
    for (name, _) in MODELS {
        let g = graph(name);
        let plain = run(&g, &[1.0], Options::default(), 1e-3);
        let both = run(&g, &[1.0], overlap(), 1e-3);
        let twice: f64 = both
            .steps
            .iter()
            .map(|s| {
                let rows = s.overlap.as_ref().expect("overlap rows");
                let comp = max(&rows.comp_forward, &[1.0]) + max(&rows.comp_backward, &[1.0]);
                if rows.batch { 2.0 * comp } else { comp }
            })
            .sum();
        assert!((both.cost - twice).abs() <= 1e-9 * twice, "{name}: {} vs {twice}", both.cost);
        assert!(both.cost <= 2.0 * plain.cost * (1.0 + 1e-9), "{name}: {} > 2 × {}", both.cost, plain.cost);
    }
}
