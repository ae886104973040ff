//! Pass 1, per session: the intra-session ceiling and the session-first node events.
//!
//! Each session's trie is a [`NodeSet`] of its nodes, private to the worker walking it, so
//! sessions run in parallel (rayon, over chunks of sessions of similar key counts). A request
//! usually extends the previous request of its session, so the walk first compares keys with
//! that request (a plain slice compare) and hashes only from where the two differ: most keys
//! of an agentic trace cost one comparison. For `j >= k_intra(r)` the node at depth `j` is new
//! to the session: it is emitted as an [`Event`] (16 bytes), grouped by the shard of its node at the end of each
//! chunk, for pass 2.
//!
//! O(keys) comparisons plus O(keys past the common prefix) hash-set steps. Thread-safe: the
//! shared outputs are atomics written once per position.

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use super::node::{check, node, path_hash, shard_of, NodeSet, ROOT};
use super::prep::{Layout, Trace};
use super::{Control, Stop};

/// A node first reached by its session: its 96-bit identity and its key position (the
/// position of the key in the whole trace, taken in processing order).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    pub hash: u64,
    pub check: u32,
    pub at: u32,
}

/// Events of one chunk of sessions, grouped by shard: shard `s` is
/// `events[off[s]..off[s + 1]]`. Exactly sized (16 bytes an event).
pub(crate) struct Buckets {
    pub events: Vec<Event>,
    pub off: Vec<u32>,
}

impl Buckets {
    fn group(raw: &[Event], shards: usize) -> Self {
        let mut off = vec![0u32; shards + 1];
        for e in raw {
            off[shard_of(e.hash, shards) + 1] += 1;
        }
        for s in 0..shards {
            off[s + 1] += off[s];
        }
        let mut fill = off.clone();
        let mut events = vec![Event { hash: 0, check: 0, at: 0 }; raw.len()];
        for &e in raw {
            let s = shard_of(e.hash, shards);
            events[fill[s] as usize] = e;
            fill[s] += 1;
        }
        Self { events, off }
    }

    pub fn shard(&self, s: usize) -> &[Event] {
        &self.events[self.off[s] as usize..self.off[s + 1] as usize]
    }
}

/// Length of the common prefix of `a` and `b`.
#[inline]
pub(crate) fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n && a[i..i + 8] == b[i..i + 8] {
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Walk every session; store `k_intra` by position and return the events per chunk.
pub(crate) fn run(
    trace: &Trace<'_>,
    layout: &Layout,
    chunks: &[std::ops::Range<usize>],
    shards: usize,
    k_intra: &[AtomicU32],
    ctl: &Control,
) -> Result<Vec<Buckets>, Stop> {
    chunks
        .par_iter()
        .map_init(Vec::new, |raw: &mut Vec<Event>, range| {
            // One buffer per worker, sized for the worst case (every key new): pages are
            // faulted in once, and those never touched cost no memory.
            let keys: usize = range.clone().flat_map(|s| layout.session(s)).map(|&p| layout.keys_at(p)).sum();
            raw.clear();
            raw.reserve(keys);
            let mut set = NodeSet::default();
            let mut hashes: Vec<u64> = Vec::new();
            for s in range.clone() {
                ctl.check()?;
                let positions = layout.session(s);
                if positions.len() > 1 {
                    // Clearing costs the table's capacity: shrink a table far too big first.
                    let need: usize = positions.iter().map(|&p| layout.keys_at(p)).sum();
                    if set.capacity() > 4 * need.max(1024) {
                        set = NodeSet::with_capacity_and_hasher(need, Default::default());
                    } else {
                        set.clear();
                        set.reserve(need);
                    }
                }
                let mut prev: &[u64] = &[];
                let mut work = 0u64;
                for (i, &p) in positions.iter().enumerate() {
                    // Only a later request of the session reads the set.
                    let keep = i + 1 < positions.len();
                    let keys = trace.keys[layout.rows[p as usize] as usize];
                    let base = layout.key_off[p as usize] as u32;
                    let lcp = common_prefix(prev, keys);
                    hashes.truncate(lcp);
                    let mut j = lcp;
                    let parent_of = |h: &[u64], j: usize| if j == 0 { ROOT } else { h[j - 1] };
                    // Nodes past the common prefix that the session has already reached.
                    while i > 0 && j < keys.len() {
                        let parent = parent_of(&hashes, j);
                        let n = node(parent, keys[j]);
                        let known = if keep { !set.insert(n) } else { set.contains(&n) };
                        if !known {
                            break;
                        }
                        hashes.push(path_hash(parent, keys[j]));
                        j += 1;
                    }
                    k_intra[p as usize].store(j as u32, Ordering::Relaxed);
                    // The rest is new to the session (its trie is prefix-closed).
                    for (j, &key) in keys.iter().enumerate().skip(j) {
                        let parent = parent_of(&hashes, j);
                        let hash = path_hash(parent, key);
                        hashes.push(hash);
                        if keep {
                            set.insert(node(parent, key));
                        }
                        raw.push(Event { hash, check: check(parent, key), at: base + j as u32 });
                    }
                    work += keys.len() as u64 + 1;
                    prev = keys;
                }
                ctl.advance(work);
            }
            Ok(Buckets::group(raw, shards))
        })
        .collect()
}
