//! [`Pending`]: the blocks of routed requests that no event has confirmed yet, per instance,
//! with their deadlines and the queue that expires them.
//!
//! A routed request's blocks count as held by the instance chosen for the pending TTL from
//! the moment it is routed (its prefill has not stored them yet), unless an event confirms
//! them sooner; a pending block that no event confirms in time is forgotten. Each mark is
//! added to (and removed from) the cluster index like an event's block.
//!
//! `predict` is O(keys); `expire` O(marks expired) amortised (each mark expires once);
//! `confirm` O(1). Not synchronised: owned by the [`super::EventView`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::index::ClusterIndex;
use crate::index::KeyIndex;

/// Pending memberships: per instance, key -> deadline (ms since `epoch`), and their expiry
/// queue in deadline order.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    ttl_ms: u64,
    epoch: Instant,
    marks: Vec<KeyIndex<u64>>,
    queue: VecDeque<(u64, u32, u64)>,
}

impl Pending {
    /// No instance and no mark; marks last `ttl` (zero: no predictions).
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl_ms: ttl.as_millis() as u64,
            epoch: Instant::now(),
            marks: Vec::new(),
            queue: VecDeque::new(),
        }
    }

    /// Add an instance with no mark.
    pub fn add_instance(&mut self) {
        self.marks.push(KeyIndex::default());
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// An event stored `key` on `inst`: if it was pending, its membership is the event's
    /// now (returns true: the caller adds none).
    pub fn confirm(&mut self, inst: usize, key: u64) -> bool {
        self.marks[inst].len() > 0 && self.marks[inst].remove(key)
    }

    /// Count `keys` as pending on `inst` until the TTL from now (renewing marks already there).
    pub fn predict(&mut self, inst: usize, keys: &[u64], ix: &mut ClusterIndex) {
        if self.ttl_ms == 0 {
            return;
        }
        let deadline = self.now_ms() + self.ttl_ms;
        for &key in keys {
            if let Some(d) = self.marks[inst].get_mut(key) {
                *d = deadline;
            } else if ix.holds(key, inst) {
                continue; // confirmed by an event
            } else {
                self.marks[inst].insert(key, deadline);
                ix.add(key, inst);
            }
            self.queue.push_back((deadline, inst as u32, key));
        }
    }

    /// Forget the marks whose deadline has passed.
    pub fn expire(&mut self, ix: &mut ClusterIndex) {
        let now = self.now_ms();
        while let Some(&(deadline, inst, key)) = self.queue.front() {
            if deadline > now {
                break;
            }
            self.queue.pop_front();
            let marks = &mut self.marks[inst as usize];
            if marks.get(key) == Some(deadline) {
                marks.remove(key);
                ix.remove(key, inst as usize);
            }
        }
    }

    /// Forget every mark of `inst`.
    pub fn clear(&mut self, inst: usize, ix: &mut ClusterIndex) {
        for (key, _) in self.marks[inst].iter() {
            ix.remove(key, inst);
        }
        self.marks[inst] = KeyIndex::default();
    }

    /// Keys pending on `inst`.
    pub fn held(&self, inst: usize) -> usize {
        self.marks[inst].len()
    }

    /// Bytes of the marks and the expiry queue.
    pub fn memory_bytes(&self) -> usize {
        let marks: usize = self.marks.iter().map(KeyIndex::memory_bytes).sum();
        marks + self.queue.capacity() * 24
    }
}
