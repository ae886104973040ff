//! Conversions for `Router`'s KV-event methods: a batch argument (msgpack bytes as vLLM
//! publishes them, or the same batch already decoded into Python lists and dicts) into the
//! core's `EventBatch`, and the core's reports into dicts.
//!
//! Decoding runs without the GIL on a copy of the payload (O(payload)); thread-safe.

use kvroute_core::events::{
    decode::decode_batch, Applied, EventBatch, KvEvent, Outcome, RankReport, ViewReport,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{invalid, wrong_type};

/// The batch in `batch`: `bytes` of msgpack, or a decoded batch (`[ts, events, rank]`),
/// which is packed with the `msgpack` package first so that both take one decoder.
pub fn batch_of(batch: &Bound<'_, PyAny>, seq: u64) -> PyResult<EventBatch> {
    let py = batch.py();
    let payload: Vec<u8> = if let Ok(bytes) = batch.cast::<PyBytes>() {
        bytes.as_bytes().to_vec()
    } else if batch.is_instance_of::<pyo3::types::PyList>() || batch.is_instance_of::<pyo3::types::PyTuple>()
    {
        let packed = py.import("msgpack")?.call_method1("packb", (batch,)).map_err(|e| {
            invalid(py, format!("batch {seq} is not a KV-event batch msgpack can encode: {}", e.value(py)))
        })?;
        packed.cast_into::<PyBytes>()?.as_bytes().to_vec()
    } else {
        let name = batch.get_type().name()?;
        return Err(wrong_type(
            py,
            format!("batch must be bytes (msgpack) or a list [ts, events, rank], got {name}"),
        ));
    };
    py.detach(|| decode_batch(&payload))
        .map_err(|e| invalid(py, format!("KV-event batch {seq} cannot be decoded: {e}")))
}

/// `{"outcome", "expected", "reset", "degraded"}` of one application.
pub fn applied_dict<'py>(py: Python<'py>, a: &Applied) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let (outcome, expected) = match a.outcome {
        Outcome::Applied => ("applied", None),
        Outcome::Duplicate => ("duplicate", None),
        Outcome::Gap { expected } => ("gap", Some(expected)),
        Outcome::Foreign => ("foreign", None),
    };
    d.set_item("outcome", outcome)?;
    d.set_item("expected", expected)?;
    d.set_item("reset", a.reset)?;
    d.set_item("degraded", a.degraded)?;
    Ok(d)
}

fn rank_dict<'py>(py: Python<'py>, r: &RankReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rank", r.rank)?;
    d.set_item("state", r.state.name())?;
    d.set_item(
        "reason",
        match &r.state {
            kvroute_core::events::ViewState::Degraded(why) => Some(why.as_str()),
            _ => None,
        },
    )?;
    d.set_item("last_seq", r.last_seq)?;
    for (name, value) in [
        ("batches", r.batches),
        ("replayed_batches", r.replayed_batches),
        ("events", r.events),
        ("blocks_stored", r.blocks_stored),
        ("blocks_removed", r.blocks_removed),
        ("blocks_ignored", r.blocks_ignored),
        ("unknown_removals", r.unknown_removals),
        ("unkeyable_blocks", r.unkeyable_blocks),
        ("gaps", r.gaps),
        ("foreign_batches", r.foreign_batches),
        ("resets", r.resets),
    ] {
        d.set_item(name, value)?;
    }
    d.set_item("blocks_indexed", r.blocks_indexed)?;
    d.set_item("last_ts", r.last_ts)?;
    d.set_item("lag_s", r.lag_s)?;
    d.set_item("memory_bytes", r.memory_bytes)?;
    Ok(d)
}

/// `{"uses_events", "blocks", "pending", "ranks": [...]}` of one instance.
pub fn view_dict<'py>(py: Python<'py>, v: &ViewReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("uses_events", v.uses_events)?;
    d.set_item("blocks", v.blocks)?;
    d.set_item("pending", v.pending)?;
    let ranks = v.ranks.iter().map(|r| rank_dict(py, r)).collect::<PyResult<Vec<_>>>()?;
    d.set_item("ranks", ranks)?;
    Ok(d)
}

/// What one published batch holds, decoded by the core (for summaries such as
/// `kvroute kv-events`): `ts`, `rank`, `events`, and blocks `stored`, `removed`, `ignored`
/// (outside the view: LoRA, extra keys, other media or groups) and `cleared` events.
#[pyfunction]
pub fn decode_kv_events<'py>(py: Python<'py>, payload: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let batch = batch_of(payload, 0)?;
    let (mut stored, mut removed, mut ignored, mut cleared) = (0usize, 0usize, 0usize, 0usize);
    for event in &batch.events {
        match event {
            KvEvent::Stored(s) if s.ignored.is_some() => ignored += s.hashes.len(),
            KvEvent::Stored(s) => stored += s.hashes.len(),
            KvEvent::Removed { hashes, ignored: Some(_) } => ignored += hashes.len(),
            KvEvent::Removed { hashes, .. } => removed += hashes.len(),
            KvEvent::Cleared => cleared += 1,
        }
    }
    let d = PyDict::new(py);
    d.set_item("ts", batch.ts)?;
    d.set_item("rank", batch.rank)?;
    d.set_item("events", batch.events.len())?;
    d.set_item("stored", stored)?;
    d.set_item("removed", removed)?;
    d.set_item("ignored", ignored)?;
    d.set_item("cleared", cleared)?;
    Ok(d)
}
