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

/// A single run of at least this many requests over at least [`BACKGROUND_MIN_INSTANCES`]
/// engines touches its router's cache model on a second core when there is one: there the
/// engines' work between two routes hides the touches. On small clusters the touches are most
/// of the work, and handing them over costs more than it saves.
pub const BACKGROUND_MIN_REQUESTS: usize = 100_000;
/// See [`BACKGROUND_MIN_REQUESTS`].
pub const BACKGROUND_MIN_INSTANCES: usize = 64;

/// Run `(trace index, config)` pairs in parallel; results in input order. A cancelled run
/// yields `Ok(None)`. A single large run on a machine with a second core gets it for its
/// router's cache-model touches (`RunConfig::background_touch`, see
/// [`BACKGROUND_MIN_REQUESTS`]); several runs use the cores themselves.
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
            let large = p.trace.len() >= BACKGROUND_MIN_REQUESTS && cfg.instances >= BACKGROUND_MIN_INSTANCES;
            let cfg =
                RunConfig { background_touch: cfg.background_touch || (spare_core && large), ..cfg.clone() };
            run(&p.trace, &p.sessions, &cfg, cancel)
        })
        .collect()
}
