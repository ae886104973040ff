//! One engine's KV pool: a fixed number of blocks, with prefix caching on the trace's keys.
//!
//! A cached key (one trace block, `block_size` tokens = `block_size / kv_block_size` pool
//! blocks) is an entry with a reference count. Entries referenced by running requests are
//! pinned; entries nobody references stay cached in LRU order and are evicted from its cold
//! end when blocks are needed. A request releasing its keys puts them back from the last to
//! the first, so the head of a prefix is the most recent and a prefix loses its tail first
//! (vLLM's free-block queue). Blocks not covered by a cached key (partial chunks, decode
//! tokens, keys another request cached first) are the request's private blocks.
//!
//! The LRU is a queue of release events `(key, slot, stamp)` (`stamped.rs`); an entry remembers
//! the stamp of its last release, and pinning or evicting it clears that stamp, so queue events
//! that no longer match are skipped (and dropped in place when they outnumber live ones).
//! Eviction reads the queue front to back, so the entries and map buckets of the next victims
//! are prefetched well ahead and their cache misses overlap.
//!
//! Accounting: `pinned` (private + referenced entries) + `cached` (free entries) + empty =
//! total. New blocks come from empty ones first, then by evicting free entries, LRU first.
//! Every operation is O(1) per key touched (eviction amortized); an entry map lookup per key
//! (a `KeyIndex`, prefetched ahead). Not synchronised: owned by one engine.
//!
//! On request ([`KvPool::record_events`]) the pool also logs what it stores, evicts and
//! clears ([`PoolEvent`]), in order, for an engine that publishes vLLM's KV-cache events (the
//! emulator); off, the log costs one branch per stored or evicted key.

use crate::index::{prefetch, KeyIndex};
use crate::stamped::{Stamped, StampedQueue};

/// How many queue events ahead eviction prefetches victims' entries and map buckets.
const EVICT_AHEAD: usize = 8;

#[derive(Debug, Clone)]
struct Entry {
    key: u64,
    blocks: u32,
    refs: u32,
    /// Stamp of the release that made it free; 0 while pinned or evicted.
    freed: u64,
}

/// A change to the pool's cached keys, as vLLM's KV-cache events report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolEvent {
    /// A key was cached (vLLM's `BlockStored`).
    Stored(u64),
    /// A cached key was evicted, or dropped by a reset that running requests survived
    /// (`BlockRemoved`).
    Removed(u64),
    /// A reset emptied the whole pool (`AllBlocksCleared`).
    Cleared,
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
    /// Releases in time order (front evicted first); live where the entry's stamp matches.
    queue: StampedQueue,
    /// Unreferenced entries, and the last release stamp handed out.
    free_entries: usize,
    clock: u64,
    evictions: u64,
    /// What changed since the last [`take_events`](Self::take_events), when recording.
    log: Option<Vec<PoolEvent>>,
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
            queue: StampedQueue::default(),
            free_entries: 0,
            clock: 0,
            evictions: 0,
            log: None,
        }
    }

    /// Start (or stop, dropping what is logged) logging [`PoolEvent`]s.
    pub fn record_events(&mut self, on: bool) {
        self.log = on.then(Vec::new);
    }

    /// The events logged since the last call, oldest first (none when not recording).
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn logged(&mut self, event: PoolEvent) {
        if let Some(log) = &mut self.log {
            log.push(event);
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
    /// The map lookups run first (buckets prefetched ahead), then the entries are read, so
    /// that their cache misses overlap too.
    pub fn lookup(&self, keys: &[u64], slots: &mut Vec<u32>) -> Lookup {
        slots.clear();
        for (pos, &k) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(pos + 8) {
                self.map.prefetch(ahead);
            }
            let Some(slot) = self.map.get(k) else { break };
            prefetch(&self.entries[slot as usize]);
            slots.push(slot);
        }
        let unpinned = |&slot: &u32| {
            let e = &self.entries[slot as usize];
            if e.refs == 0 {
                u64::from(e.blocks)
            } else {
                0
            }
        };
        Lookup { hits: slots.len(), unpinned_blocks: slots.iter().map(unpinned).sum() }
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
                e.freed = 0;
                self.free_entries -= 1;
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
        let empty = self.total - self.pinned - self.cached;
        if empty < n {
            self.evict_blocks(n - empty);
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
            None => u32::try_from(self.entries.len()).expect("fewer than 2^32 cached keys"),
        };
        if !self.map.insert_new(key, slot) {
            return None;
        }
        let e = Entry { key, blocks, refs: 1, freed: 0 };
        if self.free_slots.pop().is_some() {
            self.entries[slot as usize] = e;
        } else {
            self.entries.push(e);
        }
        self.logged(PoolEvent::Stored(key));
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
                self.clock += 1;
                e.freed = self.clock;
                self.free_entries += 1;
                self.queue.push(e.key, slot, self.clock);
            }
        }
        let entries = &self.entries;
        self.queue.compact(self.free_entries, |f| entries[f.slot as usize].freed == f.stamp);
    }

    /// Drop every unreferenced entry (vLLM's `reset_prefix_cache`; not counted as
    /// evictions); entries running requests hold stay. Returns the blocks emptied. Logged as
    /// [`PoolEvent::Cleared`] when nothing is left, else a `Removed` per entry dropped.
    pub fn reset(&mut self) -> u64 {
        let blocks = self.cached;
        let evictions = self.evictions;
        let whole = self.free_entries == self.map.len();
        let log = if whole { self.log.take() } else { None };
        if blocks > 0 {
            self.evict_blocks(blocks);
        }
        if let Some(mut log) = log {
            log.push(PoolEvent::Cleared);
            self.log = Some(log);
        }
        self.evictions = evictions;
        blocks
    }

    /// Unreferenced resident keys from most to least recently freed (tests).
    pub fn free_keys_mru(&self) -> Vec<u64> {
        let mut free: Vec<&Entry> = self.entries.iter().filter(|e| e.freed != 0).collect();
        free.sort_unstable_by_key(|e| std::cmp::Reverse(e.freed));
        free.into_iter().map(|e| e.key).collect()
    }

    /// Evict free entries, least recently freed first, until at least `need` more blocks are
    /// empty. The entries and map buckets of the victims a few events on are prefetched.
    fn evict_blocks(&mut self, need: u64) {
        let mut freed = 0;
        (0..EVICT_AHEAD.min(self.queue.len())).for_each(|at| self.prefetch_victim(at));
        while freed < need {
            let (entries, map) = (&self.entries, &self.map);
            let live = |f: &Stamped| entries[f.slot as usize].freed == f.stamp;
            let f = self.queue.pop_live(EVICT_AHEAD, live, |a| {
                prefetch(&entries[a.slot as usize]);
                map.prefetch(a.key);
            });
            let f = f.expect("eviction from an empty LRU");
            let e = &mut self.entries[f.slot as usize];
            e.freed = 0;
            freed += u64::from(e.blocks);
            self.cached -= u64::from(e.blocks);
            self.free_entries -= 1;
            self.map.remove(f.key);
            self.free_slots.push(f.slot);
            self.evictions += 1;
            self.logged(PoolEvent::Removed(f.key));
        }
    }

    fn prefetch_victim(&self, at: usize) {
        if let Some(f) = self.queue.get(at) {
            prefetch(&self.entries[f.slot as usize]);
            self.map.prefetch(f.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

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
        // A reset keeps the referenced key 1, drops nothing else (none is free), and counts
        // no evictions.
        kv.release(&h2, 0);
        assert_eq!(kv.reset(), 2);
        assert_eq!((kv.cached(), kv.resident_keys(), kv.evictions()), (0, 0, 2));
    }

    #[test]
    fn logs_stores_evictions_and_resets_in_order() {
        use PoolEvent::{Cleared, Removed, Stored};
        let mut kv = KvPool::new(4);
        assert!(kv.alloc(2));
        assert!(kv.register(7, 1).is_some()); // not recording yet
        kv.record_events(true);
        let held = vec![kv.register(8, 1).unwrap()];
        assert!(kv.register(8, 1).is_none()); // a duplicate is not stored
        assert_eq!(kv.take_events(), vec![Stored(8)]);
        assert!(kv.take_events().is_empty());
        kv.release(&held, 0);
        assert!(kv.alloc(3)); // evicts key 8 (key 7 is still pinned)
        assert_eq!(kv.take_events(), vec![Removed(8)]);
        // Key 7's entry is released; a reset that leaves nothing is one Cleared...
        let mut slots = Vec::new();
        kv.lookup(&[7], &mut slots);
        kv.release(&slots, 3);
        assert_eq!(kv.reset(), 1);
        assert_eq!(kv.take_events(), vec![Cleared]);
        // ...and one that a running request survives names what it drops.
        assert!(kv.alloc(2));
        let a = kv.register(1, 1).unwrap();
        let b = kv.register(2, 1).unwrap();
        kv.release(&[b], 0);
        assert_eq!(kv.reset(), 1);
        assert_eq!(kv.take_events(), vec![Stored(1), Stored(2), Removed(2)]);
        kv.record_events(false);
        kv.release(&[a], 0);
        kv.reset();
        assert!(kv.take_events().is_empty());
    }

    /// A plain model of the pool: reference counts, and the free keys as a list (most
    /// recently freed first) that pinning unlinks from and eviction pops from the back.
    #[derive(Default)]
    struct Model {
        refs: std::collections::HashMap<u64, u32>,
        free: VecDeque<u64>,
        pinned: u64,
        evictions: u64,
    }

    impl Model {
        /// Drop a reference to each of `keys`, last first; unreferenced ones become free.
        fn unref(&mut self, keys: &[u64]) {
            for k in keys.iter().rev() {
                let r = self.refs.get_mut(k).unwrap();
                *r -= 1;
                if *r == 0 {
                    self.pinned -= 2;
                    self.free.push_front(*k);
                }
            }
        }
    }

    /// Random requests (prefix hits, new keys, duplicates, private blocks) pinned, grown and
    /// released in random order: the pool and the model agree on every count and on the
    /// LRU order at every step, through many stale queue events and compactions.
    #[test]
    fn agrees_with_a_list_model() {
        const BLOCKS: u64 = 2;
        let mut rng = crate::rng::SplitMix64::new(5);
        let (mut kv, mut m) = (KvPool::new(40), Model::default());
        let mut active: Vec<(Vec<u32>, Vec<u64>, u64)> = Vec::new();
        let mut slots = Vec::new();
        for _ in 0..20_000 {
            if active.len() > 3 || (rng.below(2) == 0 && !active.is_empty()) {
                let (held, keys, private) = active.swap_remove(rng.below(active.len()));
                kv.release(&held, private);
                m.pinned -= private;
                m.unref(&keys);
            } else {
                let base = rng.below(6) as u64 * 100;
                let keys: Vec<u64> = (0..1 + rng.below(6) as u64).map(|j| base + j).collect();
                let hits = kv.lookup(&keys, &mut slots).hits;
                assert_eq!(hits, keys.iter().take_while(|k| m.refs.contains_key(k)).count());
                let need = BLOCKS * (keys.len() - hits) as u64 + rng.below(3) as u64;
                let mut held = Vec::new();
                kv.pin(&slots, &mut held);
                for k in &keys[..hits] {
                    let r = m.refs.get_mut(k).unwrap();
                    *r += 1;
                    if *r == 1 {
                        m.free.retain(|f| f != k);
                        m.pinned += BLOCKS;
                    }
                }
                let empty = 40 - m.pinned - BLOCKS * m.free.len() as u64;
                let fits = need <= 40 - m.pinned;
                assert_eq!(kv.alloc(need), fits);
                if !fits {
                    kv.release(&held, 0);
                    m.unref(&keys[..hits]);
                    continue;
                }
                for _ in 0..need.saturating_sub(empty).div_ceil(BLOCKS) {
                    m.refs.remove(&m.free.pop_back().unwrap());
                    m.evictions += 1;
                }
                m.pinned += need;
                let mut private = need;
                let mut mine = keys[..hits].to_vec();
                for &k in &keys[hits..] {
                    if let Some(slot) = kv.register(k, BLOCKS as u32) {
                        held.push(slot);
                        private -= BLOCKS;
                        m.refs.insert(k, 1);
                        mine.push(k);
                    }
                }
                active.push((held, mine, private));
            }
            assert_eq!(kv.free_keys_mru(), Vec::from(m.free.clone()));
            assert_eq!(
                (kv.pinned(), kv.evictions(), kv.resident_keys()),
                (m.pinned, m.evictions, m.refs.len())
            );
            assert_eq!(kv.cached(), BLOCKS * m.free.len() as u64);
        }
        assert!(m.evictions > 1000, "only {} evictions", m.evictions);
    }
}
