//! Block-key indexes: an open-addressing hash map from a block key to a small `Copy` value
//! (the router's [`Entry`], the simulated engines' entry slots), with linear probing,
//! backward-shift deletion (no tombstones) and a load factor of at most 1/2.
//!
//! A general-purpose map would do, but these indexes are where a request's walk over its keys
//! spends its time: one cache miss per key. This map can [`KeyIndex::prefetch`] the bucket of
//! a key a walk will look up a few positions later, so those misses overlap. Buckets are 16
//! bytes (four per cache line) and keys are placed by Fibonacci hashing, so that small or
//! sequential keys spread as well as real (already hashed) block keys do.
//!
//! Lookup, insert and remove O(1) expected; growth doubles the table. Not synchronised.

/// Hint the CPU to start loading the cache line of `value` (no effect off x86_64).
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and cannot fault; the pointer comes
    // from a reference anyway. SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((value as *const T).cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// A value an index can store: one value is reserved to mark empty buckets.
pub(crate) trait IndexValue: Copy + PartialEq + std::fmt::Debug {
    /// The reserved value; never stored.
    const VACANT: Self;
}

/// `Entry::inst` of an empty bucket.
pub(crate) const VACANT: u32 = u32::MAX - 1;

/// The router's value per key: an instance and a slot (their meaning is the cache's).
/// `inst` must not be `u32::MAX - 1`, which marks empty buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub inst: u32,
    pub slot: u32,
}

impl IndexValue for Entry {
    const VACANT: Self = Entry { inst: VACANT, slot: 0 };
}

/// A slot number; `u32::MAX` is reserved.
impl IndexValue for u32 {
    const VACANT: Self = u32::MAX;
}

/// A block key or a deadline; `u64::MAX` is reserved.
impl IndexValue for u64 {
    const VACANT: Self = u64::MAX;
}

#[derive(Debug, Clone, Copy)]
struct Bucket<V> {
    key: u64,
    entry: V,
}

/// Map `u64 -> V`.
#[derive(Debug, Clone)]
pub(crate) struct KeyIndex<V: IndexValue> {
    buckets: Vec<Bucket<V>>,
    /// `64 - log2(buckets.len())`: a key's home is the top bits of its Fibonacci hash.
    shift: u32,
    len: usize,
}

impl<V: IndexValue> Default for KeyIndex<V> {
    fn default() -> Self {
        Self::with_buckets(16)
    }
}

impl<V: IndexValue> KeyIndex<V> {
    const EMPTY: Bucket<V> = Bucket { key: 0, entry: V::VACANT };

    fn with_buckets(n: usize) -> Self {
        debug_assert!(n.is_power_of_two() && n >= 2);
        Self { buckets: vec![Self::EMPTY; n], shift: 64 - n.trailing_zeros(), len: 0 }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of its bucket table.
    pub fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket<V>>()
    }

    /// Every `(key, value)`, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.buckets.iter().filter(|b| b.entry != V::VACANT).map(|b| (b.key, b.entry))
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
            if b.entry == V::VACANT {
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
        prefetch(&self.buckets[self.home(key)]);
    }

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Option<V> {
        let (i, found) = self.find(key);
        found.then(|| self.buckets[i].entry)
    }

    /// The value of `key`, to change in place.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        let (i, found) = self.find(key);
        found.then(|| &mut self.buckets[i].entry)
    }

    /// Set the value of `key` (inserting it if absent).
    pub fn insert(&mut self, key: u64, entry: V) {
        debug_assert!(entry != V::VACANT);
        let (i, found) = self.find_for_insert(key);
        self.buckets[i] = Bucket { key, entry };
        self.len += usize::from(!found);
    }

    /// Insert `key` with `value` unless it is present; returns whether it was inserted.
    pub fn insert_new(&mut self, key: u64, entry: V) -> bool {
        debug_assert!(entry != V::VACANT);
        let (i, found) = self.find_for_insert(key);
        if !found {
            self.buckets[i] = Bucket { key, entry };
            self.len += 1;
        }
        !found
    }

    /// [`KeyIndex::find`] after making room for one more key.
    fn find_for_insert(&mut self, key: u64) -> (usize, bool) {
        if 2 * (self.len + 1) > self.buckets.len() {
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
        // Backward shift: pull later buckets of the probe run into the hole when the hole
        // lies between their home and where they sit, so every key stays reachable.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.entry == V::VACANT {
                break;
            }
            let home = self.home(b.key);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = Self::EMPTY;
        self.len -= 1;
        true
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_buckets(self.buckets.len() * 2));
        for b in old.buckets.into_iter().filter(|b| b.entry != V::VACANT) {
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
            let (mut ours, mut std_map) = (KeyIndex::<Entry>::default(), HashMap::new());
            for step in 0..20_000u32 {
                let key = rng.below(key_range as usize) as u64;
                match rng.below(4) {
                    0 => {
                        let e = Entry { inst: step % 5, slot: step };
                        assert_eq!(ours.insert_new(key, e), !std_map.contains_key(&key));
                        std_map.entry(key).or_insert(e);
                    }
                    1 | 2 => {
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
        let mut ix = KeyIndex::<Entry>::default();
        ix.insert(0, Entry { inst: 1, slot: 2 });
        ix.insert(u64::MAX, Entry { inst: 3, slot: 4 });
        assert_eq!(ix.get(0), Some(Entry { inst: 1, slot: 2 }));
        ix.get_mut(u64::MAX).unwrap().slot = 9;
        assert_eq!(ix.get(u64::MAX), Some(Entry { inst: 3, slot: 9 }));
        assert!(ix.remove(0) && !ix.remove(0));
        assert_eq!(ix.len(), 1);
    }
}
