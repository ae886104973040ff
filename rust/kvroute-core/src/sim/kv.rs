//! One engine's KV pool: a fixed number of blocks, with prefix caching on the trace's keys.
//!
//! A cached key (one trace block, `block_size` tokens = `block_size / kv_block_size` pool
//! blocks) is an entry with a reference count. Entries referenced by running requests are
//! pinned; entries nobody references stay cached in an LRU "free queue" and are evicted from
//! its cold end when blocks are needed. A request releasing its keys puts them back from the
//! last to the first, so the head of a prefix is the most recent and a prefix loses its tail
//! first (vLLM's free-block queue). Blocks not covered by a cached key (partial chunks,
//! decode tokens, keys another request cached first) are the request's private blocks.
//!
//! Accounting: `pinned` (private + referenced entries) + `cached` (free entries) + empty =
//! total. New blocks come from empty ones first, then by evicting free entries, LRU first.
//! Every operation is O(1) per key touched; an entry map lookup per key (a
//! `KeyIndex`, prefetched ahead during lookups). Not synchronised:
//! owned by one engine.

use crate::index::{prefetch, KeyIndex};

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Entry {
    key: u64,
    blocks: u32,
    refs: u32,
    prev: u32,
    next: u32,
}

/// The pool and its prefix cache.
#[derive(Debug, Clone)]
pub struct KvPool {
    total: u64,
    pinned: u64,
    cached: u64,
    map: KeyIndex<u32>,
    entries: Vec<Entry>,
    free_slots: Vec<u32>,
    /// LRU of unreferenced entries: `head` most recent, `tail` evicted first.
    head: u32,
    tail: u32,
    evictions: u64,
}

/// The result of a prefix lookup, read only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Leading keys resident.
    pub hits: usize,
    /// Pool blocks of those keys that sit unreferenced (pinning them takes them from the
    /// evictable supply).
    pub unpinned_blocks: u64,
}

impl KvPool {
    /// An empty pool of `total` blocks.
    pub fn new(total: u64) -> Self {
        Self {
            total,
            pinned: 0,
            cached: 0,
            map: KeyIndex::default(),
            entries: Vec::new(),
            free_slots: Vec::new(),
            head: NIL,
            tail: NIL,
            evictions: 0,
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Blocks held by running requests (private or referenced entries).
    pub fn pinned(&self) -> u64 {
        self.pinned
    }

    /// Blocks of unreferenced cached entries (evictable).
    pub fn cached(&self) -> u64 {
        self.cached
    }

    /// Blocks a request may still get: empty plus evictable.
    pub fn available(&self) -> u64 {
        self.total - self.pinned
    }

    /// Entries evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Keys resident (pinned or free).
    pub fn resident_keys(&self) -> usize {
        self.map.len()
    }

    /// Leading keys of `keys` resident; their entry slots are written to `slots`. Read only.
    pub fn lookup(&self, keys: &[u64], slots: &mut Vec<u32>) -> Lookup {
        slots.clear();
        let mut out = Lookup { hits: 0, unpinned_blocks: 0 };
        for (pos, &k) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(pos + 8) {
                self.map.prefetch(ahead);
            }
            let Some(slot) = self.map.get(k) else { break };
            let e = &self.entries[slot as usize];
            if e.refs == 0 {
                out.unpinned_blocks += u64::from(e.blocks);
            }
            slots.push(slot);
            out.hits += 1;
        }
        out
    }

    /// Start loading the map bucket of `key` (a lookup or register of it follows soon).
    pub fn prefetch(&self, key: u64) {
        self.map.prefetch(key);
    }

    /// Reference the entries at `slots` (from a [`lookup`](Self::lookup) just before),
    /// pushing them to `held`. Returns their blocks.
    pub fn pin(&mut self, slots: &[u32], held: &mut Vec<u32>) -> u64 {
        let mut blocks = 0;
        for &slot in slots {
            let e = &mut self.entries[slot as usize];
            e.refs += 1;
            let b = u64::from(e.blocks);
            blocks += b;
            if e.refs == 1 {
                self.unlink(slot);
                self.cached -= b;
                self.pinned += b;
            }
            held.push(slot);
        }
        blocks
    }

    /// Take `n` new private blocks, evicting free entries LRU-first if needed. Returns false
    /// (and changes nothing) when even eviction cannot free enough.
    pub fn alloc(&mut self, n: u64) -> bool {
        if n > self.available() {
            return false;
        }
        while self.total - self.pinned - self.cached < n {
            self.evict_one();
        }
        self.pinned += n;
        true
    }

    /// Turn `blocks` of a request's private blocks into a new cached entry for `key`, which
    /// the request references. Returns the slot, or None when `key` is already resident
    /// (the blocks stay private, as a duplicate block in vLLM is not cached).
    pub fn register(&mut self, key: u64, blocks: u32) -> Option<u32> {
        let slot = match self.free_slots.last() {
            Some(&s) => s,
            None => u32::try_from(self.entries.len())
                .ok()
                .filter(|&s| s != NIL)
                .expect("fewer than 2^32 - 1 cached keys"),
        };
        if !self.map.insert_new(key, slot) {
            return None;
        }
        let e = Entry { key, blocks, refs: 1, prev: NIL, next: NIL };
        if self.free_slots.pop().is_some() {
            self.entries[slot as usize] = e;
        } else {
            self.entries.push(e);
        }
        Some(slot)
    }

    /// Release a request: its `private` blocks become empty; its `held` entries (in key
    /// order) lose a reference, and those left unreferenced enter the LRU last key first.
    pub fn release(&mut self, held: &[u32], private: u64) {
        self.pinned -= private;
        for (pos, &slot) in held.iter().enumerate().rev() {
            if let Some(&ahead) = pos.checked_sub(8).map(|p| &held[p]) {
                prefetch(&self.entries[ahead as usize]);
            }
            let e = &mut self.entries[slot as usize];
            e.refs -= 1;
            if e.refs == 0 {
                let b = u64::from(e.blocks);
                self.pinned -= b;
                self.cached += b;
                self.push_head(slot);
            }
        }
    }

    /// Resident keys from most to least recently freed, then the pinned ones (tests).
    pub fn free_keys_mru(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = self.head;
        while cur != NIL {
            out.push(self.entries[cur as usize].key);
            cur = self.entries[cur as usize].next;
        }
        out
    }

    fn evict_one(&mut self) {
        let slot = self.tail;
        debug_assert!(slot != NIL, "evict from an empty LRU");
        self.unlink(slot);
        let e = &self.entries[slot as usize];
        self.cached -= u64::from(e.blocks);
        self.map.remove(e.key);
        self.free_slots.push(slot);
        // The next victim's entry is in cache now (unlink touched it); start on its bucket.
        if self.tail != NIL {
            self.map.prefetch(self.entries[self.tail as usize].key);
        }
        self.evictions += 1;
    }

    fn push_head(&mut self, slot: u32) {
        let old = self.head;
        {
            let e = &mut self.entries[slot as usize];
            e.prev = NIL;
            e.next = old;
        }
        if old != NIL {
            self.entries[old as usize].prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = {
            let e = &self.entries[slot as usize];
            (e.prev, e.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        let e = &mut self.entries[slot as usize];
        e.prev = NIL;
        e.next = NIL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_release_and_tail_first_eviction() {
        let mut kv = KvPool::new(10);
        assert!(kv.alloc(6));
        let mut held = Vec::new();
        for (k, _) in [(1u64, 0), (2, 0), (3, 0)] {
            held.push(kv.register(k, 2).unwrap());
        }
        assert_eq!(kv.pinned(), 6);
        kv.release(&held, 0);
        assert_eq!((kv.pinned(), kv.cached()), (0, 6));
        assert_eq!(kv.free_keys_mru(), vec![1, 2, 3]);
        let mut slots = Vec::new();
        let l = kv.lookup(&[1, 2, 9], &mut slots);
        assert_eq!(l, Lookup { hits: 2, unpinned_blocks: 4 });
        assert_eq!(slots, held[..2]);
        // 4 empty + 6 evictable; taking 7 evicts key 3 (the tail) and key 2.
        assert!(kv.alloc(7));
        assert_eq!(kv.free_keys_mru(), vec![1]);
        assert_eq!(kv.evictions(), 2);
        assert!(!kv.alloc(4));
        let mut h2 = Vec::new();
        kv.lookup(&[1], &mut slots);
        assert_eq!(kv.pin(&slots, &mut h2), 2);
        assert_eq!((kv.pinned(), kv.cached(), kv.available()), (9, 0, 1));
        assert!(kv.register(1, 2).is_none());
    }
}
