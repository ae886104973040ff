//! Admission at the router: while the engine a request's policy prefers has no room (it is
//! overloaded by the router's rule: its reported waiting requests or KV usage, its requests
//! or their prompt tokens in flight at the cap, or the request's tokens do not fit under the
//! token cap: [`crate::Router::takes`]), generation requests wait in a bounded queue, and
//! each is routed (bound to an engine) only when one has room, on the cache and load view of
//! that moment (late binding).
//!
//! Binding: a waiting request goes to the engine its policy picks among all the available
//! engines, overloaded ones included (its preferred engine, [`crate::Router::preferred`],
//! looked at again at each wake), as soon as that engine has room and no request before it
//! in the queue's order prefers the same engine. After `patience` in the queue, the first
//! request in the order takes any engine with room (the policy's pick among those), so an
//! engine does not idle long while the queue waits for another.
//!
//! Holds (`hold` > 0): when a session's request ends on an engine, that engine keeps a room
//! (and, under a token cap, the request's prompt tokens) for the session's next request for
//! `hold`: others see one room less there until it comes (it goes there at once, queue or
//! not, when its tokens fit there) or the hold runs out. No room is held while a request has
//! waited `hold_yield` or longer, so the waiting sessions get in within about that. Under a
//! cap this keeps the sessions being served on their engines while others wait, so the
//! prompts the engines cache are those of the sessions they serve: past the cache's size,
//! taking every waiting session in turn evicts each one's prompt before its next turn. Holds
//! that ran out are dropped when the queue is looked at, and when their number doubles.
//!
//! Order: a higher priority first (the priority header, an integer, 0 without it); within a
//! priority, a session's n-th waiting request after every other session's (n-1)-th (so a
//! session with many requests waiting does not starve the others; a request without a
//! session is a session of its own), then arrival. Past the queue's bound, or after
//! `max_wait` in it, the answer is 503 with `Retry-After`; a request whose client goes away
//! leaves the queue with its future (its [`Ticket`] drops) and leaves no other trace.
//! Retries of a request already routed do not wait again.
//!
//! The first waiter is woken when a request ends ([`Admission::wake`], from the job's end) and
//! every [`POLL`] (engine reports and health changes come from the control plane). O(log n) to
//! enter and leave a queue of n, O(n) to look for an earlier request preferring the same
//! engine; the queue is locked briefly, never with the router's lock held across an await.
//! Shared by the relay's tasks.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
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
    /// How long a request waits for its preferred engine before it takes any with room.
    pub patience: Duration,
    /// Lower-case name of the header with a request's priority (an integer, higher first).
    pub priority_header: String,
    /// How long an engine keeps a room for a session's next request after one ends there
    /// (zero: no holds).
    pub hold: Duration,
    /// No room is held while a request has waited this long.
    pub hold_yield: Duration,
}

/// A place in the queue: priority (higher first), the session's round, arrival.
type Place = (Reverse<i64>, u64, u64);

#[derive(Default)]
struct Queue {
    arrivals: u64,
    /// Waiting requests in order, each with its preferred engine when last looked at and
    /// when it came.
    order: BTreeMap<Place, (Option<usize>, Instant)>,
    /// Requests waiting per session.
    sessions: HashMap<Id, u64>,
    /// Per session, the engine that keeps a room for its next request, the prompt tokens
    /// held with it, and until when.
    holds: HashMap<Id, (usize, u64, Instant)>,
    /// Holds kept before those that ran out are dropped.
    holds_bound: usize,
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
        let (place, since) = ((Reverse(priority), round, q.arrivals), Instant::now());
        q.arrivals += 1;
        q.order.insert(place, (None, since));
        stats.queue.queued.fetch_add(1, Relaxed);
        Some(Ticket { admission: self, place, session: session.cloned(), since })
    }

    /// A request of `session` with `tokens` of prompt ended on `instance`: hold a room there
    /// for the session's next request (when holds are on and no request has waited
    /// `hold_yield`). O(waiting).
    pub fn hold(&self, session: &Id, instance: usize, tokens: u64) {
        if self.config.hold.is_zero() {
            return;
        }
        let mut q = self.locked();
        let now = Instant::now();
        if self.yielding(&q, now) {
            return;
        }
        if q.holds.len() >= q.holds_bound {
            q.holds.retain(|_, (_, _, until)| now < *until);
            q.holds_bound = (2 * q.holds.len()).max(1024);
        }
        q.holds.insert(session.clone(), (instance, tokens, now + self.config.hold));
    }

    /// Whether some request in `q` has waited `hold_yield` by `now`: no room is held then.
    fn yielding(&self, q: &Queue, now: Instant) -> bool {
        q.order.values().any(|(_, since)| now.duration_since(*since) >= self.config.hold_yield)
    }

    /// The engine holding a room for `session`'s next request, if any, now given up.
    pub fn take_hold(&self, session: &Id) -> Option<usize> {
        let (instance, _, until) = self.locked().holds.remove(session)?;
        (Instant::now() < until).then_some(instance)
    }

    /// Rooms and prompt tokens `instance` holds for sessions other than `session` (none while
    /// a request has waited `hold_yield`); the holds that ran out are dropped.
    /// O(holds + waiting).
    pub fn held_on(&self, instance: usize, session: Option<&Id>) -> (u64, u64) {
        let mut q = self.locked();
        let now = Instant::now();
        if q.holds.is_empty() || self.yielding(&q, now) {
            return (0, 0);
        }
        q.holds.retain(|_, (_, _, until)| now < *until);
        let held = q.holds.iter().filter(|(s, (i, _, _))| *i == instance && Some(*s) != session);
        held.fold((0, 0), |(rooms, tokens), (_, (_, t, _))| (rooms + 1, tokens + t))
    }

    /// A future that completes at the next [`Admission::wake`] (registered at once).
    pub fn woken(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }
}

impl Ticket<'_> {
    /// Whether this request is the first in the queue's order.
    pub fn is_first(&self) -> bool {
        self.admission.locked().order.first_key_value().map(|(p, _)| p) == Some(&self.place)
    }

    /// Record the engine this request prefers now (None: none is available).
    pub fn prefer(&self, instance: Option<usize>) {
        if let Some(p) = self.admission.locked().order.get_mut(&self.place) {
            p.0 = instance;
        }
    }

    /// Whether no request before this one in the order prefers `instance`.
    pub fn first_for(&self, instance: usize) -> bool {
        let q = self.admission.locked();
        !q.order.range(..self.place).any(|(_, p)| p.0 == Some(instance))
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
            patience: Duration::ZERO,
            priority_header: "x-priority".into(),
            hold: Duration::ZERO,
            hold_yield: Duration::from_secs(60),
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
    fn an_engine_goes_to_the_first_request_preferring_it() {
        let (a, stats) = (admission(8), Stats::default());
        let (first, second, third) = (
            a.enter(0, None, &stats).unwrap(),
            a.enter(0, None, &stats).unwrap(),
            a.enter(0, None, &stats).unwrap(),
        );
        first.prefer(Some(1));
        second.prefer(Some(0));
        third.prefer(Some(1));
        assert!(first.first_for(1) && second.first_for(0) && !second.first_for(1));
        assert!(!third.first_for(1) && !third.first_for(0) && third.first_for(2));
        drop(first);
        assert!(third.first_for(1));
    }

    #[test]
    fn a_full_queue_refuses() {
        let (a, stats) = (admission(1), Stats::default());
        let held = a.enter(0, None, &stats).unwrap();
        assert!(a.enter(0, None, &stats).is_none());
        drop(held);
        assert!(a.enter(0, None, &stats).is_some());
    }

    #[test]
    fn an_engine_holds_a_room_for_a_sessions_next_request() {
        let mut a = admission(8);
        let (s1, s2) = (Id::Str("s1".into()), Id::Str("s2".into()));
        a.hold(&s1, 0, 100);
        assert_eq!(a.held_on(0, None), (0, 0), "no holds when hold is zero");
        a.config.hold = Duration::from_secs(60);
        a.hold(&s1, 0, 100);
        a.hold(&s2, 0, 50);
        assert_eq!(
            (a.held_on(0, Some(&s2)), a.held_on(0, None), a.held_on(1, None)),
            ((1, 100), (2, 150), (0, 0))
        );
        assert_eq!(a.held_on(0, Some(&s1)), (1, 50), "not against the session itself");
        assert_eq!((a.take_hold(&s1), a.take_hold(&s2)), (Some(0), Some(0)));
        assert_eq!((a.take_hold(&s1), a.held_on(0, None)), (None, (0, 0)), "taken once");
        a.config.hold = Duration::from_nanos(1);
        a.hold(&s2, 1, 100);
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(a.held_on(1, None), (0, 0), "run out");
        assert_eq!(a.take_hold(&s2), None);
        for n in 0..3000 {
            a.hold(&Id::Int(n), 0, 1);
        }
        assert!(a.locked().holds.len() <= 2048, "the ones that ran out are dropped");
    }

    #[test]
    fn no_hold_is_given_while_a_request_has_waited_long() {
        let (mut a, stats) = (admission(8), Stats::default());
        a.config.hold = Duration::from_secs(60);
        a.config.hold_yield = Duration::from_nanos(1);
        let s1 = Id::Str("s1".into());
        let waiting = a.enter(0, None, &stats).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        a.hold(&s1, 0, 100);
        assert_eq!(a.held_on(0, None), (0, 0), "the waiting request waited past hold_yield");
        drop(waiting);
        a.hold(&s1, 0, 100);
        assert_eq!(a.held_on(0, None), (1, 100));
        let waiting = a.enter(0, None, &stats).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(a.held_on(0, None), (0, 0), "a hold given before is not counted either");
        drop(waiting);
        assert_eq!(a.held_on(0, None), (1, 100));
    }
}
