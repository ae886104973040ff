//! Python values to core values: ids, counts, key arrays and token arrays.
//!
//! Numpy arrays of the right dtype are read in place (zero-copy when contiguous); lists and
//! tuples are read item by item. Every failure names the argument, and the item when it is
//! one item of a sequence. O(len) at most; no state.

use kvroute_core::Id;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};

use crate::errors::{invalid, wrong_type};

/// A request or session id: int (64-bit) or str.
pub fn id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Id> {
    let py = obj.py();
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Id::Str(s.to_str()?.to_owned()));
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        return obj.extract::<i64>().map(Id::Int).map_err(|_| {
            invalid(
                py,
                format!("{name} must fit in a signed 64-bit integer, got {obj}"),
            )
        });
    }
    Err(wrong_type(
        py,
        format!("{name} must be an int or a str, got {}", type_name(obj)),
    ))
}

/// An optional id; `None` stays `None`.
pub fn optional_id(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Id>> {
    match obj {
        Some(o) if !o.is_none() => id(o, name).map(Some),
        _ => Ok(None),
    }
}

/// A non-negative integer argument.
pub fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let py = obj.py();
    if !obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyBool>() {
        return Err(wrong_type(
            py,
            format!("{name} must be an int, got {}", type_name(obj)),
        ));
    }
    match obj.extract::<i64>() {
        Ok(v) if v >= 0 => Ok(v as u64),
        _ => Err(invalid(
            py,
            format!("{name} must be a non-negative 64-bit integer, got {obj}"),
        )),
    }
}

/// Block keys, borrowed from a contiguous uint64 array or collected from anything else.
pub enum Keys<'py> {
    Borrowed(PyReadonlyArray1<'py, u64>),
    Owned(Vec<u64>),
}

impl Keys<'_> {
    pub fn as_slice(&self) -> &[u64] {
        match self {
            Keys::Borrowed(a) => a.as_slice().unwrap_or(&[]),
            Keys::Owned(v) => v,
        }
    }
}

/// `hash_ids`: a list/tuple of ints or a 1-D numpy uint64/int64 array.
/// int64 values (and negative ints) are taken as their 64-bit two's complement pattern.
pub fn keys<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Keys<'py>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(wrong_type(
                py,
                format!("{name} must be a 1-D array, got {} dimensions", arr.ndim()),
            ));
        }
        if let Ok(a) = obj.cast::<PyArray1<u64>>() {
            let ro = a.readonly();
            return Ok(if ro.as_slice().is_ok() {
                Keys::Borrowed(ro)
            } else {
                Keys::Owned(ro.as_array().iter().copied().collect())
            });
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            return Ok(Keys::Owned(
                a.readonly().as_array().iter().map(|&v| v as u64).collect(),
            ));
        }
        return Err(wrong_type(
            py,
            format!(
                "{name} must have dtype uint64 or int64, got {}",
                arr.dtype()
            ),
        ));
    }
    if obj.is_instance_of::<PyString>() || obj.hasattr("decode")? {
        return Err(wrong_type(
            py,
            format!("{name} must be a sequence of ints, got {}", type_name(obj)),
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        wrong_type(
            py,
            format!(
                "{name} must be a sequence of ints or a numpy array, got {}",
                type_name(obj)
            ),
        )
    })?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (pos, item) in iter.enumerate() {
        let item = item?;
        out.push(key_item(&item).ok_or_else(|| {
            wrong_type(
                py,
                format!(
                    "{name}[{pos}] must be an int in the 64-bit range, got {}",
                    describe(&item)
                ),
            )
        })?);
    }
    Ok(Keys::Owned(out))
}

fn key_item(item: &Bound<'_, PyAny>) -> Option<u64> {
    if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
        return item
            .extract::<u64>()
            .ok()
            .filter(|_| is_numpy_integer(item));
    }
    item.extract::<u64>()
        .ok()
        .or_else(|| item.extract::<i64>().ok().map(|v| v as u64))
}

fn is_numpy_integer(item: &Bound<'_, PyAny>) -> bool {
    item.hasattr("dtype").unwrap_or(false) && item.hasattr("__index__").unwrap_or(false)
}

/// Token ids: numpy int32/uint32/int64 read in place, anything else collected as int64.
pub enum Tokens<'py> {
    U32(PyReadonlyArray1<'py, u32>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
    Owned(Vec<i64>),
}

/// `token_ids` for `block_hashes`.
pub fn tokens<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Tokens<'py>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(wrong_type(
                py,
                format!("{name} must be a 1-D array, got {} dimensions", arr.ndim()),
            ));
        }
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
            return Ok(Tokens::Owned(
                a.readonly().as_array().iter().map(|&v| v as i64).collect(),
            ));
        }
        return Err(wrong_type(
            py,
            format!(
                "{name} must have dtype int32, uint32, int64 or uint64, got {}",
                arr.dtype()
            ),
        ));
    }
    let keys = keys(obj, name)?;
    Ok(Tokens::Owned(
        keys.as_slice().iter().map(|&v| v as i64).collect(),
    ))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    let repr = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    format!(
        "{} {}",
        type_name(obj),
        repr.chars().take(40).collect::<String>()
    )
}
