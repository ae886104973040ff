//! Admission in the simulator: the proxy's queue (`docs/proxy.md` "Admission") on the
//! virtual clock, so a policy with and without admission can be compared offline.
//!
//! An engine with `max_in_flight` requests routed to it and not finished has no room. A
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
//! [`Waiting::next`] is O(waiters × (keys + instances)) at worst (it stops at the first
//! request that can go). Owned by one run; not synchronised.

use std::collections::VecDeque;

use crate::error::Result;
use crate::router::{Id, OverloadRule, Router};

use super::trace::SimTrace;

/// Admission's settings in a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimAdmission {
    /// Requests in flight per engine at most (the proxy's `--max-in-flight`).
    pub max_in_flight: u64,
    /// Seconds a request waits for its preferred engine before the first waiting takes any
    /// engine with room (`--queue-patience`).
    pub patience_s: f64,
}

impl SimAdmission {
    /// Set the router's overload rule to the in-flight cap.
    pub(super) fn apply(&self, router: &mut Router) -> Result<()> {
        router.set_overload_rule(OverloadRule {
            in_flight: Some(self.max_in_flight),
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

/// The requests waiting, in arrival order.
#[derive(Debug, Default)]
pub(super) struct Waiting {
    list: VecDeque<Waiter>,
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

    /// The next request to route at `t` and where: `Some(instance)`, only there; `None`, any
    /// engine with room. Removed from the queue; None when no request can go now.
    pub fn next(
        &mut self,
        router: &mut Router,
        trace: &SimTrace<'_>,
        t: f64,
        patience_s: f64,
    ) -> Option<(Waiter, Option<usize>)> {
        if self.list.is_empty() || !router.has_room() {
            return None;
        }
        let n = router.num_instances();
        self.claimed.clear();
        self.claimed.resize(n, false);
        for (k, w) in self.list.iter().enumerate() {
            let i = w.row as usize;
            let session = Id::Int(i64::from(w.session));
            let input = trace.input_length[i] as u64;
            let Some(x) = router.preferred(trace.keys_of(i), input, Some(&session)) else {
                continue;
            };
            if router.has_room_on(x) && !self.claimed[x] {
                let w = self.list.remove(k).expect("an index of the list");
                return Some((w, Some(x)));
            }
            self.claimed[x] = true;
        }
        let first = self.list.front()?;
        (t - first.since >= patience_s).then(|| (self.list.pop_front().expect("not empty"), None))
    }
}
