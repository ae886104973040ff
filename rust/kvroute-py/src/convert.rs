//! Python values to core values: ids, integers, flags, key arrays and token arrays.
//!
//! Numpy arrays of the right dtype are read in place (zero-copy when contiguous); lists and
//! tuples are read item by item. Python ints and numpy integer scalars are both integers;
//! bools and floats are not. Every failure names the argument, and the item when it is one
//! item of a sequence. O(len) at most; no state.

use kvroute_core::keys::TokenId;
use kvroute_core::Id;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString};

use crate::errors::{invalid, wrong_type};

/// A request or session id: int (64-bit) or str.
pub fn id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Id> {
    let py = obj.py();
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Id::Str(s.to_str()?.to_owned()));
    }
    match integer(obj, name) {
        Ok(Some(v)) => Ok(Id::Int(v)),
        Ok(None) => Err(invalid(py, format!("{name} must fit in a signed 64-bit integer, got {obj}"))),
        Err(_) => Err(wrong_type(py, format!("{name} must be an int or a str, got {}", type_name(obj)))),
    }
}

/// A str argument with a default, checked (and named) by [`TextArg::get`] like [`IntArg`].
pub struct TextArg(Result<std::borrow::Cow<'static, str>, String>);

impl TextArg {
    /// A default value.
    pub const fn of(v: &'static str) -> Self {
        Self(Ok(std::borrow::Cow::Borrowed(v)))
    }

    pub fn get(&self, py: Python<'_>, name: &str) -> PyResult<&str> {
        match &self.0 {
            Ok(s) => Ok(s),
            Err(what) => Err(wrong_type(py, format!("{name} must be a str, got {what}"))),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for TextArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(match obj.cast::<PyString>() {
            Ok(s) => Ok(std::borrow::Cow::Owned(s.to_str()?.to_owned())),
            Err(_) => Err(describe(&obj)),
        }))
    }
}

/// An optional id; `None` stays `None`.
pub fn optional_id(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Id>> {
    match obj {
        Some(o) if !o.is_none() => id(o, name).map(Some),
        _ => Ok(None),
    }
}

/// An integer argument as `i64`; `Ok(None)` for an integer outside the `i64` range.
pub fn integer(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<i64>> {
    if !is_integer(obj) {
        return Err(wrong_type(obj.py(), format!("{name} must be an int, got {}", type_name(obj))));
    }
    Ok(obj.extract::<i64>().ok())
}

/// A non-negative integer argument.
pub fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    match integer(obj, name)? {
        Some(v) if v >= 0 => Ok(v as u64),
        _ => Err(invalid(obj.py(), format!("{name} must be a non-negative 64-bit integer, got {obj}"))),
    }
}

/// A bool argument (Python or numpy bool).
pub fn flag(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(b.is_true());
    }
    if obj.get_type().name().is_ok_and(|n| n == "bool") {
        return obj.is_truthy();
    }
    Err(wrong_type(obj.py(), format!("{name} must be a bool, got {}", type_name(obj))))
}

/// A Python int or a numpy integer scalar, but not a bool or a float.
fn is_integer(obj: &Bound<'_, PyAny>) -> bool {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return false;
    }
    obj.is_instance_of::<PyInt>()
        || (obj.hasattr("dtype").unwrap_or(false) && obj.hasattr("__index__").unwrap_or(false))
}

/// How a numeric argument failed to be a number, for [`IntArg::get`] / [`RealArg::get`].
enum Problem {
    Type(String),
    Range(String),
}

/// An integer argument as Python passed it. Extraction never fails, so that the check in
/// [`IntArg::get`] can name the argument and raise kvroute's errors: a wrong type is a
/// `KvrouteTypeError`, a value out of range an `InvalidArgumentError`.
pub struct IntArg(Result<i128, Problem>);

impl IntArg {
    /// A default value.
    pub const fn of(v: i64) -> Self {
        Self(Ok(v as i128))
    }

    /// The value as `T`, if it is an int in `lo..=hi`.
    pub fn get<T: TryFrom<i128>>(&self, py: Python<'_>, name: &str, lo: i128, hi: i128) -> PyResult<T> {
        let range = || format!("{name} must be an int in [{lo}, {hi}]");
        match &self.0 {
            Err(Problem::Type(what)) => Err(wrong_type(py, format!("{name} must be an int, got {what}"))),
            Err(Problem::Range(repr)) => Err(invalid(py, format!("{}, got {repr}", range()))),
            Ok(v) if (lo..=hi).contains(v) => {
                T::try_from(*v).map_err(|_| invalid(py, format!("{}, got {v}", range())))
            }
            Ok(v) => Err(invalid(py, format!("{}, got {v}", range()))),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for IntArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if !is_integer(&obj) {
            return Ok(Self(Err(Problem::Type(describe(&obj)))));
        }
        Ok(Self(obj.extract::<i128>().map_err(|_| Problem::Range(describe(&obj)))))
    }
}

/// A real-number argument (an int or a float, not a bool or a str), checked by
/// [`RealArg::get`] like [`IntArg`].
pub struct RealArg(Result<f64, Problem>);

impl RealArg {
    /// A default value.
    pub const fn of(v: f64) -> Self {
        Self(Ok(v))
    }

    /// The value, if it is finite and at least `min` (`f64::MIN`: any finite value).
    pub fn get(&self, py: Python<'_>, name: &str, min: f64) -> PyResult<f64> {
        let bound = if min > f64::MIN { format!(" >= {min}") } else { String::new() };
        match &self.0 {
            Err(Problem::Type(what)) => Err(wrong_type(py, format!("{name} must be a number, got {what}"))),
            Ok(v) if v.is_finite() && *v >= min => Ok(*v),
            Ok(v) => Err(invalid(py, format!("{name} must be a finite number{bound}, got {v}"))),
            Err(Problem::Range(repr)) => {
                Err(invalid(py, format!("{name} must be a finite number{bound}, got {repr}")))
            }
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for RealArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let numpy_float = || {
            obj.hasattr("dtype").unwrap_or(false)
                && obj.hasattr("__float__").unwrap_or(false)
                && !obj.get_type().name().is_ok_and(|n| n == "bool")
        };
        let number = obj.is_instance_of::<PyFloat>() || is_integer(&obj) || numpy_float();
        if !number || obj.is_instance_of::<PyBool>() {
            return Ok(Self(Err(Problem::Type(describe(&obj)))));
        }
        Ok(Self(obj.extract::<f64>().map_err(|_| Problem::Range(describe(&obj)))))
    }
}

/// A 1-D numpy array of `T` (named `dtype` in errors), read in place.
pub fn array<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArray1<'py, T>> {
    match obj.cast::<PyArray1<T>>() {
        Ok(a) => Ok(a.readonly()),
        Err(_) => Err(wrong_type(
            obj.py(),
            format!("{name} must be a 1-D numpy {dtype} array, got {}", describe(obj)),
        )),
    }
}

/// Block keys, borrowed from a contiguous uint64 array or collected from anything else.
pub enum Keys<'py> {
    /// A C-contiguous uint64 array, read in place.
    Borrowed(Bound<'py, PyArray1<u64>>),
    Owned(Vec<u64>),
}

impl Keys<'_> {
    pub fn as_slice(&self) -> &[u64] {
        match self {
            // SAFETY: the array is C-contiguous (checked when it was taken) and kept alive by
            // `a`. The slice is only used while the GIL is held and no Python code runs (the
            // router call), so nothing can write to or resize the array meanwhile; the
            // extension is built for the GIL-enabled ABI (abi3). numpy's dynamic borrow
            // tracking is skipped on purpose: it costs more than a whole route() on short keys.
            Keys::Borrowed(a) => unsafe { a.as_slice() }.unwrap_or(&[]),
            Keys::Owned(v) => v,
        }
    }
}

fn one_dimensional(arr: &Bound<'_, PyUntypedArray>, name: &str) -> PyResult<()> {
    if arr.ndim() == 1 {
        return Ok(());
    }
    Err(wrong_type(arr.py(), format!("{name} must be a 1-D array, got {} dimensions", arr.ndim())))
}

/// Items of a list/tuple/iterable, each converted by `item`; errors name the position.
fn collect_items<T>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    item: impl Fn(&Bound<'_, PyAny>) -> Option<T>,
    expected: &str,
) -> PyResult<Vec<T>> {
    let py = obj.py();
    let not_a_sequence = || {
        wrong_type(py, format!("{name} must be a sequence of ints or a numpy array, got {}", type_name(obj)))
    };
    if obj.is_instance_of::<PyString>() || obj.hasattr("decode")? {
        return Err(not_a_sequence());
    }
    let iter = obj.try_iter().map_err(|_| not_a_sequence())?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (pos, value) in iter.enumerate() {
        let value = value?;
        let converted = item(&value).ok_or_else(|| {
            wrong_type(py, format!("{name}[{pos}] must be {expected}, got {}", describe(&value)))
        })?;
        out.push(converted);
    }
    Ok(out)
}

/// `hash_ids`: a list/tuple of ints or a 1-D numpy uint64/int64 array.
/// int64 values (and negative ints) are taken as their 64-bit two's complement pattern.
pub fn keys<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Keys<'py>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        one_dimensional(arr, name)?;
        if let Ok(a) = obj.cast::<PyArray1<u64>>() {
            return Ok(if a.is_c_contiguous() {
                Keys::Borrowed(a.clone())
            } else {
                Keys::Owned(a.readonly().as_array().iter().copied().collect())
            });
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            return Ok(Keys::Owned(a.readonly().as_array().iter().map(|&v| v as u64).collect()));
        }
        return Err(wrong_type(
            obj.py(),
            format!("{name} must have dtype uint64 or int64, got {}", arr.dtype()),
        ));
    }
    let key_item = |item: &Bound<'_, PyAny>| {
        is_integer(item)
            .then(|| item.extract::<u64>().ok().or_else(|| item.extract::<i64>().ok().map(|v| v as u64)))
            .flatten()
    };
    collect_items(obj, name, key_item, "an int in the 64-bit range").map(Keys::Owned)
}

/// Token ids: numpy int32/uint32/int64 read in place, anything else collected exactly.
pub enum Tokens<'py> {
    U32(PyReadonlyArray1<'py, u32>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
    U64(PyReadonlyArray1<'py, u64>),
    /// A list of ints that all fit, read with the list fast path.
    OwnedU32(Vec<u32>),
    Owned(Vec<i128>),
}

/// `token_ids` for `block_hashes`.
pub fn tokens<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Tokens<'py>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        one_dimensional(arr, name)?;
        if let Ok(a) = obj.cast::<PyArray1<u32>>() {
            return Ok(Tokens::U32(a.readonly()));
        }
        if let Ok(a) = obj.cast::<PyArray1<i32>>() {
            return Ok(Tokens::I32(a.readonly()));
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            return Ok(Tokens::I64(a.readonly()));
        }
        if let Ok(a) = obj.cast::<PyArray1<u64>>() {
            return Ok(Tokens::U64(a.readonly()));
        }
        return Err(wrong_type(
            obj.py(),
            format!("{name} must have dtype int32, uint32, int64 or uint64, got {}", arr.dtype()),
        ));
    }
    if let Some(ids) = list_of_u32(obj) {
        return Ok(Tokens::OwnedU32(ids));
    }
    let token_item = |item: &Bound<'_, PyAny>| {
        is_integer(item)
            .then(|| {
                item.extract::<i64>().map(i128::from).or_else(|_| item.extract::<u64>().map(i128::from)).ok()
            })
            .flatten()
    };
    collect_items(obj, name, token_item, "an int").map(Tokens::Owned)
}

/// Token ids as `u32`, range-checked (an error names `name` and the position).
pub fn token_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    fn narrow<T: TokenId>(ids: impl Iterator<Item = T>, py: Python<'_>, name: &str) -> PyResult<Vec<u32>> {
        ids.enumerate()
            .map(|(i, t)| {
                t.to_u32().ok_or_else(|| {
                    invalid(
                        py,
                        format!("{name}[{i}] = {} is outside the token id range 0..2**32", t.to_i128()),
                    )
                })
            })
            .collect()
    }
    let py = obj.py();
    match tokens(obj, name)? {
        Tokens::U32(a) => Ok(a.as_array().to_vec()),
        Tokens::I32(a) => narrow(a.as_array().iter().copied(), py, name),
        Tokens::I64(a) => narrow(a.as_array().iter().copied(), py, name),
        Tokens::U64(a) => narrow(a.as_array().iter().copied(), py, name),
        Tokens::OwnedU32(v) => Ok(v),
        Tokens::Owned(v) => narrow(v.into_iter(), py, name),
    }
}

/// The ids of an exact `list` of exact `int`s in `0..2**32` (the common case: a prompt
/// from a JSON body), read without the generic sequence protocol; None for anything else,
/// which the generic path then reads (and reports on).
fn list_of_u32(obj: &Bound<'_, PyAny>) -> Option<Vec<u32>> {
    let list = obj.cast_exact::<PyList>().ok()?;
    let mut out = Vec::with_capacity(list.len());
    for item in list.iter() {
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        out.push(u32::try_from(item.extract::<i64>().ok()?).ok()?);
    }
    Some(out)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    let repr = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    format!("{} {}", type_name(obj), repr.chars().take(40).collect::<String>())
}
