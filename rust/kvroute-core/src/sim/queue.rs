//! The simulator's event queue: the earliest of (time, sequence) over a binary heap of
//! driver events (launches, sends, deliveries, samples) and each engine's one pending
//! segment end.
//!
//! Engines' segment ends sit in a tournament tree (a leaf per engine, each inner node the
//! earlier of its two children): rescheduling an engine replaces its leaf and replays its
//! path to the root, so a changed engine leaves no stale entry behind and the earliest end
//! is the root. Ties in time break by the sequence number handed out at scheduling, for
//! both kinds alike, so the order is that of one heap over all events.
//!
//! Push O(log heap); rescheduling an engine O(log engines); pop O(log heap + log engines).
//! Not synchronised: owned by one run.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A driver event's kind (engines' segment ends are [`Next::Segment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Launch,
    Send(u32),
    /// A routed trace row reaches its engine's scheduler (after a busy engine's handling).
    Deliver(u32),
    Sample,
    /// A room held for a session runs out: the waiting requests are looked at again.
    Admit,
}

/// What comes next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Next {
    Driver(f64, Kind),
    /// Engine `e`'s segment ends at the time.
    Segment(f64, u32),
}

/// A time and the sequence number that orders equal times.
#[derive(Debug, Clone, Copy, PartialEq)]
struct At {
    t: f64,
    seq: u64,
}

impl At {
    const NEVER: At = At { t: f64::INFINITY, seq: u64::MAX };

    fn before(self, o: At) -> bool {
        self.t.total_cmp(&o.t).then(self.seq.cmp(&o.seq)) == Ordering::Less
    }
}

#[derive(Debug, Clone, Copy)]
struct Ev {
    at: At,
    kind: Kind,
}

impl PartialEq for Ev {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at
    }
}
impl Eq for Ev {}
impl PartialOrd for Ev {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ev {
    /// Reversed: the heap pops the earliest, then the first pushed.
    fn cmp(&self, o: &Self) -> Ordering {
        o.at.t.total_cmp(&self.at.t).then(o.at.seq.cmp(&self.at.seq))
    }
}

/// Driver events and engine segment ends, in time order.
pub(crate) struct EventQueue {
    heap: BinaryHeap<Ev>,
    /// Tournament tree over `leaves` engines: node `i`'s children are `2i` and `2i + 1`;
    /// leaves start at `leaves`; each node holds its subtree's earliest `(At, engine)`.
    tree: Vec<(At, u32)>,
    leaves: usize,
    seq: u64,
}

impl EventQueue {
    /// An empty queue for `engines` engines.
    pub fn new(engines: usize) -> Self {
        let leaves = engines.next_power_of_two();
        Self { heap: BinaryHeap::new(), tree: vec![(At::NEVER, u32::MAX); 2 * leaves], leaves, seq: 0 }
    }

    /// Queue a driver event at `t`.
    pub fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Ev { at: At { t, seq: self.seq }, kind });
    }

    /// Engine `e`'s pending segment now ends at `t` (`None`: it has none), replacing what was
    /// queued for it.
    pub fn set_engine(&mut self, e: usize, t: Option<f64>) {
        let seq = if t.is_some() { self.reserve() } else { u64::MAX };
        self.set_engine_in_turn(e, t, seq);
    }

    /// Take a place in the order of equal times now, for an engine whose segment end is
    /// known later ([`EventQueue::set_engine_in_turn`]).
    pub fn reserve(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// [`EventQueue::set_engine`] with a place `seq` from [`EventQueue::reserve`]: among
    /// equal times it comes where it would have, had it been set when the place was taken.
    pub fn set_engine_in_turn(&mut self, e: usize, t: Option<f64>, seq: u64) {
        let at = t.map_or(At::NEVER, |t| At { t, seq });
        let mut i = self.leaves + e;
        self.tree[i] = (at, e as u32);
        while i > 1 {
            i /= 2;
            let (l, r) = (self.tree[2 * i], self.tree[2 * i + 1]);
            self.tree[i] = if r.0.before(l.0) { r } else { l };
        }
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty() && self.tree[1].0 == At::NEVER
    }

    /// The time of the earliest event, if any.
    pub fn peek_time(&self) -> Option<f64> {
        let engine = self.tree[1].0;
        let first = match self.heap.peek() {
            Some(ev) if !engine.before(ev.at) => ev.at,
            _ => engine,
        };
        (first != At::NEVER).then_some(first.t)
    }

    /// Take the earliest event. An engine's segment end stays queued until
    /// [`EventQueue::set_engine`] replaces it, which its handler must do.
    pub fn pop(&mut self) -> Option<Next> {
        let (engine_at, e) = self.tree[1];
        match self.heap.peek() {
            Some(ev) if !engine_at.before(ev.at) => {
                let ev = self.heap.pop()?;
                Some(Next::Driver(ev.at.t, ev.kind))
            }
            _ if engine_at != At::NEVER => Some(Next::Segment(engine_at.t, e)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interleaved pushes and engine reschedules come out as one heap over all of them
    /// would give them: by time, then by the order they were queued.
    #[test]
    fn one_order_for_both_kinds() {
        let mut q = EventQueue::new(3);
        q.push(2.0, Kind::Sample);
        q.set_engine(1, Some(1.0));
        q.set_engine(2, Some(2.0));
        q.push(1.0, Kind::Send(7));
        q.set_engine(0, Some(5.0));
        q.set_engine(0, Some(2.0)); // replaces 5.0, queued after the rest
        let mut order = Vec::new();
        while let Some(next) = q.pop() {
            order.push(next);
            if let Next::Segment(_, e) = next {
                q.set_engine(e as usize, None);
            }
        }
        use Next::*;
        assert_eq!(
            order,
            vec![
                Segment(1.0, 1),
                Driver(1.0, Kind::Send(7)),
                Driver(2.0, Kind::Sample),
                Segment(2.0, 2),
                Segment(2.0, 0)
            ]
        );
        assert!(q.is_empty());
    }

    /// An engine set in a place reserved earlier comes, among equal times, where it would
    /// have come had it been set then; `peek_time` sees what `pop` takes.
    #[test]
    fn a_reserved_place_keeps_its_turn() {
        let mut q = EventQueue::new(2);
        q.set_engine(0, Some(1.0));
        let place = q.reserve();
        q.push(2.0, Kind::Send(1));
        q.set_engine(0, Some(2.0));
        q.set_engine_in_turn(1, Some(2.0), place);
        assert_eq!(q.peek_time(), Some(2.0));
        let order: Vec<Next> = std::iter::from_fn(|| {
            let next = q.pop()?;
            if let Next::Segment(_, e) = next {
                q.set_engine(e as usize, None);
            }
            Some(next)
        })
        .collect();
        use Next::*;
        assert_eq!(order, vec![Segment(2.0, 1), Driver(2.0, Kind::Send(1)), Segment(2.0, 0)]);
        assert_eq!(q.peek_time(), None);
    }
}
