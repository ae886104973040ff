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

/// Run `(trace index, config)` pairs in parallel; results in input order. A cancelled run
/// yields `Ok(None)`. A single run on a machine with a second core gets it for its router's
/// cache-model touches (`RunConfig::background_touch`); several runs use the cores themselves.
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
            let cfg = RunConfig { background_touch: cfg.background_touch || spare_core, ..cfg.clone() };
            run(&p.trace, &p.sessions, &cfg, cancel)
        })
        .collect()
}
