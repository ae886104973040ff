//! `kvroute._core.Relay`: the proxy's data path (`kvroute_core::relay`, on hyper) behind a
//! Python class. The Python proxy binds the listening socket, runs the control plane (the
//! side application, health checks, admin), and hands the relay a `hooks` object whose
//! methods the relay's threads call with the GIL: `key(body, chat, session_header)` →
//! `(keys, input_length, stream, session, tail)` or `(status, error_body)` (`tail`: the
//! prompt's ids after its last full block, None unless keyed by token ids);
//! `output(answer, stream)` → `(ids, generated)` or None (the tokens an answer generated, when
//! the router models vLLM's cache rule); `failure(index)`;
//! `success(index)`; `log_error(message)`; and its attribute `key_may_block` says whether
//! `key` may wait on the network (it then runs on a thread of its own), and `output_from_text`
//! whether `output` can tokenize text (else it only gets answers with `token_ids`). With a
//! `model` (`kvroute._core.TextModel`) the relay keys text and chat bodies itself and reads
//! answers' output itself (`output` is asked only of answers it is not sure of).
//!
//! Thread-safety: the relay's thread never holds the router lock while it waits for the GIL
//! (lock order GIL → router, as in `router.rs`); `stop` waits without the GIL.

use std::net::TcpListener;
use std::os::unix::io::FromRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::relay::admission::AdmissionConfig;
use kvroute_core::relay::connect::Address;
use kvroute_core::relay::stats::{ErrorKind, Stats};
use kvroute_core::relay::stats::{Histogram, BRANCHES};
use kvroute_core::relay::{Backend, Backends, Hooks, Keyed, Refusal, Relay, RelayConfig};
use kvroute_core::CacheRule;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::convert::{keys, optional_id, token_ids};
use crate::errors::invalid;
use crate::router::PyRouter;
use crate::text::PyTextModel;

struct PyHooks {
    hooks: Py<PyAny>,
    key_may_block: bool,
}

const INTERNAL: &[u8] =
    br#"{"error":{"message":"internal proxy error","type":"internal_error","param":null,"code":500}}"#;

impl PyHooks {
    fn call_key(
        &self,
        py: Python<'_>,
        body: &[u8],
        chat: bool,
        header: Option<&str>,
    ) -> PyResult<Result<Keyed, Refusal>> {
        let got = self.hooks.bind(py).call_method1("key", (PyBytes::new(py, body), chat, header))?;
        let got = got.cast::<PyTuple>()?;
        if got.len() == 2 {
            let status: u16 = got.get_item(0)?.extract()?;
            let body: Vec<u8> = got.get_item(1)?.extract()?;
            return Ok(Err(Refusal { status, body }));
        }
        let k = keys(&got.get_item(0)?, "keys")?;
        let tail = got.get_item(4)?;
        Ok(Ok(Keyed {
            keys: k.as_slice().to_vec(),
            input_length: got.get_item(1)?.extract()?,
            stream: got.get_item(2)?.extract()?,
            session: optional_id(Some(&got.get_item(3)?), "session")?,
            tail: if tail.is_none() { None } else { Some(token_ids(&tail, "tail")?) },
        }))
    }

    fn call_output(&self, py: Python<'_>, answer: &[u8], stream: bool) -> PyResult<Option<(Vec<u32>, u64)>> {
        let got = self.hooks.bind(py).call_method1("output", (PyBytes::new(py, answer), stream))?;
        if got.is_none() {
            return Ok(None);
        }
        let got = got.cast::<PyTuple>()?;
        Ok(Some((token_ids(&got.get_item(0)?, "output ids")?, got.get_item(1)?.extract()?)))
    }

    fn call(&self, method: &str, arg: impl for<'py> IntoPyObject<'py>) {
        Python::attach(|py| {
            if let Err(e) = self.hooks.bind(py).call_method1(method, (arg,)) {
                e.write_unraisable(py, None);
            }
        });
    }
}

impl Hooks for PyHooks {
    fn key(&self, body: &[u8], chat: bool, session_header: Option<&str>) -> Result<Keyed, Refusal> {
        Python::attach(|py| {
            self.call_key(py, body, chat, session_header).unwrap_or_else(|e| {
                e.write_unraisable(py, None);
                Err(Refusal { status: 500, body: INTERNAL.to_vec() })
            })
        })
    }

    fn key_may_block(&self) -> bool {
        self.key_may_block
    }

    fn output(&self, answer: &[u8], stream: bool) -> Option<(Vec<u32>, u64)> {
        Python::attach(|py| {
            self.call_output(py, answer, stream).unwrap_or_else(|e| {
                e.write_unraisable(py, None);
                None
            })
        })
    }

    fn failure(&self, index: usize) {
        self.call("failure", index);
    }

    fn success(&self, index: usize) {
        self.call("success", index);
    }

    fn log_error(&self, message: &str) {
        self.call("log_error", message);
    }
}

/// The data path of `kvroute proxy` (see the module doc).
#[pyclass(frozen, name = "Relay", module = "kvroute._core")]
pub struct PyRelay {
    relay: Mutex<Option<Relay>>,
    backends: Arc<Backends>,
    stats: Arc<Stats>,
}

fn seconds(py: Python<'_>, value: f64, name: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| invalid(py, format!("{name} must be positive, got {value}")))
}

fn seconds_or_zero(py: Python<'_>, value: f64, name: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| invalid(py, format!("{name} must be >= 0, got {value}")))
}

/// `(keys, input_length, stream, session)` of a relay keying, for Python.
fn keyed_tuple<'py>(py: Python<'py>, k: Keyed) -> PyResult<Bound<'py, PyTuple>> {
    let session = match k.session {
        None => py.None().into_bound(py),
        Some(kvroute_core::Id::Int(i)) => i.into_pyobject(py)?.into_any(),
        Some(kvroute_core::Id::Str(s)) => s.into_pyobject(py)?.into_any(),
    };
    let keys = numpy::PyArray1::from_vec(py, k.keys).into_any();
    let items = [
        keys,
        k.input_length.into_pyobject(py)?.into_any(),
        k.stream.into_pyobject(py)?.to_owned().into_any(),
        session,
    ];
    PyTuple::new(py, items)
}

/// `block_size` as the relay's keying takes it: positive.
fn positive_block_size(py: Python<'_>, block_size: usize) -> PyResult<()> {
    match block_size {
        0 => Err(invalid(py, "block_size must be positive, got 0".into())),
        _ => Ok(()),
    }
}

/// The relay's own keying of a completions body with a token-id prompt:
/// `(keys, input_length, stream, session)`, or None when it leaves the body to the hooks
/// (`kvroute_core::relay::body`). For tests that hold it to the Python keyer.
#[pyfunction]
#[pyo3(signature = (body, block_size, session_field = None, session_header = None))]
pub fn relay_token_prompt<'py>(
    py: Python<'py>,
    body: &[u8],
    block_size: usize,
    session_field: Option<&str>,
    session_header: Option<&str>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    positive_block_size(py, block_size)?;
    kvroute_core::relay::body::token_prompt(body, block_size, session_field, session_header)
        .map(|k| keyed_tuple(py, k))
        .transpose()
}

/// The relay's own keying of a text completions or chat body with `model`, as
/// [`relay_token_prompt`] (`kvroute_core::relay::text`).
#[pyfunction]
#[pyo3(signature = (model, body, chat, block_size, session_field = None, session_header = None))]
pub fn relay_text_prompt<'py>(
    py: Python<'py>,
    model: &PyTextModel,
    body: &[u8],
    chat: bool,
    block_size: usize,
    session_field: Option<&str>,
    session_header: Option<&str>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    positive_block_size(py, block_size)?;
    let keyed = py.detach(|| {
        kvroute_core::relay::text_prompt(&model.model, body, chat, block_size, session_field, session_header)
    });
    keyed.map(|k| keyed_tuple(py, k)).transpose()
}

/// The relay's own reading of an answer's output: `(token_ids or None, text,
/// completion_tokens or None)`, or None when it leaves the answer to the hooks
/// (`kvroute_core::relay::output`). For tests that hold it to the Python reader.
#[pyfunction]
pub fn relay_answer_output(raw: &[u8], stream: bool) -> RelayOutput {
    kvroute_core::relay::output::answer_output(raw, stream).map(|o| (o.ids, o.text, o.generated))
}

type RelayOutput = Option<(Option<Vec<u32>>, String, Option<u64>)>;

/// `(scheme, host, port)` as the Python side writes addresses; scheme `http` or `unix`
/// (host: the socket path).
fn address(py: Python<'_>, (scheme, host, port): (String, String, u16), what: &str) -> PyResult<Address> {
    match scheme.as_str() {
        "http" => Ok(Address::Tcp(host, port)),
        "unix" => Ok(Address::Unix(PathBuf::from(host))),
        other => Err(invalid(py, format!("the relay cannot reach {other}:// ({what})"))),
    }
}

fn histogram<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyTuple>> {
    let (counts, sum) = h.read();
    PyTuple::new(py, [counts.into_pyobject(py)?.into_any(), sum.into_pyobject(py)?.into_any()])
}

fn errors<'py>(py: Python<'py>, counts: &[std::sync::atomic::AtomicU64]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (kind, c) in ErrorKind::ALL.iter().zip(counts) {
        d.set_item(kind.name(), c.load(std::sync::atomic::Ordering::Relaxed))?;
    }
    Ok(d)
}

#[pymethods]
impl PyRelay {
    #[new]
    #[pyo3(signature = (listen_fd, router, side, hooks, *, max_body, request_timeout_s, connect_timeout_s,
        max_concurrency, retries, session_header, session_field = None, decision_log = None, header_read_timeout_s = 30.0,
        body_read_timeout_s = 60.0, max_connections = 8192, upstream_idle_timeout_s = 30.0, model = None,
        queue_size = None, queue_timeout_s = 30.0, queue_patience_s = 0.5, priority_header = "x-priority", queue_hold_s = 0.0, queue_hold_yield_s = 5.0, first_tokens = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen_fd: i32,
        router: &PyRouter,
        side: (String, String, u16),
        hooks: Py<PyAny>,
        max_body: usize,
        request_timeout_s: f64,
        connect_timeout_s: f64,
        max_concurrency: usize,
        retries: usize,
        session_header: &str,
        session_field: Option<String>,
        decision_log: Option<PathBuf>,
        header_read_timeout_s: f64,
        body_read_timeout_s: f64,
        max_connections: usize,
        upstream_idle_timeout_s: f64,
        model: Option<&PyTextModel>,
        queue_size: Option<usize>,
        queue_timeout_s: f64,
        queue_patience_s: f64,
        priority_header: &str,
        queue_hold_s: f64,
        queue_hold_yield_s: f64,
        first_tokens: bool,
    ) -> PyResult<Self> {
        if listen_fd < 0 {
            return Err(invalid(py, format!("listen_fd must be a file descriptor, got {listen_fd}")));
        }
        if max_concurrency == 0 || max_body == 0 || max_connections == 0 {
            return Err(invalid(
                py,
                "max_body, max_concurrency and max_connections must be at least 1".into(),
            ));
        }
        let router_config = router.shared().lock().unwrap_or_else(|e| e.into_inner()).config().clone();
        let config = RelayConfig {
            max_body,
            request_timeout: seconds(py, request_timeout_s, "request_timeout_s")?,
            connect_timeout: seconds(py, connect_timeout_s, "connect_timeout_s")?,
            header_read_timeout: seconds(py, header_read_timeout_s, "header_read_timeout_s")?,
            body_read_timeout: seconds(py, body_read_timeout_s, "body_read_timeout_s")?,
            max_connections,
            upstream_idle_timeout: seconds(py, upstream_idle_timeout_s, "upstream_idle_timeout_s")?,
            max_concurrency,
            retries,
            session_header: session_header.to_ascii_lowercase(),
            session_field,
            block_size: usize::try_from(router_config.block_size).unwrap_or(usize::MAX),
            model_output: router_config.cache_rule == CacheRule::Vllm,
            output_from_text: hooks.bind(py).getattr("output_from_text")?.is_truthy()?,
            text: model.map(|m| Arc::clone(&m.model)),
            side: address(py, side, "the side application")?,
            decision_log,
            admission: match queue_size {
                None => None,
                Some(queue) => Some(AdmissionConfig {
                    queue,
                    max_wait: seconds(py, queue_timeout_s, "queue_timeout_s")?,
                    patience: seconds_or_zero(py, queue_patience_s, "queue_patience_s")?,
                    priority_header: priority_header.to_ascii_lowercase(),
                    hold: seconds_or_zero(py, queue_hold_s, "queue_hold_s")?,
                    hold_yield: seconds_or_zero(py, queue_hold_yield_s, "queue_hold_yield_s")?,
                }),
            },
            first_tokens,
        };
        // SAFETY: the caller hands over a listening socket it no longer uses (socket.detach()).
        let listener = unsafe { TcpListener::from_raw_fd(listen_fd) };
        let backends = Arc::new(Backends::default());
        let key_may_block = hooks.bind(py).getattr("key_may_block")?.is_truthy()?;
        let hooks: Arc<dyn Hooks> = Arc::new(PyHooks { hooks, key_may_block });
        let relay = Relay::start(listener, config, router.shared(), Arc::clone(&backends), hooks)
            .map_err(|e| invalid(py, format!("cannot start the relay: {e}")))?;
        let stats = relay.stats();
        Ok(Self { relay: Mutex::new(Some(relay)), backends, stats })
    }

    /// Where backend `index` (router instance `index`) is: `address` is `(scheme, host,
    /// port)`, scheme `http` or `unix` (host: the socket path).
    fn set_backend(
        &self,
        py: Python<'_>,
        index: usize,
        url: String,
        address: (String, String, u16),
        host: String,
        prefix: String,
    ) -> PyResult<()> {
        let (scheme, where_, port) = address;
        let address = match scheme.as_str() {
            "http" => Address::Tcp(where_, port),
            "unix" => Address::Unix(PathBuf::from(where_)),
            other => return Err(invalid(py, format!("the relay cannot reach {other}:// backends ({url})"))),
        };
        let failing = false.into();
        self.backends.set(index, Backend { url, address, host, prefix, failing });
        Ok(())
    }

    /// Mark backend `index` as having failures that a successful request should clear.
    fn set_failing(&self, index: usize, failing: bool) {
        if let Some(b) = self.backends.get(index) {
            b.failing.store(failing, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The counters: `{"backends": [per index: {"decisions": {branch: n}, "estimated",
    /// "reported", "prompt", "retries", "errors": {kind: n}, "ttft": (counts, sum), "e2e"}],
    /// "errors": {kind: n}, "routing": (counts, sum), "queue": {"waiting", "queued",
    /// "shed_full", "shed_timeout", "wait": (counts, sum)}}`; histogram counts are per bucket,
    /// the last one above every bound.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let out = PyDict::new(py);
        let mut backends = Vec::new();
        for b in self.stats.snapshot() {
            let d = PyDict::new(py);
            let decisions = PyDict::new(py);
            for (branch, c) in BRANCHES.iter().zip(&b.decisions) {
                decisions.set_item(branch.name(), c.load(Relaxed))?;
            }
            d.set_item("decisions", decisions)?;
            d.set_item("estimated", b.estimated.load(Relaxed))?;
            d.set_item("reported", b.reported.load(Relaxed))?;
            d.set_item("prompt", b.prompt.load(Relaxed))?;
            d.set_item("retries", b.retries.load(Relaxed))?;
            d.set_item("errors", errors(py, &b.errors)?)?;
            d.set_item("ttft", histogram(py, &b.ttft)?)?;
            d.set_item("e2e", histogram(py, &b.e2e)?)?;
            backends.push(d);
        }
        out.set_item("backends", backends)?;
        out.set_item("errors", errors(py, &self.stats.errors)?)?;
        out.set_item("routing", histogram(py, &self.stats.routing)?)?;
        let queue = PyDict::new(py);
        let q = &self.stats.queue;
        let waiting =
            self.relay.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, Relay::queue_waiting);
        queue.set_item("waiting", waiting)?;
        queue.set_item("queued", q.queued.load(Relaxed))?;
        queue.set_item("shed_full", q.shed_full.load(Relaxed))?;
        queue.set_item("shed_timeout", q.shed_timeout.load(Relaxed))?;
        queue.set_item("wait", histogram(py, &q.wait)?)?;
        out.set_item("queue", queue)?;
        Ok(out)
    }

    /// The first tokens sampled since the last call, oldest first (the newest 4,096 are
    /// kept): per streamed request answered on its first attempt, `(pending_prefill_tokens,
    /// num_requests, ongoing_decode_tokens)` of its engine just before the decision, its
    /// `new_prefill` and `input_length`, and the seconds from the decision to its first byte.
    fn take_first_tokens(&self) -> Vec<(u64, u64, u64, u64, u64, f64)> {
        let taken = self.stats.first_tokens.take();
        taken
            .into_iter()
            .map(|s| {
                let l = s.load;
                (
                    l.pending_prefill_tokens,
                    l.num_requests,
                    l.ongoing_decode_tokens,
                    s.new_prefill,
                    s.input_length,
                    s.seconds,
                )
            })
            .collect()
    }

    /// Write out the decision log's buffer.
    fn flush_log(&self) {
        if let Some(r) = self.relay.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            r.flush_log();
        }
    }

    /// Stop: no new connections; requests being answered get `grace_s` seconds, then every
    /// connection closes. Idempotent.
    #[pyo3(signature = (grace_s = 5.0))]
    fn stop(&self, py: Python<'_>, grace_s: f64) {
        let taken = self.relay.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut relay) = taken {
            let grace = Duration::try_from_secs_f64(grace_s).unwrap_or(Duration::ZERO);
            py.detach(move || relay.stop(grace));
        }
    }
}
