//! The events view's cluster index: `kvroute key -> holders`, each holder an instance with a
//! count of the memberships it has for that key (one per data-parallel rank and engine hash
//! that maps to the key, plus one while a routed request's block is pending there).
//!
//! One walk over a request's keys gives every instance's matched prefix, as the estimate
//! view's walk does (`cache.rs`): O(instances + Σ holders of walked keys). Adding or removing
//! a membership is O(holders of that key). A key with one holder keeps it inline in its
//! 16-byte bucket; a key with several points into a side table of holder lists.
//!
//! Not synchronised: the router owns it behind its lock.

use crate::index::{IndexValue, KeyIndex};

/// `Holders::inst` of a key with several holders: `count` then indexes the list table.
const MANY: u32 = u32::MAX;

/// The holders of one key: `(inst, count)` inline, or a list (`inst == MANY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holders {
    inst: u32,
    count: u32,
}

impl IndexValue for Holders {
    const VACANT: Self = Holders { inst: crate::index::VACANT, count: 0 };
}

/// How far ahead of its lookups the walk prefetches index buckets.
const PREFETCH_AHEAD: usize = 8;

/// Memberships of keys on instances, walked once per request.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClusterIndex {
    keys: KeyIndex<Holders>,
    /// Holder lists `(inst, count)` of keys with several holders; `free` lists unused ones.
    many: Vec<Vec<(u32, u32)>>,
    free: Vec<u32>,
    /// Distinct keys held per instance.
    held: Vec<usize>,
}

impl ClusterIndex {
    /// Make room for instances `0..n`.
    pub fn grow_to(&mut self, n: usize) {
        if self.held.len() < n {
            self.held.resize(n, 0);
        }
    }

    /// Distinct keys `inst` holds.
    pub fn held(&self, inst: usize) -> usize {
        self.held.get(inst).copied().unwrap_or(0)
    }

    /// Distinct keys held anywhere.
    pub fn distinct_keys(&self) -> usize {
        self.keys.len()
    }

    /// Bytes the index's tables take (buckets and holder lists, not the allocator's slack).
    pub fn memory_bytes(&self) -> usize {
        let lists: usize = self.many.iter().map(|l| l.capacity() * 8 + 24).sum();
        self.keys.memory_bytes() + lists + self.free.capacity() * 4 + self.held.capacity() * 8
    }

    /// One more membership of `key` on `inst`.
    pub fn add(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        let Some(h) = self.keys.get_mut(key) else {
            self.keys.insert(key, Holders { inst: i, count: 1 });
            self.held[inst] += 1;
            return;
        };
        if h.inst == i {
            h.count += 1;
            return;
        }
        if h.inst != MANY {
            let list = vec![(h.inst, h.count), (i, 1)];
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
            *h = Holders { inst: MANY, count: at };
            self.held[inst] += 1;
            return;
        }
        let list = &mut self.many[h.count as usize];
        match list.iter_mut().find(|(x, _)| *x == i) {
            Some((_, c)) => *c += 1,
            None => {
                list.push((i, 1));
                self.held[inst] += 1;
            }
        }
    }

    /// One membership less of `key` on `inst` (none to take: no change).
    pub fn remove(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        let Some(h) = self.keys.get_mut(key) else {
            return;
        };
        if h.inst == i {
            h.count -= 1;
            if h.count == 0 {
                self.keys.remove(key);
                self.held[inst] -= 1;
            }
            return;
        }
        if h.inst != MANY {
            return;
        }
        let at = h.count;
        let list = &mut self.many[at as usize];
        let Some(pos) = list.iter().position(|&(x, _)| x == i) else {
            return;
        };
        list[pos].1 -= 1;
        if list[pos].1 > 0 {
            return;
        }
        list.swap_remove(pos);
        self.held[inst] -= 1;
        if let [(x, c)] = list[..] {
            list.clear();
            self.free.push(at);
            *h = Holders { inst: x, count: c };
        }
    }

    /// Whether `inst` holds `key`.
    pub fn holds(&self, key: u64, inst: usize) -> bool {
        let i = inst as u32;
        self.keys.get(key).is_some_and(|h| {
            h.inst == i || (h.inst == MANY && self.many[h.count as usize].iter().any(|&(x, _)| x == i))
        })
    }

    /// Leading keys of `keys` held by each instance, from one walk, into `matched` (one
    /// entry per instance). O(instances + Σ holders of walked keys).
    pub fn walk(&self, keys: &[u64], matched: &mut Vec<u32>) {
        matched.clear();
        matched.resize(self.held.len(), 0);
        for (pos, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(pos + PREFETCH_AHEAD) {
                self.keys.prefetch(ahead);
            }
            let Some(h) = self.keys.get(key) else {
                break;
            };
            let pos = pos as u32;
            let mut advance = |i: u32| {
                let m = &mut matched[i as usize];
                let hit = *m == pos;
                *m += u32::from(hit);
                hit
            };
            let advanced = if h.inst == MANY {
                self.many[h.count as usize].iter().fold(false, |any, &(i, _)| advance(i) | any)
            } else {
                advance(h.inst)
            };
            if !advanced {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_walks() {
        let mut ix = ClusterIndex::default();
        ix.grow_to(3);
        for (key, inst) in [(1, 0), (2, 0), (1, 1), (1, 1), (2, 1), (3, 1), (1, 2)] {
            ix.add(key, inst);
        }
        let mut m = Vec::new();
        ix.walk(&[1, 2, 3, 4], &mut m);
        assert_eq!(m, vec![2, 3, 1]);
        assert_eq!((ix.held(0), ix.held(1), ix.held(2), ix.distinct_keys()), (2, 3, 1, 3));
        ix.remove(1, 1); // one of its two memberships
        assert!(ix.holds(1, 1));
        ix.remove(1, 1);
        assert!(!ix.holds(1, 1) && ix.holds(1, 0) && ix.holds(1, 2));
        ix.remove(1, 2);
        ix.remove(1, 2); // nothing left to take
        ix.remove(1, 0);
        assert_eq!((ix.distinct_keys(), ix.held(0), ix.held(1)), (2, 1, 2));
        ix.walk(&[1, 2], &mut m);
        assert_eq!(m, vec![0, 0, 0]);
    }
}
