//! Admission in the simulator: the proxy's queue (`docs/proxy.md` "Admission") on the
//! virtual clock, so a policy with and without admission can be compared offline.
//!
//! An engine with `max_in_flight` requests routed to it and not finished has no room, nor,
//! under `max_tokens`, one where the request's prompt tokens do not fit beside those in
//! flight and held ([`Router::takes`]: an engine with nothing in flight takes any). A
//! request waits while the engine its policy prefers ([`Router::preferred`]: the pick among
//! all engines, full ones included) has none; it goes there once that engine has room and no
//! request before it prefers the same engine. After `patience_s`, the first waiting request
//! takes any engine with room (the policy's pick among those). A simulated session has one
//! turn in flight at a time and the trace has no priorities, so the proxy's order (priority,
//! then each session's n-th request, then arrival) is arrival order here. The simulator
//! waits without a bound (no queue size, no timeout). The queue is looked at on each arrival
//! and at the end of each engine step (while a request waits, the engine it waits for runs),
//! so patience runs out at the first step end after it.
//!
//! Holds (`hold_s` > 0), as the proxy's: when a session's turn ends on an engine, that engine
//! keeps a room (and the turn's prompt tokens) for the session's next turn until `hold_s`
//! later; the turn goes there at once (when its own tokens fit there, else it waits)
//! when it comes, and other sessions see one room less there meanwhile. No room is held
//! while a request has waited `hold_yield_s`. The queue is looked at again when a hold runs
//! out and when a request has waited `hold_yield_s` ([`Waiting::next_change`]).
//!
//! [`Waiting::next`] is O(waiters × (keys + instances)) at worst (it stops at the first
//! request that can go). Owned by one run; not synchronised.

use std::collections::{HashMap, VecDeque};

use crate::error::Result;
use crate::router::{Id, OverloadRule, Router};

use super::trace::SimTrace;

/// Admission's settings in a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimAdmission {
    /// Requests in flight per engine at most (the proxy's `--max-in-flight`; None: no cap).
    pub max_in_flight: Option<u64>,
    /// Prompt tokens in flight per engine at most (`--max-in-flight-tokens`; None: no cap).
    pub max_tokens: Option<u64>,
    /// Seconds a request waits for its preferred engine before the first waiting takes any
    /// engine with room (`--queue-patience`).
    pub patience_s: f64,
    /// Seconds an engine keeps a room for a session's next turn after one ends there
    /// (`--queue-hold`; 0: no holds).
    pub hold_s: f64,
    /// No room is held while a request has waited this long (`--queue-hold-yield`).
    pub hold_yield_s: f64,
}

impl SimAdmission {
    /// Set the router's overload rule to the caps.
    pub(super) fn apply(&self, router: &mut Router) -> Result<()> {
        router.set_overload_rule(OverloadRule {
            in_flight: self.max_in_flight,
            tokens: self.max_tokens,
            ..OverloadRule::default()
        })
    }
}

/// A request waiting at the router: its trace row, its session, when it arrived.
#[derive(Debug, Clone, Copy)]
pub(super) struct Waiter {
    pub row: u32,
    pub session: u32,
    pub since: f64,
}

/// Where a request leaves the queue for: only `On` that engine, or any engine but those in
/// `Any` (they hold their rooms for other sessions).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Bind {
    On(usize),
    Any(Vec<usize>),
}

/// The requests waiting, in arrival order, and the engines' held rooms.
#[derive(Debug, Default)]
pub(super) struct Waiting {
    list: VecDeque<Waiter>,
    /// Per session, the engine holding a room for its next turn, the prompt tokens held with
    /// it, and until when.
    holds: HashMap<u32, (usize, u64, f64)>,
    /// Engines claimed by an earlier waiter during one scan (scratch).
    claimed: Vec<bool>,
}

impl Waiting {
    pub fn push(&mut self, w: Waiter) {
        self.list.push_back(w);
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Session `session`'s turn of `tokens` prompt tokens ended on `instance` at `t`: hold a
    /// room there for its next turn (see the module doc).
    pub fn hold(&mut self, a: &SimAdmission, session: u32, instance: usize, tokens: u64, t: f64) {
        if a.hold_s > 0.0 && !self.yielding(a, t) {
            self.holds.insert(session, (instance, tokens, t + a.hold_s));
        }
    }

    /// When after `t` the holds next change what waiting requests see (a hold runs out, or a
    /// request reaches `hold_yield_s`); None while nothing waits or nothing is held.
    pub fn next_change(&self, a: &SimAdmission, t: f64) -> Option<f64> {
        if self.list.is_empty() || self.holds.is_empty() || self.yielding(a, t) {
            return None;
        }
        let ends = self.holds.values().map(|&(_, _, until)| until);
        let yields = self.list.iter().map(|w| w.since + a.hold_yield_s);
        ends.chain(yields).filter(|&x| x > t).min_by(f64::total_cmp)
    }

    /// The engine holding a room for `session`'s next turn at `t`, if any, now given up.
    pub fn take_hold(&mut self, session: u32, t: f64) -> Option<usize> {
        self.holds.remove(&session).filter(|&(_, _, until)| t < until).map(|(i, _, _)| i)
    }

    /// Whether a request has waited `hold_yield_s` by `t`: no room is held then.
    fn yielding(&self, a: &SimAdmission, t: f64) -> bool {
        self.list.iter().any(|w| t >= w.since + a.hold_yield_s) // as the wake-up is timed
    }

    /// Rooms and prompt tokens `instance` holds at `t` for sessions other than `session`.
    pub fn held_on(&self, a: &SimAdmission, instance: usize, session: u32, t: f64) -> (u64, u64) {
        if self.holds.is_empty() || self.yielding(a, t) {
            return (0, 0);
        }
        let held =
            |(s, (i, _, until)): &(&u32, &(usize, u64, f64))| **s != session && *i == instance && t < *until;
        self.holds.iter().filter(held).fold((0, 0), |(rooms, tokens), (_, (_, n, _))| (rooms + 1, tokens + n))
    }

    /// The next request to route at `t` and where. Removed from the queue; None when no
    /// request can go now.
    pub fn next(
        &mut self,
        router: &mut Router,
        trace: &SimTrace<'_>,
        t: f64,
        a: &SimAdmission,
    ) -> Option<(Waiter, Bind)> {
        if self.list.is_empty() || !router.has_room() {
            return None;
        }
        self.holds.retain(|_, &mut (_, _, until)| t < until);
        let n = router.num_instances();
        self.claimed.clear();
        self.claimed.resize(n, false);
        for (k, w) in self.list.iter().enumerate() {
            let i = w.row as usize;
            let session = Id::Int(i64::from(w.session));
            let (keys, input) = (trace.keys_of(i), trace.input_length[i] as u64);
            let Some(x) = router.preferred(keys, input, Some(&session)) else {
                continue;
            };
            if router.takes(x, keys, input, self.held_on(a, x, w.session, t)) && !self.claimed[x] {
                let w = self.list.remove(k).expect("an index of the list");
                return Some((w, Bind::On(x)));
            }
            self.claimed[x] = true;
        }
        let first = self.list.front()?;
        if t - first.since < a.patience_s {
            return None;
        }
        let row = first.row as usize;
        let (keys, input) = (trace.keys_of(row), trace.input_length[row] as u64);
        let no_room: Vec<usize> =
            (0..n).filter(|&i| !router.takes(i, keys, input, self.held_on(a, i, first.session, t))).collect();
        if no_room.len() == n {
            return None;
        }
        let no_room = no_room.into_iter().filter(|&i| router.room_on(i) > 0).collect();
        Some((self.list.pop_front().expect("not empty"), Bind::Any(no_room)))
    }
}
