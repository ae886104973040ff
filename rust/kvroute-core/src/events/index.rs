//! The events view's cluster index: `kvroute key -> holders`, each holder an instance with a
//! count of the memberships it has for that key (one per data-parallel rank and engine hash
//! that maps to the key, plus one while a routed request's block is pending there).
//!
//! One walk over a request's keys gives every instance's matched prefix, as the estimate
//! view's walk does (`cache.rs`): O(instances + Σ holders of walked keys). Adding or removing
//! a membership is O(holders of that key). A key with one holder of one membership keeps it
//! inline in its 12-byte bucket (`table.rs`); any other key points into a side table of
//! holder lists `(instance, memberships)`.
//!
//! Not synchronised: the router owns it behind its lock.

use super::table::Table;

/// A key's value at or above this is `LIST + index` into the holder lists; below it, the one
/// instance that holds the key once.
const LIST: u32 = 1 << 31;

/// How far ahead of its lookups the walk prefetches index buckets.
const PREFETCH_AHEAD: usize = 8;

/// Memberships of keys on instances, walked once per request.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClusterIndex {
    keys: Table<u32>,
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

    /// Make room for `n` distinct keys.
    pub fn reserve(&mut self, n: usize) {
        self.keys.reserve(n);
    }

    /// A new holder list; its index as a key's value.
    fn new_list(many: &mut Vec<Vec<(u32, u32)>>, free: &mut Vec<u32>, list: Vec<(u32, u32)>) -> u32 {
        let at = match free.pop() {
            Some(at) => {
                many[at as usize] = list;
                at
            }
            None => {
                many.push(list);
                u32::try_from(many.len() - 1).ok().filter(|&a| a < LIST - 1).expect("2^31 shared keys")
            }
        };
        LIST + at
    }

    /// One more membership of `key` on `inst`. One table probe.
    pub fn add(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        debug_assert!(i < LIST);
        let Self { keys, many, free, held } = self;
        let (v, found) = keys.entry(key, i);
        if !found {
            held[inst] += 1;
            return;
        }
        if *v < LIST {
            let list = if *v == i { vec![(i, 2)] } else { vec![(*v, 1), (i, 1)] };
            held[inst] += usize::from(*v != i);
            *v = Self::new_list(many, free, list);
            return;
        }
        let list = &mut many[(*v - LIST) as usize];
        match list.iter_mut().find(|(x, _)| *x == i) {
            Some((_, c)) => *c += 1,
            None => {
                list.push((i, 1));
                held[inst] += 1;
            }
        }
    }

    /// One membership less of `key` on `inst` (none to take: no change).
    pub fn remove(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        let Some(v) = self.keys.get(key) else {
            return;
        };
        if v < LIST {
            if v == i {
                self.keys.remove(key);
                self.held[inst] -= 1;
            }
            return;
        }
        let at = v - LIST;
        let list = &mut self.many[at as usize];
        let Some(pos) = list.iter().position(|&(x, _)| x == i) else {
            return;
        };
        list[pos].1 -= 1;
        if list[pos].1 > 0 && list.len() > 1 {
            return;
        }
        if list[pos].1 == 0 {
            list.swap_remove(pos);
            self.held[inst] -= 1;
        }
        // Back inline when one holder of one membership is left; gone when none is.
        match list[..] {
            [] => {
                self.free.push(at);
                self.keys.remove(key);
            }
            [(x, 1)] => {
                list.clear();
                self.free.push(at);
                self.keys.insert(key, x);
            }
            _ => {}
        }
    }

    /// Whether `inst` holds `key`.
    pub fn holds(&self, key: u64, inst: usize) -> bool {
        let i = inst as u32;
        self.keys.get(key).is_some_and(|v| {
            v == i || (v >= LIST && self.many[(v - LIST) as usize].iter().any(|&(x, _)| x == i))
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
            let Some(v) = self.keys.get(key) else {
                break;
            };
            let pos = pos as u32;
            let mut advance = |i: u32| {
                let m = &mut matched[i as usize];
                let hit = *m == pos;
                *m += u32::from(hit);
                hit
            };
            let advanced = if v >= LIST {
                self.many[(v - LIST) as usize].iter().fold(false, |any, &(i, _)| advance(i) | any)
            } else {
                advance(v)
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
