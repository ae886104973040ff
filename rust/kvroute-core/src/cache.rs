//! The cluster's cache model: one LRU per instance plus one index `key -> holders`.
//!
//! The index lets one walk over a request's keys yield the matched prefix length on every
//! instance at once: at position `i`, only the holders of key `i` that matched `i` keys so far
//! advance, and the walk stops when none does. Cost O(instances + Σ holders of walked keys),
//! not O(instances × keys). Touching a key and evicting one are O(holders of that key), and
//! holders is almost always one or two. The index and the LRUs change together in
//! [`ClusterCache::touch_request`], so they never disagree.
//!
//! Not synchronised: the router owns it behind its lock.

use rustc_hash::FxHashMap;

use crate::lru::Lru;

/// Instances holding one key, with the key's slot in each instance's LRU.
/// Inline for the common single holder; no allocation then.
#[derive(Debug, Clone)]
enum Holders {
    One(u32, u32),
    Many(Vec<(u32, u32)>),
}

impl Holders {
    fn slot_of(&self, inst: u32) -> Option<u32> {
        match self {
            Holders::One(i, s) => (*i == inst).then_some(*s),
            Holders::Many(v) => v.iter().find(|(i, _)| *i == inst).map(|(_, s)| *s),
        }
    }

    fn push(&mut self, inst: u32, slot: u32) {
        match self {
            Holders::One(i, s) => *self = Holders::Many(vec![(*i, *s), (inst, slot)]),
            Holders::Many(v) => v.push((inst, slot)),
        }
    }

    /// Remove `inst`; returns whether no holder is left.
    fn remove(&mut self, inst: u32) -> bool {
        let Holders::Many(v) = self else {
            return matches!(self, Holders::One(i, _) if *i == inst);
        };
        v.retain(|(i, _)| *i != inst);
        let empty = v.is_empty();
        if let [(i, s)] = v.as_slice() {
            *self = Holders::One(*i, *s);
        }
        empty
    }

    fn for_each_instance(&self, mut f: impl FnMut(u32)) {
        match self {
            Holders::One(i, _) => f(*i),
            Holders::Many(v) => v.iter().for_each(|(i, _)| f(*i)),
        }
    }
}

/// Per-instance LRU caches of block keys with a shared reverse index.
#[derive(Debug, Clone, Default)]
pub struct ClusterCache {
    index: FxHashMap<u64, Holders>,
    lrus: Vec<Lru>,
    capacity: Option<usize>,
}

impl ClusterCache {
    /// `instances` empty caches of `capacity` keys each (`None`: unbounded).
    pub fn new(instances: usize, capacity: Option<usize>) -> Self {
        Self { index: FxHashMap::default(), lrus: vec![Lru::new(capacity.is_some()); instances], capacity }
    }

    /// Add one empty instance cache; returns its index.
    pub fn add_instance(&mut self) -> usize {
        self.lrus.push(Lru::new(self.capacity.is_some()));
        self.lrus.len() - 1
    }

    /// Number of keys resident on `inst`.
    pub fn cached_blocks(&self, inst: usize) -> usize {
        self.lrus[inst].len()
    }

    /// Leading keys of `keys` resident on `inst`. Read only. O(matched × holders).
    pub fn matched_blocks(&self, inst: usize, keys: &[u64]) -> usize {
        let inst = inst as u32;
        keys.iter().take_while(|k| self.index.get(k).is_some_and(|h| h.slot_of(inst).is_some())).count()
    }

    /// Leading keys of `keys` resident on every instance, written into `out` (resized to the
    /// number of instances). Read only. One walk: O(instances + Σ holders of walked keys).
    pub fn matched_blocks_all(&self, keys: &[u64], out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.lrus.len(), 0);
        for (pos, key) in keys.iter().enumerate() {
            let Some(holders) = self.index.get(key) else {
                break;
            };
            let pos = pos as u32;
            let mut advanced = false;
            holders.for_each_instance(|i| {
                let m = &mut out[i as usize];
                if *m == pos {
                    *m = pos + 1;
                    advanced = true;
                }
            });
            if !advanced {
                break;
            }
        }
    }

    /// Touch every key of a request on `inst` from last to first (so the head of the prefix
    /// is the most recent), evicting least recently touched keys while over capacity.
    pub fn touch_request(&mut self, inst: usize, keys: &[u64]) {
        for &key in keys.iter().rev() {
            self.touch(inst, key);
            if let Some(cap) = self.capacity {
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

    fn touch(&mut self, inst: usize, key: u64) {
        let lru = &mut self.lrus[inst];
        let i = inst as u32;
        match self.index.get_mut(&key) {
            Some(holders) => match holders.slot_of(i) {
                Some(slot) => lru.move_to_front(slot),
                None => holders.push(i, lru.push_front(key)),
            },
            None => {
                self.index.insert(key, Holders::One(i, lru.push_front(key)));
            }
        }
    }

    fn evict_one(&mut self, inst: usize) {
        let Some(victim) = self.lrus[inst].pop_back() else {
            return;
        };
        if let Some(holders) = self.index.get_mut(&victim) {
            if holders.remove(inst as u32) {
                self.index.remove(&victim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_walk_matches_per_instance_walks() {
        let mut c = ClusterCache::new(3, None);
        c.touch_request(0, &[1, 2, 3]);
        c.touch_request(1, &[1, 2]);
        c.touch_request(2, &[9]);
        let mut out = Vec::new();
        c.matched_blocks_all(&[1, 2, 3, 4], &mut out);
        assert_eq!(out, vec![3, 2, 0]);
        for (i, &m) in out.iter().enumerate() {
            assert_eq!(c.matched_blocks(i, &[1, 2, 3, 4]), m as usize);
        }
    }

    #[test]
    fn eviction_takes_the_tail_of_a_prefix_first() {
        let mut c = ClusterCache::new(1, Some(3));
        c.touch_request(0, &[1, 2, 3]);
        assert_eq!(c.keys_mru(0), vec![1, 2, 3]);
        c.touch_request(0, &[7]);
        assert_eq!(c.keys_mru(0), vec![7, 1, 2]);
        assert_eq!(c.matched_blocks(0, &[1, 2, 3]), 2);
        assert_eq!(c.distinct_keys(), 3);
    }

    #[test]
    fn index_follows_evictions_on_shared_keys() {
        let mut c = ClusterCache::new(2, Some(2));
        c.touch_request(0, &[1, 2]);
        c.touch_request(1, &[1, 2]);
        c.touch_request(0, &[5, 6]);
        let mut out = Vec::new();
        c.matched_blocks_all(&[1, 2], &mut out);
        assert_eq!(out, vec![0, 2]);
        c.touch_request(1, &[8]);
        c.matched_blocks_all(&[1, 2], &mut out);
        assert_eq!(out, vec![0, 1]);
        assert_eq!(c.distinct_keys(), 4); // 1, 5, 6, 8
    }
}
