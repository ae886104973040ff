//! The events view's tables: a dense open-addressing map `u64 -> V`, keys and values in two
//! arrays (12 bytes a bucket for `u32` values, 16 for `u64`), up to 7/8 full, of any size (a
//! key's home is `hash(key) * buckets >> 64`), so that a table reserved for an engine's KV
//! capacity holds it without rehashing. Linear probing, backward-shift deletion.
//!
//! Denser than the estimate's `KeyIndex` (at most 1/2 full, 16-byte buckets), where walks
//! are the hot path; here memory per block is. Lookup, insert and remove O(1) expected
//! (longer probes near 7/8); growth doubles. Not synchronised.

use crate::index::IndexValue;

/// Map `u64 -> V` (see the module doc). `V::VACANT` marks empty buckets.
#[derive(Debug, Clone)]
pub(crate) struct Table<V: IndexValue> {
    keys: Vec<u64>,
    vals: Vec<V>,
    len: usize,
}

impl<V: IndexValue> Default for Table<V> {
    fn default() -> Self {
        Self::with_buckets(8)
    }
}

/// The most keys a table reserves room for before they arrive (16 Mi keys: 293 MiB of
/// `u64 -> u64` buckets, the blocks of 16 engines of a million each for the cluster table),
/// so that a capacity given by a caller cannot allocate without bound; a table holding more
/// grows as keys come.
pub const RESERVE_LIMIT: usize = 1 << 24;

/// Buckets for `n` keys at most 7/8 full (room for at most [`RESERVE_LIMIT`]).
fn buckets_for(n: usize) -> usize {
    (n.min(RESERVE_LIMIT) * 8).div_ceil(7).max(8)
}

impl<V: IndexValue> Table<V> {
    fn with_buckets(n: usize) -> Self {
        Self { keys: vec![0; n], vals: vec![V::VACANT; n], len: 0 }
    }

    /// A table that holds `n` keys without growing (at most [`RESERVE_LIMIT`] reserved
    /// up front; beyond it the table grows on demand).
    pub fn with_capacity(n: usize) -> Self {
        Self::with_buckets(buckets_for(n))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of its arrays.
    pub fn memory_bytes(&self) -> usize {
        self.keys.capacity() * 8 + self.vals.capacity() * std::mem::size_of::<V>()
    }

    fn home(&self, key: u64) -> usize {
        let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(h) * self.keys.len() as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.keys.len() {
            0
        } else {
            i + 1
        }
    }

    /// The bucket holding `key`, or the empty bucket where it would go.
    fn find(&self, key: u64) -> (usize, bool) {
        let mut i = self.home(key);
        loop {
            if self.vals[i] == V::VACANT {
                return (i, false);
            }
            if self.keys[i] == key {
                return (i, true);
            }
            i = self.next(i);
        }
    }

    /// Hint the CPU to load the bucket where a lookup of `key` begins.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        let i = self.home(key);
        crate::index::prefetch(&self.keys[i]);
        crate::index::prefetch(&self.vals[i]);
    }

    pub fn get(&self, key: u64) -> Option<V> {
        let (i, found) = self.find(key);
        found.then(|| self.vals[i])
    }

    /// Set the value of `key` (inserting it if absent).
    pub fn insert(&mut self, key: u64, value: V) {
        let (i, found) = self.find_for_insert(key);
        (self.keys[i], self.vals[i]) = (key, value);
        self.len += usize::from(!found);
    }

    /// The value of `key`, inserted as `init` if absent, and whether it was present.
    pub fn entry(&mut self, key: u64, init: V) -> (&mut V, bool) {
        let (i, found) = self.find_for_insert(key);
        if !found {
            (self.keys[i], self.vals[i]) = (key, init);
            self.len += 1;
        }
        (&mut self.vals[i], found)
    }

    /// Insert `key` unless present; returns whether it was inserted.
    pub fn insert_new(&mut self, key: u64, value: V) -> bool {
        let (i, found) = self.find_for_insert(key);
        if !found {
            (self.keys[i], self.vals[i]) = (key, value);
            self.len += 1;
        }
        !found
    }

    fn find_for_insert(&mut self, key: u64) -> (usize, bool) {
        debug_assert!(self.len < self.keys.len());
        if 8 * (self.len + 1) > 7 * self.keys.len() {
            self.grow();
        }
        self.find(key)
    }

    /// Remove `key`; returns whether it was there.
    pub fn remove(&mut self, key: u64) -> bool {
        let (mut hole, found) = self.find(key);
        if !found {
            return false;
        }
        let n = self.keys.len();
        let dist = |from: usize, to: usize| (to + n - from) % n;
        let mut j = hole;
        loop {
            j = self.next(j);
            if self.vals[j] == V::VACANT {
                break;
            }
            // Move bucket j into the hole when the hole lies between its home and j.
            if dist(self.home(self.keys[j]), j) >= dist(hole, j) {
                self.keys[hole] = self.keys[j];
                self.vals[hole] = self.vals[j];
                hole = j;
            }
        }
        self.vals[hole] = V::VACANT;
        self.len -= 1;
        true
    }

    /// Every `(key, value)`, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.keys.iter().zip(&self.vals).filter(|(_, v)| **v != V::VACANT).map(|(k, v)| (*k, *v))
    }

    /// Make room for `n` keys in all (at most [`RESERVE_LIMIT`]).
    pub fn reserve(&mut self, n: usize) {
        let n = n.min(RESERVE_LIMIT);
        if 8 * n > 7 * self.keys.len() {
            self.rehash(Self::with_capacity(n).keys.len());
        }
    }

    /// Give memory back after a mass removal: rebuild for `n` keys (at least those held) when
    /// the table has over four times the buckets that takes. O(1) unless it rebuilds.
    pub fn shrink_to(&mut self, n: usize) {
        let buckets = buckets_for(n.max(self.len));
        if self.keys.len() > 4 * buckets {
            self.rehash(buckets);
        }
    }

    fn grow(&mut self) {
        self.rehash(self.keys.len() * 2);
    }

    fn rehash(&mut self, buckets: usize) {
        let old = std::mem::replace(self, Self::with_buckets(buckets));
        for (k, v) in old.iter() {
            let (i, _) = self.find(k);
            (self.keys[i], self.vals[i]) = (k, v);
        }
        self.len = old.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_std_map() {
        let mut rng = SplitMix64::new(5);
        for (range, reserve) in [(8u64, 0), (40, 3), (1000, 700)] {
            let (mut ours, mut std_map) = (Table::<u32>::default(), HashMap::new());
            ours.reserve(reserve);
            for step in 0..20_000u32 {
                let key = rng.below(range as usize) as u64;
                match rng.below(4) {
                    0 => {
                        let new = !std_map.contains_key(&key);
                        assert_eq!(ours.insert_new(key, step), new);
                        std_map.entry(key).or_insert(step);
                    }
                    1 | 2 => {
                        ours.insert(key, step);
                        std_map.insert(key, step);
                    }
                    _ => assert_eq!(ours.remove(key), std_map.remove(&key).is_some()),
                }
                assert_eq!(ours.len(), std_map.len());
                let probe = rng.below(range as usize) as u64;
                assert_eq!(ours.get(probe), std_map.get(&probe).copied());
            }
            assert_eq!(ours.iter().count(), std_map.len());
        }
    }
}
