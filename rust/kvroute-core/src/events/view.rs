//! [`EventView`]: the router's events view of every instance: its ranks' views, the cluster
//! index they feed, and the pending blocks of routed requests (`pending.rs`).
//!
//! A routed request's blocks count as held by the instance chosen for `pending_ttl` from the
//! moment it is routed (its prefill has not stored them yet), unless an event confirms them
//! sooner; so a burst of requests with one new prefix does not scatter before the first
//! events arrive. A pending block that no event confirms in time is forgotten.
//!
//! `apply` is O(blocks of the batch × holders); `predict` O(keys) amortised (each mark expires
//! once); `walk` as the index's. Not synchronised.

use std::time::Duration;

use super::engine::{Outcome, RankReport, RankView, ViewState};
use super::index::ClusterIndex;
use super::pending::Pending;
use super::EventBatch;

/// The most data-parallel ranks one instance's view keeps.
pub const MAX_RANKS: usize = 1024;

/// What applying one batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Applied, skipped as a duplicate, or refused for a gap.
    pub outcome: Outcome,
    /// The batch revealed a restart (its sequence went backwards): the rank was reset first.
    pub reset: bool,
    /// The rank's view turned degraded while applying it.
    pub degraded: bool,
}

/// One instance's events view.
#[derive(Debug, Clone, PartialEq)]
pub struct ViewReport {
    /// Whether routing reads the events view for this instance (else the estimate).
    pub uses_events: bool,
    /// Its ranks, by rank.
    pub ranks: Vec<RankReport>,
    /// Distinct keys it holds in the events view, pending ones included.
    pub blocks: usize,
    /// Of those, keys pending (routed there, not yet confirmed by an event).
    pub pending: usize,
}

/// The events view of a cluster (see the module doc).
#[derive(Debug, Clone)]
pub struct EventView {
    index: ClusterIndex,
    /// Per instance, its ranks' views, sorted by rank.
    engines: Vec<Vec<RankView>>,
    /// Per instance, whether routing reads this view (kept with the ranks' states).
    uses: Vec<bool>,
    pending: Pending,
    block_size: u64,
    /// Per instance, the blocks its engine can hold (0: unknown), to size its tables.
    capacities: Vec<usize>,
}

impl EventView {
    /// A view of `instances` instances with nothing applied, for keys of `block_size` tokens;
    /// routed blocks stay pending for `pending_ttl` (zero: no predictions).
    pub fn new(instances: usize, block_size: u64, pending_ttl: Duration) -> Self {
        let mut view = Self {
            index: ClusterIndex::default(),
            engines: Vec::new(),
            uses: Vec::new(),
            pending: Pending::new(pending_ttl),
            block_size,
            capacities: Vec::new(),
        };
        (0..instances).for_each(|_| view.add_instance());
        view
    }

    /// Add an instance with nothing applied.
    pub fn add_instance(&mut self) {
        self.engines.push(Vec::new());
        self.uses.push(false);
        self.capacities.push(0);
        self.pending.add_instance();
        self.index.grow_to(self.engines.len());
    }

    /// `inst`'s engine holds at most `blocks` blocks (its KV capacity): size its tables, and
    /// the cluster index, for that many, so that they do not rehash while the engine fills.
    pub fn reserve(&mut self, inst: usize, blocks: usize) {
        self.capacities[inst] = blocks;
        for rank in &mut self.engines[inst] {
            rank.set_capacity(blocks);
        }
        self.index.reserve(self.capacities.iter().sum());
    }

    /// Whether routing reads this view for `inst`: it has events and every rank is complete.
    pub fn uses_events(&self, inst: usize) -> bool {
        self.uses[inst]
    }

    /// Which view routing reads for `inst`: `"events"`, `"degraded"` (a rank's view is not
    /// whole: the estimate) or `"estimate"` (no events applied yet).
    pub fn source(&self, inst: usize) -> &'static str {
        if self.uses[inst] {
            "events"
        } else if self.engines[inst].iter().any(|r| matches!(r.state(), ViewState::Degraded(_))) {
            "degraded"
        } else {
            "estimate"
        }
    }

    /// After `inst`'s view changed: whether routing reads it, and memory back from the index
    /// after a mass removal.
    fn refresh(&mut self, inst: usize) {
        let ranks = &self.engines[inst];
        self.uses[inst] = !ranks.is_empty() && ranks.iter().all(|r| *r.state() == ViewState::Complete);
        self.index.shrink_to(self.capacities.iter().sum());
    }

    /// Apply batch `seq` of `inst` (from its rank's PUB socket, or `replayed` from its replay
    /// socket). Batches apply in sequence order per rank; see [`Outcome`]. `source_rank`: the
    /// rank whose socket it came from; a batch naming another rank is refused
    /// ([`Outcome::Foreign`]). Without it, the batch's own rank is taken: a rank not seen
    /// before starts at sequence 0 (a later batch of it is a gap, and makes no view), and a
    /// rank beyond the first [`MAX_RANKS`] of an instance is an error.
    pub fn apply(
        &mut self,
        inst: usize,
        seq: u64,
        batch: &EventBatch,
        replayed: bool,
        source_rank: Option<u32>,
    ) -> Result<Applied, String> {
        self.pending.expire(&mut self.index);
        let block_size = self.block_size;
        let rank = source_rank.unwrap_or(batch.rank);
        let Self { index, engines, pending, .. } = self;
        let known = engines[inst].iter().any(|r| r.report.rank == rank);
        if source_rank.is_none() && !known && seq != 0 {
            return Ok(Applied { outcome: Outcome::Gap { expected: 0 }, reset: false, degraded: false });
        }
        let view = rank_view(&mut engines[inst], rank, self.capacities[inst])?;
        let resets = view.report.resets;
        let outcome = match view.check(seq, replayed, inst, index) {
            Some(outcome) => Err(outcome),
            None if rank != batch.rank => {
                view.skip_foreign(seq);
                Err(Outcome::Foreign)
            }
            None => Ok(view.apply(seq, batch, replayed, (inst, block_size, index, pending))),
        };
        let reset = view.report.resets > resets;
        self.refresh(inst);
        Ok(match outcome {
            Ok(degraded) => Applied { outcome: Outcome::Applied, reset, degraded },
            Err(outcome) => Applied { outcome, reset, degraded: false },
        })
    }

    /// The batches `inst`'s `rank` missed cannot be replayed: degrade its view and take its
    /// next batch as a new start.
    pub fn resync(&mut self, inst: usize, rank: u32, reason: String) -> Result<(), String> {
        rank_view(&mut self.engines[inst], rank, self.capacities[inst])?.resync(
            reason,
            inst,
            &mut self.index,
        );
        self.refresh(inst);
        Ok(())
    }

    /// `inst`'s engine restarted (or was replaced): drop its view and pending blocks, and wait
    /// for its sequence 0.
    pub fn reset(&mut self, inst: usize) {
        let Self { index, engines, pending, .. } = self;
        for view in &mut engines[inst] {
            view.reset(inst, index);
        }
        pending.clear(inst, index);
        self.refresh(inst);
    }

    /// When a rank of `inst` has turned degraded since the last call: the keys `inst` held
    /// in this view just before (that rank's then, the other ranks' now).
    pub fn take_dropped(&mut self, inst: usize) -> Option<Vec<u64>> {
        let (mut dropped, mut others) = (None::<Vec<u64>>, Vec::new());
        for r in &mut self.engines[inst] {
            match r.dropped.take() {
                Some(keys) => dropped.get_or_insert_with(Vec::new).extend(keys),
                None => others.extend(r.keys()),
            }
        }
        let mut keys = dropped?;
        keys.extend(others);
        Some(keys)
    }

    /// Leading keys of `keys` each instance holds in this view (pending ones included).
    pub fn walk(&self, keys: &[u64], matched: &mut Vec<u32>) {
        self.index.walk(keys, matched);
    }

    /// Leading keys of `keys` held by `inst` in this view. O(matched × holders).
    pub fn matched_blocks(&self, inst: usize, keys: &[u64]) -> usize {
        keys.iter().take_while(|&&k| self.index.holds(k, inst)).count()
    }

    /// Distinct keys held anywhere in this view.
    pub fn distinct_keys(&self) -> usize {
        self.index.distinct_keys()
    }

    /// Count `keys` (a routed request's stored blocks) as pending on `inst`.
    pub fn predict(&mut self, inst: usize, keys: &[u64]) {
        self.pending.expire(&mut self.index);
        self.pending.predict(inst, keys, &mut self.index);
    }

    /// Distinct keys `inst` holds in this view.
    pub fn cached_blocks(&self, inst: usize) -> usize {
        self.index.held(inst)
    }

    /// `inst`'s view: its ranks, blocks and whether routing reads it.
    pub fn report(&self, inst: usize) -> ViewReport {
        ViewReport {
            uses_events: self.uses_events(inst),
            ranks: self.engines[inst].iter().map(RankView::snapshot).collect(),
            blocks: self.index.held(inst),
            pending: self.pending.held(inst),
        }
    }

    /// Bytes of the view's tables: the cluster index, every rank's hash map, pending marks.
    pub fn memory_bytes(&self) -> usize {
        let ranks: usize = self.engines.iter().flatten().map(RankView::memory_bytes).sum();
        self.index.memory_bytes() + ranks + self.pending.memory_bytes()
    }
}

/// The view of `rank` among an instance's ranks (sorted by rank), added if new (sized for
/// `capacity` blocks) and the instance has fewer than [`MAX_RANKS`].
fn rank_view(ranks: &mut Vec<RankView>, rank: u32, capacity: usize) -> Result<&mut RankView, String> {
    let at = match ranks.binary_search_by_key(&rank, |r| r.report.rank) {
        Ok(at) => at,
        Err(_) if ranks.len() >= MAX_RANKS => {
            return Err(format!("rank {rank} is refused: the instance has {MAX_RANKS} ranks already"))
        }
        Err(at) => {
            ranks.insert(at, RankView::new(rank, capacity));
            at
        }
    };
    Ok(&mut ranks[at])
}
