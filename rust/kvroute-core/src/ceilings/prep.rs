//! Preparing a trace for the ceiling passes: the processing order (timestamps, stable),
//! dense session ids and the per-session request lists.
//!
//! [`Trace`] borrows every request's keys (zero-copy from Arrow buffers in the bindings) and
//! owns small per-request columns. [`stable_order`] is O(n) on sorted input and an
//! O(n log n) stable parallel sort otherwise; [`dense_ids`] is O(n) expected;
//! [`Layout::new`] is O(n). Plain data, `Send + Sync`.

use std::collections::HashMap;
use std::hash::Hash;

use rayon::prelude::*;
use rustc_hash::FxBuildHasher;

use crate::{Error, Result};

/// The requests of a trace, by row (file order).
#[derive(Debug, Clone, Default)]
pub struct Trace<'a> {
    /// Block keys of each row.
    pub keys: Vec<&'a [u64]>,
    /// Prompt tokens of each row.
    pub input_length: Vec<u64>,
    /// Dense session id of each row, `0..num_sessions`.
    pub session: Vec<u32>,
    /// Number of distinct sessions.
    pub num_sessions: usize,
    /// Rows in processing order (a permutation of `0..rows`).
    pub order: Vec<u32>,
}

impl<'a> Trace<'a> {
    /// Check that the columns agree with each other; `order` must be a permutation.
    pub fn validate(&self) -> Result<()> {
        let n = self.keys.len();
        if self.input_length.len() != n || self.session.len() != n || self.order.len() != n {
            return Err(Error::InvalidArgument(format!(
                "trace columns differ in length: {n} key lists, {} input lengths, {} session \
                 ids, {} order entries",
                self.input_length.len(),
                self.session.len(),
                self.order.len()
            )));
        }
        if u32::try_from(n).is_err() {
            return Err(Error::InvalidArgument(format!(
                "a trace of {n} requests is over the limit of 2^32 - 1"
            )));
        }
        if let Some(&s) = self.session.iter().find(|&&s| s as usize >= self.num_sessions) {
            return Err(Error::InvalidArgument(format!(
                "session id {s} is not below num_sessions = {}",
                self.num_sessions
            )));
        }
        let mut seen = vec![false; n];
        for &r in &self.order {
            match seen.get_mut(r as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(Error::InvalidArgument("order is not a permutation of the rows".into())),
            }
        }
        Ok(())
    }
}

/// Rows sorted by timestamp; ties keep row order. NaN timestamps are an error.
pub fn stable_order(timestamps: &[f64]) -> Result<Vec<u32>> {
    if let Some(i) = timestamps.iter().position(|t| t.is_nan()) {
        return Err(Error::InvalidArgument(format!("timestamp of row {i} is NaN")));
    }
    let mut order: Vec<u32> = (0..timestamps.len() as u32).collect();
    if timestamps.windows(2).all(|w| w[0] <= w[1]) {
        return Ok(order);
    }
    order.par_sort_by(|&a, &b| timestamps[a as usize].total_cmp(&timestamps[b as usize]));
    Ok(order)
}

/// Dense ids `0..k` in order of first appearance, and `k`.
pub fn dense_ids<K: Hash + Eq>(values: impl IntoIterator<Item = K>) -> (Vec<u32>, usize) {
    let mut ids: HashMap<K, u32, FxBuildHasher> = HashMap::default();
    let out = values
        .into_iter()
        .map(|v| {
            let next = ids.len() as u32;
            *ids.entry(v).or_insert(next)
        })
        .collect();
    (out, ids.len())
}

/// Positions in processing order, grouped by session (CSR), and key offsets.
pub(crate) struct Layout {
    /// `rows[p]`: the row processed at position `p`.
    pub rows: Vec<u32>,
    /// `key_off[p]`: keys of positions before `p`; `key_off[n]` is the total.
    pub key_off: Vec<u64>,
    /// Positions of session `s`: `by_session[sess_off[s]..sess_off[s + 1]]`, ascending.
    pub sess_off: Vec<u32>,
    pub by_session: Vec<u32>,
}

impl Layout {
    pub fn new(trace: &Trace<'_>) -> Self {
        let n = trace.order.len();
        let mut key_off = Vec::with_capacity(n + 1);
        let mut total = 0u64;
        key_off.push(0);
        for &r in &trace.order {
            total += trace.keys[r as usize].len() as u64;
            key_off.push(total);
        }
        let mut sess_off = vec![0u32; trace.num_sessions + 1];
        for &s in &trace.session {
            sess_off[s as usize + 1] += 1;
        }
        for s in 0..trace.num_sessions {
            sess_off[s + 1] += sess_off[s];
        }
        let mut fill = sess_off.clone();
        let mut by_session = vec![0u32; n];
        for (p, &r) in trace.order.iter().enumerate() {
            let s = trace.session[r as usize] as usize;
            by_session[fill[s] as usize] = p as u32;
            fill[s] += 1;
        }
        Self { rows: trace.order.clone(), key_off, sess_off, by_session }
    }

    pub fn total_keys(&self) -> u64 {
        *self.key_off.last().unwrap_or(&0)
    }

    /// Number of keys of the request at position `p`.
    pub fn keys_at(&self, p: u32) -> usize {
        (self.key_off[p as usize + 1] - self.key_off[p as usize]) as usize
    }

    /// Positions of session `s`.
    pub fn session(&self, s: usize) -> &[u32] {
        &self.by_session[self.sess_off[s] as usize..self.sess_off[s + 1] as usize]
    }

    /// Sessions split into about `parts` contiguous ranges of similar key counts.
    pub fn session_chunks(&self, trace: &Trace<'_>, parts: usize) -> Vec<std::ops::Range<usize>> {
        let sessions = self.sess_off.len() - 1;
        let target = self.total_keys() / parts.max(1) as u64 + 1;
        let mut out = Vec::with_capacity(parts + 1);
        let (mut start, mut acc) = (0usize, 0u64);
        for s in 0..sessions {
            acc += self
                .session(s)
                .iter()
                .map(|&p| trace.keys[self.rows[p as usize] as usize].len() as u64 + 1)
                .sum::<u64>();
            if acc >= target {
                out.push(start..s + 1);
                start = s + 1;
                acc = 0;
            }
        }
        if start < sessions {
            out.push(start..sessions);
        }
        out
    }
}
