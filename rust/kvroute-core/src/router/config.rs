//! The router's settings: request and session ids, the cache rule (which blocks are stored
//! and can hit), the cache view (estimate or events) and [`RouterConfig`]. Plain values:
//! O(1), `Send` and `Sync`.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::policy::PolicyParams;

/// Largest accepted `input_length` (2^40 tokens): far above any real prompt, and small enough
/// that the per-instance sums cannot overflow with fewer than 2^23 requests in flight.
pub const MAX_INPUT_LENGTH: u64 = 1 << 40;

/// The most instances a router holds (each costs a few hundred bytes before any cache).
pub const MAX_INSTANCES: usize = 1 << 16;

/// Default of [`RouterConfig::pending_ttl`]: long enough for a prefill of a long prompt on a
/// busy engine to store its blocks.
pub const DEFAULT_PENDING_TTL: Duration = Duration::from_secs(10);

/// A request or session id: an integer or a string, never equal to each other.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Id {
    /// An integer id.
    Int(i64),
    /// A string id.
    Str(String),
}

impl std::fmt::Display for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Id::Int(i) => write!(f, "{i}"),
            Id::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// Which blocks of a request an engine keeps and which can hit (docs/semantics.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheRule {
    /// Every key of a request is stored and may hit, the last (partial) block too: the
    /// trace semantics of the ceilings and the simulator's router.
    #[default]
    Trace,
    /// vLLM's prefix cache: only full blocks are stored, and a prompt's last token is always
    /// recomputed, so a request of `n` tokens can hit at most `floor((n - 1) / block_size)`
    /// blocks; blocks its output completes are stored too
    /// ([`Router::extend`](super::Router::extend)).
    Vllm,
}

impl CacheRule {
    /// The rule named `name` (`"trace"` or `"vllm"`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "trace" => Ok(Self::Trace),
            "vllm" => Ok(Self::Vllm),
            _ => Err(Error::InvalidArgument(format!("cache_rule must be 'trace' or 'vllm', got {name:?}"))),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Vllm => "vllm",
        }
    }

    /// How many leading keys of a request of `input_length` tokens with `keys` keys may hit,
    /// and how many its engine stores.
    pub fn limits(self, keys: usize, input_length: u64, block_size: u64) -> (usize, usize) {
        match self {
            Self::Trace => (keys, keys),
            Self::Vllm => {
                let blocks =
                    |tokens: u64| keys.min(usize::try_from(tokens / block_size).unwrap_or(usize::MAX));
                (blocks(input_length.saturating_sub(1)), blocks(input_length))
            }
        }
    }
}

/// What the router believes each instance's cache holds (docs/kv-events.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheView {
    /// The router's own model: an LRU per instance fed by its routing decisions.
    #[default]
    Estimate,
    /// The engines' KV-cache events wherever they are applied and whole; the estimate for the
    /// other instances.
    Events,
}

impl CacheView {
    /// The view named `name` (`"estimate"` or `"events"`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "estimate" => Ok(Self::Estimate),
            "events" => Ok(Self::Events),
            _ => Err(Error::InvalidArgument(format!(
                "cache_view must be 'estimate' or 'events', got {name:?}"
            ))),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Estimate => "estimate",
            Self::Events => "events",
        }
    }
}

/// What feeds the policies' load terms (docs/semantics.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadSource {
    /// The router's own counts of the requests it routed and that have not finished.
    #[default]
    Router,
    /// The router's own counts plus, per engine with a report
    /// ([`Router::set_engine_load`](super::Router::set_engine_load)), the requests the engine
    /// reported beyond them (another replica's, traffic that bypassed the router).
    Engine,
}

impl LoadSource {
    /// The source named `name` (`"router"` or `"engine"`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "router" => Ok(Self::Router),
            "engine" => Ok(Self::Engine),
            _ => {
                Err(Error::InvalidArgument(format!("load_source must be 'router' or 'engine', got {name:?}")))
            }
        }
    }
}

/// How a router is set up.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Tokens per block key.
    pub block_size: u64,
    /// Keys each instance's cache holds; `None` = unbounded.
    pub cache_capacity_blocks: Option<usize>,
    /// Which blocks are stored and can hit.
    pub cache_rule: CacheRule,
    /// Sessions whose affinity is kept (the most recently routed); `None` = every session.
    pub max_sessions: Option<usize>,
    /// Seed of the RNG used by `random`, `power_of_two` and `dynamo_cost`.
    pub seed: u64,
    /// Policy parameters.
    pub params: PolicyParams,
    /// The cache view routing reads.
    pub cache_view: CacheView,
    /// With the events view: how long a routed request's blocks count as held by the instance
    /// chosen before an event confirms them (zero: not at all).
    pub pending_ttl: Duration,
    /// A session's affinity is derived from state replicas share instead of kept in this
    /// router's map: the available instance holding the longest prefix of the request (ties,
    /// and no prefix anywhere, by a rendezvous hash of the session over the available ones).
    /// Routers that read the same events view then agree on it, whichever routed the turn
    /// before.
    pub shared_affinity: bool,
    /// What feeds the policies' load terms.
    pub load_source: LoadSource,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: 512,
            cache_capacity_blocks: None,
            cache_rule: CacheRule::Trace,
            max_sessions: None,
            seed: 0,
            params: PolicyParams::default(),
            cache_view: CacheView::Estimate,
            pending_ttl: DEFAULT_PENDING_TTL,
            shared_affinity: false,
            load_source: LoadSource::Router,
        }
    }
}
