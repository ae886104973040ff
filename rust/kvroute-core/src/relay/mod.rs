//! The proxy's compiled data path: an HTTP/1.1 relay in front of a fleet of engines that
//! routes each generation request with the [`Router`] and relays the answer byte for byte.
//!
//! - [`http`]: HTTP/1.1 framing (heads, bodies, chunks).
//! - [`io`]: TCP and Unix stream sockets, polling two of them at once.
//! - [`upstream`]: keep-alive connections to the backends and reading one response.
//! - `front`: a client connection: reading requests, refusing bad ones, answering.
//! - `forward`: one generation request: key, route, send, retry, relay, finish.
//! - [`stats`]: counters and histograms for the metrics; `log`: the JSONL decision log.
//!
//! A thread per client connection, blocking sockets: a relayed chunk costs one `poll`, one
//! read and one write, with no interpreter and no task switch. `POST /v1/completions` and
//! `POST /v1/chat/completions` are forwarded; every other request goes to the side
//! application (the control plane: health, metrics, admin) at `RelayConfig::side`. What the
//! relay cannot do by itself it asks of its [`Hooks`]: the keys of a body (the tokenizer
//! lives there), and a backend's failures and recoveries (its health state lives there).
//!
//! Thread-safety: [`Relay`] is shared by its threads through an `Arc`; the router is locked
//! for each lifecycle step and never while a hook runs.

mod forward;
mod front;
pub mod http;
pub mod io;
mod log;
pub mod stats;
pub mod upstream;

use std::net::TcpListener;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Id, Router};
use io::{wait, Address, Ready};
use stats::Stats;
use upstream::Pool;

/// Lock a mutex; a panic elsewhere leaves the data usable (each update is a single step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Largest request body accepted (413 above).
    pub max_body: usize,
    /// Longest wait for a backend's next bytes.
    pub request_timeout: Duration,
    /// Longest wait for a connection to a backend.
    pub connect_timeout: Duration,
    /// A client connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// An idle upstream connection is closed after this long.
    pub upstream_idle_timeout: Duration,
    /// Generation requests forwarded at once; more wait.
    pub max_concurrency: usize,
    /// Further attempts on other backends after a failure before any byte reached the client.
    pub retries: usize,
    /// Lower-case name of the header that carries the session id.
    pub session_header: String,
    /// Where the other requests go.
    pub side: Address,
    /// JSONL decision log, when wanted.
    pub decision_log: Option<PathBuf>,
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

/// What the relay's threads share.
pub(crate) struct Shared {
    config: RelayConfig,
    router: Arc<Mutex<Router>>,
    backends: Arc<Backends>,
    hooks: Arc<dyn Hooks>,
    pool: Pool,
    stats: Arc<Stats>,
    log: Option<log::DecisionLog>,
    stopping: AtomicBool,
    next_request: AtomicI64,
    /// Generation requests being forwarded, bounded by `max_concurrency`.
    forwarding: (Mutex<usize>, Condvar),
    /// Open client connections, for shutdown: a clone of each socket and whether a request
    /// is being answered on it.
    connections: Mutex<Vec<(u64, std::net::TcpStream, Arc<AtomicBool>)>>,
    open: (Mutex<usize>, Condvar),
}

/// A running relay (see the module doc).
pub struct Relay {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
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
        let shared = Arc::new(Shared {
            pool: Pool::new(config.connect_timeout, config.upstream_idle_timeout),
            config,
            router,
            backends,
            hooks,
            stats: Arc::new(Stats::default()),
            log,
            stopping: AtomicBool::new(false),
            next_request: AtomicI64::new(1),
            forwarding: (Mutex::new(0), Condvar::new()),
            connections: Mutex::new(Vec::new()),
            open: (Mutex::new(0), Condvar::new()),
        });
        listener.set_nonblocking(true)?;
        let sh = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("kvroute-accept".into())
            .spawn(move || accept_loop(&sh, &listener))?;
        Ok(Relay { shared, acceptor: Some(acceptor) })
    }

    /// The counters.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.shared.stats)
    }

    /// Write out the decision log's buffer.
    pub fn flush_log(&self) {
        if let Some(log) = &self.shared.log {
            log.flush();
        }
    }

    /// Stop accepting; let requests being answered finish for up to `grace`, then close every
    /// connection.
    pub fn stop(&mut self, grace: Duration) {
        let sh = &self.shared;
        sh.stopping.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        sh.close_connections(false);
        let deadline = Instant::now() + grace;
        sh.wait_closed(deadline);
        sh.close_connections(true);
        sh.wait_closed(Instant::now() + Duration::from_secs(1));
        sh.pool.clear();
        self.flush_log();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.acceptor.is_some() {
            self.stop(Duration::ZERO);
        }
    }
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    fn close_connections(&self, busy_too: bool) {
        for (_, stream, busy) in lock(&self.connections).iter() {
            if busy_too || !busy.load(Ordering::SeqCst) {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn wait_closed(&self, deadline: Instant) {
        let (count, cv) = &self.open;
        let mut n = lock(count);
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            n = cv.wait_timeout(n, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    /// Wait for a forwarding slot; released when the guard drops.
    fn forwarding_slot(&self) -> SlotGuard<'_> {
        let (count, cv) = &self.forwarding;
        let mut n = lock(count);
        while *n >= self.config.max_concurrency {
            n = cv.wait(n).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *n += 1;
        SlotGuard(self)
    }
}

struct SlotGuard<'a>(&'a Shared);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let (count, cv) = &self.0.forwarding;
        *lock(count) -= 1;
        cv.notify_one();
    }
}

fn accept_loop(sh: &Arc<Shared>, listener: &TcpListener) {
    let mut next_id = 0u64;
    let mut swept = Instant::now();
    while !sh.stopping() {
        let tick = Instant::now() + Duration::from_millis(100);
        if !matches!(wait(listener.as_raw_fd(), None, tick), Ok(Ready::First)) {
            if swept.elapsed() > Duration::from_secs(1) {
                sh.pool.sweep();
                swept = Instant::now();
            }
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                sh.hooks.log_error(&format!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        next_id += 1;
        if let Err(e) = spawn_connection(sh, stream, next_id) {
            sh.hooks.log_error(&format!("cannot start a connection thread: {e}"));
        }
    }
}

fn spawn_connection(sh: &Arc<Shared>, stream: std::net::TcpStream, id: u64) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let busy = Arc::new(AtomicBool::new(false));
    let clone = stream.try_clone()?;
    *lock(&sh.open.0) += 1;
    lock(&sh.connections).push((id, clone, Arc::clone(&busy)));
    let thread_sh = Arc::clone(sh);
    let spawned =
        std::thread::Builder::new().name("kvroute-conn".into()).stack_size(512 << 10).spawn(move || {
            let closed = ClosedGuard(&thread_sh, id);
            front::serve(&thread_sh, stream, &busy);
            drop(closed);
        });
    if let Err(e) = spawned {
        ClosedGuard(sh, id).drop_now();
        return Err(e);
    }
    Ok(())
}

/// Takes a connection off the registry when its thread ends, however it ends.
struct ClosedGuard<'a>(&'a Shared, u64);

impl ClosedGuard<'_> {
    fn drop_now(self) {}
}

impl Drop for ClosedGuard<'_> {
    fn drop(&mut self) {
        lock(&self.0.connections).retain(|(id, _, _)| *id != self.1);
        let (count, cv) = &self.0.open;
        *lock(count) -= 1;
        cv.notify_all();
    }
}
