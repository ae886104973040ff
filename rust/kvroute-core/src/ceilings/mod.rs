//! APC ceilings of a trace (SEMANTICS §4): how much of the prompt tokens a prefix cache
//! could serve at best, over tries of key paths.
//!
//! - any-session, intra-session and shared-prefix (`S(node) >= min_sessions`) ceilings;
//! - the reuse split of the any-session hits (intra / cross / shared);
//! - the capacity curve, one global LRU of `C` keys for every requested `C`.
//!
//! [`compute`] runs three passes over a [`Trace`] (rows borrowed, processing order given):
//! [`session`] walks each session's own trie (parallel over sessions) and emits the nodes
//! new to a session; [`global`] finds, per shard of nodes (parallel), each node's first
//! request and session count; [`combine`] derives the any-session and shared-prefix matches
//! and the totals (parallel over sessions). The capacity curve ([`capacity`]) is sequential
//! by nature and runs beside them. Work is O(keys) expected for the three ceilings and
//! O(keys · boundaries touched) for the curve; memory is O(requests + nodes new to their
//! session + keys + max C).
//!
//! [`Control`] is shared with the caller: a progress counter it may poll from another thread
//! and a cancel flag the passes check between sessions; a cancelled run returns
//! [`Stop::Cancelled`].

mod capacity;
mod combine;
mod global;
mod node;
mod prep;
mod session;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

pub use prep::{dense_ids, stable_order, Trace};

use crate::Error;

/// Parameters of [`compute`].
#[derive(Debug, Clone)]
pub struct Params {
    /// Tokens per block (positive).
    pub block_size: u64,
    /// Sessions a node needs to count as a shared prefix (positive).
    pub min_sessions: u32,
    /// Cache capacities in keys for the capacity curve (positive, any order).
    pub capacities: Vec<u64>,
    /// Keep every request's matched key counts.
    pub per_request: bool,
}

impl Default for Params {
    fn default() -> Self {
        Self { block_size: 512, min_sessions: 8, capacities: Vec::new(), per_request: false }
    }
}

/// Sums of one variant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub hit_tokens: u64,
    pub total_tokens: u64,
    pub hit_requests: u64,
    pub total_requests: u64,
}

impl Totals {
    /// `hit_tokens / total_tokens` (0 for no tokens).
    pub fn ratio(&self) -> f64 {
        if self.total_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.total_tokens as f64
        }
    }

    /// Count one request of `len` tokens with `k` matched keys.
    #[inline]
    pub(crate) fn record(&mut self, k: u64, block: u64, len: u64) {
        self.hit_tokens += k.saturating_mul(block).min(len);
        self.total_tokens += len;
        self.hit_requests += u64::from(k >= 1);
        self.total_requests += 1;
    }

    pub(crate) fn add(&mut self, o: &Totals) {
        self.hit_tokens += o.hit_tokens;
        self.total_tokens += o.total_tokens;
        self.hit_requests += o.hit_requests;
        self.total_requests += o.total_requests;
    }
}

/// Any-session hit tokens split by where the hit block was first reached.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    pub intra: u64,
    pub cross: u64,
    pub shared: u64,
}

/// Matched key counts of every request, by row (file order).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PerRequest {
    pub any: Vec<u32>,
    pub intra: Vec<u32>,
    pub shared: Vec<u32>,
    /// One column per entry of [`Ceilings::capacity`].
    pub capacity: Vec<Vec<u32>>,
}

/// Everything [`compute`] finds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Ceilings {
    pub any: Totals,
    pub intra: Totals,
    pub shared: Totals,
    pub reuse: Reuse,
    /// `(C, totals)` for each distinct requested capacity, ascending.
    pub capacity: Vec<(u64, Totals)>,
    pub per_request: Option<PerRequest>,
}

/// Why [`compute`] returned early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// Bad input; the message names it.
    Invalid(Error),
    /// [`Control::cancel`] was called.
    Cancelled,
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Invalid(e)
    }
}

/// Progress and cancellation, shared between a run and its caller.
#[derive(Debug, Default)]
pub struct Control {
    done: AtomicU64,
    total: AtomicU64,
    cancel: AtomicBool,
}

impl Control {
    /// `(done, total)` work units so far; `total` is known once the run has started.
    pub fn progress(&self) -> (u64, u64) {
        (self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }

    /// Ask the run to stop at its next check.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    pub(crate) fn check(&self) -> Result<(), Stop> {
        if self.cancel.load(Ordering::Relaxed) {
            Err(Stop::Cancelled)
        } else {
            Ok(())
        }
    }

    pub(crate) fn advance(&self, units: u64) {
        self.done.fetch_add(units, Ordering::Relaxed);
    }
}

fn atomics<T: Default>(n: usize) -> Vec<T> {
    (0..n).map(|_| T::default()).collect()
}

/// All ceilings of `trace`.
pub fn compute(trace: &Trace<'_>, params: &Params, ctl: &Control) -> Result<Ceilings, Stop> {
    if params.block_size == 0 || params.min_sessions == 0 {
        return Err(Error::InvalidArgument(format!(
            "block_size and min_sessions must be positive, got {} and {}",
            params.block_size, params.min_sessions
        ))
        .into());
    }
    if let Some(c) = params.capacities.iter().find(|&&c| c == 0) {
        return Err(Error::InvalidArgument(format!("capacities must be positive, got {c}")).into());
    }
    let mut caps = params.capacities.clone();
    caps.sort_unstable();
    caps.dedup();
    if caps.len() > usize::from(u16::MAX) {
        return Err(Error::InvalidArgument("at most 65535 capacities".into()).into());
    }
    trace.validate()?;
    if trace.keys.iter().any(|k| k.len() > u32::MAX as usize) {
        return Err(Error::InvalidArgument("a request has over 2^32 - 1 keys".into()).into());
    }
    let layout = prep::Layout::new(trace);
    let total_keys = layout.total_keys();
    if total_keys > u64::from(u32::MAX) {
        return Err(Error::InvalidArgument(format!(
            "a trace of {total_keys} keys is over the limit of 2^32 - 1 keys"
        ))
        .into());
    }
    let n = trace.order.len();
    let passes = 2 + u64::from(!caps.is_empty());
    ctl.total.store((total_keys + n as u64) * passes, Ordering::Relaxed);

    let (curve, ceilings) = rayon::join(
        || capacity_curve(trace, &layout, &caps, params, ctl),
        || ceilings(trace, &layout, params, ctl),
    );
    let (mut out, per) = ceilings?;
    let (curve, cap_per) = curve?;
    out.capacity = caps.iter().copied().zip(curve).collect();
    if let Some(mut per) = per {
        per.capacity = cap_per.map(|c| c.capacity).unwrap_or_default();
        out.per_request = Some(per);
    }
    Ok(out)
}

fn to_rows(layout: &prep::Layout, by_pos: Vec<AtomicU32>) -> Vec<u32> {
    let mut rows = vec![0u32; by_pos.len()];
    for (p, v) in by_pos.into_iter().enumerate() {
        rows[layout.rows[p] as usize] = v.into_inner();
    }
    rows
}

type WithRows<T> = Result<(T, Option<PerRequest>), Stop>;

fn ceilings(trace: &Trace<'_>, layout: &prep::Layout, params: &Params, ctl: &Control) -> WithRows<Ceilings> {
    let n = trace.order.len();
    let total_keys = layout.total_keys();
    let threads = rayon::current_num_threads().max(1);
    let chunks = layout.session_chunks(trace, threads * 16);
    let shards = (total_keys / (1 << 14)).next_power_of_two().clamp(1, 4096) as usize;

    let k_intra: Vec<AtomicU32> = atomics(n);
    let buckets = session::run(trace, layout, &chunks, shards, &k_intra, ctl)?;
    let ann: Vec<AtomicU8> = atomics(total_keys as usize);
    global::run(&buckets, shards, params.min_sessions, &ann, ctl)?;
    drop(buckets);
    let k_any: Vec<AtomicU32> = atomics(n);
    let k_shared: Vec<AtomicU32> = atomics(n);
    let matches = combine::Matches { k_intra: &k_intra, k_any: &k_any, k_shared: &k_shared };
    let part = combine::run(trace, layout, &chunks, &ann, params.block_size, &matches, ctl)?;
    drop(ann);
    let out = Ceilings {
        any: part.any,
        intra: part.intra,
        shared: part.shared,
        reuse: part.reuse,
        capacity: Vec::new(),
        per_request: None,
    };
    let per = params.per_request.then(|| PerRequest {
        any: to_rows(layout, k_any),
        intra: to_rows(layout, k_intra),
        shared: to_rows(layout, k_shared),
        capacity: Vec::new(),
    });
    Ok((out, per))
}

fn capacity_curve(
    trace: &Trace<'_>,
    layout: &prep::Layout,
    caps: &[u64],
    params: &Params,
    ctl: &Control,
) -> WithRows<Vec<Totals>> {
    let mut totals = vec![Totals::default(); caps.len()];
    if caps.is_empty() {
        return Ok((totals, None));
    }
    let n = layout.rows.len();
    let mut per = if params.per_request { vec![vec![0u32; n]; caps.len()] } else { Vec::new() };
    let mut lru = capacity::MultiLru::new(caps.to_vec());
    let mut matched = vec![0u32; lru.count()];
    let mut work = 0u64;
    for (p, &row) in layout.rows.iter().enumerate() {
        let keys = trace.keys[row as usize];
        let len = trace.input_length[row as usize];
        lru.matched(keys, &mut matched);
        for (b, &k) in matched.iter().enumerate() {
            totals[b].record(u64::from(k), params.block_size, len);
            if let Some(col) = per.get_mut(b) {
                col[row as usize] = k;
            }
        }
        for &k in keys.iter().rev() {
            lru.touch(k);
        }
        work += keys.len() as u64 + 1;
        if p % 4096 == 4095 {
            ctl.check()?;
            ctl.advance(work);
            work = 0;
        }
    }
    ctl.advance(work);
    let per = params.per_request.then(|| PerRequest { capacity: per, ..Default::default() });
    Ok((totals, per))
}

/// Convenience: [`compute`] with a fresh [`Control`], on the rayon pool.
pub fn compute_simple(trace: &Trace<'_>, params: &Params) -> Result<Ceilings, Stop> {
    compute(trace, params, &Control::default())
}
