//! The capacity curve: one global LRU of `C` keys for every requested `C`, in one pass.
//!
//! A single LRU order of at most `max(C)` keys (an intrusive list in a slab, most recent at
//! the head) carries one boundary per capacity: `bounds[b]` is the key at position
//! `caps[b] - 1`, the last one an LRU of `caps[b]` keys would hold, and each key knows its
//! level, the number of boundaries above it. A key is in the cache of capacity `caps[b]`
//! exactly when its level is at most `b` (Mattson's stack inclusion). Touching a key moves
//! the keys at the boundaries above it down one level and the boundaries up one key; a key
//! pushed past the last boundary is dropped. Requests are taken in order: the leading keys
//! present before the request are read for every capacity, then its keys are touched last to
//! first (SEMANTICS §2 step 1).
//!
//! O(keys · (1 + boundaries above the touched key)); memory O(max C); sequential.

use std::collections::HashMap;

use rustc_hash::FxBuildHasher;

const NIL: u32 = u32::MAX;

/// Multi-capacity LRU over block keys.
pub(crate) struct MultiLru {
    caps: Vec<u64>,
    bounds: Vec<u32>,
    slots: HashMap<u64, u32, FxBuildHasher>,
    key: Vec<u64>,
    prev: Vec<u32>,
    next: Vec<u32>,
    level: Vec<u16>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: u64,
}

impl MultiLru {
    /// `caps`: distinct positive capacities, ascending (at most `u16::MAX` of them).
    pub fn new(caps: Vec<u64>) -> Self {
        debug_assert!(caps.windows(2).all(|w| w[0] < w[1]) && caps.first() != Some(&0));
        Self {
            bounds: vec![NIL; caps.len()],
            caps,
            slots: HashMap::default(),
            key: Vec::new(),
            prev: Vec::new(),
            next: Vec::new(),
            level: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Number of capacities.
    pub fn count(&self) -> usize {
        self.caps.len()
    }

    /// Level of `key`: the smallest `b` whose cache holds it, or `count()` if none does.
    #[inline]
    pub fn level(&self, key: u64) -> usize {
        self.slots.get(&key).map_or(self.caps.len(), |&i| usize::from(self.level[i as usize]))
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n
        } else {
            self.next[p as usize] = n
        }
        if n == NIL {
            self.tail = p
        } else {
            self.prev[n as usize] = p
        }
    }

    fn push_front(&mut self, i: u32) {
        self.prev[i as usize] = NIL;
        self.next[i as usize] = self.head;
        if self.head == NIL {
            self.tail = i
        } else {
            self.prev[self.head as usize] = i
        }
        self.head = i;
        self.level[i as usize] = 0;
    }

    /// Shift boundaries `0..upto` one key up, for a key `i` about to go to the head; returns
    /// the key pushed out past the last boundary, if any.
    fn shift(&mut self, upto: usize, i: u32) -> Option<u32> {
        let mut dropped = None;
        for b in 0..upto {
            let e = self.bounds[b];
            if e == NIL {
                continue;
            }
            if b + 1 == self.caps.len() {
                dropped = Some(e);
            } else {
                self.level[e as usize] += 1;
            }
            self.bounds[b] = if self.caps[b] == 1 { i } else { self.prev[e as usize] };
        }
        dropped
    }

    /// Touch `key`: make it the most recent, evicting past the largest capacity.
    pub fn touch(&mut self, key: u64) {
        if let Some(&i) = self.slots.get(&key) {
            let l = usize::from(self.level[i as usize]);
            let dropped = self.shift(l, i);
            debug_assert!(dropped.is_none());
            // The key may itself be the last one of cache `l`: its predecessor takes its place.
            if l < self.caps.len() && self.bounds[l] == i && self.caps[l] > 1 {
                self.bounds[l] = self.prev[i as usize];
            }
            self.unlink(i);
            self.push_front(i);
            return;
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.key[i as usize] = key;
                i
            }
            None => {
                self.key.push(key);
                self.prev.push(NIL);
                self.next.push(NIL);
                self.level.push(0);
                (self.key.len() - 1) as u32
            }
        };
        self.slots.insert(key, i);
        let dropped = self.shift(self.caps.len(), i);
        self.push_front(i);
        self.len += 1;
        if let Some(e) = dropped {
            self.unlink(e);
            self.slots.remove(&self.key[e as usize]);
            self.free.push(e);
            self.len -= 1;
        } else if let Some(b) = self.caps.iter().position(|&c| c == self.len) {
            self.bounds[b] = self.tail;
        }
    }

    /// For each capacity `b`, the number of leading `keys` in its cache (into `out`).
    pub fn matched(&self, keys: &[u64], out: &mut [u32]) {
        let count = self.caps.len();
        let mut level = 0usize;
        let mut b = 0usize;
        for (j, &k) in keys.iter().enumerate() {
            level = level.max(self.level(k));
            while b < level {
                out[b] = j as u32;
                b += 1;
            }
            if b == count {
                return;
            }
        }
        for o in &mut out[b..] {
            *o = keys.len() as u32;
        }
    }
}
