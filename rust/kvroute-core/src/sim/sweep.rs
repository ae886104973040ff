//! Many runs at once: each run is independent (its own router and engines), so a sweep is
//! a parallel map over runs (rayon, every core). Traces are borrowed and shared read only.
//! Time: the sum of the runs over the cores; memory: every run's output at once.

use std::sync::atomic::AtomicBool;

use rayon::prelude::*;

use super::cluster::{run, RunConfig};
use super::output::SimOutput;
use super::trace::{Sessions, SimTrace};
use crate::error::Result;

/// A trace and its sessions, ready for runs.
#[derive(Debug, Clone)]
pub struct PreparedTrace<'t> {
    pub trace: SimTrace<'t>,
    pub sessions: Sessions,
}

impl<'t> PreparedTrace<'t> {
    /// Check the trace and group its sessions.
    pub fn new(trace: SimTrace<'t>) -> Result<Self> {
        trace.validate()?;
        let sessions = Sessions::new(&trace)?;
        Ok(Self { trace, sessions })
    }
}

/// A single run of at least this many requests over at least [`SECOND_THREAD_MIN_INSTANCES`]
/// engines settles its engines on a second core when there is one (`pipeline.rs`): there
/// the engines' pool work and planning run beside the router. On small clusters there is
/// little to overlap within one step's lookahead, and handing over costs more than it saves.
pub const SECOND_THREAD_MIN_REQUESTS: usize = 100_000;
/// See [`SECOND_THREAD_MIN_REQUESTS`].
pub const SECOND_THREAD_MIN_INSTANCES: usize = 64;

/// Run `(trace index, config)` pairs in parallel; results in input order. A cancelled run
/// yields `Ok(None)`. A single large run on a machine with a second core gets it for its
/// engines (`RunConfig::second_thread`, see [`SECOND_THREAD_MIN_REQUESTS`]); several runs
/// use the cores themselves.
pub fn run_many(
    traces: &[PreparedTrace<'_>],
    runs: &[(usize, RunConfig)],
    cancel: &AtomicBool,
) -> Vec<Result<Option<SimOutput>>> {
    let spare_core = runs.len() == 1 && std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    runs.par_iter()
        .with_max_len(1)
        .map(|(t, cfg)| {
            let p = &traces[*t];
            let large =
                p.trace.len() >= SECOND_THREAD_MIN_REQUESTS && cfg.instances >= SECOND_THREAD_MIN_INSTANCES;
            let cfg = RunConfig { second_thread: cfg.second_thread || (spare_core && large), ..cfg.clone() };
            run(&p.trace, &p.sessions, &cfg, cancel)
        })
        .collect()
}
