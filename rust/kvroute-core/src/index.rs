//! The cluster cache's key index: an open-addressing hash map from a block key to one
//! [`Entry`], with linear probing, backward-shift deletion (no tombstones) and a load factor
//! of at most 1/2.
//!
//! A general-purpose map would do, but the index is where a request's walk spends its time:
//! one cache miss per key of the request. This map can [`KeyIndex::prefetch`] the bucket of a
//! key the walk will look up a few positions later, so those misses overlap. Buckets are 16
//! bytes (four per cache line) and keys are placed by Fibonacci hashing, so that small or
//! sequential keys spread as well as real (already hashed) block keys do.
//!
//! Lookup, insert and remove O(1) expected; growth doubles the table. Not synchronised.

/// `Entry::inst` of an empty bucket.
pub(crate) const VACANT: u32 = u32::MAX - 1;

/// What the index stores per key: an instance and a slot (their meaning is the cache's).
/// `inst` must not be `u32::MAX - 1`, which marks empty buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub inst: u32,
    pub slot: u32,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    key: u64,
    entry: Entry,
}

const EMPTY: Bucket = Bucket { key: 0, entry: Entry { inst: VACANT, slot: 0 } };

/// Map `u64 -> Entry`.
#[derive(Debug, Clone)]
pub(crate) struct KeyIndex {
    buckets: Vec<Bucket>,
    /// `64 - log2(buckets.len())`: a key's home is the top bits of its Fibonacci hash.
    shift: u32,
    len: usize,
}

impl Default for KeyIndex {
    fn default() -> Self {
        Self::with_buckets(16)
    }
}

impl KeyIndex {
    fn with_buckets(n: usize) -> Self {
        debug_assert!(n.is_power_of_two() && n >= 2);
        Self { buckets: vec![EMPTY; n], shift: 64 - n.trailing_zeros(), len: 0 }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The bucket holding `key`, or the empty bucket where it would go.
    fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let b = &self.buckets[i];
            if b.entry.inst == VACANT {
                return (i, false);
            }
            if b.key == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// Hint the CPU to start loading the bucket where a lookup of `key` begins.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let bucket: *const Bucket = &self.buckets[self.home(key)];
            // SAFETY: a prefetch reads nothing architecturally and cannot fault; the pointer
            // is in bounds anyway. SSE is part of the x86_64 baseline.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(bucket.cast()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// The entry of `key`.
    pub fn get(&self, key: u64) -> Option<Entry> {
        let (i, found) = self.find(key);
        found.then(|| self.buckets[i].entry)
    }

    /// The entry of `key`, to change in place.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut Entry> {
        let (i, found) = self.find(key);
        found.then(|| &mut self.buckets[i].entry)
    }

    /// Set the entry of `key` (inserting it if absent).
    pub fn insert(&mut self, key: u64, entry: Entry) {
        debug_assert!(entry.inst != VACANT);
        if 2 * (self.len + 1) > self.buckets.len() {
            self.grow();
        }
        let (i, found) = self.find(key);
        self.buckets[i] = Bucket { key, entry };
        self.len += usize::from(!found);
    }

    /// Remove `key`; returns whether it was there.
    pub fn remove(&mut self, key: u64) -> bool {
        let (mut hole, found) = self.find(key);
        if !found {
            return false;
        }
        // Backward shift: pull later buckets of the probe run into the hole when the hole
        // lies between their home and where they sit, so every key stays reachable.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.entry.inst == VACANT {
                break;
            }
            let home = self.home(b.key);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        true
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_buckets(self.buckets.len() * 2));
        for b in old.buckets.into_iter().filter(|b| b.entry.inst != VACANT) {
            let (i, _) = self.find(b.key);
            self.buckets[i] = b;
        }
        self.len = old.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use std::collections::HashMap;

    /// Random inserts, updates and removes over a small key range (long probe runs, many
    /// wrap-arounds and backward shifts) agree with `std`'s map at every step.
    #[test]
    fn agrees_with_a_std_map() {
        let mut rng = SplitMix64::new(3);
        for key_range in [8u64, 40, 1000] {
            let (mut ours, mut std_map) = (KeyIndex::default(), HashMap::new());
            for step in 0..20_000u32 {
                let key = rng.below(key_range as usize) as u64;
                match rng.below(3) {
                    0 | 1 => {
                        let e = Entry { inst: step % 7, slot: step };
                        ours.insert(key, e);
                        std_map.insert(key, e);
                    }
                    _ => assert_eq!(ours.remove(key), std_map.remove(&key).is_some()),
                }
                assert_eq!(ours.len(), std_map.len());
                let probe = rng.below(key_range as usize) as u64;
                assert_eq!(ours.get(probe), std_map.get(&probe).copied());
            }
            for (k, e) in &std_map {
                assert_eq!(ours.get(*k), Some(*e));
            }
        }
    }

    #[test]
    fn key_zero_and_max_are_ordinary_keys() {
        let mut ix = KeyIndex::default();
        ix.insert(0, Entry { inst: 1, slot: 2 });
        ix.insert(u64::MAX, Entry { inst: 3, slot: 4 });
        assert_eq!(ix.get(0), Some(Entry { inst: 1, slot: 2 }));
        ix.get_mut(u64::MAX).unwrap().slot = 9;
        assert_eq!(ix.get(u64::MAX), Some(Entry { inst: 3, slot: 9 }));
        assert!(ix.remove(0) && !ix.remove(0));
        assert_eq!(ix.len(), 1);
    }
}
