//! One data-parallel rank of one engine, as its events describe it: the map from the engine's
//! block hashes to kvroute keys, the sequence cursor, the view's state and its counters.
//!
//! States (docs/kv-events.md):
//! - `awaiting`: no batch applied yet (the instance is routed on the estimate view);
//! - `complete`: every batch since the engine's first (sequence 0) or since its last
//!   `AllBlocksCleared` was applied in order: the view is exact;
//! - `degraded`: batches were lost and could not be replayed, a stored block's parent was
//!   unknown, or the engine's block size is not the router's. The rank's blocks are dropped at
//!   that moment (none can be stale) and the blocks stored after it are indexed, but the
//!   instance is routed on the estimate view until the view is whole again: after an
//!   `AllBlocksCleared`, or after a restart (a sequence that goes backwards, or
//!   [`super::EventView::reset`]) replayed from sequence 0.
//!
//! A rank holds at most [`max_blocks`] of its engine's blocks (twice the engine's KV capacity,
//! or [`MAX_BLOCKS_UNKNOWN`] when that is not known): a stream that stores more has missed
//! removals, or lies, and the view turns degraded (its blocks dropped), so that what a
//! publisher sends cannot grow the router's memory without bound.
//!
//! Applying a batch is O(its blocks × holders). Not synchronised.

use rustc_hash::FxHashMap;

use super::index::ClusterIndex;
use super::pending::Pending;
use super::table::Table;
use super::{EventBatch, KvEvent, StoredBlocks};
use crate::keys::{hash_block, ROOT_SEED};

/// The most blocks a rank's view holds when its engine's capacity is not known.
pub const MAX_BLOCKS_UNKNOWN: usize = 1 << 22;

/// The most blocks a rank's view of an engine of `capacity` blocks (0: unknown) holds.
pub fn max_blocks(capacity: usize) -> usize {
    if capacity == 0 {
        MAX_BLOCKS_UNKNOWN
    } else {
        capacity.saturating_mul(2).max(1024)
    }
}

/// Whether a rank's view is exact (docs: the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewState {
    /// No batch applied yet.
    Awaiting,
    /// Every batch since the start applied in order.
    Complete,
    /// Not whole; the reason.
    Degraded(String),
}

impl ViewState {
    /// `"awaiting"`, `"complete"` or `"degraded"`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Awaiting => "awaiting",
            Self::Complete => "complete",
            Self::Degraded(_) => "degraded",
        }
    }
}

/// What one call of `apply` did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Applied.
    Applied,
    /// Already applied (a replayed batch seen before); skipped.
    Duplicate,
    /// Not applied: batches `expected..seq` are missing. Replay them from `expected`, or
    /// call `resync` if they cannot be had.
    Gap {
        /// The first missing sequence number.
        expected: u64,
    },
    /// Refused: the batch names another rank than the source it came from. Its events are
    /// not applied; its sequence number is the source's, and the source's view moves past it.
    Foreign,
}

/// Counters and state of one rank's view.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// The data-parallel rank.
    pub rank: u32,
    /// Its state.
    pub state: ViewState,
    /// The sequence number of the last batch applied.
    pub last_seq: Option<u64>,
    /// Batches applied.
    pub batches: u64,
    /// Of `batches`, those that came from the replay socket.
    pub replayed_batches: u64,
    /// Events applied.
    pub events: u64,
    /// Blocks stored and removed, as the events said.
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// Blocks outside the view (LoRA, extra keys, other media or groups), stored or removed.
    pub blocks_ignored: u64,
    /// Removals of blocks the view did not hold (their store was ignored or came before the
    /// view's start).
    pub unknown_removals: u64,
    /// Stored blocks that could not be keyed (their parent unknown) while degraded.
    pub unkeyable_blocks: u64,
    /// Gaps seen in the sequence numbers.
    pub gaps: u64,
    /// Batches from this rank's source that named another rank (refused, not applied).
    pub foreign_batches: u64,
    /// Restarts seen (sequence backwards or an explicit reset).
    pub resets: u64,
    /// Engine hashes held now (filled in by `snapshot`).
    pub blocks_indexed: usize,
    /// The engine's timestamp of the last batch, and its lag to the moment it was applied (s).
    pub last_ts: f64,
    /// Seconds from the last batch's timestamp to its application.
    pub lag_s: f64,
    /// Bytes of this rank's tables (filled in by `snapshot`).
    pub memory_bytes: usize,
}

/// One rank's view.
#[derive(Debug, Clone)]
pub(crate) struct RankView {
    /// Engine hash -> kvroute key of every block held.
    hashes: Table<u64>,
    /// Engine hashes held by more than one physical block: the copies beyond the first.
    copies: FxHashMap<u64, u32>,
    next_seq: Option<u64>,
    pub report: RankReport,
    capacity: usize,
    /// The keys this view held when it last turned degraded, until the router takes them.
    pub dropped: Option<Vec<u64>>,
}

impl RankView {
    /// A rank's view sized for `capacity` blocks (its engine's KV capacity, if known).
    pub fn new(rank: u32, capacity: usize) -> Self {
        let report = RankReport {
            rank,
            state: ViewState::Awaiting,
            last_seq: None,
            batches: 0,
            replayed_batches: 0,
            events: 0,
            blocks_stored: 0,
            blocks_removed: 0,
            blocks_ignored: 0,
            unknown_removals: 0,
            unkeyable_blocks: 0,
            gaps: 0,
            foreign_batches: 0,
            resets: 0,
            blocks_indexed: 0,
            last_ts: 0.0,
            lag_s: 0.0,
            memory_bytes: 0,
        };
        let hashes = Table::with_capacity(capacity);
        Self { hashes, copies: FxHashMap::default(), next_seq: None, report, capacity, dropped: None }
    }

    /// Its engine holds at most `capacity` blocks: size the table for them, and bound it
    /// ([`max_blocks`]).
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        self.hashes.reserve(capacity);
    }

    pub fn state(&self) -> &ViewState {
        &self.report.state
    }

    /// Where `seq` stands against the cursor: `Some(outcome)` when the batch is not to be
    /// applied. A live batch behind the cursor is a restart: the view is reset first.
    pub fn check(&mut self, seq: u64, replayed: bool, inst: usize, ix: &mut ClusterIndex) -> Option<Outcome> {
        match self.next_seq {
            Some(next) if seq == next => None,
            Some(next) if seq < next && replayed => Some(Outcome::Duplicate),
            Some(next) if seq > next => {
                self.report.gaps += 1;
                Some(Outcome::Gap { expected: next })
            }
            Some(_) => {
                self.reset(inst, ix);
                self.check(seq, replayed, inst, ix)
            }
            None if seq == 0 || matches!(self.report.state, ViewState::Degraded(_)) => None,
            None => {
                self.report.gaps += 1;
                Some(Outcome::Gap { expected: 0 })
            }
        }
    }

    /// Apply a batch `check` let through. Returns whether the view degraded on it.
    pub fn apply(
        &mut self,
        seq: u64,
        batch: &EventBatch,
        replayed: bool,
        ctx: (usize, u64, &mut ClusterIndex, &mut Pending),
    ) -> bool {
        let (inst, block_size, ix, pending) = ctx;
        if self.report.state == ViewState::Awaiting {
            self.report.state = ViewState::Complete;
        }
        let was_degraded = matches!(self.report.state, ViewState::Degraded(_));
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) => self.store(s, block_size, inst, ix, pending),
                KvEvent::Removed { hashes, ignored } => {
                    if ignored.is_some() {
                        self.report.blocks_ignored += hashes.len() as u64;
                        continue;
                    }
                    self.report.blocks_removed += hashes.len() as u64;
                    for &h in hashes {
                        self.remove(h, inst, ix);
                    }
                }
                KvEvent::Cleared => {
                    self.drop_blocks(inst, ix);
                    self.report.state = ViewState::Complete;
                }
            }
        }
        self.next_seq = Some(seq.wrapping_add(1)); // after 2^64-1 comes 0
        let r = &mut self.report;
        r.last_seq = Some(seq);
        r.batches += 1;
        r.replayed_batches += u64::from(replayed);
        r.events += batch.events.len() as u64;
        r.last_ts = batch.ts;
        r.lag_s = unix_now() - batch.ts;
        !was_degraded && matches!(r.state, ViewState::Degraded(_))
    }

    /// Move past batch `seq`, which `check` let through, without applying its events: it
    /// came from this rank's source but names another rank.
    pub fn skip_foreign(&mut self, seq: u64) {
        if self.report.state == ViewState::Awaiting {
            self.report.state = ViewState::Complete;
        }
        self.next_seq = Some(seq.wrapping_add(1)); // after 2^64-1 comes 0
        self.report.last_seq = Some(seq);
        self.report.foreign_batches += 1;
    }

    fn store(
        &mut self,
        s: &StoredBlocks,
        block_size: u64,
        inst: usize,
        ix: &mut ClusterIndex,
        pending: &mut Pending,
    ) {
        let n = s.hashes.len() as u64;
        if s.ignored.is_some() {
            self.report.blocks_ignored += n;
            return;
        }
        self.report.blocks_stored += n;
        if u64::from(s.block_size) != block_size {
            let why = format!("the engine's blocks have {} tokens, the router's {block_size}", s.block_size);
            self.degrade(why, inst, ix);
            self.report.unkeyable_blocks += n;
            return;
        }
        let parent = match s.parent {
            None => Some(ROOT_SEED),
            Some(h) => self.hashes.get(h),
        };
        let Some(mut prev) = parent else {
            if self.report.state == ViewState::Complete {
                self.degrade(
                    format!("a stored block's parent {:#x} is unknown", s.parent.unwrap_or(0)),
                    inst,
                    ix,
                );
            }
            self.report.unkeyable_blocks += n;
            return;
        };
        for (&h, tokens) in s.hashes.iter().zip(s.token_ids.chunks_exact(s.block_size as usize)) {
            prev = hash_block(tokens, prev);
            if prev == u64::MAX {
                self.report.unkeyable_blocks += 1; // the reserved value: 2^-64 per block
                continue;
            }
            if self.hashes.insert_new(h, prev) {
                if !pending.confirm(inst, prev) {
                    ix.add(prev, inst);
                }
            } else {
                let c = self.copies.entry(h).or_insert(0);
                *c = c.saturating_add(1);
            }
        }
        let limit = max_blocks(self.capacity);
        if self.hashes.len() > limit {
            let why =
                format!("the engine stored over {limit} blocks without removing them (missed removals)");
            self.degrade(why, inst, ix);
        }
    }

    fn remove(&mut self, h: u64, inst: usize, ix: &mut ClusterIndex) {
        if let Some(c) = self.copies.get_mut(&h) {
            *c -= 1;
            if *c == 0 {
                self.copies.remove(&h);
            }
            return;
        }
        match self.hashes.get(h) {
            Some(key) => {
                self.hashes.remove(h);
                ix.remove(key, inst);
            }
            None => self.report.unknown_removals += 1,
        }
    }

    /// The keys of the blocks this rank holds.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.hashes.iter().map(|(_, key)| key)
    }

    /// Drop every block of this rank from the index.
    fn drop_blocks(&mut self, inst: usize, ix: &mut ClusterIndex) {
        for (_, key) in self.hashes.iter() {
            ix.remove(key, inst);
        }
        self.hashes = Table::with_capacity(self.capacity);
        self.copies = FxHashMap::default();
    }

    /// The view cannot be trusted: drop its blocks (kept in `dropped` for the router, whose
    /// estimate takes over from them) and mark it degraded.
    pub fn degrade(&mut self, reason: String, inst: usize, ix: &mut ClusterIndex) {
        if !matches!(self.report.state, ViewState::Degraded(_)) {
            self.dropped = Some(self.keys().collect());
        }
        self.drop_blocks(inst, ix);
        self.report.state = ViewState::Degraded(reason);
    }

    /// Missing batches cannot be had: degrade and take the next batch as the new start.
    pub fn resync(&mut self, reason: String, inst: usize, ix: &mut ClusterIndex) {
        self.degrade(reason, inst, ix);
        self.next_seq = None;
    }

    /// The engine restarted: drop everything and wait for its sequence 0.
    pub fn reset(&mut self, inst: usize, ix: &mut ClusterIndex) {
        self.drop_blocks(inst, ix);
        self.next_seq = None;
        self.report.state = ViewState::Awaiting;
        self.report.resets += 1;
    }

    /// Bytes of this rank's tables.
    pub fn memory_bytes(&self) -> usize {
        self.hashes.memory_bytes() + self.copies.capacity() * 16
    }

    /// The report, with the sizes read now.
    pub fn snapshot(&self) -> RankReport {
        RankReport {
            blocks_indexed: self.hashes.len(),
            memory_bytes: self.memory_bytes(),
            ..self.report.clone()
        }
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
