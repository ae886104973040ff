//! The cluster's cache model: one index `key -> holders`, where each holder is an instance
//! and the time it last touched the key. The stamps give every instance's LRU order.
//!
//! - One walk over a request's keys yields the matched prefix length on every instance at
//!   once: at position `i`, only the holders of key `i` that matched `i` keys so far advance,
//!   and the walk stops when none does. O(instances + Σ holders of walked keys), not
//!   O(instances × keys).
//! - A touch is one index lookup and one stamp write in the same entry (no separate LRU
//!   structure to keep in step). Holders is almost always one or two instances.
//! - A bounded instance also queues `(key, stamp)` in touch order; eviction pops the oldest
//!   entry whose stamp is still current (stale ones, superseded by a later touch, are
//!   skipped) and drops that holder. The queue is compacted in place when stale entries
//!   outnumber live ones, so eviction is amortized O(1).
//!
//! Not synchronised: the router owns it behind its lock.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

/// One instance holding a key, and when it last touched it.
#[derive(Debug, Clone, Copy)]
struct Holder {
    inst: u32,
    stamp: u64,
}

/// Instances holding one key; inline for the common single holder.
#[derive(Debug, Clone)]
enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    fn get_mut(&mut self, inst: u32) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => (h.inst == inst).then_some(h),
            Holders::Many(v) => v.iter_mut().find(|h| h.inst == inst),
        }
    }

    fn push(&mut self, holder: Holder) {
        match self {
            Holders::One(h) => *self = Holders::Many(vec![*h, holder]),
            Holders::Many(v) => v.push(holder),
        }
    }

    /// Remove `inst`; returns whether no holder is left.
    fn remove(&mut self, inst: u32) -> bool {
        let Holders::Many(v) = self else {
            return matches!(self, Holders::One(h) if h.inst == inst);
        };
        v.retain(|h| h.inst != inst);
        let empty = v.is_empty();
        if let [h] = v.as_slice() {
            *self = Holders::One(*h);
        }
        empty
    }
}

/// What one instance needs beyond the index: its size and, when bounded, its touch queue.
#[derive(Debug, Clone, Default)]
struct InstanceCache {
    len: usize,
    queue: VecDeque<(u64, u64)>,
}

/// Per-instance LRU caches of block keys, all in one reverse index.
#[derive(Debug, Clone, Default)]
pub struct ClusterCache {
    index: FxHashMap<u64, Holders>,
    instances: Vec<InstanceCache>,
    capacity: Option<usize>,
    clock: u64,
}

impl ClusterCache {
    /// `instances` empty caches of `capacity` keys each (`None`: unbounded).
    pub fn new(instances: usize, capacity: Option<usize>) -> Self {
        Self {
            index: FxHashMap::default(),
            instances: vec![InstanceCache::default(); instances],
            capacity,
            clock: 0,
        }
    }

    /// Add one empty instance cache; returns its index.
    pub fn add_instance(&mut self) -> usize {
        self.instances.push(InstanceCache::default());
        self.instances.len() - 1
    }

    /// Number of keys resident on `inst`.
    pub fn cached_blocks(&self, inst: usize) -> usize {
        self.instances[inst].len
    }

    /// Leading keys of `keys` resident on `inst`. Read only. O(matched × holders).
    pub fn matched_blocks(&self, inst: usize, keys: &[u64]) -> usize {
        let inst = inst as u32;
        keys.iter()
            .take_while(|k| self.index.get(k).is_some_and(|h| h.as_slice().iter().any(|x| x.inst == inst)))
            .count()
    }

    /// Leading keys of `keys` resident on every instance, written into `out` (resized to the
    /// number of instances). Read only. One walk: O(instances + Σ holders of walked keys).
    pub fn matched_blocks_all(&self, keys: &[u64], out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.instances.len(), 0);
        for (pos, key) in keys.iter().enumerate() {
            let Some(holders) = self.index.get(key) else { break };
            let pos = pos as u32;
            let mut advanced = false;
            for h in holders.as_slice() {
                let m = &mut out[h.inst as usize];
                if *m == pos {
                    *m = pos + 1;
                    advanced = true;
                }
            }
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
                while self.instances[inst].len > cap {
                    self.evict_one(inst);
                }
            }
        }
    }

    /// Keys resident on `inst`, most recent first (for tests and inspection; O(all keys)).
    pub fn keys_mru(&self, inst: usize) -> Vec<u64> {
        let inst = inst as u32;
        let mut resident: Vec<(u64, u64)> = self
            .index
            .iter()
            .filter_map(|(&key, h)| h.as_slice().iter().find(|x| x.inst == inst).map(|x| (x.stamp, key)))
            .collect();
        resident.sort_unstable_by_key(|&(stamp, _)| std::cmp::Reverse(stamp));
        resident.into_iter().map(|(_, key)| key).collect()
    }

    /// Number of distinct keys resident anywhere.
    pub fn distinct_keys(&self) -> usize {
        self.index.len()
    }

    fn touch(&mut self, inst: usize, key: u64) {
        self.clock += 1;
        let stamp = self.clock;
        let i = inst as u32;
        let added = match self.index.get_mut(&key) {
            Some(holders) => match holders.get_mut(i) {
                Some(h) => {
                    h.stamp = stamp;
                    false
                }
                None => {
                    holders.push(Holder { inst: i, stamp });
                    true
                }
            },
            None => {
                self.index.insert(key, Holders::One(Holder { inst: i, stamp }));
                true
            }
        };
        let cache = &mut self.instances[inst];
        cache.len += usize::from(added);
        if self.capacity.is_some() {
            cache.queue.push_back((key, stamp));
            if cache.queue.len() > 2 * cache.len + 1024 {
                self.compact(inst);
            }
        }
    }

    /// Whether `(key, stamp)` is `inst`'s current touch of `key`.
    fn is_current(&self, inst: u32, key: u64, stamp: u64) -> bool {
        self.index.get(&key).is_some_and(|h| h.as_slice().iter().any(|x| x.inst == inst && x.stamp == stamp))
    }

    fn evict_one(&mut self, inst: usize) {
        let i = inst as u32;
        while let Some((key, stamp)) = self.instances[inst].queue.pop_front() {
            if !self.is_current(i, key, stamp) {
                continue;
            }
            if self.index.get_mut(&key).is_some_and(|h| h.remove(i)) {
                self.index.remove(&key);
            }
            self.instances[inst].len -= 1;
            return;
        }
    }

    /// Drop the stale entries of `inst`'s queue, keeping the order of the rest.
    fn compact(&mut self, inst: usize) {
        let mut queue = std::mem::take(&mut self.instances[inst].queue);
        queue.retain(|&(key, stamp)| self.is_current(inst as u32, key, stamp));
        self.instances[inst].queue = queue;
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

    #[test]
    fn stale_touches_are_compacted_and_order_kept() {
        let mut c = ClusterCache::new(1, Some(10));
        for round in 0..5000u64 {
            c.touch_request(0, &[round % 10]);
        }
        assert!(c.instances[0].queue.len() <= 2 * 10 + 1024);
        assert_eq!(c.keys_mru(0), (0..10).rev().collect::<Vec<u64>>());
        c.touch_request(0, &[99]);
        assert_eq!(c.keys_mru(0).len(), 10);
        assert!(!c.keys_mru(0).contains(&0), "the least recent key went first");
    }
}
