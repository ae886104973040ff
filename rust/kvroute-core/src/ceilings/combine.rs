//! Pass 3, per session: any-session and shared-prefix matches, totals and reuse split.
//!
//! With `k_intra` from pass 1 and the event bits from pass 2:
//! - `k_any(r) = k_intra(r)` plus the leading events of `r` whose node was seen before.
//! - `S` never grows along a path, so the nodes with `S >= min_sessions` on `r`'s path are a
//!   prefix of length `b(r)`, and `k_shared(r) = min(b(r), k_any(r))`. `b` is carried from the
//!   previous request of the session where the paths agree; past that, a node already in the
//!   session trie is looked up in the session's small set of shared nodes, and a new one reads
//!   its [`SHARED`] bit (and joins that set when it has it).
//! - Reuse split of each hit block `j < k_any(r)`: intra if `j < k_intra(r)`, else shared or
//!   cross by its bit.
//!
//! O(keys) comparisons plus O(hit blocks past the intra prefix); parallel over sessions;
//! per-position outputs are atomics written once.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

use rayon::prelude::*;

use super::global::{SEEN_BEFORE, SHARED};
use super::node::{node, path_hash, NodeSet, ROOT};
use super::prep::{Layout, Trace};
use super::session::common_prefix;
use super::{Control, Reuse, Stop, Totals};

/// Sums over one chunk of sessions.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Partial {
    pub any: Totals,
    pub intra: Totals,
    pub shared: Totals,
    pub reuse: Reuse,
}

impl Partial {
    fn merge(mut self, o: Partial) -> Partial {
        self.any.add(&o.any);
        self.intra.add(&o.intra);
        self.shared.add(&o.shared);
        self.reuse.intra += o.reuse.intra;
        self.reuse.cross += o.reuse.cross;
        self.reuse.shared += o.reuse.shared;
        self
    }
}

/// Tokens of block `j` of a request of `len` tokens.
#[inline]
fn block_tokens(j: u64, block: u64, len: u64) -> u64 {
    ((j + 1) * block).min(len).saturating_sub(j * block)
}

/// Per-position outputs of pass 3.
pub(crate) struct Matches<'a> {
    pub k_intra: &'a [AtomicU32],
    pub k_any: &'a [AtomicU32],
    pub k_shared: &'a [AtomicU32],
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    trace: &Trace<'_>,
    layout: &Layout,
    chunks: &[std::ops::Range<usize>],
    ann: &[AtomicU8],
    block: u64,
    out: &Matches<'_>,
    ctl: &Control,
) -> Result<Partial, Stop> {
    chunks
        .par_iter()
        .map(|range| {
            let mut acc = Partial::default();
            let mut shared_set = NodeSet::default();
            let mut hashes: Vec<u64> = Vec::new();
            for s in range.clone() {
                ctl.check()?;
                shared_set.clear();
                let mut prev: &[u64] = &[];
                let mut prev_b = 0usize;
                let mut work = 0u64;
                for &p in layout.session(s) {
                    let row = layout.rows[p as usize] as usize;
                    let keys = trace.keys[row];
                    let len = trace.input_length[row];
                    let off = layout.key_off[p as usize] as usize;
                    let bits = |j: usize| ann[off + j].load(Ordering::Relaxed);
                    let ki = out.k_intra[p as usize].load(Ordering::Relaxed) as usize;
                    let mut ka = ki;
                    while ka < keys.len() && bits(ka) & SEEN_BEFORE != 0 {
                        ka += 1;
                    }
                    let lcp = common_prefix(prev, keys);
                    let b = if prev_b < lcp {
                        prev_b
                    } else {
                        hashes.truncate(lcp);
                        let mut b = lcp;
                        while b < keys.len() {
                            let parent = if b == 0 { ROOT } else { hashes[b - 1] };
                            let n = node(parent, keys[b]);
                            let shared = if b < ki {
                                shared_set.contains(&n)
                            } else if bits(b) & SHARED != 0 {
                                shared_set.insert(n);
                                true
                            } else {
                                false
                            };
                            if !shared {
                                break;
                            }
                            hashes.push(path_hash(parent, keys[b]));
                            b += 1;
                        }
                        b
                    };
                    let ks = b.min(ka);
                    out.k_any[p as usize].store(ka as u32, Ordering::Relaxed);
                    out.k_shared[p as usize].store(ks as u32, Ordering::Relaxed);
                    acc.intra.record(ki as u64, block, len);
                    acc.any.record(ka as u64, block, len);
                    acc.shared.record(ks as u64, block, len);
                    acc.reuse.intra += (ki as u64 * block).min(len);
                    for j in ki..ka {
                        let t = block_tokens(j as u64, block, len);
                        if bits(j) & SHARED != 0 {
                            acc.reuse.shared += t;
                        } else {
                            acc.reuse.cross += t;
                        }
                    }
                    work += keys.len() as u64 + 1;
                    prev = keys;
                    prev_b = b;
                }
                ctl.advance(work);
            }
            Ok(acc)
        })
        .try_reduce(Partial::default, |a, b| Ok(a.merge(b)))
}
