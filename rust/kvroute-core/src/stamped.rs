//! A queue of stamped events for LRU orders kept by lazy deletion: the router's per-instance
//! cache model (`lru.rs`: touches) and the simulated engines' pools (`sim/kv.rs`: releases).
//!
//! Each event names a key, the slot that holds it and the stamp the slot got then. The
//! owner keeps the latest stamp in the slot, so an event is live while its slot still
//! carries its stamp and stale once a later event (or an eviction) changed it. Popping skips
//! stale events; when they outnumber live ones, [`StampedQueue::compact`] drops them in
//! place. The front is the least recent live event, so an LRU pops its victims there, and
//! since the queue names the next victims' keys and slots, the owner can start loading what
//! eviction will need a few events ahead.
//!
//! Push O(1); pop amortized O(1); compaction O(queue), at most once per `live + 1024` pushes.
//! Not synchronised: owned by its LRU.

use std::collections::VecDeque;

/// One event: `key` in `slot`, stamped `stamp`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stamped {
    pub key: u64,
    pub stamp: u64,
    pub slot: u32,
}

/// Stamped events, oldest first.
#[derive(Debug, Clone, Default)]
pub(crate) struct StampedQueue(VecDeque<Stamped>);

impl StampedQueue {
    /// Append an event (the most recent).
    #[inline]
    pub fn push(&mut self, key: u64, slot: u32, stamp: u64) {
        self.0.push_back(Stamped { key, stamp, slot });
    }

    /// Events queued, stale ones included.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The event `at` places from the front.
    #[inline]
    pub fn get(&self, at: usize) -> Option<&Stamped> {
        self.0.get(at)
    }

    /// Drop the stale events when there are more than `live + 1024` events in all.
    #[inline]
    pub fn compact(&mut self, live: usize, is_live: impl Fn(&Stamped) -> bool) {
        if self.0.len() > 2 * live + 1024 {
            self.0.retain(is_live);
        }
    }

    /// Remove and return the oldest live event, dropping the stale ones before it. For each
    /// event taken, `on_ahead` is called on the event `ahead` places behind it (none for 0),
    /// so that every event is announced once, that many events before it is taken.
    #[inline]
    pub fn pop_live(
        &mut self,
        ahead: usize,
        is_live: impl Fn(&Stamped) -> bool,
        mut on_ahead: impl FnMut(&Stamped),
    ) -> Option<Stamped> {
        while let Some(e) = self.0.pop_front() {
            if let Some(a) = ahead.checked_sub(1).and_then(|i| self.0.get(i)) {
                on_ahead(a);
            }
            if is_live(&e) {
                return Some(e);
            }
        }
        None
    }
}
