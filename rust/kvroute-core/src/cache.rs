//! The cluster's cache model: one LRU per instance plus one index `key -> holders`.
//!
//! The index lets one walk over a request's keys yield the matched prefix length on every
//! instance at once: at position `i`, only the holders of key `i` that matched `i` keys so far
//! advance, and the walk stops when none does. Cost O(instances + Σ holders of walked keys),
//! not O(instances × keys). The walk also keeps each walked key's index entry, so touching
//! the chosen instance's matched prefix afterwards needs no second lookup (each kept entry is
//! checked against the instance's slot before use, so evictions in between are safe).
//! Touching a key and evicting one are O(holders of that key), and holders is almost always
//! one or two. The index and the LRUs change together in [`ClusterCache::touch_request`], so
//! they never disagree.
//!
//! Index entries are 16 bytes (key, instance, slot) so that more of the index stays in cache;
//! a key held by several instances points into a side table of holder lists instead. The
//! walk prefetches the index buckets of the keys a few positions ahead (`index::KeyIndex`).
//!
//! Not synchronised: the router owns it behind its lock.

use crate::index::{Entry, KeyIndex, VACANT};
use crate::lru::Lru;

/// `Entry::inst` of a key with several holders: `slot` then indexes the holder-list table.
/// (An entry's single holder is `(inst, slot)`.)
const MANY: u32 = u32::MAX;

/// How far ahead of its lookups the walk prefetches index buckets.
const PREFETCH_AHEAD: usize = 8;

/// How many eviction-queue entries ahead eviction prefetches slots and index buckets (about
/// 2.4 entries are taken per eviction, stale ones included).
const EVICT_AHEAD: usize = 16;

/// The result of one walk: matched blocks per instance and the walked keys' index entries.
#[derive(Debug, Clone, Default)]
pub struct PrefixWalk {
    matched: Vec<u32>,
    entries: Vec<Entry>,
}

impl PrefixWalk {
    /// Leading keys resident on each instance.
    pub fn matched(&self) -> &[u32] {
        &self.matched
    }

    /// Move the walked entries out (all a touch needs), leaving this walk empty.
    pub fn take_entries(&mut self) -> PrefixWalk {
        PrefixWalk { matched: Vec::new(), entries: std::mem::take(&mut self.entries) }
    }

    /// Forget the last walk (a touch then looks every key up).
    pub fn clear(&mut self) {
        self.matched.clear();
        self.entries.clear();
    }
}

/// Per-instance LRU caches of block keys with a shared reverse index.
#[derive(Debug, Clone, Default)]
pub struct ClusterCache {
    index: KeyIndex<Entry>,
    /// Holder lists `(inst, slot)` of keys with several holders; `free` lists unused ones.
    many: Vec<Vec<(u32, u32)>>,
    free: Vec<u32>,
    lrus: Vec<Lru>,
    /// Keys each instance holds at most (`None`: unbounded), and the default for new ones.
    capacities: Vec<Option<usize>>,
    capacity: Option<usize>,
}

impl ClusterCache {
    /// `instances` empty caches of `capacity` keys each (`None`: unbounded).
    pub fn new(instances: usize, capacity: Option<usize>) -> Self {
        let mut cache = Self { capacity, ..Self::default() };
        (0..instances).for_each(|_| _ = cache.add_instance());
        cache
    }

    /// Add one empty instance cache; returns its index.
    pub fn add_instance(&mut self) -> usize {
        assert!(self.lrus.len() < VACANT as usize, "more than 2^32 - 2 instances");
        self.lrus.push(Lru::new(self.capacity.is_some()));
        self.capacities.push(self.capacity);
        self.lrus.len() - 1
    }

    /// Bound `inst`'s cache to `capacity` keys (`None`: unbounded), evicting its least
    /// recently touched keys beyond it. O(its keys × log) when its LRU must be rebuilt (an
    /// unbounded one keeps no eviction order), else O(evicted).
    pub fn set_capacity(&mut self, inst: usize, capacity: Option<usize>) {
        self.capacities[inst] = capacity;
        if capacity.is_some() && !self.lrus[inst].evicts() {
            let keys = self.lrus[inst].keys_mru();
            self.clear_instance(inst);
            self.lrus[inst] = Lru::new(true);
            for &key in keys.iter().rev() {
                self.touch(inst, key);
            }
        }
        if let Some(cap) = capacity {
            while self.lrus[inst].len() > cap {
                self.evict_one(inst);
            }
        }
    }

    /// Number of keys resident on `inst`.
    pub fn cached_blocks(&self, inst: usize) -> usize {
        self.lrus[inst].len()
    }

    /// Leading keys of `keys` resident on `inst`. Read only. O(matched × holders).
    pub fn matched_blocks(&self, inst: usize, keys: &[u64]) -> usize {
        let inst = inst as u32;
        keys.iter()
            .take_while(|&&k| self.index.get(k).is_some_and(|e| self.slot_of(e, inst).is_some()))
            .count()
    }

    /// Leading keys of `keys` resident on every instance, from one walk. Read only.
    /// O(instances + Σ holders of walked keys).
    pub fn walk(&self, keys: &[u64], walk: &mut PrefixWalk) {
        let PrefixWalk { matched, entries } = walk;
        matched.clear();
        matched.resize(self.lrus.len(), 0);
        entries.clear();
        for (pos, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(pos + PREFETCH_AHEAD) {
                self.index.prefetch(ahead);
            }
            let Some(entry) = self.index.get(key) else {
                break;
            };
            entries.push(entry);
            let pos = pos as u32;
            let mut advance = |i: u32| {
                let m = &mut matched[i as usize];
                let hit = *m == pos;
                *m += u32::from(hit);
                hit
            };
            let advanced = if entry.inst == MANY {
                self.many[entry.slot as usize].iter().fold(false, |any, &(i, _)| advance(i) | any)
            } else {
                advance(entry.inst)
            };
            if !advanced {
                break;
            }
        }
    }

    /// Touch every key of a request on `inst` from last to first (so the head of the prefix
    /// is the most recent), evicting least recently touched keys while over capacity.
    /// `walk` is a walk over the same keys since which only this call changed the cache (or
    /// an empty one): its entries spare the matched prefix a second index lookup.
    pub fn touch_request(&mut self, inst: usize, keys: &[u64], walk: &PrefixWalk) {
        let i = inst as u32;
        // Start early on what a key a few positions on will need: its slot on `inst` when the
        // walk found it there, else (new to the cluster, mostly) its index bucket.
        let prefetch = |cache: &Self, pos: usize| match walk.entries.get(pos) {
            Some(&e) if e.inst == i => cache.lrus[inst].prefetch_slot(e.slot),
            Some(_) => {}
            None => cache.index.prefetch(keys[pos]),
        };
        let n = keys.len();
        (n.saturating_sub(PREFETCH_AHEAD)..n).for_each(|pos| prefetch(self, pos));
        for (pos, &key) in keys.iter().enumerate().rev() {
            if let Some(ahead) = pos.checked_sub(PREFETCH_AHEAD) {
                prefetch(self, ahead);
            }
            let hinted = walk.entries.get(pos).and_then(|&e| self.slot_of(e, i));
            let lru = &mut self.lrus[inst];
            match hinted {
                Some(slot) if lru.holds(slot, key) => lru.move_to_front(slot),
                _ => self.touch(inst, key),
            }
            if let Some(cap) = self.capacities[inst] {
                while self.lrus[inst].len() > cap {
                    self.evict_one(inst);
                }
            }
        }
    }

    /// Keys resident on `inst`, most recent first (for tests and inspection).
    pub fn keys_mru(&self, inst: usize) -> Vec<u64> {
        self.lrus[inst].keys_mru()
    }

    /// Number of distinct keys resident anywhere.
    pub fn distinct_keys(&self) -> usize {
        self.index.len()
    }

    /// `inst`'s slot in `entry`, if `inst` is among its holders. An entry kept from an
    /// earlier walk may be stale: callers check the slot with [`Lru::holds`].
    fn slot_of(&self, entry: Entry, inst: u32) -> Option<u32> {
        if entry.inst == MANY {
            let list = self.many.get(entry.slot as usize)?;
            list.iter().find(|&&(h, _)| h == inst).map(|&(_, s)| s)
        } else {
            (entry.inst == inst).then_some(entry.slot)
        }
    }

    fn touch(&mut self, inst: usize, key: u64) {
        let i = inst as u32;
        let Some(entry) = self.index.get(key) else {
            let slot = self.lrus[inst].push_front(key);
            self.index.insert(key, Entry { inst: i, slot });
            return;
        };
        if let Some(slot) = self.slot_of(entry, i) {
            self.lrus[inst].move_to_front(slot);
            return;
        }
        let slot = self.lrus[inst].push_front(key);
        if entry.inst == MANY {
            self.many[entry.slot as usize].push((i, slot));
            return;
        }
        let list = vec![(entry.inst, entry.slot), (i, slot)];
        let at = match self.free.pop() {
            Some(at) => {
                self.many[at as usize] = list;
                at
            }
            None => {
                self.many.push(list);
                u32::try_from(self.many.len() - 1).expect("more than 2^32 shared keys")
            }
        };
        self.index.insert(key, Entry { inst: MANY, slot: at });
    }

    /// Empty `inst`'s cache (its engine dropped every block). O(keys it held × holders).
    pub fn clear_instance(&mut self, inst: usize) {
        for key in self.lrus[inst].clear() {
            self.unindex(inst, key);
        }
    }

    fn evict_one(&mut self, inst: usize) {
        let index = &self.index;
        let Some(victim) = self.lrus[inst].pop_back_prefetching(EVICT_AHEAD, |k| index.prefetch(k)) else {
            return;
        };
        self.unindex(inst, victim);
    }

    /// Take `inst` out of the holders of `victim` (no longer in its LRU).
    fn unindex(&mut self, inst: usize, victim: u64) {
        let i = inst as u32;
        let Some(entry) = self.index.get_mut(victim) else {
            return;
        };
        if entry.inst != MANY {
            if entry.inst == i {
                self.index.remove(victim);
            }
            return;
        }
        let list = &mut self.many[entry.slot as usize];
        list.retain(|&(h, _)| h != i);
        if let [(h, s)] = list[..] {
            list.clear();
            self.free.push(entry.slot);
            *entry = Entry { inst: h, slot: s };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_walk_matches_per_instance_walks() {
        let none = PrefixWalk::default();
        let mut c = ClusterCache::new(3, None);
        c.touch_request(0, &[1, 2, 3], &PrefixWalk::default());
        c.touch_request(1, &[1, 2], &none);
        c.touch_request(2, &[9], &none);
        let mut w = PrefixWalk::default();
        c.walk(&[1, 2, 3, 4], &mut w);
        assert_eq!(w.matched(), vec![3, 2, 0]);
        for (i, &m) in w.matched().iter().enumerate() {
            assert_eq!(c.matched_blocks(i, &[1, 2, 3, 4]), m as usize);
        }
    }

    #[test]
    fn eviction_takes_the_tail_of_a_prefix_first() {
        let none = PrefixWalk::default();
        let mut c = ClusterCache::new(1, Some(3));
        c.touch_request(0, &[1, 2, 3], &PrefixWalk::default());
        assert_eq!(c.keys_mru(0), vec![1, 2, 3]);
        c.touch_request(0, &[7], &none);
        assert_eq!(c.keys_mru(0), vec![7, 1, 2]);
        assert_eq!(c.matched_blocks(0, &[1, 2, 3]), 2);
        assert_eq!(c.distinct_keys(), 3);
    }

    #[test]
    fn index_follows_evictions_on_shared_keys() {
        let none = PrefixWalk::default();
        let mut c = ClusterCache::new(2, Some(2));
        c.touch_request(0, &[1, 2], &none);
        c.touch_request(1, &[1, 2], &none);
        c.touch_request(0, &[5, 6], &none);
        let mut w = PrefixWalk::default();
        c.walk(&[1, 2], &mut w);
        assert_eq!(w.matched(), vec![0, 2]);
        c.touch_request(1, &[8], &none);
        c.walk(&[1, 2], &mut w);
        assert_eq!(w.matched(), vec![0, 1]);
        assert_eq!(c.distinct_keys(), 4); // 1, 5, 6, 8
    }

    #[test]
    fn a_capacity_set_later_evicts_the_least_recent_keys() {
        let none = PrefixWalk::default();
        let mut c = ClusterCache::new(2, None);
        c.touch_request(0, &[1, 2, 3], &none);
        c.touch_request(0, &[7], &none);
        c.touch_request(1, &[1, 2], &none);
        c.set_capacity(0, Some(2));
        assert_eq!(c.keys_mru(0), vec![7, 1]);
        c.touch_request(0, &[8], &none);
        assert_eq!(c.keys_mru(0), vec![8, 7]);
        assert_eq!(c.keys_mru(1), vec![1, 2]);
        c.set_capacity(0, None);
        c.touch_request(0, &[9, 10], &none);
        assert_eq!(c.cached_blocks(0), 4);
    }

    #[test]
    fn clearing_an_instance_leaves_the_others() {
        let none = PrefixWalk::default();
        let mut c = ClusterCache::new(2, Some(4));
        c.touch_request(0, &[1, 2, 3], &none);
        c.touch_request(1, &[1, 2, 9], &none);
        c.clear_instance(0);
        let mut w = PrefixWalk::default();
        c.walk(&[1, 2, 3], &mut w);
        assert_eq!(w.matched(), vec![0, 2]);
        assert_eq!((c.cached_blocks(0), c.distinct_keys()), (0, 3));
        c.touch_request(0, &[1, 5, 6, 7, 8], &none); // evicts again after the clear
        assert_eq!(c.keys_mru(0), vec![1, 5, 6, 7]);
        c.clear_instance(1);
        assert_eq!(c.distinct_keys(), 4);
    }

    /// Touching with a walk's entries gives the same state as touching without, also when
    /// the touch's own evictions free (and reuse) the slots and holder lists the walk saw.
    #[test]
    fn walk_entries_never_change_the_outcome() {
        let mut rng = crate::rng::SplitMix64::new(7);
        for capacity in [Some(3), Some(6), Some(20), None] {
            let (mut hinted, mut plain) = (ClusterCache::new(3, capacity), ClusterCache::new(3, capacity));
            let mut w = PrefixWalk::default();
            for _ in 0..3000 {
                let len = 1 + rng.below(8);
                let keys: Vec<u64> = (0..len).map(|_| rng.below(12) as u64).collect();
                let inst = rng.below(3);
                hinted.walk(&keys, &mut w);
                hinted.touch_request(inst, &keys, &w);
                plain.touch_request(inst, &keys, &PrefixWalk::default());
                for i in 0..3 {
                    assert_eq!(hinted.keys_mru(i), plain.keys_mru(i));
                }
                assert_eq!(hinted.distinct_keys(), plain.distinct_keys());
            }
        }
    }
}
