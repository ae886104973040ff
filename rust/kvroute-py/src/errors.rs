//! Maps core errors to the Python exception classes of `kvroute.errors`, which subclass
//! both `KvrouteError` and the matching builtin (ValueError, TypeError, ...).
//! The module is imported once and cached; safe from any thread.

use kvroute_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// A `kvroute.errors.<class_name>` exception with `message`.
pub fn raise(py: Python<'_>, class_name: &str, message: String) -> PyErr {
    let class = ERRORS_MODULE
        .get_or_try_init(py, || py.import("kvroute.errors").map(Bound::unbind))
        .and_then(|m| m.bind(py).getattr(class_name))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match class {
        Ok(class) => PyErr::from_type(class, message),
        Err(import_error) => import_error,
    }
}

/// Convert a core error.
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let class = match err {
        Error::UnknownPolicy(_) => "UnknownPolicyError",
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::UnknownInstance { .. } => "UnknownInstanceError",
        Error::DuplicateRequest(_) => "DuplicateRequestError",
        Error::NoInstanceAvailable => "NoInstanceAvailableError",
    };
    raise(py, class, err.to_string())
}

/// `InvalidArgumentError(message)`.
pub fn invalid(py: Python<'_>, message: String) -> PyErr {
    raise(py, "InvalidArgumentError", message)
}

/// `KvrouteTypeError(message)`: an argument of the wrong type.
pub fn wrong_type(py: Python<'_>, message: String) -> PyErr {
    raise(py, "KvrouteTypeError", message)
}
