//! `_core.simulate_runs`, `_core.engine_params`, `_core.engine_presets` and the
//! `EngineModel` class ([`engine_model`]): the simulator of `kvroute_core::sim`.
//!
//! Traces arrive as dicts of contiguous numpy columns (built by `kvroute.sim`), borrowed,
//! not copied; results leave as dicts of numpy arrays built from the run's own vectors
//! (moved, not copied). Runs execute on a scoped worker thread (rayon inside, every core)
//! while the calling thread waits without the GIL, waking every 100 ms to run Python's
//! signal handlers: Ctrl-C cancels the runs and raises `KeyboardInterrupt`. No shared state.

pub mod engine_model;

use crate::worker::run_interruptible;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_core::sim::{
    run_many, EngineParams, KeyChunks, Mode, PreparedTrace, RouterCache, RunConfig, SimAdmission, SimOutput,
    SimTrace,
};
use kvroute_core::{Policy, PolicyParams};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{invalid, to_py, wrong_type};

/// Names of the engine presets.
#[pyfunction]
pub fn engine_presets() -> Vec<&'static str> {
    kvroute_core::sim::params::PRESETS.to_vec()
}

/// Every engine parameter of `preset` with `overrides` applied (derived KV capacity filled in).
#[pyfunction]
#[pyo3(signature = (preset = "h20-qwen3-coder-30b-a3b", overrides = None))]
pub fn engine_params<'py>(
    py: Python<'py>,
    preset: &str,
    overrides: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let p = build_params(py, preset, overrides)?;
    let d = PyDict::new(py);
    for (k, v) in p.to_pairs() {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// A preset with overrides, validated; errors name the parameter.
pub fn build_params(
    py: Python<'_>,
    preset: &str,
    overrides: Option<&Bound<'_, PyDict>>,
) -> PyResult<EngineParams> {
    let mut p = EngineParams::preset(preset).map_err(|e| to_py(py, e))?;
    if let Some(o) = overrides {
        for (k, v) in o.iter() {
            let name: String =
                k.extract().map_err(|_| wrong_type(py, "engine parameter names must be str".into()))?;
            if v.is_instance_of::<pyo3::types::PyBool>() {
                return Err(wrong_type(py, format!("engine parameter {name} must be a number, got bool")));
            }
            let value: f64 = v.extract().map_err(|_| {
                wrong_type(
                    py,
                    format!(
                        "engine parameter {name} must be a number, got {}",
                        v.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ),
                )
            })?;
            p.set(&name, value).map_err(|e| to_py(py, e))?;
        }
    }
    p.validate().map_err(|e| to_py(py, e))?;
    Ok(p)
}

fn get<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?.ok_or_else(|| invalid(d.py(), format!("missing {key:?}")))
}

fn slice<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, T>,
    name: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| invalid(py, format!("trace column {name} must be a contiguous array")))
}

struct Columns<'py> {
    ts: PyReadonlyArray1<'py, f64>,
    sess: PyReadonlyArray1<'py, u32>,
    turn: PyReadonlyArray1<'py, i32>,
    inp: PyReadonlyArray1<'py, i64>,
    out: PyReadonlyArray1<'py, i64>,
    off: PyReadonlyArray1<'py, i64>,
    keys: Vec<PyReadonlyArray1<'py, u64>>,
    ttp: Option<PyReadonlyArray1<'py, f64>>,
    block_size: u64,
}

fn columns<'py>(d: &Bound<'py, PyDict>) -> PyResult<Columns<'py>> {
    let ttp = get(d, "ttp")?;
    Ok(Columns {
        ts: get(d, "timestamp")?.extract()?,
        sess: get(d, "session")?.extract()?,
        turn: get(d, "turn")?.extract()?,
        inp: get(d, "input_length")?.extract()?,
        out: get(d, "output_length")?.extract()?,
        off: get(d, "offsets")?.extract()?,
        keys: get(d, "keys")?.extract()?,
        ttp: if ttp.is_none() { None } else { Some(ttp.extract()?) },
        block_size: get(d, "block_size")?.extract()?,
    })
}

fn view<'a>(py: Python<'_>, c: &'a Columns<'_>) -> PyResult<SimTrace<'a>> {
    Ok(SimTrace {
        timestamp: slice(py, &c.ts, "timestamp")?,
        session: slice(py, &c.sess, "session")?,
        turn: slice(py, &c.turn, "turn")?,
        input_length: slice(py, &c.inp, "input_length")?,
        output_length: slice(py, &c.out, "output_length")?,
        offsets: slice(py, &c.off, "offsets")?,
        keys: KeyChunks::new(c.keys.iter().map(|k| slice(py, k, "hash_ids")).collect::<PyResult<_>>()?),
        ttp: c.ttp.as_ref().map(|t| slice(py, t, "time_to_parent_chat")).transpose()?,
        block_size: c.block_size,
    })
}

fn run_config(py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<(usize, RunConfig)> {
    let err = |e| to_py(py, e);
    let policy = Policy::from_name(&get(d, "policy")?.extract::<String>()?).map_err(err)?;
    let rate: Option<f64> = get(d, "rate")?.extract()?;
    let mode = Mode::from_name(&get(d, "mode")?.extract::<String>()?, rate).map_err(err)?;
    let mut params = PolicyParams::default();
    let (mut cap, mut tokens, mut patience_s) = (0.0_f64, 0.0_f64, 0.5_f64);
    let (mut hold_s, mut hold_yield_s) = (0.0_f64, 5.0_f64);
    if let Some(pd) = d.get_item("params")? {
        for (k, v) in pd.cast::<PyDict>()?.iter() {
            let name: String = k.extract()?;
            let slot = match name.as_str() {
                "max_in_flight" => &mut cap,
                "max_in_flight_tokens" => &mut tokens,
                "queue_patience_s" => &mut patience_s,
                "queue_hold_s" => &mut hold_s,
                "queue_hold_yield_s" => &mut hold_yield_s,
                "overload_factor" => &mut params.overload_factor,
                "hit_ratio_gate" => &mut params.hit_ratio_gate,
                "cache_threshold" => &mut params.cache_threshold,
                "balance_rel" => &mut params.balance_rel,
                "overlap_weight" => &mut params.overlap_weight,
                "queued_weight" => &mut params.queued_weight,
                "dedup_weight" => &mut params.dedup_weight,
                "temperature" => &mut params.temperature,
                "ttft_slo_s" => &mut params.ttft_slo_s,
                "delay_weight" => &mut params.delay_weight,
                "balance_abs" => {
                    let v: f64 = v.extract()?;
                    if !(v >= 0.0 && v.fract() == 0.0) {
                        return Err(invalid(py, format!("balance_abs must be a whole number >= 0, got {v}")));
                    }
                    params.balance_abs = v as u64;
                    continue;
                }
                _ => {
                    return Err(invalid(
                        py,
                        format!(
                            "unknown policy parameter {name:?}; known: overload_factor, hit_ratio_gate, \
                         cache_threshold, balance_abs, balance_rel, overlap_weight, queued_weight, dedup_weight, temperature, ttft_slo_s, delay_weight, \
                         max_in_flight, max_in_flight_tokens, queue_patience_s, queue_hold_s, queue_hold_yield_s"
                        ),
                    ))
                }
            };
            *slot = v.extract()?;
        }
    }
    params.validate().map_err(err)?;
    for (name, v) in [("max_in_flight", cap), ("max_in_flight_tokens", tokens)] {
        if !(v >= 0.0 && v.fract() == 0.0 && v < 2f64.powi(53)) {
            return Err(invalid(py, format!("{name} must be a whole number >= 0 (0: no cap), got {v}")));
        }
    }
    for (name, v) in
        [("queue_patience_s", patience_s), ("queue_hold_s", hold_s), ("queue_hold_yield_s", hold_yield_s)]
    {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(invalid(py, format!("{name} must be a finite number >= 0, got {v}")));
        }
    }
    let cap_of = |v: f64| (v > 0.0).then_some(v as u64);
    let (max_in_flight, max_tokens) = (cap_of(cap), cap_of(tokens));
    let admission = (max_in_flight.is_some() || max_tokens.is_some()).then_some(SimAdmission {
        max_in_flight,
        max_tokens,
        patience_s,
        hold_s,
        hold_yield_s,
    });
    let engine = build_params(
        py,
        &get(d, "preset")?.extract::<String>()?,
        d.get_item("engine")?.as_ref().map(|e| e.cast::<PyDict>()).transpose()?,
    )?;
    let rc = get(d, "router_cache")?;
    let router_cache = if rc.is_none() {
        RouterCache::Unbounded
    } else if let Ok(s) = rc.extract::<String>() {
        match s.as_str() {
            "engine" => RouterCache::MatchEngine,
            "unbounded" => RouterCache::Unbounded,
            _ => {
                return Err(invalid(
                    py,
                    format!("router_cache must be 'engine', 'unbounded', None or a positive int, got {s:?}"),
                ))
            }
        }
    } else {
        let n: i64 = rc.extract()?;
        if n <= 0 {
            return Err(invalid(py, format!("router_cache must be positive, got {n}")));
        }
        RouterCache::Blocks(n as usize)
    };
    let instances: i64 = get(d, "instances")?.extract()?;
    if instances <= 0 {
        return Err(invalid(py, format!("instances must be positive, got {instances}")));
    }
    let seed: i64 = get(d, "seed")?.extract()?;
    let seed = u64::try_from(seed).map_err(|_| invalid(py, format!("seed must be >= 0, got {seed}")))?;
    Ok((
        get(d, "trace")?.extract()?,
        RunConfig {
            instances: instances as usize,
            policy,
            params,
            mode,
            seed,
            engine,
            router_cache,
            sample_interval: get(d, "sample_interval")?.extract()?,
            closed_form: get(d, "closed_form")?.extract()?,
            second_thread: false,
            admission,
        },
    ))
}

/// Run every config of `runs` (dicts, see `kvroute.sim`) over `traces` (dicts of numpy
/// columns), in parallel; one dict of numpy arrays per run, in order.
#[pyfunction]
pub fn simulate_runs<'py>(
    py: Python<'py>,
    traces: &Bound<'py, PyList>,
    runs: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyList>> {
    let cols = traces.iter().map(|t| columns(t.cast::<PyDict>()?)).collect::<PyResult<Vec<_>>>()?;
    let views = cols.iter().map(|c| view(py, c)).collect::<PyResult<Vec<_>>>()?;
    let configs = runs.iter().map(|r| run_config(py, r.cast::<PyDict>()?)).collect::<PyResult<Vec<_>>>()?;
    if let Some((t, _)) = configs.iter().find(|(t, _)| *t >= views.len()) {
        return Err(invalid(py, format!("run refers to trace {t}, only {} given", views.len())));
    }
    let cancel = AtomicBool::new(false);
    let results = wait(py, &cancel, || {
        let prepared = views.into_iter().map(PreparedTrace::new).collect::<Result<Vec<_>, _>>()?;
        Ok(run_many(&prepared, &configs, &cancel))
    })?
    .map_err(|e| to_py(py, e))?;
    let out = PyList::empty(py);
    for r in results {
        match r.map_err(|e| to_py(py, e))? {
            Some(o) => out.append(output(py, o)?)?,
            None => return Err(PyRuntimeError::new_err("kvroute: simulation cancelled")),
        }
    }
    Ok(out)
}

fn output(py: Python<'_>, o: SimOutput) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let r = o.records;
    d.set_item("instance", r.instance.into_pyarray(py))?;
    d.set_item("send", r.send.into_pyarray(py))?;
    d.set_item("first_token", r.first_token.into_pyarray(py))?;
    d.set_item("finish", r.finish.into_pyarray(py))?;
    d.set_item("output_length", r.output_length.into_pyarray(py))?;
    d.set_item("cached_tokens", r.cached_tokens.into_pyarray(py))?;
    d.set_item("estimated_hit_tokens", r.estimated_hit_tokens.into_pyarray(py))?;
    d.set_item("queue_wait", r.queue_wait.into_pyarray(py))?;
    d.set_item("router_wait", r.router_wait.into_pyarray(py))?;
    d.set_item("preemptions", r.preemptions.into_pyarray(py))?;
    d.set_item("decode_overlaps_prefill", PyArray1::from_vec(py, r.decode_overlaps_prefill))?;
    d.set_item("error", r.error.into_pyarray(py))?;
    let s = o.series;
    let series = PyDict::new(py);
    series.set_item("time", s.time.into_pyarray(py))?;
    series.set_item("instance", s.instance.into_pyarray(py))?;
    series.set_item("running", s.running.into_pyarray(py))?;
    series.set_item("waiting", s.waiting.into_pyarray(py))?;
    series.set_item("kv_used_blocks", s.kv_used_blocks.into_pyarray(py))?;
    series.set_item("kv_cached_blocks", s.kv_cached_blocks.into_pyarray(py))?;
    d.set_item("series", series)?;
    let st = o.stats;
    let stats = PyDict::new(py);
    for (k, v) in [
        ("events", st.events),
        ("engine_steps", st.engine_steps),
        ("segments", st.segments),
        ("preemptions", st.preemptions),
        ("evictions", st.evictions),
        ("finished", st.finished),
        ("rejected", st.rejected),
        ("kv_total_blocks", st.kv_total_blocks),
        ("router_in_flight", st.router_in_flight),
        ("router_counters_sum", st.router_counters_sum),
        ("max_in_flight", st.max_in_flight),
        ("max_waiting", st.max_waiting),
        ("second_thread_settles", st.second_thread_settles),
    ] {
        stats.set_item(k, v)?;
    }
    stats.set_item("makespan", st.makespan)?;
    stats.set_item("wall_s", st.wall_s)?;
    d.set_item("stats", stats)?;
    Ok(d)
}

/// Run `work` off the GIL; on a signal set `cancel`, wait for the worker and raise.
fn wait<T: Send>(py: Python<'_>, cancel: &AtomicBool, work: impl FnOnce() -> T + Send) -> PyResult<T> {
    run_interruptible(py, "simulation", || py.check_signals(), || cancel.store(true, Ordering::Relaxed), work)
}
