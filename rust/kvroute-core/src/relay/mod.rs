//! The proxy's compiled data path: an HTTP/1.1 relay on hyper in front of a fleet of engines
//! that routes each generation request with the [`Router`] and relays the answer as it comes.
//!
//! - [`body`]: keying a token-id completions body without the hooks; `text`: keying a text
//!   or chat body with the model's tokenizer and chat template ([`crate::text`]), likewise.
//! - [`connect`]: backend addresses (TCP and Unix sockets) and connecting to them.
//! - `request`: a client's request as the relay holds it, the headers not passed on, and
//!   errors as one line.
//! - `pool`: keep-alive connections on hyper's HTTP/1.1 client, driven by their requests.
//! - `job`: one generation request's books: its place in the router, the backend an attempt
//!   went to, its output read by the hooks.
//! - `stream`: a streamed answer's body, relayed frame by frame.
//! - `forward`: one generation request: key, route, send, retry, answer, finish.
//! - [`admission`]: the queue requests wait in while no engine has room.
//! - `server`: client connections on hyper's server: reading requests, refusing bad ones,
//!   relaying the side application's requests.
//! - `reply`: answer bodies and JSON error bodies.
//! - [`output`]: what an answer generated (its token ids or text), for the router to record
//!   the blocks the engine stored for it.
//! - [`stats`]: counters and histograms for the metrics, and [`first_tokens`], the samples
//!   `ttft`'s costs are fitted from; `usage`: the usage an answer reports; `log`: the JSONL
//!   decision log.
//!
//! One event-loop thread (a single-threaded tokio runtime) serves every connection: a
//! relayed chunk costs one read and one write, with no interpreter and no thread switch.
//! `POST /v1/completions` and `POST /v1/chat/completions` are forwarded; every other request
//! goes to the side application (the control plane: health, metrics, admin) at
//! `RelayConfig::side`. What the relay cannot do by itself it asks of its [`Hooks`]: the keys
//! of a body it cannot key itself (without a model, text and chat; the `backend` tokenizer;
//! bodies it is not sure of), the output of an answer it cannot read itself (text without a
//! model, answers it is not sure of), and a backend's failures and recoveries (its health
//! state lives there). At most `max_connections` client connections are served at once;
//! one beyond gets a 503 and is closed.
//!
//! Thread-safety: the relay's state is shared with the caller's threads through an `Arc`;
//! the router is locked for each lifecycle step, never across an await or while a hook runs.

pub mod admission;
pub mod body;
pub mod connect;
pub mod first_tokens;
mod forward;
mod job;
mod log;
pub mod output;
mod pool;
mod reply;
mod request;
mod server;
pub mod stats;
mod stream;
mod text;
mod usage;

pub use text::text_prompt;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{watch, Notify, Semaphore};

use crate::{Id, Router};
use connect::Address;
use pool::Pool;
use stats::Stats;

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Largest request body accepted (413 above).
    pub max_body: usize,
    /// Longest wait for a backend's next bytes.
    pub request_timeout: Duration,
    /// Longest wait for a connection to a backend.
    pub connect_timeout: Duration,
    /// Longest wait for a request head to be complete, counted from when the connection
    /// waits for it (so it also closes an idle kept-alive connection).
    pub header_read_timeout: Duration,
    /// Longest wait for a request body to be complete once its head is read (408 after).
    pub body_read_timeout: Duration,
    /// Client connections served at once; one beyond gets a 503 and is closed.
    pub max_connections: usize,
    /// An idle upstream connection is closed after this long.
    pub upstream_idle_timeout: Duration,
    /// Generation requests forwarded at once; more wait.
    pub max_concurrency: usize,
    /// Further attempts on other backends after a failure before any byte reached the client.
    pub retries: usize,
    /// Lower-case name of the header that carries the session id.
    pub session_header: String,
    /// Body field that names the session when the header is absent.
    pub session_field: Option<String>,
    /// Tokens per block key (the router's).
    pub block_size: usize,
    /// Record the blocks each answer's output completes in the router (the router keeps
    /// vLLM's cache rule): through [`Hooks::output`], for requests keyed by token ids.
    pub model_output: bool,
    /// Whether the hooks can tokenize an answer's text (else only answers that carry
    /// `token_ids` go to [`Hooks::output`]).
    pub output_from_text: bool,
    /// The model's tokenizer and chat template: text and chat bodies are keyed with them in
    /// Rust (`text.rs`) instead of by the hooks, wherever they can be.
    pub text: Option<Arc<crate::text::TextModel>>,
    /// Where the other requests go.
    pub side: Address,
    /// JSONL decision log, when wanted.
    pub decision_log: Option<PathBuf>,
    /// Requests wait while no engine has room ([`admission`]); None: they are routed at once
    /// (overloaded engines all take part when every one is).
    pub admission: Option<admission::AdmissionConfig>,
    /// Keep a sample of each streamed first attempt's first token ([`first_tokens`]), for a
    /// control plane that fits `ttft`'s costs; off, nothing is kept.
    pub first_tokens: bool,
}

/// A request body's routing inputs, from [`Hooks::key`].
#[derive(Debug, Clone)]
pub struct Keyed {
    /// Block keys of the prompt.
    pub keys: Vec<u64>,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The session id, if any.
    pub session: Option<Id>,
    /// When the keys are of token ids: the prompt's ids after its last full block (the
    /// start of the first block its output may complete).
    pub tail: Option<Vec<u32>>,
}

/// An answer instead of forwarding (a body the API refuses): status and JSON body.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// The JSON error body.
    pub body: Vec<u8>,
}

/// What the relay asks of the code around it (the Python control plane).
pub trait Hooks: Send + Sync {
    /// The routing inputs of a generation request's body (`chat`: the chat endpoint), given
    /// the session header's value.
    fn key(&self, body: &[u8], chat: bool, session_header: Option<&str>) -> Result<Keyed, Refusal>;
    /// Whether [`Hooks::key`] and [`Hooks::output`] may wait on the network (then they run
    /// off the event loop).
    fn key_may_block(&self) -> bool;
    /// The token ids an answer (`stream`: its SSE body) generated, as far as they are known,
    /// and how many tokens it sampled: for answers the relay cannot read itself
    /// ([`output`]).
    fn output(&self, answer: &[u8], stream: bool) -> Option<(Vec<u32>, u64)>;
    /// Backend `index` failed a request (connection, 5xx, timeout, mid-stream).
    fn failure(&self, index: usize);
    /// Backend `index`, marked failing, served a request well.
    fn success(&self, index: usize);
    /// Something to log (an internal error).
    fn log_error(&self, message: &str);
}

/// One backend: where its requests go.
#[derive(Debug)]
pub struct Backend {
    /// Its URL (the metrics' and decision log's label).
    pub url: String,
    /// Its address.
    pub address: Address,
    /// The `Host` header of its requests.
    pub host: String,
    /// Path prefix of its URL (no trailing slash).
    pub prefix: String,
    /// Set while it has failures not yet cleared by a success: only then is
    /// [`Hooks::success`] called.
    pub failing: AtomicBool,
}

/// Backends by router instance index.
#[derive(Debug, Default)]
pub struct Backends(RwLock<Vec<Option<Arc<Backend>>>>);

impl Backends {
    /// Set (or replace) backend `index`.
    pub fn set(&self, index: usize, backend: Backend) {
        let mut all = self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if all.len() <= index {
            all.resize(index + 1, None);
        }
        all[index] = Some(Arc::new(backend));
    }

    /// Backend `index`, if set.
    pub fn get(&self, index: usize) -> Option<Arc<Backend>> {
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(index).cloned().flatten()
    }
}

/// What the relay's tasks share.
pub(crate) struct Shared {
    config: RelayConfig,
    router: Arc<Mutex<Router>>,
    backends: Arc<Backends>,
    hooks: Arc<dyn Hooks>,
    /// Keep-alive connections to the backends and the side application.
    pool: Pool,
    stats: Arc<Stats>,
    log: Option<log::DecisionLog>,
    admission: Option<admission::Admission>,
    next_request: AtomicI64,
    /// Generation requests forwarded at once (`max_concurrency` permits).
    forwarding: Arc<Semaphore>,
    /// Client connections open (`max_connections` permits).
    connections: Arc<Semaphore>,
    /// Some(grace) once stopping.
    stop: watch::Sender<Option<Duration>>,
    open: AtomicUsize,
    closed: Notify,
}

/// A running relay (see the module doc).
pub struct Relay {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    /// Serve `listener` (already bound and listening) until [`Relay::stop`].
    pub fn start(
        listener: TcpListener,
        config: RelayConfig,
        router: Arc<Mutex<Router>>,
        backends: Arc<Backends>,
        hooks: Arc<dyn Hooks>,
    ) -> std::io::Result<Relay> {
        let log = config.decision_log.as_deref().map(log::DecisionLog::open).transpose()?;
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let _entered = runtime.enter(); // the listener takes its reactor
        let shared = Arc::new(Shared {
            admission: config.admission.clone().map(admission::Admission::new),
            pool: Pool::new(config.connect_timeout, config.upstream_idle_timeout),
            forwarding: Arc::new(Semaphore::new(config.max_concurrency.min(Semaphore::MAX_PERMITS))),
            connections: Arc::new(Semaphore::new(config.max_connections.min(Semaphore::MAX_PERMITS))),
            config,
            router,
            backends,
            hooks,
            stats: Arc::new(Stats::default()),
            log,
            next_request: AtomicI64::new(1),
            stop: watch::Sender::new(None),
            open: AtomicUsize::new(0),
            closed: Notify::new(),
        });
        let listener = tokio::net::TcpListener::from_std(listener)?;
        drop(_entered);
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("kvroute-relay".into()).spawn(move || {
            runtime.block_on(run(Arc::clone(&sh), listener));
            runtime.shutdown_timeout(Duration::from_secs(1));
            sh.pool.clear();
        })?;
        Ok(Relay { shared, thread: Some(thread) })
    }

    /// The counters.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.shared.stats)
    }

    /// Requests waiting in the admission queue now.
    pub fn queue_waiting(&self) -> usize {
        self.shared.admission.as_ref().map_or(0, admission::Admission::waiting)
    }

    /// Write out the decision log's buffer.
    pub fn flush_log(&self) {
        if let Some(log) = &self.shared.log {
            log.flush();
        }
    }

    /// Stop accepting; let requests being answered finish for up to `grace`, then close every
    /// connection. Blocks until the relay's thread has ended.
    pub fn stop(&mut self, grace: Duration) {
        self.shared.stop.send_replace(Some(grace));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.flush_log();
    }
}

impl Drop for Relay {
    /// Stop at once without waiting for the relay's thread, which may be waiting for
    /// whatever the dropping thread holds (the GIL, for one): it ends by itself.
    fn drop(&mut self) {
        self.shared.stop.send_replace(Some(Duration::ZERO));
    }
}

/// The event loop's main task: accept until stopped, then wait for open connections (up to
/// the grace period); the runtime drops whatever is left.
async fn run(sh: Arc<Shared>, listener: tokio::net::TcpListener) {
    let mut stop = sh.stop.subscribe();
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    let mut accept_errors = Throttled::default();
    let mut busy = Throttled::default();
    let grace = loop {
        if let Some(grace) = *stop.borrow() {
            break grace;
        }
        tokio::select! {
            got = listener.accept() => match got {
                Ok((stream, _)) => {
                    sh.open.fetch_add(1, Ordering::SeqCst);
                    let conn = Arc::clone(&sh);
                    match Arc::clone(&sh.connections).try_acquire_owned() {
                        Ok(slot) => tokio::spawn(async move {
                            let _open = (Open(&conn), slot);
                            server::serve(Arc::clone(&conn), stream).await;
                        }),
                        Err(_) => {
                            busy.note(sh.hooks.as_ref(), "the connection limit is reached; answering 503");
                            tokio::spawn(async move {
                                let _open = Open(&conn);
                                server::refuse_busy(Arc::clone(&conn), stream).await;
                            })
                        }
                    };
                }
                Err(e) => {
                    accept_errors.note(sh.hooks.as_ref(), &format!("accept failed: {e}; retrying"));
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = sweep.tick() => sh.pool.sweep(),
            _ = stop.changed() => {}
        }
    };
    drop(listener);
    let deadline = tokio::time::sleep(grace);
    tokio::pin!(deadline);
    loop {
        let closed = sh.closed.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        if sh.open.load(Ordering::SeqCst) == 0 {
            return;
        }
        tokio::select! {
            () = closed => {}
            () = &mut deadline => return,
        }
    }
}

/// How often a recurring condition is logged at most (failures to accept a connection: out
/// of file descriptors, they come back at every retry; connections beyond the cap).
const LOG_INTERVAL: Duration = Duration::from_secs(5);

/// A recurring condition, logged at most once per [`LOG_INTERVAL`] with how many more
/// times it came since the last line.
#[derive(Default)]
struct Throttled {
    logged: Option<std::time::Instant>,
    since: u64,
}

impl Throttled {
    fn note(&mut self, hooks: &dyn Hooks, message: &str) {
        let now = std::time::Instant::now();
        if self.logged.is_some_and(|t| now.duration_since(t) < LOG_INTERVAL) {
            self.since += 1;
            return;
        }
        let more = match self.since {
            0 => String::new(),
            n => format!(" ({n} more times since the last report)"),
        };
        hooks.log_error(&format!("{message}{more}"));
        (self.logged, self.since) = (Some(now), 0);
    }
}

/// Counts an open connection while its task lives (however it ends).
struct Open<'a>(&'a Shared);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
        self.0.closed.notify_waiters();
    }
}
