//! `hapd._core`: the Python surface of hapd-core. Converts and exports, nothing more;
//! every function is listed once in [`_core`]. Errors become classes of `hapd.errors`,
//! chosen by name from the core's typed error.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hapd_core::problem::{Mode, Options};
use hapd_core::summary::Summary;
use hapd_core::{Error, Graph, Limits};

/// Raise a core error as the `hapd.errors` class it names, carrying node and field.
fn to_py_err(py: Python<'_>, err: Error) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let module = py.import("hapd.errors")?;
        let class = module.getattr(err.kind())?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("node", err.node())?;
        kwargs.set_item("field", err.field())?;
        let instance = class.call((err.to_string(),), Some(&kwargs))?;
        Ok(PyErr::from_value(instance))
    };
    build().unwrap_or_else(|import_error| {
        PyRuntimeError::new_err(format!("{err} (and hapd.errors could not be used: {import_error})"))
    })
}

/// Decode and validate a `.hapg` document; return its summary as a dict.
#[pyfunction]
fn load_graph<'py>(py: Python<'py>, data: &Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyDict>> {
    let bytes = data.as_bytes();
    let graph = py.detach(|| Graph::from_msgpack(bytes)).map_err(|e| to_py_err(py, e))?;
    summary_dict(py, &Summary::of(&graph))
}

fn summary_dict<'py>(py: Python<'py>, s: &Summary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &s.name)?;
    d.set_item("nodes", s.nodes)?;
    d.set_item("ops", PyList::new(py, &s.ops)?)?;
    d.set_item("parameters", PyList::new(py, &s.parameters)?)?;
    d.set_item("parameter_elements", s.parameter_elements)?;
    d.set_item("buffers", PyList::new(py, &s.buffers)?)?;
    d.set_item("inputs", PyList::new(py, &s.inputs)?)?;
    d.set_item("opaque_ops", PyList::new(py, &s.opaque_ops)?)?;
    d.set_item("flops", s.flops)?;
    d.set_item("opaque_flops", s.opaque_flops)?;
    d.set_item("expert_parallel", PyList::new(py, &s.expert_parallel)?)?;
    Ok(d)
}

/// Search for the cheapest program of `graph` on `profile` under `ratios`.
///
/// `options`: `mode` ("auto" | "data_parallel"), `force` ({node: rule}), `zero` (bool),
/// `overlap` (bool: price the program as two duplicas interleaved),
/// `recompute` (the blocks whose activations the backward pass recomputes),
/// `max_states` (int), `max_seconds` (float), `memory_price` (seconds per byte held on
/// each device: the search trades time for memory). Returns the program as msgpack bytes.
/// The search runs on a worker thread while this thread polls for signals, so Ctrl-C
/// cancels it (it raises KeyboardInterrupt).
#[pyfunction]
#[pyo3(signature = (graph, profile, ratios, options=None))]
fn synthesize<'py>(
    py: Python<'py>,
    graph: &Bound<'py, PyBytes>,
    profile: &Bound<'py, PyBytes>,
    ratios: Vec<f64>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let (opts, limits) = parse_options(py, options)?;
    let graph = graph.as_bytes().to_vec();
    let profile = profile.as_bytes().to_vec();
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cancel);
    let worker = std::thread::spawn(move || {
        hapd_core::synthesize(&graph, &profile, &ratios, opts, limits, Some(&flag))
            .and_then(|p| rmp_serde::to_vec_named(&p).map_err(|e| Error::Synthesis { message: e.to_string() }))
    });
    loop {
        if worker.is_finished() {
            break;
        }
        py.detach(|| std::thread::sleep(Duration::from_millis(2)));
        if let Err(interrupt) = py.check_signals() {
            cancel.store(true, Ordering::Relaxed);
            let _ = py.detach(|| worker.join());
            return Err(interrupt);
        }
    }
    let result = worker.join().map_err(|_| PyRuntimeError::new_err("hapd core: the search thread panicked (a bug)"))?;
    let bytes = result.map_err(|e| to_py_err(py, e))?;
    Ok(PyBytes::new(py, &bytes))
}

fn parse_options(py: Python<'_>, options: Option<&Bound<'_, PyDict>>) -> PyResult<(Options, Limits)> {
    let mut opts = Options::default();
    let mut limits = Limits::default();
    let Some(options) = options else { return Ok((opts, limits)) };
    let bad = |field: &str, message: String| to_py_err(py, Error::InvalidOption { field: field.into(), message });
    for (key, value) in options.iter() {
        let key: String = key.extract()?;
        match key.as_str() {
            "mode" => {
                let mode: String = value.extract()?;
                opts.mode = match mode.as_str() {
                    "auto" => Mode::Auto,
                    "data_parallel" => Mode::DataParallel,
                    other => return Err(bad("mode", format!("{other:?} is not auto or data_parallel"))),
                };
            }
            "force" => opts.force = value.extract::<BTreeMap<String, String>>()?,
            "zero" => opts.zero = value.extract()?,
            "overlap" => opts.overlap = value.extract()?,
            "recompute" => opts.recompute = value.extract::<Vec<String>>()?.into_iter().collect(),
            "max_states" => limits.max_states = value.extract()?,
            "front_width" => limits.front_width = value.extract()?,
            "max_seconds" => limits.max_seconds = value.extract()?,
            "memory_price" => limits.memory_price = Some(value.extract::<Vec<f64>>()?),
            other => return Err(bad(other, "unknown option".into())),
        }
    }
    Ok((opts, limits))
}

/// The graph IR version this core reads.
#[pyfunction]
fn graph_version() -> u32 {
    hapd_core::ir::GRAPH_VERSION
}

/// Every rule name a plan can record, by constant name:
/// `{"ROW_PARALLEL": "row-parallel", ...}` (the core's `rules::rule_names`).
#[pyfunction]
fn rule_names() -> BTreeMap<&'static str, &'static str> {
    hapd_core::rules::rule_names::ALL.iter().copied().collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GRAD_BUCKET_BYTES", hapd_core::comm::GRAD_BUCKET_BYTES as u64)?;
    m.add_function(wrap_pyfunction!(load_graph, m)?)?;
    m.add_function(wrap_pyfunction!(graph_version, m)?)?;
    m.add_function(wrap_pyfunction!(rule_names, m)?)?;
    m.add_function(wrap_pyfunction!(synthesize, m)?)?;
    Ok(())
}
