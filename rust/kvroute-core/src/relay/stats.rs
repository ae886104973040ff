//! The relay's counters and latency histograms, per backend, for the proxy's Prometheus
//! metrics (the Python side reads a [`Stats::snapshot`] at scrape time and labels it).
//!
//! Also the first tokens the control plane fits `ttft`'s costs from ([`super::first_tokens`]).
//!
//! Every update is a few relaxed atomic adds: O(1) (O(buckets) for a histogram). Shared by the
//! relay's tasks and the scrapes; backends are added under a short write lock.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::first_tokens::FirstTokens;
use crate::Branch;

/// Upper bounds (seconds) of the TTFT and end-to-end histograms.
pub const LATENCY_BUCKETS: [f64; 15] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds (seconds) of the routing-time histogram.
pub const ROUTING_BUCKETS: [f64; 11] =
    [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1];
/// Every branch, in the order of the decision counters.
pub const BRANCHES: [Branch; 8] = [
    Branch::Affinity,
    Branch::Score,
    Branch::TieBreak,
    Branch::RoundRobin,
    Branch::Sampled,
    Branch::LoadBalance,
    Branch::CacheMatch,
    Branch::SmallestCache,
];

/// What went wrong with a request or an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The backend could not be reached, or failed before answering.
    Connect,
    /// The backend answered 5xx.
    Status,
    /// No byte from the backend within the read timeout.
    Timeout,
    /// The backend failed mid-stream.
    Midstream,
    /// The client hung up before its answer was complete.
    ClientDisconnect,
    /// A body the API refuses.
    BadRequest,
    /// No backend was up.
    NoBackend,
}

impl ErrorKind {
    /// Every kind, in counter order.
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Connect,
        ErrorKind::Status,
        ErrorKind::Timeout,
        ErrorKind::Midstream,
        ErrorKind::ClientDisconnect,
        ErrorKind::BadRequest,
        ErrorKind::NoBackend,
    ];

    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Status => "status",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Midstream => "midstream",
            ErrorKind::ClientDisconnect => "client_disconnect",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::NoBackend => "no_backend",
        }
    }
}

/// A histogram: counts per bucket (the last one: above every bound) and the sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Count one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self.bounds.iter().position(|&b| s <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Counts per bucket (not cumulative) and the sum in seconds.
    pub fn read(&self) -> (Vec<u64>, f64) {
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_ns.load(Relaxed) as f64 * 1e-9;
        (self.counts.iter().map(|c| c.load(Relaxed)).collect(), sum)
    }
}

fn counters<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

/// One backend's counters.
#[derive(Debug)]
pub struct BackendStats {
    /// Decisions per branch ([`BRANCHES`] order).
    pub decisions: [AtomicU64; 8],
    /// Router-estimated cached tokens.
    pub estimated: AtomicU64,
    /// Engine-reported cached tokens.
    pub reported: AtomicU64,
    /// Engine-reported prompt tokens.
    pub prompt: AtomicU64,
    /// Attempts retried elsewhere.
    pub retries: AtomicU64,
    /// Errors per kind ([`ErrorKind::ALL`] order).
    pub errors: [AtomicU64; 7],
    /// Request received to first streamed byte.
    pub ttft: Histogram,
    /// Request received to answer end.
    pub e2e: Histogram,
}

impl BackendStats {
    fn new() -> Self {
        Self {
            decisions: counters(),
            estimated: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            prompt: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            errors: counters(),
            ttft: Histogram::new(&LATENCY_BUCKETS),
            e2e: Histogram::new(&LATENCY_BUCKETS),
        }
    }

    /// Count a decision for this backend.
    pub fn decision(&self, branch: Branch, hit_tokens: u64) {
        let i = BRANCHES.iter().position(|&b| b == branch).unwrap_or(0);
        self.decisions[i].fetch_add(1, Relaxed);
        self.estimated.fetch_add(hit_tokens, Relaxed);
    }

    /// Count an error of this backend.
    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Relaxed);
    }
}

/// All counters of a relay.
#[derive(Debug)]
pub struct Stats {
    backends: RwLock<Vec<Arc<BackendStats>>>,
    /// Errors before a backend was chosen ([`ErrorKind::ALL`] order).
    pub errors: [AtomicU64; 7],
    /// Keying plus the routing decision (a wait in the admission queue not included).
    pub routing: Histogram,
    /// The admission queue's.
    pub queue: QueueStats,
    /// First tokens, for fitting `ttft`'s costs.
    pub first_tokens: FirstTokens,
}

/// The admission queue's counters.
#[derive(Debug)]
pub struct QueueStats {
    /// Requests that waited (entered the queue).
    pub queued: AtomicU64,
    /// Requests refused because the queue was full.
    pub shed_full: AtomicU64,
    /// Requests refused after waiting their longest.
    pub shed_timeout: AtomicU64,
    /// Seconds waited by the requests that were routed after waiting.
    pub wait: Histogram,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            backends: RwLock::new(Vec::new()),
            errors: counters(),
            routing: Histogram::new(&ROUTING_BUCKETS),
            queue: QueueStats {
                queued: AtomicU64::new(0),
                shed_full: AtomicU64::new(0),
                shed_timeout: AtomicU64::new(0),
                wait: Histogram::new(&LATENCY_BUCKETS),
            },
            first_tokens: FirstTokens::default(),
        }
    }
}

impl Stats {
    /// The counters of backend `index` (created on first use).
    pub fn backend(&self, index: usize) -> Arc<BackendStats> {
        if let Some(b) = self.backends.read().unwrap_or_else(|e| e.into_inner()).get(index) {
            return Arc::clone(b);
        }
        let mut all = self.backends.write().unwrap_or_else(|e| e.into_inner());
        while all.len() <= index {
            all.push(Arc::new(BackendStats::new()));
        }
        Arc::clone(&all[index])
    }

    /// Count an error before any backend was chosen.
    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Relaxed);
    }

    /// Every backend's counters so far, by index.
    pub fn snapshot(&self) -> Vec<Arc<BackendStats>> {
        self.backends.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
