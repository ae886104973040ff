//! Policy names and parameters. The picking itself is in [`crate::picker`].
//!
//! Five policies from the study (`lmetric`, `load_only`, `sticky`, `unified`, `leastwork`,
//! exactly as the semantics page), `unified_dynamo` (`unified`'s affinity gate with
//! `dynamo_cost` as its fallback), `ttft` (LPWL in predicted seconds, from an engine
//! profile's step costs, [`TtftCosts`]), and five industry ones for comparison
//! (`round_robin`, `random`, `power_of_two`, `sglang_cache_aware`, `dynamo_cost`). Plain
//! data, thread-safe.

use crate::error::{Error, Result};

/// A routing policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// `(pending_prefill + new_prefill) * num_requests`, min, first-seen.
    Lmetric,
    /// min `num_requests`, first-seen.
    LoadOnly,
    /// Hard session affinity; new sessions go to min `num_requests`.
    Sticky,
    /// Gated affinity, else `lmetric` with a round-robin tie-break.
    Unified,
    /// LPWL: `pending_prefill + new_prefill`, same tie-break as `unified`.
    LeastWork,
    /// `unified`'s gated affinity, else `dynamo_cost`.
    UnifiedDynamo,
    /// Cycle over the available instances.
    RoundRobin,
    /// Seeded uniform choice among the available instances.
    Random,
    /// Two seeded distinct samples, the one with fewer requests (the first on a tie).
    PowerOfTwo,
    /// SGLang router's cache-aware policy.
    SglangCacheAware,
    /// Dynamo KV router's cost `overlap_weight * prefill_blocks + decode_blocks`, plus
    /// `queued_weight` times the blocks the instance has queued for prefill.
    DynamoCost,
    /// Least predicted time to first token at the profile's step costs, LPWL's tie-breaks;
    /// with an SLO, the most cache reuse among the instances predicted to meet it.
    Ttft,
}

impl Policy {
    /// Every policy, in the order `kvroute.policies()` lists them.
    pub const ALL: [Policy; 12] = [
        Policy::Lmetric,
        Policy::LoadOnly,
        Policy::Sticky,
        Policy::Unified,
        Policy::LeastWork,
        Policy::UnifiedDynamo,
        Policy::RoundRobin,
        Policy::Random,
        Policy::PowerOfTwo,
        Policy::SglangCacheAware,
        Policy::DynamoCost,
        Policy::Ttft,
    ];

    /// The policy's public name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lmetric => "lmetric",
            Policy::LoadOnly => "load_only",
            Policy::Sticky => "sticky",
            Policy::Unified => "unified",
            Policy::LeastWork => "leastwork",
            Policy::UnifiedDynamo => "unified_dynamo",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::PowerOfTwo => "power_of_two",
            Policy::SglangCacheAware => "sglang_cache_aware",
            Policy::DynamoCost => "dynamo_cost",
            Policy::Ttft => "ttft",
        }
    }

    /// Parse a public name.
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| Error::UnknownPolicy(name.to_owned()))
    }

    /// Whether the picker reads the blocks held in flight on each instance with `params`
    /// (Dynamo's cost under a `dedup_weight`).
    pub fn reads_held(self, params: &PolicyParams) -> bool {
        matches!(self, Policy::UnifiedDynamo | Policy::DynamoCost) && params.dedup_weight > 0.0
    }

    /// Whether the picker needs every instance's cache hit (one index walk per request).
    pub fn scores_cache(self) -> bool {
        matches!(
            self,
            Policy::Lmetric
                | Policy::Unified
                | Policy::LeastWork
                | Policy::UnifiedDynamo
                | Policy::SglangCacheAware
                | Policy::DynamoCost
                | Policy::Ttft
        )
    }
}

/// Tunables of the policies; each policy reads only its own.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyParams {
    /// `unified`, `unified_dynamo`: the affinity instance is overloaded above
    /// `avg * overload_factor` requests.
    pub overload_factor: f64,
    /// `unified`, `unified_dynamo`: stick only when `hit / input_length > hit_ratio_gate`.
    pub hit_ratio_gate: f64,
    /// `sglang_cache_aware`: follow the best match when its match rate is above this.
    pub cache_threshold: f64,
    /// `sglang_cache_aware`: imbalanced when `max - min > balance_abs` requests ...
    pub balance_abs: u64,
    /// ... and `max > min * balance_rel`.
    pub balance_rel: f64,
    /// `dynamo_cost`, `unified_dynamo`: weight of the prefill blocks in the cost.
    pub overlap_weight: f64,
    /// `dynamo_cost`, `unified_dynamo`: weight of the prefill queued on the instance (blocks of
    /// the requests not yet past their first token); 0 leaves it out, `overlap_weight` is
    /// Dynamo's own cost.
    pub queued_weight: f64,
    /// `dynamo_cost`, `unified_dynamo`: the share (0 to 1) of the blocks in flight that several
    /// requests on the instance hold (and that this request would share there) taken off its
    /// decode blocks; 0 counts each request's whole prompt, 1 is Dynamo's count of distinct
    /// blocks.
    pub dedup_weight: f64,
    /// `dynamo_cost`, `unified_dynamo`: 0 takes the argmin; above 0, softmax sampling over the negated costs.
    pub temperature: f64,
    /// `ttft`: the engines' step costs; required by `ttft`, read by no other policy.
    pub ttft_costs: Option<TtftCosts>,
    /// `ttft`: the time-to-first-token target in seconds; 0 = no target.
    pub ttft_slo_s: f64,
    /// `ttft`: weight of the delay the request's prefill adds to the requests running on
    /// an instance (its new tokens at `prefill_s_per_token`, once per such request); 0 leaves
    /// it out.
    pub delay_weight: f64,
}

/// The step-time terms `ttft` predicts with: an engine profile's (`kvroute calibrate`), or
/// the simulated engine's. Seconds; see `docs/semantics.md` §3 `ttft`.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftCosts {
    /// Fixed cost of an engine step.
    pub step_overhead_s: f64,
    /// Per new prefill token.
    pub prefill_s_per_token: f64,
    /// Per attended (new token, context token) pair of this request's prefill.
    pub prefill_s_per_pair: f64,
    /// Per running request, every step.
    pub decode_s_per_seq: f64,
    /// Per context token of the decoding requests, every step.
    pub decode_s_per_ctx_token: f64,
    /// Per prompt token of this request, cached or not (its admission).
    pub admit_s_per_token: f64,
    /// Per request, whatever its length (its admission).
    pub admit_s_per_request: f64,
    /// Outside the engine's steps (API server, HTTP).
    pub request_overhead_s: f64,
    /// Before a busy instance's scheduler sees the request (its handling takes turns with the
    /// steps), beyond an idle one's.
    pub busy_handling_s: f64,
    /// Prefill tokens one step takes at most (`max_num_batched_tokens`).
    pub max_num_batched_tokens: u64,
}

impl TtftCosts {
    /// The seconds-valued terms by name (all but `max_num_batched_tokens`).
    pub fn named(&self) -> [(&'static str, f64); 9] {
        [
            ("step_overhead_s", self.step_overhead_s),
            ("prefill_s_per_token", self.prefill_s_per_token),
            ("prefill_s_per_pair", self.prefill_s_per_pair),
            ("decode_s_per_seq", self.decode_s_per_seq),
            ("decode_s_per_ctx_token", self.decode_s_per_ctx_token),
            ("admit_s_per_token", self.admit_s_per_token),
            ("admit_s_per_request", self.admit_s_per_request),
            ("request_overhead_s", self.request_overhead_s),
            ("busy_handling_s", self.busy_handling_s),
        ]
    }

    pub(crate) fn validate(&self) -> Result<()> {
        for (name, value) in self.named() {
            if !value.is_finite() || value < 0.0 {
                return Err(Error::InvalidArgument(format!(
                    "ttft cost {name} must be a finite number >= 0, got {value}"
                )));
            }
        }
        if self.max_num_batched_tokens == 0 {
            return Err(Error::InvalidArgument(
                "ttft cost max_num_batched_tokens must be positive, got 0".into(),
            ));
        }
        Ok(())
    }
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            overload_factor: 2.0,
            hit_ratio_gate: 0.5,
            cache_threshold: 0.5,
            balance_abs: 32,
            balance_rel: 1.1,
            overlap_weight: 1.0,
            queued_weight: 0.0,
            dedup_weight: 0.0,
            temperature: 0.0,
            ttft_costs: None,
            ttft_slo_s: 0.0,
            delay_weight: 0.0,
        }
    }
}

impl PolicyParams {
    /// Reject values outside each parameter's domain, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        let checks = [
            ("overload_factor", self.overload_factor, 0.0),
            ("hit_ratio_gate", self.hit_ratio_gate, 0.0),
            ("cache_threshold", self.cache_threshold, 0.0),
            ("balance_rel", self.balance_rel, 0.0),
            ("overlap_weight", self.overlap_weight, 0.0),
            ("queued_weight", self.queued_weight, 0.0),
            ("dedup_weight", self.dedup_weight, 0.0),
            ("temperature", self.temperature, 0.0),
            ("ttft_slo_s", self.ttft_slo_s, 0.0),
            ("delay_weight", self.delay_weight, 0.0),
        ];
        for (name, value, min) in checks {
            if !value.is_finite() || value < min {
                return Err(Error::InvalidArgument(format!(
                    "{name} must be a finite number >= {min}, got {value}"
                )));
            }
        }
        if self.dedup_weight > 1.0 {
            return Err(Error::InvalidArgument(format!(
                "dedup_weight must be at most 1, got {}",
                self.dedup_weight
            )));
        }
        self.ttft_costs.as_ref().map_or(Ok(()), TtftCosts::validate)
    }

    /// [`validate`](Self::validate), and what `policy` needs: `ttft` its costs.
    pub fn validate_for(&self, policy: Policy) -> Result<()> {
        self.validate()?;
        if policy == Policy::Ttft && self.ttft_costs.is_none() {
            return Err(Error::InvalidArgument(
                "policy ttft needs the engines' step costs (an engine profile from kvroute calibrate)".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in Policy::ALL {
            assert_eq!(Policy::from_name(p.name()), Ok(p));
        }
        let err = Policy::from_name("lru").unwrap_err();
        assert!(err.to_string().contains("unknown policy \"lru\""));
        assert!(err.to_string().contains("leastwork"));
    }

    #[test]
    fn params_are_validated() {
        assert!(PolicyParams::default().validate().is_ok());
        let bad = PolicyParams { temperature: -1.0, ..PolicyParams::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("temperature"));
        let nan = PolicyParams { overload_factor: f64::NAN, ..PolicyParams::default() };
        assert!(nan.validate().is_err());
    }
}
