//! `hapd._core`: the Python surface of hapd-core. Converts and exports, nothing more;
//! every function is listed once in [`_core`]. Errors become classes of `hapd.errors`,
//! chosen by name from the core's typed error.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use hapd_core::summary::Summary;
use hapd_core::{Error, Graph};

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
    Ok(d)
}

/// The graph IR version this core reads.
#[pyfunction]
fn graph_version() -> u32 {
    hapd_core::ir::GRAPH_VERSION
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(load_graph, m)?)?;
    m.add_function(wrap_pyfunction!(graph_version, m)?)?;
    Ok(())
}
