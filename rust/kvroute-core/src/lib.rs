//! kvroute-core: KV-cache-aware routing of LLM requests, in pure Rust.
//!
//! - [`keys`]: prefix-chained block keys from token ids.
//! - [`cache`]: per-instance LRU cache models under one cluster-wide index (`index.rs`: the
//!   open-addressing key index with prefetch; `background.rs`: the cache model handed to a
//!   worker thread for its touches).
//! - [`events`]: the exact cache view: engines' KV-cache events decoded and indexed (the
//!   router reads it with `CacheView::Events`).
//! - [`jobs`]: a job queue for a second thread (the simulator's engines and touches).
//! - [`policy`] and [`picker`]: the routing policies and their scoring loop.
//! - [`router`]: the request state machine that ties them together (`sessions`: the
//!   session affinity map, optionally LRU-bounded).
//! - [`ceilings`]: APC ceilings of a whole trace (parallel, rayon).
//! - [`relay`]: the proxy's data path (an HTTP/1.1 relay on hyper, one event-loop thread).
//! - [`sim`]: the cluster simulator (engines, dispatch, sweeps) around the router.
//!
//! The rules are those of the project's semantics page (`docs/semantics.md`).

mod background;
pub mod cache;
pub mod ceilings;
pub mod error;
pub mod events;
mod index;
pub mod jobs;
pub mod keys;
pub mod lru;
pub mod picker;
pub mod policy;
pub mod prompt_scan;
#[cfg(unix)]
pub mod relay;
pub mod rng;
pub mod router;
pub mod sessions;
pub mod sim;
mod stamped;
pub mod text;

pub use error::{Error, Result};
pub use picker::{Branch, InstanceLoad};
pub use policy::{Policy, PolicyParams, TtftCosts};
pub use router::{
    CacheRule, CacheView, Decision, EngineLoad, Id, InstanceState, LoadSource, OverloadRule, Router,
    RouterConfig,
};
