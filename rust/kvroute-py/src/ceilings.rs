//! `_core.ceilings`: APC ceilings of a trace handed over through the Arrow PyCapsule
//! interface (`__arrow_c_stream__`: a pyarrow Table, a polars DataFrame, a RecordBatchReader).
//!
//! The stream is imported with `arrow-array`'s C stream reader, without copying: each
//! request's keys stay a slice of the producer's `hash_ids` buffer (`list` or `large_list` of
//! `uint64`/`int64`). `timestamp`, `input_length` and `session_id` (integers or strings, plain
//! or dictionary-encoded; a null is a session of its own) become small per-row vectors.
//! Only the stream import holds the GIL: the conversion and the work run on a scoped thread
//! (rayon inside) while the calling thread waits without the GIL, waking every 100 ms to run
//! Python's signal handlers (Ctrl-C cancels the run and raises `KeyboardInterrupt`) and to
//! call `progress(done, total)`. A panic in the worker becomes a `RuntimeError`.
//! O(rows + keys); no shared state.

use crate::worker::run_interruptible;
use std::collections::HashMap;

use arrow_array::cast::AsArray;
use arrow_array::ffi_stream::{ArrowArrayStreamReader, FFI_ArrowArrayStream};
use arrow_array::types::{Float32Type, Float64Type, Int64Type, UInt64Type};
use arrow_array::{Array, ArrayRef, GenericListArray, OffsetSizeTrait, RecordBatch};
use arrow_schema::DataType;
use kvroute_core::ceilings::{compute, stable_order, Control, Params, Stop, Totals, Trace};
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyList};
use rustc_hash::FxBuildHasher;

use crate::errors::{invalid, to_py, wrong_type};

const STREAM: &std::ffi::CStr = c"arrow_array_stream";

/// Every record batch of `data`'s Arrow C stream.
fn import(data: &Bound<'_, PyAny>) -> PyResult<Vec<RecordBatch>> {
    let py = data.py();
    if !data.hasattr("__arrow_c_stream__")? {
        let ty = data.get_type().name()?;
        return Err(wrong_type(
            py,
            format!("trace must be an Arrow table (pyarrow, polars or anything with __arrow_c_stream__), got {ty}"),
        ));
    }
    let capsule = data.call_method1("__arrow_c_stream__", (py.None(),))?;
    let capsule = capsule.cast::<PyCapsule>()?;
    let ptr = capsule.pointer_checked(Some(STREAM))?;
    // SAFETY: a capsule named "arrow_array_stream" holds an FFI_ArrowArrayStream (the
    // PyCapsule interface); `from_raw` moves it out and leaves a released stream behind, which
    // the capsule's destructor then ignores.
    let reader = unsafe { ArrowArrayStreamReader::from_raw(ptr.as_ptr().cast::<FFI_ArrowArrayStream>()) }
        .map_err(|e| invalid(py, format!("cannot import the Arrow stream: {e}")))?;
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(py, format!("cannot read the Arrow stream: {e}")))
}

/// A problem with the input, found without the GIL; raised once it is held again.
enum Bad {
    Invalid(String),
    Type(String),
}

impl Bad {
    fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Bad::Invalid(m) => invalid(py, m),
            Bad::Type(m) => wrong_type(py, m),
        }
    }
}

type Res<T> = Result<T, Bad>;

fn column<'b>(batch: &'b RecordBatch, name: &str) -> Res<&'b ArrayRef> {
    batch.column_by_name(name).ok_or_else(|| {
        let why = if name == "hash_ids" {
            "; ceilings need block keys, which a lengths-only trace does not have"
        } else {
            ""
        };
        Bad::Invalid(format!("trace has no column {name}{why}"))
    })
}

fn no_nulls(a: &dyn Array, name: &str) -> Res<()> {
    match a.null_count() {
        0 => Ok(()),
        n => Err(Bad::Invalid(format!("column {name} has {n} null value(s)"))),
    }
}

fn bad_type(name: &str, want: &str, got: &DataType) -> Bad {
    Bad::Type(format!("column {name} must be {want}, got {got}"))
}

/// Push every row's keys of one `hash_ids` list array.
fn push_lists<'a, O: OffsetSizeTrait>(list: &'a GenericListArray<O>, out: &mut Vec<&'a [u64]>) -> Res<()> {
    let values = list.values();
    no_nulls(values.as_ref(), "hash_ids (values)")?;
    let keys: &'a [u64] = match values.data_type() {
        DataType::UInt64 => values.as_primitive::<UInt64Type>().values(),
        DataType::Int64 => {
            let v: &'a [i64] = values.as_primitive::<Int64Type>().values();
            // SAFETY: i64 and u64 have the same size and alignment, and every bit pattern is
            // a valid u64; the slice borrows the same buffer for the same lifetime.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u64>(), v.len()) }
        }
        t => return Err(bad_type("hash_ids", "a list of uint64 or int64", t)),
    };
    for w in list.value_offsets().windows(2) {
        let (a, b) = (w[0].as_usize(), w[1].as_usize());
        let row =
            keys.get(a..b).ok_or_else(|| Bad::Invalid("column hash_ids has offsets out of range".into()))?;
        out.push(row);
    }
    Ok(())
}

/// A session id value, for dense numbering.
#[derive(Hash, PartialEq, Eq)]
enum SessionKey<'a> {
    Int(i128),
    Str(&'a str),
    Null(usize),
}

fn session_keys<'a>(a: &'a ArrayRef, base: usize) -> Res<Vec<SessionKey<'a>>> {
    let valid = |i: usize| a.is_valid(i);
    let dt = a.data_type();
    let mut out = Vec::with_capacity(a.len());
    macro_rules! ints {
        ($t:ty) => {{
            let v = a.as_primitive::<$t>();
            for i in 0..a.len() {
                out.push(if valid(i) {
                    SessionKey::Int(v.value(i) as i128)
                } else {
                    SessionKey::Null(base + i)
                });
            }
        }};
    }
    use arrow_array::types::*;
    match dt {
        DataType::Int8 => ints!(Int8Type),
        DataType::Int16 => ints!(Int16Type),
        DataType::Int32 => ints!(Int32Type),
        DataType::Int64 => ints!(Int64Type),
        DataType::UInt8 => ints!(UInt8Type),
        DataType::UInt16 => ints!(UInt16Type),
        DataType::UInt32 => ints!(UInt32Type),
        DataType::UInt64 => ints!(UInt64Type),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            for i in 0..a.len() {
                out.push(if !valid(i) {
                    SessionKey::Null(base + i)
                } else if let Some(s) = a.as_string_opt::<i32>() {
                    SessionKey::Str(s.value(i))
                } else if let Some(s) = a.as_string_opt::<i64>() {
                    SessionKey::Str(s.value(i))
                } else {
                    SessionKey::Str(a.as_string_view().value(i))
                });
            }
        }
        DataType::Dictionary(_, _) => {
            let d = a.as_any_dictionary();
            let values = session_keys(d.values(), 0)?;
            let keys = if d.values().is_empty() { vec![0; a.len()] } else { d.normalized_keys() };
            for (i, k) in keys.into_iter().enumerate() {
                out.push(match (valid(i), &values.get(k)) {
                    (true, Some(SessionKey::Int(v))) => SessionKey::Int(*v),
                    (true, Some(SessionKey::Str(s))) => SessionKey::Str(s),
                    _ => SessionKey::Null(base + i),
                });
            }
        }
        t => return Err(bad_type("session_id", "integers or strings", t)),
    }
    Ok(out)
}

/// The rows of `batches` as a core trace (keys borrowed) with its processing order.
fn trace<'a>(batches: &'a [RecordBatch]) -> Res<Trace<'a>> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let mut t =
        Trace { keys: Vec::with_capacity(rows), input_length: Vec::with_capacity(rows), ..Trace::default() };
    let mut stamps = Vec::with_capacity(rows);
    let mut sessions: HashMap<SessionKey<'a>, u32, FxBuildHasher> = HashMap::default();
    for batch in batches {
        let base = t.keys.len();
        let keys = column(batch, "hash_ids")?;
        no_nulls(keys.as_ref(), "hash_ids")?;
        match keys.data_type() {
            DataType::List(_) => push_lists(keys.as_list::<i32>(), &mut t.keys)?,
            DataType::LargeList(_) => push_lists(keys.as_list::<i64>(), &mut t.keys)?,
            d => return Err(bad_type("hash_ids", "a list or large_list of uint64/int64", d)),
        }
        let ts = column(batch, "timestamp")?;
        no_nulls(ts.as_ref(), "timestamp")?;
        match ts.data_type() {
            DataType::Float64 => stamps.extend(ts.as_primitive::<Float64Type>().values().iter()),
            DataType::Float32 => {
                stamps.extend(ts.as_primitive::<Float32Type>().values().iter().map(|&v| f64::from(v)))
            }
            DataType::Int64 => {
                stamps.extend(ts.as_primitive::<Int64Type>().values().iter().map(|&v| v as f64))
            }
            d => return Err(bad_type("timestamp", "float64 (or int64)", d)),
        }
        let len = column(batch, "input_length")?;
        no_nulls(len.as_ref(), "input_length")?;
        let len = arrow_cast_i64(len, "input_length")?;
        for (i, &v) in len.iter().enumerate() {
            let v = u64::try_from(v).map_err(|_| {
                Bad::Invalid(format!("row {}: field input_length: negative, got {v}", base + i))
            })?;
            t.input_length.push(v);
        }
        for key in session_keys(column(batch, "session_id")?, base)? {
            let next = sessions.len() as u32;
            t.session.push(*sessions.entry(key).or_insert(next));
        }
    }
    if let Some((row, v)) = stamps.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(Bad::Invalid(format!("row {row}: field timestamp: not a finite number, got {v}")));
    }
    t.num_sessions = sessions.len();
    t.order = stable_order(&stamps).map_err(|e| Bad::Invalid(e.to_string()))?;
    Ok(t)
}

/// An integer column as i64 values.
fn arrow_cast_i64(a: &ArrayRef, name: &str) -> Res<Vec<i64>> {
    use arrow_array::types::*;
    Ok(match a.data_type() {
        DataType::Int64 => a.as_primitive::<Int64Type>().values().to_vec(),
        DataType::Int32 => a.as_primitive::<Int32Type>().values().iter().map(|&v| i64::from(v)).collect(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().values().iter().map(|&v| i64::from(v)).collect(),
        DataType::UInt64 => {
            a.as_primitive::<UInt64Type>().values().iter().map(|&v| i64::try_from(v).unwrap_or(-1)).collect()
        }
        d => return Err(bad_type(name, "int64", d)),
    })
}

/// Wait for the worker while letting Python handle signals and report progress.
fn wait<T: Send>(
    py: Python<'_>,
    ctl: &Control,
    progress: Option<&Bound<'_, PyAny>>,
    work: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let poll = || {
        py.check_signals()?;
        progress.map_or(Ok(()), |cb| cb.call1(ctl.progress()).map(drop))
    };
    run_interruptible(py, "ceilings", poll, || ctl.cancel(), work)
}

fn totals<'py>(py: Python<'py>, t: &Totals) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("ratio", t.ratio())?;
    d.set_item("hit_tokens", t.hit_tokens)?;
    d.set_item("total_tokens", t.total_tokens)?;
    d.set_item("hit_requests", t.hit_requests)?;
    d.set_item("total_requests", t.total_requests)?;
    Ok(d)
}

/// APC ceilings of `data` (see `kvroute.ceilings` for the Python face).
#[pyfunction]
#[pyo3(signature = (data, *, block_size = 512, min_sessions = 8, capacities = None, per_request = false, progress = None))]
pub fn ceilings<'py>(
    data: &Bound<'py, PyAny>,
    block_size: i64,
    min_sessions: i64,
    capacities: Option<Vec<i64>>,
    per_request: bool,
    progress: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let py = data.py();
    let positive = |v: i64, name: &str| {
        u64::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| invalid(py, format!("{name} must be positive, got {v}")))
    };
    let params = Params {
        block_size: positive(block_size, "block_size")?,
        min_sessions: u32::try_from(positive(min_sessions, "min_sessions")?).unwrap_or(u32::MAX),
        capacities: capacities
            .unwrap_or_default()
            .into_iter()
            .map(|c| positive(c, "every capacity"))
            .collect::<PyResult<_>>()?,
        per_request,
    };
    let batches = import(data)?;
    let ctl = Control::default();
    let work = || trace(&batches).map(|t| compute(&t, &params, &ctl));
    let result = wait(py, &ctl, progress, work)?.map_err(|bad| bad.into_py(py))?;
    let c = match result {
        Ok(c) => c,
        Err(Stop::Invalid(e)) => return Err(to_py(py, e)),
        Err(Stop::Cancelled) => return Err(pyo3::exceptions::PyKeyboardInterrupt::new_err(())),
    };
    let out = PyDict::new(py);
    out.set_item("any", totals(py, &c.any)?)?;
    out.set_item("intra", totals(py, &c.intra)?)?;
    out.set_item("shared", totals(py, &c.shared)?)?;
    let reuse = PyDict::new(py);
    reuse.set_item("intra", c.reuse.intra)?;
    reuse.set_item("cross", c.reuse.cross)?;
    reuse.set_item("shared", c.reuse.shared)?;
    out.set_item("reuse", reuse)?;
    let curve = PyList::empty(py);
    for (cap, t) in &c.capacity {
        let d = totals(py, t)?;
        d.set_item("capacity", cap)?;
        curve.append(d)?;
    }
    out.set_item("capacity", curve)?;
    match c.per_request {
        Some(p) => {
            let d = PyDict::new(py);
            d.set_item("any", p.any.into_pyarray(py))?;
            d.set_item("intra", p.intra.into_pyarray(py))?;
            d.set_item("shared", p.shared.into_pyarray(py))?;
            let caps = PyList::empty(py);
            for col in p.capacity {
                caps.append(col.into_pyarray(py))?;
            }
            d.set_item("capacity", caps)?;
            out.set_item("per_request", d)?;
        }
        None => out.set_item("per_request", py.None())?,
    }
    Ok(out)
}
