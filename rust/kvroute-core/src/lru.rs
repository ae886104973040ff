//! One instance's LRU order over block keys, kept as touch timestamps.
//!
//! Each resident key has a slot (stable while it is resident, so the cluster index can point at
//! it) holding the key and the time it was last touched, side by side. A touch only writes that
//! stamp: no list relinking, one cache line per key. A bounded cache also appends `(key, slot,
//! stamp)` to a queue in touch order (`stamped.rs`); eviction pops the queue's front, skipping
//! entries that a later touch made stale, and stale entries are dropped in place when they
//! outnumber live ones. The order is the same as a move-to-front list's: the latest stamp is
//! the most recent. The queue names the next victims' keys and slots, so callers can start
//! loading what eviction will need a few victims ahead.
//!
//! Touch O(1); eviction amortized O(1); `keys_mru` O(n log n). Not synchronised: owned by
//! [`crate::cache::ClusterCache`].

use crate::index::prefetch;
use crate::stamped::{Stamped, StampedQueue};

/// One resident key and its last touch; stamp 0 marks a free slot.
#[derive(Debug, Clone, Copy)]
struct Slot {
    key: u64,
    stamp: u64,
}

/// LRU order over resident keys.
#[derive(Debug, Clone)]
pub struct Lru {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Touches in time order, for eviction; only kept when `evicts`.
    queue: StampedQueue,
    evicts: bool,
    clock: u64,
    len: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Self::new(true)
    }
}

impl Lru {
    /// An empty LRU; `evicts` keeps the touch queue that [`Lru::pop_back`] needs.
    pub fn new(evicts: bool) -> Self {
        Self { slots: Vec::new(), free: Vec::new(), queue: StampedQueue::default(), evicts, clock: 0, len: 0 }
    }

    /// Whether it keeps the eviction order.
    pub fn evicts(&self) -> bool {
        self.evicts
    }

    /// Number of resident keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is resident.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Insert `key` as the most recent; returns its slot.
    pub fn push_front(&mut self, key: u64) -> u32 {
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize].key = key;
                s
            }
            None => {
                self.slots.push(Slot { key, stamp: 0 });
                u32::try_from(self.slots.len() - 1).expect("more than 2^32 resident keys")
            }
        };
        self.len += 1;
        self.move_to_front(slot);
        slot
    }

    /// Whether `key` is resident in `slot` (an out-of-range slot holds nothing).
    pub fn holds(&self, slot: u32, key: u64) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.stamp != 0 && s.key == key)
    }

    /// Start loading `slot`'s cache line (a touch of it follows soon).
    pub fn prefetch_slot(&self, slot: u32) {
        if let Some(s) = self.slots.get(slot as usize) {
            prefetch(s);
        }
    }

    /// Make the key at `slot` the most recent.
    #[inline]
    pub fn move_to_front(&mut self, slot: u32) {
        self.clock += 1;
        let s = &mut self.slots[slot as usize];
        s.stamp = self.clock;
        if self.evicts {
            self.queue.push(s.key, slot, self.clock);
            let slots = &self.slots;
            self.queue.compact(self.len, |t| slots[t.slot as usize].stamp == t.stamp);
        }
    }

    /// Remove and return the least recently touched key.
    ///
    /// # Panics
    /// On an LRU made with `evicts = false`.
    pub fn pop_back(&mut self) -> Option<u64> {
        self.pop_back_prefetching(0, |_| {})
    }

    /// [`Lru::pop_back`] that, for each queue entry it takes, starts loading the slot of the
    /// entry `ahead` places behind it and hands that entry's key to `ahead_key`, so that
    /// every future victim (and stale entry) is prefetched once, `ahead` entries early.
    pub fn pop_back_prefetching(&mut self, ahead: usize, mut ahead_key: impl FnMut(u64)) -> Option<u64> {
        assert!(self.evicts, "pop_back on an LRU without eviction order");
        let slots = &self.slots;
        let live = |t: &Stamped| slots[t.slot as usize].stamp == t.stamp;
        let t = self.queue.pop_live(ahead, live, |a| {
            prefetch(&slots[a.slot as usize]);
            ahead_key(a.key);
        })?;
        self.slots[t.slot as usize].stamp = 0;
        self.free.push(t.slot);
        self.len -= 1;
        Some(t.key)
    }

    /// Remove every key; returns them (in no particular order).
    pub fn clear(&mut self) -> Vec<u64> {
        let keys = self.slots.iter().filter(|s| s.stamp != 0).map(|s| s.key).collect();
        *self = Self::new(self.evicts);
        keys
    }

    /// Keys from most to least recently touched (for tests and inspection).
    pub fn keys_mru(&self) -> Vec<u64> {
        let mut live: Vec<Slot> = self.slots.iter().copied().filter(|s| s.stamp != 0).collect();
        live.sort_unstable_by_key(|s| std::cmp::Reverse(s.stamp));
        live.into_iter().map(|s| s.key).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_eviction() {
        let mut lru = Lru::default();
        let a = lru.push_front(1);
        lru.push_front(2);
        lru.push_front(3);
        assert_eq!(lru.keys_mru(), vec![3, 2, 1]);
        lru.move_to_front(a);
        assert_eq!(lru.keys_mru(), vec![1, 3, 2]);
        assert_eq!(lru.pop_back(), Some(2));
        assert_eq!(lru.pop_back(), Some(3));
        lru.push_front(4); // reuses a freed slot
        assert_eq!(lru.keys_mru(), vec![4, 1]);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.pop_back(), Some(1));
        assert_eq!(lru.pop_back(), Some(4));
        assert_eq!(lru.pop_back(), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn compaction_keeps_the_order() {
        let mut lru = Lru::default();
        let slots: Vec<u32> = (0..10).map(|k| lru.push_front(k)).collect();
        for round in 0..3000 {
            lru.move_to_front(slots[round % 10]);
        }
        assert!(lru.queue.len() <= 2 * lru.len() + 1024);
        let expected: Vec<u64> = (0..10).rev().collect();
        assert_eq!(lru.keys_mru(), expected);
        assert_eq!(lru.pop_back(), Some(0));
    }

    #[test]
    fn unbounded_lru_keeps_order_without_a_queue() {
        let mut lru = Lru::new(false);
        let a = lru.push_front(1);
        lru.push_front(2);
        lru.move_to_front(a);
        assert_eq!(lru.keys_mru(), vec![1, 2]);
        assert_eq!(lru.queue.len(), 0);
    }
}
