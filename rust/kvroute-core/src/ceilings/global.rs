//! Pass 2, per shard of nodes: first occurrence over the whole trace and session counts.
//!
//! A node's first request in the any-session trie is the one of its session-first event with
//! the smallest key position (key positions grow with processing order, and a node occurs
//! at most once in a request, so an event is "seen before" exactly when it is not that one), and `S(node)` (distinct sessions through it) is the number of those
//! events, one per session by construction. Each shard owns the nodes whose
//! [`shard_of`](super::node::shard_of) is its index, so shards run in parallel with maps small
//! enough to stay in cache. Each event is then annotated, at its key position, with two bits:
//! [`SEEN_BEFORE`] (the node was in the trie before this request) and [`SHARED`]
//! (`S >= min_sessions`).
//!
//! Each shard's nodes live in a linear-probing table at most half full, keyed by the 96-bit
//! identity; each event remembers its slot, so the annotation needs no second lookup.
//! O(events) expected; memory O(events of one shard) per worker. The annotation array
//! is written through relaxed atomics, one writer per key position.

use std::sync::atomic::{AtomicU8, Ordering};

use rayon::prelude::*;

use super::session::{Buckets, Event};
use super::{Control, Stop};

/// The node was reached by an earlier request (any session).
pub(crate) const SEEN_BEFORE: u8 = 1;
/// `S(node) >= min_sessions`.
pub(crate) const SHARED: u8 = 2;

/// One slot of a shard's open-addressing table; `sessions == 0` marks it empty.
#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    check: u32,
    first: u32,
    sessions: u32,
}

/// Per-worker scratch: the table and each event's slot, reused from shard to shard.
#[derive(Default)]
struct Scratch {
    table: Vec<Slot>,
    slot_of: Vec<u32>,
}

impl Scratch {
    /// Fill the table from `events`: first key position and session count per node.
    fn build<'e>(&mut self, events: impl Iterator<Item = &'e Event>, total: usize) {
        let size = (total * 2).next_power_of_two().max(16);
        self.table.clear();
        self.table.resize(size, Slot::default());
        self.slot_of.clear();
        let mask = size - 1;
        for e in events {
            let mut i = e.hash as usize & mask;
            loop {
                let slot = &mut self.table[i];
                if slot.sessions == 0 {
                    *slot = Slot { hash: e.hash, check: e.check, first: e.at, sessions: 1 };
                    break;
                }
                if slot.hash == e.hash && slot.check == e.check {
                    slot.first = slot.first.min(e.at);
                    slot.sessions = slot.sessions.saturating_add(1);
                    break;
                }
                i = (i + 1) & mask;
            }
            self.slot_of.push(i as u32);
        }
    }
}

/// Annotate every event of `buckets` into `ann` at its key position.
pub(crate) fn run(
    buckets: &[Buckets],
    shards: usize,
    min_sessions: u32,
    ann: &[AtomicU8],
    ctl: &Control,
) -> Result<(), Stop> {
    (0..shards).into_par_iter().try_for_each_init(Scratch::default, |scratch, s| {
        ctl.check()?;
        let events = || buckets.iter().flat_map(|b| b.shard(s));
        let total: usize = buckets.iter().map(|b| b.shard(s).len()).sum();
        scratch.build(events(), total);
        for (e, &i) in events().zip(&scratch.slot_of) {
            let slot = &scratch.table[i as usize];
            let bits =
                u8::from(slot.first != e.at) * SEEN_BEFORE + u8::from(slot.sessions >= min_sessions) * SHARED;
            if bits != 0 {
                ann[e.at as usize].store(bits, Ordering::Relaxed);
            }
        }
        Ok(())
    })
}
