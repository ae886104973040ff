//! `kvroute.Router`: the core router behind a mutex, so one instance can be shared by
//! several Python threads and the relay's threads. Each call holds the lock for one O(keys + instances) step and
//! never releases the GIL while holding it, so lock order is always GIL → router.

use std::sync::{Arc, Mutex, MutexGuard};

use std::time::Duration;

use kvroute_core::router::MAX_INSTANCES;
use kvroute_core::{
    CacheRule, CacheView, LoadSource, OverloadRule, Policy, PolicyParams, Router, RouterConfig,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{self, count, id, keys, optional_id, IntArg, RealArg, TextArg};
use crate::errors::{invalid, to_py};
use crate::kv_events::{applied_dict, batch_of, view_dict};
use crate::sim::build_params;

/// A KV-cache-aware router over `num_instances` engines (see the `kvroute` docs).
#[pyclass(frozen, name = "Router", module = "kvroute._core")]
pub struct PyRouter {
    inner: Arc<Mutex<Router>>,
}

impl PyRouter {
    /// The router itself, for the relay's threads (which lock it without the GIL).
    pub fn shared(&self) -> Arc<Mutex<Router>> {
        Arc::clone(&self.inner)
    }

    fn lock(&self) -> MutexGuard<'_, Router> {
        // A panic inside the core cannot leave the counters half-updated in a way later
        // calls could not tolerate, so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The engine preset whose costs `ttft` predicts with, under the profile's parameters.
const TTFT_PRESET: &str = "h20-qwen3-coder-30b-a3b";

/// The largest size argument (blocks, sessions, tokens) a router takes: 2**40.
const MAX_SIZE: i128 = 1 << 40;

/// An optional size in `1..=MAX_SIZE`.
fn size(py: Python<'_>, arg: Option<IntArg>, name: &str) -> PyResult<Option<usize>> {
    arg.map(|a| a.get(py, name, 1, MAX_SIZE)).transpose()
}

#[pymethods]
impl PyRouter {
    #[new]
    #[pyo3(signature = (num_instances, policy = TextArg::of("unified"), *, block_size = IntArg::of(512), cache_capacity_blocks = None,
        cache_rule = TextArg::of("trace"), max_sessions = None, overload_factor = RealArg::of(2.0), hit_ratio_gate = RealArg::of(0.5),
        seed = IntArg::of(0), cache_threshold = RealArg::of(0.5), balance_abs = IntArg::of(32),
        balance_rel = RealArg::of(1.1), overlap_weight = RealArg::of(1.0), queued_weight = RealArg::of(0.0),
        dedup_weight = RealArg::of(0.0), temperature = RealArg::of(0.0),
        cache_view = TextArg::of("estimate"), pending_ttl_s = RealArg::of(10.0), affinity = TextArg::of("map"),
        load_source = TextArg::of("router"), engine_profile = None, ttft_slo_s = RealArg::of(0.0),
        delay_weight = RealArg::of(0.0)),
        text_signature = "(num_instances, policy='unified', *, block_size=512, cache_capacity_blocks=None, \
        cache_rule='trace', max_sessions=None, overload_factor=2.0, hit_ratio_gate=0.5, seed=0, cache_threshold=0.5, \
        balance_abs=32, balance_rel=1.1, overlap_weight=1.0, queued_weight=0.0, dedup_weight=0.0, temperature=0.0, cache_view='estimate', pending_ttl_s=10.0, affinity='map', \
        load_source='router', engine_profile=None, ttft_slo_s=0.0, delay_weight=0.0)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_instances: IntArg,
        policy: TextArg,
        block_size: IntArg,
        cache_capacity_blocks: Option<IntArg>,
        cache_rule: TextArg,
        max_sessions: Option<IntArg>,
        overload_factor: RealArg,
        hit_ratio_gate: RealArg,
        seed: IntArg,
        cache_threshold: RealArg,
        balance_abs: IntArg,
        balance_rel: RealArg,
        overlap_weight: RealArg,
        queued_weight: RealArg,
        dedup_weight: RealArg,
        temperature: RealArg,
        cache_view: TextArg,
        pending_ttl_s: RealArg,
        affinity: TextArg,
        load_source: TextArg,
        engine_profile: Option<Bound<'_, PyDict>>,
        ttft_slo_s: RealArg,
        delay_weight: RealArg,
    ) -> PyResult<Self> {
        let max_instances = MAX_INSTANCES as i128;
        let n: usize = num_instances.get(py, "num_instances", 0, max_instances)?;
        let policy = Policy::from_name(policy.get(py, "policy")?).map_err(|e| to_py(py, e))?;
        let real = |arg: &RealArg, name: &str| arg.get(py, name, f64::MIN);
        let config = RouterConfig {
            block_size: block_size.get(py, "block_size", 1, MAX_SIZE)?,
            cache_capacity_blocks: size(py, cache_capacity_blocks, "cache_capacity_blocks")?,
            cache_rule: CacheRule::from_name(cache_rule.get(py, "cache_rule")?).map_err(|e| to_py(py, e))?,
            max_sessions: size(py, max_sessions, "max_sessions")?,
            seed: seed.get(py, "seed", 0, u64::MAX.into())?,
            params: PolicyParams {
                overload_factor: real(&overload_factor, "overload_factor")?,
                hit_ratio_gate: real(&hit_ratio_gate, "hit_ratio_gate")?,
                cache_threshold: real(&cache_threshold, "cache_threshold")?,
                balance_abs: balance_abs.get(py, "balance_abs", 0, u64::MAX.into())?,
                balance_rel: real(&balance_rel, "balance_rel")?,
                overlap_weight: real(&overlap_weight, "overlap_weight")?,
                queued_weight: real(&queued_weight, "queued_weight")?,
                dedup_weight: real(&dedup_weight, "dedup_weight")?,
                temperature: real(&temperature, "temperature")?,
                ttft_costs: Some(build_params(py, TTFT_PRESET, engine_profile.as_ref())?.ttft_costs()),
                ttft_slo_s: real(&ttft_slo_s, "ttft_slo_s")?,
                delay_weight: real(&delay_weight, "delay_weight")?,
            },
            cache_view: CacheView::from_name(cache_view.get(py, "cache_view")?).map_err(|e| to_py(py, e))?,
            pending_ttl: Duration::from_secs_f64(pending_ttl_s.get(py, "pending_ttl_s", 0.0)?.min(1e9)),
            shared_affinity: match affinity.get(py, "affinity")? {
                "map" => false,
                "shared" => true,
                other => {
                    return Err(invalid(py, format!("affinity must be 'map' or 'shared', got {other:?}")))
                }
            },
            load_source: LoadSource::from_name(load_source.get(py, "load_source")?)
                .map_err(|e| to_py(py, e))?,
        };
        let router = Router::new(n, policy, config).map_err(|e| to_py(py, e))?;
        Ok(Self { inner: Arc::new(Mutex::new(router)) })
    }

    /// Pick an instance for a request and count it there; returns the instance index.
    #[pyo3(signature = (request_id, hash_ids, input_length, session_id = None))]
    fn route(
        &self,
        request_id: &Bound<'_, PyAny>,
        hash_ids: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
        session_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        self.route_info_impl(request_id, hash_ids, input_length, session_id).map(|d| d.instance)
    }

    /// Like `route`, returning the decision: instance, hit_tokens, new_prefill, branch.
    #[pyo3(signature = (request_id, hash_ids, input_length, session_id = None))]
    fn route_info<'py>(
        &self,
        request_id: &Bound<'py, PyAny>,
        hash_ids: &Bound<'py, PyAny>,
        input_length: &Bound<'py, PyAny>,
        session_id: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = self.route_info_impl(request_id, hash_ids, input_length, session_id)?;
        let out = PyDict::new(request_id.py());
        out.set_item("instance", d.instance)?;
        out.set_item("hit_tokens", d.hit_tokens)?;
        out.set_item("new_prefill", d.new_prefill)?;
        out.set_item("branch", d.branch.name())?;
        Ok(out)
    }

    /// The request's first token came back. Returns whether anything changed.
    fn first_token(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = id(request_id, "request_id")?;
        Ok(self.lock().first_token(&rid))
    }

    /// The request ended (success, error or abort). Returns whether it was in flight.
    fn finish(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = id(request_id, "request_id")?;
        Ok(self.lock().finish(&rid))
    }

    /// Estimated cached tokens of a request on one instance; changes nothing.
    fn estimate_cache_hit(
        &self,
        instance: &Bound<'_, PyAny>,
        hash_ids: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let inst = self.instance(instance)?;
        let keys = keys(hash_ids, "hash_ids")?;
        let n = count(input_length, "input_length")?;
        self.lock().estimate_cache_hit(inst, keys.as_slice(), n).map_err(|e| to_py(instance.py(), e))
    }

    /// Estimated cached tokens on every instance (one index walk per view); changes nothing.
    /// `view`: `"routing"` (the view routing reads for each instance), `"estimate"` or
    /// `"events"` (that view for every instance).
    #[pyo3(signature = (hash_ids, input_length, view = TextArg::of("routing")), text_signature = "($self, hash_ids, input_length, view='routing')")]
    fn estimate_cache_hits(
        &self,
        hash_ids: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
        view: TextArg,
    ) -> PyResult<Vec<u64>> {
        let py = hash_ids.py();
        let view = match view.get(py, "view")? {
            "routing" => None,
            other => Some(CacheView::from_name(other).map_err(|_| {
                invalid(py, format!("view must be 'routing', 'estimate' or 'events', got {other:?}"))
            })?),
        };
        let keys = keys(hash_ids, "hash_ids")?;
        let n = count(input_length, "input_length")?;
        Ok(self.lock().estimate_cache_hits_in(keys.as_slice(), n, view))
    }

    /// One dict per instance: num_requests, ongoing_tokens, pending_prefill_tokens,
    /// ongoing_decode_tokens, cached_blocks, available, cache_view, engine (its last report:
    /// running, waiting, kv_usage, sent_since, outside; None without one), overloaded.
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let snapshot = self.lock().state();
        snapshot
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("num_requests", s.load.num_requests)?;
                d.set_item("ongoing_tokens", s.load.ongoing_tokens)?;
                d.set_item("pending_prefill_tokens", s.load.pending_prefill_tokens)?;
                d.set_item("ongoing_decode_tokens", s.load.ongoing_decode_tokens)?;
                d.set_item("cached_blocks", s.cached_blocks)?;
                d.set_item("available", s.load.available)?;
                d.set_item("cache_view", s.cache_view)?;
                let engine = s.engine.map(|e| -> PyResult<_> {
                    let r = PyDict::new(py);
                    r.set_item("running", e.running)?;
                    r.set_item("waiting", e.waiting)?;
                    r.set_item("kv_usage", e.kv_usage)?;
                    r.set_item("sent_since", e.sent_since)?;
                    r.set_item("outside", e.outside)?;
                    Ok(r)
                });
                d.set_item("engine", engine.transpose()?)?;
                d.set_item("overloaded", s.overloaded)?;
                Ok(d)
            })
            .collect()
    }

    /// Predict `ttft`'s times with these step costs from now on (costs refitted while
    /// serving): engine parameters by name, as in an engine profile's `params`.
    fn set_ttft_costs(&self, py: Python<'_>, costs: Bound<'_, PyDict>) -> PyResult<()> {
        let c = build_params(py, TTFT_PRESET, Some(&costs))?.ttft_costs();
        self.lock().set_ttft_costs(c).map_err(|e| to_py(py, e))
    }

    /// The step costs `ttft` predicts with, by name.
    fn ttft_costs<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(c) = self.lock().config().params.ttft_costs.clone() else { return Ok(None) };
        let d = PyDict::new(py);
        for (name, value) in c.named() {
            d.set_item(name, value)?;
        }
        d.set_item("max_num_batched_tokens", c.max_num_batched_tokens)?;
        Ok(Some(d))
    }

    /// An instance's engine reports `running` and `waiting` requests and a KV-cache usage
    /// `kv_usage` (0 to 1) now; the overload rule reads it (with the requests sent since).
    fn set_engine_load(
        &self,
        instance: &Bound<'_, PyAny>,
        running: IntArg,
        waiting: IntArg,
        kv_usage: RealArg,
    ) -> PyResult<()> {
        let py = instance.py();
        let inst = self.instance(instance)?;
        let running = running.get(py, "running", 0, u64::MAX.into())?;
        let waiting = waiting.get(py, "waiting", 0, u64::MAX.into())?;
        let kv_usage = kv_usage.get(py, "kv_usage", 0.0)?;
        self.lock().set_engine_load(inst as i64, running, waiting, kv_usage).map_err(|e| to_py(py, e))
    }

    /// An instance's report is gone (a read failed or went stale).
    fn clear_engine_load(&self, instance: &Bound<'_, PyAny>) -> PyResult<()> {
        let inst = self.instance(instance)?;
        self.lock().clear_engine_load(inst as i64).map_err(|e| to_py(instance.py(), e))
    }

    /// Leave out of decisions an engine whose waiting requests (reported, plus those sent
    /// since) reach `waiting`, whose KV usage reaches `kv_usage`, or whose requests in flight
    /// (as the policies read them) reach `in_flight`, or whose prompt tokens in flight reach
    /// `tokens`, while another is under all four (None: that signal unused; all None: off).
    #[pyo3(signature = (waiting = None, kv_usage = None, in_flight = None, tokens = None))]
    fn set_overload_rule(
        &self,
        py: Python<'_>,
        waiting: Option<IntArg>,
        kv_usage: Option<RealArg>,
        in_flight: Option<IntArg>,
        tokens: Option<IntArg>,
    ) -> PyResult<()> {
        let rule = OverloadRule {
            waiting: waiting.map(|w| w.get(py, "waiting", 1, u64::MAX.into())).transpose()?,
            kv_usage: kv_usage.map(|k| k.get(py, "kv_usage", 0.0)).transpose()?,
            in_flight: in_flight.map(|w| w.get(py, "in_flight", 1, u64::MAX.into())).transpose()?,
            tokens: tokens.map(|w| w.get(py, "tokens", 1, u64::MAX.into())).transpose()?,
        };
        self.lock().set_overload_rule(rule).map_err(|e| to_py(py, e))
    }

    /// Whether some available instance is not overloaded (a request routed now has room).
    fn has_room(&self) -> bool {
        self.lock().has_room()
    }

    /// Mark an instance up (True) or down (False).
    fn set_available(&self, instance: &Bound<'_, PyAny>, flag: &Bound<'_, PyAny>) -> PyResult<()> {
        let inst = self.instance(instance)?;
        let up = convert::flag(flag, "flag")?;
        self.lock().set_available(inst as i64, up).map_err(|e| to_py(instance.py(), e))
    }

    /// Add an available instance with an empty cache; returns its index.
    fn add_instance(&self, py: Python<'_>) -> PyResult<usize> {
        self.lock().add_instance().map_err(|e| to_py(py, e))
    }

    /// The session's affinity instance, or None.
    fn session_affinity(&self, session_id: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let sid = id(session_id, "session_id")?;
        Ok(self.lock().session_affinity(&sid))
    }

    /// Number of sessions with an affinity instance (at most `max_sessions`).
    #[getter]
    fn num_sessions(&self) -> usize {
        self.lock().num_sessions()
    }

    /// Keys resident on an instance's cache model, most recently touched first.
    fn cached_keys(&self, instance: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let inst = self.instance(instance)?;
        self.lock().cached_keys(inst as i64).map_err(|e| to_py(instance.py(), e))
    }

    /// The engine stored more blocks for an in-flight request (vLLM keeps those its output
    /// completes): `hash_ids` are the request's whole sequence so far, full blocks only,
    /// touched on its instance. Returns whether the request was in flight.
    fn extend(&self, request_id: &Bound<'_, PyAny>, hash_ids: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = id(request_id, "request_id")?;
        let keys = keys(hash_ids, "hash_ids")?;
        Ok(self.lock().extend(&rid, keys.as_slice()))
    }

    /// Empty an instance's cache model (after its engine's prefix cache was reset); its
    /// counters and in-flight requests stay.
    fn clear_cache(&self, instance: &Bound<'_, PyAny>) -> PyResult<()> {
        let inst = self.instance(instance)?;
        self.lock().clear_cache(inst as i64).map_err(|e| to_py(instance.py(), e))
    }

    /// Bound an instance's estimate view to `capacity` blocks (None: unbounded), e.g. its
    /// engine's real KV capacity; its least recently touched blocks beyond it are evicted.
    fn set_cache_capacity(&self, instance: &Bound<'_, PyAny>, capacity: Option<IntArg>) -> PyResult<()> {
        let py = instance.py();
        let inst = self.instance(instance)?;
        let capacity = size(py, capacity, "capacity")?;
        self.lock().set_cache_capacity(inst as i64, capacity).map_err(|e| to_py(py, e))
    }

    /// Apply one batch of an instance's KV-cache events: `batch` is the msgpack payload vLLM
    /// publishes (the third frame of a message) or the same batch decoded (`[ts, events,
    /// rank]`), `seq` its sequence number (unsigned 64 bits), `replayed` whether it came from
    /// the engine's replay socket, `rank` the rank whose socket it came from (a batch naming
    /// another is refused). Returns `{"outcome": "applied" | "duplicate" | "gap" | "foreign",
    /// "expected", "reset", "degraded"}` (docs/kv-events.md). Needs `cache_view="events"`.
    #[pyo3(
        signature = (instance, seq, batch, *, replayed = None, rank = None),
        text_signature = "($self, instance, seq, batch, *, replayed=False, rank=None)"
    )]
    fn apply_kv_events<'py>(
        &self,
        instance: &Bound<'py, PyAny>,
        seq: IntArg,
        batch: &Bound<'py, PyAny>,
        replayed: Option<&Bound<'py, PyAny>>,
        rank: Option<IntArg>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let py = instance.py();
        let inst = self.instance(instance)?;
        let seq = seq.get(py, "seq", 0, u64::MAX.into())?;
        let replayed = replayed.map(|r| convert::flag(r, "replayed")).transpose()?.unwrap_or(false);
        let rank = rank.map(|r| r.get(py, "rank", 0, u32::MAX.into())).transpose()?;
        let batch = batch_of(batch, seq)?;
        let applied = self
            .lock()
            .apply_kv_events(inst as i64, seq, &batch, replayed, rank)
            .map_err(|e| to_py(py, e))?;
        applied_dict(py, &applied)
    }

    /// An instance's rank missed batches that cannot be replayed: its view turns degraded
    /// (routed on the estimate) and takes the next batch as a new start.
    fn kv_resync(&self, instance: &Bound<'_, PyAny>, rank: IntArg, reason: TextArg) -> PyResult<()> {
        let py = instance.py();
        let inst = self.instance(instance)?;
        let rank = rank.get(py, "rank", 0, u32::MAX.into())?;
        let reason = reason.get(py, "reason")?;
        self.lock().kv_resync(inst as i64, rank, reason).map_err(|e| to_py(py, e))
    }

    /// An instance's engine restarted: drop its events view until its sequence 0 arrives.
    fn kv_reset(&self, instance: &Bound<'_, PyAny>) -> PyResult<()> {
        let inst = self.instance(instance)?;
        self.lock().kv_reset(inst as i64).map_err(|e| to_py(instance.py(), e))
    }

    /// An instance's events view (`uses_events`, `blocks`, `pending`, and per rank its state,
    /// last sequence number and counters), or None with `cache_view="estimate"`.
    fn kv_view<'py>(&self, instance: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let py = instance.py();
        let inst = self.instance(instance)?;
        let report = self.lock().kv_view(inst as i64).map_err(|e| to_py(py, e))?;
        report.map(|r| view_dict(py, &r)).transpose()
    }

    /// Bytes of the events view's tables (0 with the estimate view).
    #[getter]
    fn kv_memory_bytes(&self) -> usize {
        self.lock().event_view().map_or(0, |v| v.memory_bytes())
    }

    /// The cache view: `"estimate"` or `"events"`.
    #[getter]
    fn cache_view(&self) -> &'static str {
        self.lock().config().cache_view.name()
    }

    /// The policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.lock().policy().name()
    }

    /// The cache rule: `"trace"` or `"vllm"`.
    #[getter]
    fn cache_rule(&self) -> &'static str {
        self.lock().config().cache_rule.name()
    }

    /// Number of instances ever added.
    #[getter]
    fn num_instances(&self) -> usize {
        self.lock().num_instances()
    }

    /// Tokens per block key.
    #[getter]
    fn block_size(&self) -> u64 {
        self.lock().config().block_size
    }

    /// Number of requests routed and not finished.
    #[getter]
    fn in_flight(&self) -> usize {
        self.lock().in_flight()
    }

    fn __repr__(&self) -> String {
        let r = self.lock();
        format!(
            "Router(num_instances={}, policy={:?}, block_size={}, in_flight={})",
            r.num_instances(),
            r.policy().name(),
            r.config().block_size,
            r.in_flight()
        )
    }
}

impl PyRouter {
    /// An instance index argument: an int naming an existing instance.
    fn instance(&self, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
        let count = self.lock().num_instances();
        convert::integer(obj, "instance")?
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < count)
            .ok_or_else(|| {
                let index = obj.extract::<i64>().unwrap_or(i64::MAX);
                to_py(obj.py(), kvroute_core::Error::UnknownInstance { index, count })
            })
    }

    fn route_info_impl(
        &self,
        request_id: &Bound<'_, PyAny>,
        hash_ids: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
        session_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<kvroute_core::Decision> {
        let py = request_id.py();
        let rid = id(request_id, "request_id")?;
        let keys = keys(hash_ids, "hash_ids")?;
        let n = count(input_length, "input_length")?;
        let sid = optional_id(session_id, "session_id")?;
        self.lock().route(rid, keys.as_slice(), n, sid.as_ref()).map_err(|e| to_py(py, e))
    }
}
