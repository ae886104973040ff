//! The picking loop: given the instances' loads and cache hits, choose one instance.
//!
//! One pass over the instances per pick, O(instances) (the round-robin tie-break lists the
//! tied instances as it goes); `unified` reads the average load for its gate from the
//! router's running totals. Hits come precomputed from one cluster-index walk
//! ([`crate::cache::ClusterCache::walk`]). Pure except for the tie counter, the RNG and a
//! scratch list in [`PickState`]; the router holds it under its lock.

use crate::keys::hit_tokens;
use crate::policy::{Policy, PolicyParams, TtftCosts};
use crate::rng::SplitMix64;

/// Counters of one instance, as the semantics page names them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceLoad {
    /// Requests routed here and not finished.
    pub num_requests: u64,
    /// Σ input_length of those requests.
    pub ongoing_tokens: u64,
    /// Σ new_prefill of those whose first token has not come back.
    pub pending_prefill_tokens: u64,
    /// Σ input_length of those whose first token has come back.
    pub ongoing_decode_tokens: u64,
    /// Whether the instance takes part in picks.
    pub available: bool,
}

/// Why an instance was chosen; a label for metrics and decision logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Branch {
    /// The session's affinity instance (`sticky`, or `unified`'s gate held).
    Affinity,
    /// The unique minimum of the policy's score.
    Score,
    /// Several minima; the round-robin counter (or the RNG, `dynamo_cost`) chose.
    TieBreak,
    /// `round_robin`'s cycle.
    RoundRobin,
    /// A seeded draw (`random`, `power_of_two`, `dynamo_cost` with temperature > 0).
    Sampled,
    /// `sglang_cache_aware`: load imbalanced, shortest queue.
    LoadBalance,
    /// `sglang_cache_aware`: best prefix match above the threshold.
    CacheMatch,
    /// `sglang_cache_aware`: match too short, instance with the fewest cached blocks.
    SmallestCache,
    /// `ttft` with a target: the most cache reuse among the instances predicted to meet it.
    WithinSlo,
}

impl Branch {
    /// Label used in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Branch::Affinity => "affinity",
            Branch::Score => "score",
            Branch::TieBreak => "tie_break",
            Branch::RoundRobin => "round_robin",
            Branch::Sampled => "sampled",
            Branch::LoadBalance => "load_balance",
            Branch::CacheMatch => "cache_match",
            Branch::SmallestCache => "smallest_cache",
            Branch::WithinSlo => "within_slo",
        }
    }
}

/// What one pick may read.
pub(crate) struct PickInput<'a> {
    pub loads: &'a [InstanceLoad],
    /// Matched leading blocks per instance; only filled for policies that score the cache.
    pub matched: &'a [u32],
    /// Resident blocks per instance; read by `sglang_cache_aware` only.
    pub cached_blocks: &'a dyn Fn(usize) -> usize,
    pub input_length: u64,
    pub block_size: u64,
    /// Tokens that the instance's requests in flight and this one count beyond the blocks
    /// the engine would hold for them: a block several hold, and this request's leading
    /// blocks held there already, once each (0 unless [`Policy::reads_held`] or a token cap).
    pub held_again: &'a dyn Fn(usize) -> u64,
    /// The session's affinity instance, if it is available.
    pub affinity: Option<usize>,
    /// Σ num_requests and the count, over the available instances.
    pub available_totals: (u64, u64),
}

/// The mutable part of picking: the tie counter and the seeded RNG (plus a scratch list of
/// tied instances, reused between picks).
#[derive(Debug, Clone)]
pub(crate) struct PickState {
    pub rr: u64,
    pub rng: SplitMix64,
    pub tied: Vec<u32>,
}

impl PickInput<'_> {
    fn new_prefill(&self, i: usize) -> u64 {
        self.new_prefill_of(self.matched[i])
    }

    /// The prefill left of this request where `matched` of its blocks are cached.
    #[inline]
    fn new_prefill_of(&self, matched: u32) -> u64 {
        self.input_length - hit_tokens(u64::from(matched), self.block_size, self.input_length)
    }

    fn available(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.loads.len()).filter(|&i| self.loads[i].available)
    }

    /// First available index with the minimum of `key`.
    fn argmin<K: PartialOrd>(&self, key: impl Fn(usize) -> K) -> Option<usize> {
        let mut best: Option<(usize, K)> = None;
        for i in self.available() {
            let k = key(i);
            if best.as_ref().is_none_or(|(_, b)| k < *b) {
                best = Some((i, k));
            }
        }
        best.map(|(i, _)| i)
    }

    /// The minimum of `(prefill_work × num_requests, new_prefill, num_requests)` (for
    /// `weigh_by_requests`) or of `(prefill_work, new_prefill, num_requests)`, exact.
    fn argmin_prefill(&self, state: &mut PickState, weigh_by_requests: bool) -> Option<(usize, Branch)> {
        self.argmin_tied(state, |l, new_prefill| {
            let work = u128::from(l.pending_prefill_tokens) + u128::from(new_prefill);
            Some(if weigh_by_requests { work * u128::from(l.num_requests) } else { work })
        })
    }

    /// The minimum of `(lead, new_prefill, num_requests)` over the available instances whose
    /// `lead` is `Some`; among several instances at the minimum, `tied[rr % len]` and
    /// `rr += 1`. One tight pass that settles most instances on `lead` alone and lists the
    /// instances tied at the minimum so far (this scan is most of a pick on a large cluster,
    /// and idle instances tie often).
    fn argmin_tied<K: PartialOrd + Copy>(
        &self,
        state: &mut PickState,
        lead: impl Fn(&InstanceLoad, u64) -> Option<K>,
    ) -> Option<(usize, Branch)> {
        debug_assert_eq!(self.matched.len(), self.loads.len(), "these policies walk the cache");
        let mut best: Option<(K, (u64, u64))> = None;
        let tied = &mut state.tied;
        tied.clear();
        for (i, (l, &m)) in self.loads.iter().zip(self.matched).enumerate() {
            if !l.available {
                continue;
            }
            let new_prefill = self.new_prefill_of(m);
            let Some(k) = lead(l, new_prefill) else { continue };
            let rest = (new_prefill, l.num_requests);
            match best {
                Some((b, _)) if k > b => {}
                Some((b, r)) if k == b && rest > r => {}
                Some((b, r)) if k == b && rest == r => tied.push(i as u32),
                _ => {
                    best = Some((k, rest));
                    tied.clear();
                    tied.push(i as u32);
                }
            }
        }
        match tied[..] {
            [] => None,
            [only] => Some((only as usize, Branch::Score)),
            _ => {
                let nth = (state.rr % tied.len() as u64) as usize;
                state.rr += 1;
                Some((tied[nth] as usize, Branch::TieBreak))
            }
        }
    }

    /// `pending_prefill_tokens + new_prefill`, exact.
    fn prefill_work(&self, i: usize) -> u128 {
        u128::from(self.loads[i].pending_prefill_tokens) + u128::from(self.new_prefill(i))
    }

    fn lmetric_key(&self, i: usize) -> u128 {
        self.prefill_work(i) * u128::from(self.loads[i].num_requests)
    }
}

/// Choose an instance, or `None` when none is available.
pub(crate) fn pick(
    policy: Policy,
    p: &PolicyParams,
    input: &PickInput<'_>,
    state: &mut PickState,
) -> Option<(usize, Branch)> {
    let nreq = |i: usize| input.loads[i].num_requests;
    match policy {
        Policy::Lmetric => input.argmin(|i| input.lmetric_key(i)).map(|i| (i, Branch::Score)),
        Policy::LoadOnly => input.argmin(nreq).map(|i| (i, Branch::Score)),
        Policy::Sticky => match input.affinity {
            Some(a) => Some((a, Branch::Affinity)),
            None => input.argmin(nreq).map(|i| (i, Branch::Score)),
        },
        Policy::Unified | Policy::UnifiedDynamo => {
            if let Some(a) = input.affinity {
                if unified_gate(p, input, a) {
                    return Some((a, Branch::Affinity));
                }
            }
            match policy {
                Policy::Unified => input.argmin_prefill(state, true),
                _ => dynamo_cost(p, input, state),
            }
        }
        Policy::LeastWork => input.argmin_prefill(state, false),
        Policy::RoundRobin => {
            let avail: Vec<usize> = input.available().collect();
            let chosen = *avail.get((state.rr % avail.len().max(1) as u64) as usize)?;
            state.rr += 1;
            Some((chosen, Branch::RoundRobin))
        }
        Policy::Random => {
            let avail: Vec<usize> = input.available().collect();
            (!avail.is_empty()).then(|| (avail[state.rng.below(avail.len())], Branch::Sampled))
        }
        Policy::PowerOfTwo => power_of_two(input, state),
        Policy::SglangCacheAware => sglang_cache_aware(p, input),
        Policy::DynamoCost => dynamo_cost(p, input, state),
        Policy::Ttft => match &p.ttft_costs {
            Some(costs) => ttft(costs, p, input, state),
            // Router::new refuses `ttft` without costs.
            None => input.argmin_prefill(state, false),
        },
    }
}

/// Predicted seconds until the first token of a request of `input_length` tokens, of which
/// `new_prefill` are not cached, on an instance with these counters (`docs/semantics.md` §3).
pub fn predicted_ttft(c: &TtftCosts, load: &InstanceLoad, new_prefill: u64, input_length: u64) -> f64 {
    let work = load.pending_prefill_tokens.saturating_add(new_prefill);
    let steps = work.div_ceil(c.max_num_batched_tokens).max(1);
    let per_step = c.step_overhead_s
        + c.decode_s_per_seq * load.num_requests as f64
        + c.decode_s_per_ctx_token * load.ongoing_decode_tokens as f64;
    let hit = input_length - new_prefill;
    let n = new_prefill as f64;
    steps as f64 * per_step
        + c.prefill_s_per_token * work as f64
        + c.prefill_s_per_pair * n * (hit as f64 + n / 2.0)
        + c.admit_s_per_token * input_length as f64
        + c.admit_s_per_request
        + c.request_overhead_s
        + if load.num_requests > 0 { c.busy_handling_s } else { 0.0 }
}

/// `ttft`: with a target, the most cache reuse (then the least predicted time) among the
/// instances predicted to meet it; otherwise, or when none does, the least predicted time
/// plus `delay_weight` times the delay its prefill adds to the requests running there.
fn ttft(
    c: &TtftCosts,
    p: &PolicyParams,
    input: &PickInput<'_>,
    state: &mut PickState,
) -> Option<(usize, Branch)> {
    let predict = |l: &InstanceLoad, new_prefill: u64| predicted_ttft(c, l, new_prefill, input.input_length);
    let slo_s = p.ttft_slo_s;
    if slo_s > 0.0 {
        let within = input.argmin_tied(state, |l, new_prefill| {
            let t = predict(l, new_prefill);
            (t <= slo_s).then_some((new_prefill, t))
        });
        if let Some((i, _)) = within {
            return Some((i, Branch::WithinSlo));
        }
    }
    input.argmin_tied(state, |l, new_prefill| {
        let delay = c.prefill_s_per_token * new_prefill as f64 * l.num_requests as f64;
        Some(predict(l, new_prefill) + p.delay_weight * delay)
    })
}

/// `unified`'s affinity gate: warm enough and not overloaded.
fn unified_gate(p: &PolicyParams, input: &PickInput<'_>, a: usize) -> bool {
    let (sum, count) = input.available_totals;
    debug_assert_eq!(
        (sum, count),
        input.available().fold((0, 0), |(s, c), i| (s + input.loads[i].num_requests, c + 1))
    );
    let avg = (sum as f64 / count.max(1) as f64).max(1.0);
    let hit = input.input_length - input.new_prefill(a);
    let ratio = hit as f64 / input.input_length.max(1) as f64;
    ratio > p.hit_ratio_gate && (input.loads[a].num_requests as f64) <= avg * p.overload_factor
}

fn power_of_two(input: &PickInput<'_>, state: &mut PickState) -> Option<(usize, Branch)> {
    let avail: Vec<usize> = input.available().collect();
    match avail.len() {
        0 => None,
        1 => Some((avail[0], Branch::Sampled)),
        n => {
            let first = state.rng.below(n);
            let mut second = state.rng.below(n - 1);
            if second >= first {
                second += 1;
            }
            let (a, b) = (avail[first], avail[second]);
            let chosen = if input.loads[a].num_requests <= input.loads[b].num_requests { a } else { b };
            Some((chosen, Branch::Sampled))
        }
    }
}

fn sglang_cache_aware(p: &PolicyParams, input: &PickInput<'_>) -> Option<(usize, Branch)> {
    let nreq = |i: usize| input.loads[i].num_requests;
    let max = input.available().map(nreq).max()?;
    let min = input.available().map(nreq).min()?;
    if max - min > p.balance_abs && max as f64 > min as f64 * p.balance_rel {
        return input.argmin(nreq).map(|i| (i, Branch::LoadBalance));
    }
    let best = input.argmin(|i| std::cmp::Reverse(input.matched[i]))?;
    let hit = input.input_length - input.new_prefill(best);
    let rate = if input.input_length == 0 { 0.0 } else { hit as f64 / input.input_length as f64 };
    if rate > p.cache_threshold {
        Some((best, Branch::CacheMatch))
    } else {
        input.argmin(|i| (input.cached_blocks)(i)).map(|i| (i, Branch::SmallestCache))
    }
}

fn dynamo_cost(p: &PolicyParams, input: &PickInput<'_>, state: &mut PickState) -> Option<(usize, Branch)> {
    let bs = input.block_size as f64;
    let costs: Vec<(usize, f64)> = input
        .available()
        .map(|i| {
            let prefill_blocks = input.new_prefill(i) as f64 / bs;
            let queued_blocks = input.loads[i].pending_prefill_tokens as f64 / bs;
            let in_flight = input.loads[i].ongoing_tokens.saturating_add(input.input_length) as f64;
            let again =
                if p.dedup_weight == 0.0 { 0.0 } else { p.dedup_weight * (input.held_again)(i) as f64 };
            let decode_blocks = (in_flight - again).max(0.0) / bs;
            (i, p.overlap_weight * prefill_blocks + p.queued_weight * queued_blocks + decode_blocks)
        })
        .collect();
    let min = costs.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
    let max = costs.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
    if costs.is_empty() {
        return None;
    }
    if p.temperature == 0.0 || max == min {
        let tied: Vec<usize> = costs.iter().filter(|c| c.1 == min).map(|c| c.0).collect();
        if p.temperature == 0.0 && tied.len() == 1 {
            return Some((tied[0], Branch::Score));
        }
        return Some((
            tied[state.rng.below(tied.len())],
            if p.temperature == 0.0 { Branch::TieBreak } else { Branch::Sampled },
        ));
    }
    // Softmax over negated, range-normalised costs, as Dynamo's selector.
    let scaled: Vec<f64> = costs.iter().map(|c| -(c.1 / (max - min)) / p.temperature).collect();
    let top = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled.iter().map(|s| (s - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    let draw = state.rng.unit();
    let mut cumulative = 0.0;
    for (c, w) in costs.iter().zip(&weights) {
        cumulative += w / total;
        if draw <= cumulative {
            return Some((c.0, Branch::Sampled));
        }
    }
    costs.last().map(|c| (c.0, Branch::Sampled))
}
