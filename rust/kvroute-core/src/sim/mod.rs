//! The cluster simulator: a trace replayed through simulated vLLM engines behind the very
//! [`crate::Router`] that runs live, under any policy and dispatch mode.
//!
//! - [`params`]: engine parameters, presets and the cost model's coefficients.
//! - [`kv`]: one engine's KV block pool with prefix caching on the trace's keys.
//! - [`engine`], [`sched`], [`commit`], [`segment`], [`events`]: one engine (continuous
//!   batching, chunked prefill, token budget, preemption by recompute, closed-form decode
//!   runs) and what it reports.
//! - [`trace`] and [`dispatch`]: the trace's sessions and the dispatch modes (§5).
//! - [`cluster`]: one run's event loop (over `queue.rs`), with [`admission`] at its router;
//!   [`sweep`]: many runs in parallel (rayon).
//! - [`live`]: one engine driven by a caller's clock (the HTTP engine emulator).
//! - [`output`]: records, time series and run statistics.
//!
//! The model and its fidelity are written up in `docs/simulator.md`. Every type is plain
//! owned data (traces borrowed read only); a run is single-threaded and deterministic.

pub mod admission;
pub mod cluster;
mod commit;
pub mod dispatch;
pub mod engine;
pub mod events;
pub mod kv;
pub mod live;
pub mod output;
pub mod params;
mod pipeline;
mod queue;
mod sched;
mod segment;
pub mod sweep;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cluster;
pub mod trace;

pub use admission::SimAdmission;
pub use cluster::{run, RouterCache, RunConfig};
pub use dispatch::Mode;
pub use engine::{Engine, EngineEvent, EngineStats, FinishInfo, Reject};
pub use kv::PoolEvent;
pub use live::{LiveEngine, LiveEvent};
pub use output::{Records, RunStats, Series, SimOutput};
pub use params::EngineParams;
pub use sweep::{run_many, PreparedTrace};
pub use trace::{KeyChunks, Sessions, SimTrace};
