//! `kvroute.EngineModel`: one simulated engine for real-time driving (the HTTP engine
//! emulator). A frozen class over a mutex, so any thread may call it; each call holds the
//! lock for O(events + running requests) and never releases the GIL while holding it.

use std::sync::{Mutex, MutexGuard};

use kvroute_core::sim::{LiveEngine, LiveEvent, PoolEvent};
use kvroute_core::Id;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::build_params;
use crate::convert::{count, flag, id, keys, RealArg, TextArg};
use crate::errors::to_py;

/// One simulated vLLM engine driven by the caller's clock (see `docs/simulator.md`).
#[pyclass(frozen, name = "EngineModel", module = "kvroute._core")]
pub struct PyEngineModel {
    inner: Mutex<LiveEngine>,
    preset: String,
}

impl PyEngineModel {
    fn lock(&self) -> MutexGuard<'_, LiveEngine> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn id_to_py<'py>(py: Python<'py>, id: &Id) -> PyResult<Bound<'py, PyAny>> {
    Ok(match id {
        Id::Int(i) => i.into_pyobject(py)?.into_any(),
        Id::Str(s) => s.into_pyobject(py)?.into_any(),
    })
}

#[pymethods]
impl PyEngineModel {
    #[new]
    #[pyo3(signature = (preset = TextArg::of("h20-qwen3-coder-30b-a3b"), **overrides),
        text_signature = "(preset='h20-qwen3-coder-30b-a3b', **overrides)")]
    fn new(py: Python<'_>, preset: TextArg, overrides: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let preset = preset.get(py, "preset")?;
        let p = build_params(py, preset, overrides)?;
        Ok(Self {
            inner: Mutex::new(LiveEngine::new(p).map_err(|e| to_py(py, e))?),
            preset: preset.to_owned(),
        })
    }

    /// A request arrives at engine time `now` (seconds). Raises when the id is in flight or
    /// the request could never fit in the KV pool.
    fn submit(
        &self,
        request_id: &Bound<'_, PyAny>,
        hash_ids: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
        output_length: &Bound<'_, PyAny>,
        now: RealArg,
    ) -> PyResult<()> {
        let py = request_id.py();
        let now = now.get(py, "now", 0.0)?;
        let rid = id(request_id, "request_id")?;
        let k = keys(hash_ids, "hash_ids")?.as_slice().to_vec();
        let n_in = count(input_length, "input_length")?;
        let n_out = count(output_length, "output_length")?;
        self.lock().submit(rid, k, n_in, n_out, now).map_err(|e| to_py(py, e))
    }

    /// When the next token or finish is due (engine seconds), or None when idle.
    fn next_event_time(&self) -> Option<f64> {
        self.lock().next_event_time()
    }

    /// Every event up to `now`, in time order: `("first_token", id, t, cached_tokens)`,
    /// `("tokens", id, t, generated_so_far)`, `("finish", id, t)`.
    fn advance<'py>(&self, py: Python<'py>, now: RealArg) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let now = now.get(py, "now", 0.0)?;
        let events = self.lock().advance(now).map_err(|e| to_py(py, e))?;
        events
            .iter()
            .map(|e| match e {
                LiveEvent::FirstToken { id, time, cached_tokens } => PyTuple::new(
                    py,
                    [
                        "first_token".into_pyobject(py)?.into_any(),
                        id_to_py(py, id)?,
                        time.into_pyobject(py)?.into_any(),
                        cached_tokens.into_pyobject(py)?.into_any(),
                    ],
                ),
                LiveEvent::Tokens { id, time, generated } => PyTuple::new(
                    py,
                    [
                        "tokens".into_pyobject(py)?.into_any(),
                        id_to_py(py, id)?,
                        time.into_pyobject(py)?.into_any(),
                        generated.into_pyobject(py)?.into_any(),
                    ],
                ),
                LiveEvent::Finish { id, time } => PyTuple::new(
                    py,
                    [
                        "finish".into_pyobject(py)?.into_any(),
                        id_to_py(py, id)?,
                        time.into_pyobject(py)?.into_any(),
                    ],
                ),
            })
            .collect()
    }

    /// Drop a request (client gone); returns whether it was in the engine.
    fn cancel(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = id(request_id, "request_id")?;
        Ok(self.lock().cancel(&rid))
    }

    /// Empty the prefix cache of every block no running request holds (vLLM's
    /// ``reset_prefix_cache``); returns the KV blocks emptied.
    fn reset_prefix_cache(&self) -> u64 {
        self.lock().reset_prefix_cache()
    }

    /// Log the KV pool's stores, evictions and resets for :meth:`take_kv_events` (off at
    /// first; turning it off drops what is logged).
    fn record_kv_events(&self, on: &Bound<'_, PyAny>) -> PyResult<()> {
        let on = flag(on, "on")?;
        self.lock().record_kv_events(on);
        Ok(())
    }

    /// The pool's changes since the last call, oldest first: `("stored", key)` when a key is
    /// cached, `("removed", key)` when it is evicted (or a reset drops it while running
    /// requests keep others), `("cleared", None)` when a reset empties the pool.
    fn take_kv_events(&self) -> Vec<(&'static str, Option<u64>)> {
        let events = self.lock().take_kv_events();
        events
            .into_iter()
            .map(|e| match e {
                PoolEvent::Stored(k) => ("stored", Some(k)),
                PoolEvent::Removed(k) => ("removed", Some(k)),
                PoolEvent::Cleared => ("cleared", None),
            })
            .collect()
    }

    /// running, waiting, kv_used_blocks, kv_cached_blocks, kv_total_blocks, kv_usage,
    /// prefix_cache_queries, prefix_cache_hits (tokens), preemptions, finished, steps, now.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let eng = self.lock();
        let s = eng.stats();
        let d = PyDict::new(py);
        d.set_item("running", s.running)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("kv_used_blocks", s.kv_used_blocks)?;
        d.set_item("kv_cached_blocks", s.kv_cached_blocks)?;
        d.set_item("kv_total_blocks", s.kv_total_blocks)?;
        d.set_item("kv_usage", s.kv_used_blocks as f64 / s.kv_total_blocks.max(1) as f64)?;
        d.set_item("prefix_cache_queries", s.counters.prefix_queries)?;
        d.set_item("prefix_cache_hits", s.counters.prefix_hits)?;
        d.set_item("preemptions", s.counters.preemptions)?;
        d.set_item("finished", s.counters.finished)?;
        d.set_item("steps", s.counters.steps)?;
        d.set_item("now", eng.now())?;
        Ok(d)
    }

    /// Every engine parameter (derived KV capacity filled in).
    #[getter]
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.lock().params().to_pairs() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The preset it was built from.
    #[getter]
    fn preset(&self) -> &str {
        &self.preset
    }

    /// Requests submitted and not finished or cancelled.
    #[getter]
    fn active(&self) -> usize {
        self.lock().active()
    }

    fn __repr__(&self) -> String {
        let e = self.lock();
        let s = e.stats();
        format!(
            "EngineModel(preset={:?}, running={}, waiting={}, now={})",
            self.preset,
            s.running,
            s.waiting,
            e.now()
        )
    }
}
