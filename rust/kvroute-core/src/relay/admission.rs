//! Admission at the router: while no engine has room (each is overloaded by the router's
//! rule: its reported waiting requests or KV usage, or its requests in flight at the cap),
//! generation requests wait in a bounded queue, and each is routed (bound to an engine) only
//! when one has room, on the cache and load view of that moment (late binding).
//!
//! Order: a higher priority first (the priority header, an integer, 0 without it); within a
//! priority, a session's n-th waiting request after every other session's (n-1)-th (so a
//! session with many requests waiting does not starve the others; a request without a
//! session is a session of its own), then arrival. A request that finds others waiting waits
//! behind them even when an engine has room. Past the queue's bound, or after `max_wait` in
//! it, the answer is 503 with `Retry-After`; a request whose client goes away leaves the queue
//! with its future (its [`Ticket`] drops) and leaves no other trace. Retries of a request
//! already routed do not wait again.
//!
//! The first waiter is woken when a request ends ([`Admission::wake`], from the job's end) and
//! every [`POLL`] (engine reports and health changes come from the control plane). O(log n) to
//! enter and leave a queue of n; the queue is locked briefly, never with the router's lock
//! held across an await. Shared by the relay's tasks.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::stats::Stats;
use crate::Id;

/// How often a waiting request checks for room besides being woken.
pub const POLL: Duration = Duration::from_millis(50);

/// How admission runs.
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// Requests waiting at most; one beyond gets 503 at once.
    pub queue: usize,
    /// Longest wait in the queue (503 after).
    pub max_wait: Duration,
    /// Lower-case name of the header with a request's priority (an integer, higher first).
    pub priority_header: String,
}

/// A place in the queue: priority (higher first), the session's round, arrival.
type Place = (Reverse<i64>, u64, u64);

#[derive(Default)]
struct Queue {
    arrivals: u64,
    order: BTreeSet<Place>,
    /// Requests waiting per session.
    sessions: HashMap<Id, u64>,
}

/// The queue and its wake-ups (see the module doc).
pub(super) struct Admission {
    pub config: AdmissionConfig,
    queue: Mutex<Queue>,
    wake: Notify,
}

/// A request's place in the queue; it leaves the queue when dropped.
pub(super) struct Ticket<'a> {
    admission: &'a Admission,
    place: Place,
    session: Option<Id>,
    pub since: Instant,
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Self {
        Self { config, queue: Mutex::new(Queue::default()), wake: Notify::new() }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.locked().order.len()
    }

    /// A request may leave a room to the first waiter: wake the waiters.
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }

    /// A place for a request of `priority` in `session`; None when the queue is full.
    pub fn enter(&self, priority: i64, session: Option<&Id>, stats: &Stats) -> Option<Ticket<'_>> {
        let mut q = self.locked();
        if q.order.len() >= self.config.queue {
            return None;
        }
        let round = match session {
            Some(s) => {
                let n = q.sessions.entry(s.clone()).or_insert(0);
                *n += 1;
                *n - 1
            }
            None => 0,
        };
        let place = (Reverse(priority), round, q.arrivals);
        q.arrivals += 1;
        q.order.insert(place);
        stats.queue.queued.fetch_add(1, Relaxed);
        Some(Ticket { admission: self, place, session: session.cloned(), since: Instant::now() })
    }

    /// A future that completes at the next [`Admission::wake`] (registered at once).
    pub fn woken(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }
}

impl Ticket<'_> {
    /// Whether this request is the first in the queue's order.
    pub fn is_first(&self) -> bool {
        self.admission.locked().order.first() == Some(&self.place)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut q = self.admission.locked();
        q.order.remove(&self.place);
        if let Some(s) = &self.session {
            if let Some(n) = q.sessions.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    q.sessions.remove(s);
                }
            }
        }
        drop(q);
        self.admission.wake(); // the next one may be first now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(queue: usize) -> Admission {
        Admission::new(AdmissionConfig {
            queue,
            max_wait: Duration::from_secs(1),
            priority_header: "x-priority".into(),
        })
    }

    #[test]
    fn sessions_take_turns_and_priority_goes_first() {
        let (a, stats) = (admission(8), Stats::default());
        let (s1, s2) = (Id::Str("s1".into()), Id::Str("s2".into()));
        let first = a.enter(0, Some(&s1), &stats).unwrap();
        let second_of_s1 = a.enter(0, Some(&s1), &stats).unwrap();
        let first_of_s2 = a.enter(0, Some(&s2), &stats).unwrap();
        let urgent = a.enter(5, None, &stats).unwrap();
        assert!(urgent.is_first());
        drop(urgent);
        assert!(first.is_first());
        drop(first);
        assert!(first_of_s2.is_first(), "s2's first before s1's second");
        drop(first_of_s2);
        assert!(second_of_s1.is_first());
        drop(second_of_s1);
        assert_eq!((a.waiting(), a.locked().sessions.len()), (0, 0));
        assert_eq!(stats.queue.queued.load(Relaxed), 4);
    }

    #[test]
    fn a_full_queue_refuses() {
        let (a, stats) = (admission(1), Stats::default());
        let held = a.enter(0, None, &stats).unwrap();
        assert!(a.enter(0, None, &stats).is_none());
        drop(held);
        assert!(a.enter(0, None, &stats).is_some());
    }
}
