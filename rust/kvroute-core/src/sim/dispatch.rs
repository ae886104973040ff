//! Dispatch modes (semantics §5): when each session starts and when its next turn is sent.
//!
//! A session's turns go one at a time: turn n+1 is never sent before turn n finished.
//! - `tracets`: first turn at its timestamp (trace time shifted to start at 0); turn n+1 at
//!   `max(timestamp_{n+1}, finish_n)`.
//! - `thinktime`: first turn at its timestamp; turn n+1 at `finish_n +
//!   time_to_parent_chat_{n+1}` (a null gap counts as 0).
//! - `poisson`: sessions start as a seeded Poisson process of `rate` per second, in the
//!   order of their first timestamps; turns inside follow `thinktime`.
//!
//! O(sessions) to build the launch times, O(1) per turn; read only afterwards.

use super::trace::{Sessions, SimTrace};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Trace timestamps, sessions sequential.
    Tracets,
    /// First turns at their timestamps, then the recorded think time after each finish.
    Thinktime,
    /// Open loop: sessions start at `rate` per second; think time inside.
    Poisson { rate: f64 },
}

impl Mode {
    /// Parse `tracets`, `thinktime` or `poisson` (which needs a positive finite rate).
    pub fn from_name(name: &str, rate: Option<f64>) -> Result<Self> {
        match (name, rate) {
            ("tracets", _) => Ok(Mode::Tracets),
            ("thinktime", _) => Ok(Mode::Thinktime),
            ("poisson", Some(r)) if r.is_finite() && r > 0.0 => Ok(Mode::Poisson { rate: r }),
            ("poisson", r) => Err(Error::InvalidArgument(format!(
                "mode poisson needs a positive session rate (sessions per second), got {r:?}"
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "unknown dispatch mode {name:?}; known modes: tracets, thinktime, poisson"
            ))),
        }
    }

    /// The mode's public name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Tracets => "tracets",
            Mode::Thinktime => "thinktime",
            Mode::Poisson { .. } => "poisson",
        }
    }
}

/// Send times of each session's first turn, in `sessions.launch` order (non-decreasing).
pub fn launch_times(mode: Mode, trace: &SimTrace<'_>, sessions: &Sessions, seed: u64) -> Vec<f64> {
    match mode {
        Mode::Poisson { rate } => {
            let mut rng = SplitMix64::new(seed ^ 0xA5A5_5A5A_DEAD_BEEF);
            let mut t = 0.0;
            sessions
                .launch
                .iter()
                .map(|_| {
                    t += -(1.0 - rng.unit()).ln() / rate;
                    t
                })
                .collect()
        }
        _ => sessions
            .launch
            .iter()
            .map(|&s| trace.timestamp[sessions.rows_of(s)[0] as usize] - sessions.t0)
            .collect(),
    }
}

/// Send time of `row`, the turn after one that finished at `finish`.
pub fn next_send(mode: Mode, trace: &SimTrace<'_>, sessions: &Sessions, row: u32, finish: f64) -> f64 {
    let i = row as usize;
    match mode {
        Mode::Tracets => (trace.timestamp[i] - sessions.t0).max(finish),
        Mode::Thinktime | Mode::Poisson { .. } => {
            let gap = trace.ttp.map_or(0.0, |t| t[i]);
            finish + if gap.is_finite() && gap > 0.0 { gap } else { 0.0 }
        }
    }
}

/// Refuse a mode the trace cannot drive (think time needs `time_to_parent_chat`).
pub fn check(mode: Mode, trace: &SimTrace<'_>) -> Result<()> {
    if !matches!(mode, Mode::Tracets) && trace.ttp.is_none() {
        return Err(Error::InvalidArgument(format!(
            "mode {} needs the trace's time_to_parent_chat column; add it with \
             `kvroute trace annotate-ttp` or use mode tracets",
            mode.name()
        )));
    }
    Ok(())
}
