//! The events view's cluster index: `kvroute key -> holders`, each holder an instance with a
//! count of the memberships it has for that key (one per data-parallel rank and engine hash
//! that maps to the key, plus one while a routed request's block is pending there).
//!
//! One walk over a request's keys gives every instance's matched prefix, as the estimate
//! view's walk does (`cache.rs`): O(instances + Σ holders of walked keys). Adding or removing
//! a membership is O(holders of that key). A key's 16-byte bucket (`table.rs`) holds up to
//! two holders inline (instance below 2^16, count below 2^15: [`Holders`]), the common case
//! of a prefix on one or two engines; a key with more points into a side table of holder
//! lists `(instance, memberships)`.
//!
//! Not synchronised: the router owns it behind its lock.

use super::table::Table;

/// How far ahead of its lookups the walk prefetches index buckets.
const PREFETCH_AHEAD: usize = 8;

/// Counts inline are below this; a larger one moves the key to a holder list.
const MAX_INLINE_COUNT: u32 = (1 << 15) - 1;
/// Instances inline are below this (the router holds at most 2^16).
const MAX_INLINE_INST: u32 = (1 << 16) - 1;
const TAG_ONE: u64 = 1 << 62;
const TAG_TWO: u64 = 2 << 62;
const TAG_LIST: u64 = 3 << 62;

/// A key's holders as its bucket value packs them: tag (2 bits) | second holder (16-bit
/// instance, 15-bit count) | first holder (the same), or tag | list index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holders {
    One((u32, u32)),
    Two((u32, u32), (u32, u32)),
    List(u32),
}

impl Holders {
    fn unpack(v: u64) -> Self {
        let holder = |bits: u64| (((bits >> 15) & 0xffff) as u32, (bits & 0x7fff) as u32);
        match v & TAG_LIST {
            TAG_ONE => Holders::One(holder(v)),
            TAG_TWO => Holders::Two(holder(v), holder(v >> 31)),
            _ => Holders::List(v as u32),
        }
    }

    /// One or two holders packed; `None` for none, more, or one that does not fit inline.
    fn inline(holders: &[(u32, u32)]) -> Option<u64> {
        match *holders {
            [a] => Holders::One(a).pack(),
            [a, b] => Holders::Two(a, b).pack(),
            _ => None,
        }
    }

    /// The packed value; `None` when a holder does not fit inline.
    fn pack(self) -> Option<u64> {
        let bits = |(i, c): (u32, u32)| {
            (i <= MAX_INLINE_INST && c <= MAX_INLINE_COUNT).then_some((u64::from(i) << 15) | u64::from(c))
        };
        match self {
            Holders::One(a) => Some(TAG_ONE | bits(a)?),
            Holders::Two(a, b) => Some(TAG_TWO | (bits(b)? << 31) | bits(a)?),
            Holders::List(at) => Some(TAG_LIST | u64::from(at)),
        }
    }
}

/// Memberships of keys on instances, walked once per request.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClusterIndex {
    keys: Table<u64>,
    /// Holder lists `(inst, count)` of keys with more than two holders (or a count too large
    /// to pack); `free` lists unused ones.
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

    /// Give memory back after a mass removal, down to room for `n` keys (see
    /// [`Table::shrink_to`]); holder lists all unused are dropped. O(1) unless it shrinks.
    pub fn shrink_to(&mut self, n: usize) {
        self.keys.shrink_to(n);
        if self.free.len() == self.many.len() && !self.many.is_empty() {
            self.many = Vec::new();
            self.free = Vec::new();
        }
    }

    /// A holder list; its index as a key's value.
    fn spill(&mut self, list: Vec<(u32, u32)>) -> u64 {
        let at = match self.free.pop() {
            Some(at) => {
                self.many[at as usize] = list;
                at
            }
            None => {
                self.many.push(list);
                u32::try_from(self.many.len() - 1).expect("2^32 keys with more than two holders")
            }
        };
        TAG_LIST | u64::from(at)
    }

    /// `holders` (one or two) packed, or in a holder list when one does not fit inline.
    fn store(&mut self, holders: &[(u32, u32)]) -> u64 {
        Holders::inline(holders).unwrap_or_else(|| self.spill(holders.to_vec()))
    }

    /// The holders of a key's value (a copy when inline; the list itself otherwise).
    fn holders(&self, v: u64) -> HolderIter<'_> {
        match Holders::unpack(v) {
            Holders::One(a) => HolderIter::Inline([a, (0, 0)], 1, 0),
            Holders::Two(a, b) => HolderIter::Inline([a, b], 2, 0),
            Holders::List(at) => HolderIter::List(self.many[at as usize].iter()),
        }
    }

    /// One more membership of `key` on `inst`: one table probe for a key new to the index or
    /// held in a list, two when its inline holders change.
    pub fn add(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        let fresh = Holders::One((i, 1)).pack().expect("an instance below 2^16");
        let (slot, found) = self.keys.entry(key, fresh);
        if !found {
            self.held[inst] += 1;
            return;
        }
        let v = *slot;
        let bump = |(x, c): (u32, u32)| (x, c + u32::from(x == i));
        let packed = match Holders::unpack(v) {
            Holders::List(at) => {
                let list = &mut self.many[at as usize];
                match list.iter_mut().find(|(x, _)| *x == i) {
                    Some((_, c)) => *c += 1,
                    None => {
                        list.push((i, 1));
                        self.held[inst] += 1;
                    }
                }
                return;
            }
            Holders::One(a) if a.0 == i => self.store(&[bump(a)]),
            Holders::One(a) => {
                self.held[inst] += 1;
                self.store(&[a, (i, 1)])
            }
            Holders::Two(a, b) if a.0 == i || b.0 == i => self.store(&[bump(a), bump(b)]),
            Holders::Two(a, b) => {
                self.held[inst] += 1;
                self.spill(vec![a, b, (i, 1)])
            }
        };
        self.keys.insert(key, packed);
    }

    /// One membership less of `key` on `inst` (none to take: no change).
    pub fn remove(&mut self, key: u64, inst: usize) {
        let i = inst as u32;
        let Some(v) = self.keys.get(key) else {
            return;
        };
        let mut left = [(0, 0); 2];
        let mut n = 0;
        let mut found = false;
        if let Holders::List(at) = Holders::unpack(v) {
            let list = &mut self.many[at as usize];
            let Some(pos) = list.iter().position(|&(x, _)| x == i) else {
                return;
            };
            list[pos].1 -= 1;
            if list[pos].1 == 0 {
                list.swap_remove(pos);
                self.held[inst] -= 1;
            }
            if list.len() > 2 {
                return;
            }
            // Two holders or fewer: back inline if they fit.
            match Holders::inline(list) {
                Some(p) => {
                    list.clear();
                    self.free.push(at);
                    self.keys.insert(key, p);
                }
                None if list.is_empty() => {
                    self.free.push(at);
                    self.keys.remove(key);
                }
                None => {}
            }
            return;
        }
        let (items, len) = match Holders::unpack(v) {
            Holders::One(a) => ([a, (0, 0)], 1),
            Holders::Two(a, b) => ([a, b], 2),
            Holders::List(_) => unreachable!("handled above"),
        };
        for &(x, c) in &items[..len] {
            if x == i {
                found = true;
                if c > 1 {
                    left[n] = (x, c - 1);
                    n += 1;
                } else {
                    self.held[inst] -= 1;
                }
            } else {
                left[n] = (x, c);
                n += 1;
            }
        }
        if !found {
            return;
        }
        if n == 0 {
            self.keys.remove(key);
        } else {
            let packed = self.store(&left[..n]);
            self.keys.insert(key, packed);
        }
    }

    /// Whether `inst` holds `key`.
    pub fn holds(&self, key: u64, inst: usize) -> bool {
        let i = inst as u32;
        self.keys.get(key).is_some_and(|v| self.holders(v).any(|(x, _)| x == i))
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
            let mut advanced = false;
            for (i, _) in self.holders(v) {
                let m = &mut matched[i as usize];
                let hit = *m == pos;
                *m += u32::from(hit);
                advanced |= hit;
            }
            if !advanced {
                break;
            }
        }
    }
}

/// The `(instance, count)` holders of one key.
enum HolderIter<'a> {
    Inline([(u32, u32); 2], usize, usize),
    List(std::slice::Iter<'a, (u32, u32)>),
}

impl Iterator for HolderIter<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        match self {
            HolderIter::Inline(items, len, at) => (*at < *len).then(|| {
                *at += 1;
                items[*at - 1]
            }),
            HolderIter::List(it) => it.next().copied(),
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

    #[test]
    fn holders_pack_inline_up_to_two_and_spill_to_lists() {
        for h in [
            Holders::One((0, 1)),
            Holders::One((65_535, MAX_INLINE_COUNT)),
            Holders::Two((3, 2), (65_535, 1)),
            Holders::List(u32::MAX),
        ] {
            assert_eq!(Holders::unpack(h.pack().unwrap()), h);
            assert_ne!(h.pack(), Some(u64::MAX)); // never the vacant marker
        }
        assert_eq!(Holders::One((1, MAX_INLINE_COUNT + 1)).pack(), None);
        let mut ix = ClusterIndex::default();
        ix.grow_to(4);
        for inst in [0, 1, 2, 3, 2] {
            ix.add(7, inst);
        }
        assert_eq!((ix.many.len(), ix.free.len()), (1, 0)); // four holders: a list
        for inst in [3, 2, 2] {
            ix.remove(7, inst);
        }
        assert!(ix.holds(7, 0) && ix.holds(7, 1) && !ix.holds(7, 2));
        assert_eq!(ix.free.len(), 1); // back inline: the list is free
        for _ in 0..MAX_INLINE_COUNT + 1 {
            ix.add(8, 1);
        }
        assert!(matches!(Holders::unpack(ix.keys.get(8).unwrap()), Holders::List(_)));
        let mut m = Vec::new();
        ix.walk(&[7, 8], &mut m);
        assert_eq!(m, vec![1, 2, 0, 0]);
    }
}
