//! Engine parameters, the step-time cost model's coefficients, and the named presets with
//! their derivation from published hardware facts and the study's measured anchors.
//!
//! Step time (seconds) of one engine step, `docs/simulator.md` "Cost model":
//!
//! ```text
//! t = step_overhead_s
//!   + prefill_s_per_token     * Σ new prefill tokens
//!   + prefill_s_per_pair      * Σ chunk · (chunk_start + chunk / 2)   (attended pairs)
//!   + decode_s_per_seq        * decode sequences
//!   + decode_s_per_ctx_token  * Σ context tokens read by the decodes
//!   + admit_s_per_token       * Σ prompt tokens of the requests the step admits
//! ```
//!
//! A request also spends `request_overhead_s` outside the steps (the API server's input and
//! output processing): the client sees its tokens and its end that much later than the engine
//! makes them. One that arrives while the engine is stepping reaches the scheduler
//! `busy_handling_s` later than at an idle engine (its handling waits for the core or the
//! thread the steps run on).
//!
//! The KV pool holds `kv_capacity_tokens` tokens (rounded down to `kv_block_size` blocks);
//! unless set, it is derived: `hbm_bytes * gpu_memory_utilization - weight_bytes -
//! reserved_bytes`, over `kv_bytes_per_token`. Plain data; O(1) everywhere; thread-safe.

use crate::error::{Error, Result};
use crate::policy::TtftCosts;

/// Every parameter of one engine. Build with [`EngineParams::preset`], then [`set`](Self::set).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineParams {
    /// Tokens per trace key (the trace's block size).
    pub block_size: u64,
    /// Tokens per KV block (vLLM's `block_size`, 16).
    pub kv_block_size: u64,
    /// Token budget of one step (`max_num_batched_tokens`).
    pub max_num_batched_tokens: u64,
    /// Running requests at most (`max_num_seqs`).
    pub max_num_seqs: u64,
    /// KV pool in tokens; 0 = derive from the memory facts below.
    pub kv_capacity_tokens: u64,
    /// Device memory as the driver reports it (bytes).
    pub hbm_bytes: f64,
    /// vLLM's `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// Model weights (bytes).
    pub weight_bytes: f64,
    /// Activations, CUDA graphs and non-torch memory held outside the pool (bytes).
    pub reserved_bytes: f64,
    /// KV bytes per token: 2 × layers × KV heads × head dim × dtype bytes.
    pub kv_bytes_per_token: f64,
    /// Fixed cost of a step (s).
    pub step_overhead_s: f64,
    /// Cost per new prefill token (s).
    pub prefill_s_per_token: f64,
    /// Cost per attended (query token, context token) pair of prefill (s).
    pub prefill_s_per_pair: f64,
    /// Cost per decoding sequence in a step (s).
    pub decode_s_per_seq: f64,
    /// Cost per context token a decode reads (KV bandwidth) (s).
    pub decode_s_per_ctx_token: f64,
    /// Cost per prompt token, cached or not, of a request the step admits: hashing its
    /// blocks and looking its prefix up in the cache (s).
    pub admit_s_per_token: f64,
    /// Cost per request the step admits, whatever its length: the engine time a new request
    /// takes from the steps (its input and output handling where it shares the engine's
    /// time; on a CPU engine, its API server on the worker's core) (s).
    pub admit_s_per_request: f64,
    /// Latency a request spends outside the engine's steps (API server, HTTP) (s).
    pub request_overhead_s: f64,
    /// How much later a request that arrives while a step is in progress reaches the
    /// scheduler than one at an idle engine: its handling takes turns with the steps (s).
    pub busy_handling_s: f64,
}

/// Names of the presets, in the order `kvroute.sim.presets()` lists them.
pub const PRESETS: [&str; 2] = ["h20-qwen3-coder-30b-a3b", "h200-qwen3-coder-30b-a3b"];

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;
/// Qwen3-Coder-30B-A3B: 2 × 48 layers × 4 KV heads × 128 × 2 bytes.
const QWEN3_CODER_KV_BYTES: f64 = 98_304.0;
/// 30.53 B parameters in bf16.
const QWEN3_CODER_WEIGHTS: f64 = 30.53e9 * 2.0;
/// The study's anchors on an idle H20: a 32k prefill ~5 s, a 65k prefill ~10 s.
const H20_ANCHORS: [(f64, f64); 2] = [(32_768.0, 5.0), (65_536.0, 10.0)];
/// Dense BF16 tensor peaks (TFLOPS) and HBM bandwidth (TB/s).
const H20_TFLOPS: f64 = 148.0;
const H200_TFLOPS: f64 = 989.0;
const H20_TBPS: f64 = 4.0;
const H200_TBPS: f64 = 4.8;
/// Fraction of peak bandwidth a paged-attention decode reaches.
const KV_READ_EFFICIENCY: f64 = 0.8;
/// Lone-decode step on H20: 5.2 ms of hardware-independent overhead (scheduler, launches,
/// sampling) + 1.6 ms of weight reads (≈ 5 GB of attention and active-expert weights).
const STEP_FIXED_S: f64 = 0.0052;
const H20_WEIGHT_READ_S: f64 = 0.0016;
/// Extra expert weights read per extra sequence in a decode batch on H20 (s).
const H20_DECODE_PER_SEQ_S: f64 = 0.00012;

impl EngineParams {
    /// The named preset (see `docs/simulator.md` for the derivation).
    pub fn preset(name: &str) -> Result<Self> {
        let (hbm_mib, tflops, tbps) = match name {
            "h20-qwen3-coder-30b-a3b" => (97_871.0, H20_TFLOPS, H20_TBPS),
            "h200-qwen3-coder-30b-a3b" => (143_771.0, H200_TFLOPS, H200_TBPS),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown engine preset {name:?}; known presets: {}",
                    PRESETS.join(", ")
                )))
            }
        };
        let bw = H20_TBPS / tbps;
        let step_overhead_s = STEP_FIXED_S + H20_WEIGHT_READ_S * bw;
        let budget = 8192;
        // Fit t(N) = steps(N) · overhead + N · per_token + N²/2 · per_pair to the two H20
        // anchors, then scale the compute terms by the ratio of tensor peaks.
        let (per_token, per_pair) = fit_prefill(H20_ANCHORS, budget, STEP_FIXED_S + H20_WEIGHT_READ_S);
        let compute = H20_TFLOPS / tflops;
        Ok(Self {
            block_size: 512,
            kv_block_size: 16,
            max_num_batched_tokens: budget,
            max_num_seqs: 256,
            kv_capacity_tokens: 0,
            hbm_bytes: hbm_mib * MIB,
            gpu_memory_utilization: 0.9,
            weight_bytes: QWEN3_CODER_WEIGHTS,
            reserved_bytes: 2.5 * GIB,
            kv_bytes_per_token: QWEN3_CODER_KV_BYTES,
            step_overhead_s,
            prefill_s_per_token: per_token * compute,
            prefill_s_per_pair: per_pair * compute,
            decode_s_per_seq: H20_DECODE_PER_SEQ_S * bw,
            decode_s_per_ctx_token: QWEN3_CODER_KV_BYTES / (tbps * 1e12 * KV_READ_EFFICIENCY),
            admit_s_per_token: 0.0,
            admit_s_per_request: 0.0,
            request_overhead_s: 0.0,
            busy_handling_s: 0.0,
        })
    }

    /// Names of the settable parameters, as [`set`](Self::set) takes them.
    pub const NAMES: [&'static str; 19] = [
        "block_size",
        "kv_block_size",
        "max_num_batched_tokens",
        "max_num_seqs",
        "kv_capacity_tokens",
        "hbm_bytes",
        "gpu_memory_utilization",
        "weight_bytes",
        "reserved_bytes",
        "kv_bytes_per_token",
        "step_overhead_s",
        "prefill_s_per_token",
        "prefill_s_per_pair",
        "decode_s_per_seq",
        "decode_s_per_ctx_token",
        "admit_s_per_token",
        "admit_s_per_request",
        "request_overhead_s",
        "busy_handling_s",
    ];

    /// Set one parameter by name; integers must be whole and non-negative.
    pub fn set(&mut self, name: &str, value: f64) -> Result<()> {
        let bad = |what: &str| {
            Error::InvalidArgument(format!("engine parameter {name} must be {what}, got {value}"))
        };
        if !value.is_finite() || value < 0.0 {
            return Err(bad("a finite number >= 0"));
        }
        let int = || {
            (value.fract() == 0.0 && value < 2f64.powi(53))
                .then_some(value as u64)
                .ok_or_else(|| bad("a whole number"))
        };
        match name {
            "block_size" => self.block_size = int()?,
            "kv_block_size" => self.kv_block_size = int()?,
            "max_num_batched_tokens" => self.max_num_batched_tokens = int()?,
            "max_num_seqs" => self.max_num_seqs = int()?,
            "kv_capacity_tokens" => self.kv_capacity_tokens = int()?,
            "hbm_bytes" => self.hbm_bytes = value,
            "gpu_memory_utilization" => self.gpu_memory_utilization = value,
            "weight_bytes" => self.weight_bytes = value,
            "reserved_bytes" => self.reserved_bytes = value,
            "kv_bytes_per_token" => self.kv_bytes_per_token = value,
            "step_overhead_s" => self.step_overhead_s = value,
            "prefill_s_per_token" => self.prefill_s_per_token = value,
            "prefill_s_per_pair" => self.prefill_s_per_pair = value,
            "decode_s_per_seq" => self.decode_s_per_seq = value,
            "decode_s_per_ctx_token" => self.decode_s_per_ctx_token = value,
            "admit_s_per_token" => self.admit_s_per_token = value,
            "admit_s_per_request" => self.admit_s_per_request = value,
            "request_overhead_s" => self.request_overhead_s = value,
            "busy_handling_s" => self.busy_handling_s = value,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown engine parameter {name:?}; known: {}",
                    Self::NAMES.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// The step costs the `ttft` policy predicts with.
    pub fn ttft_costs(&self) -> TtftCosts {
        TtftCosts {
            step_overhead_s: self.step_overhead_s,
            prefill_s_per_token: self.prefill_s_per_token,
            prefill_s_per_pair: self.prefill_s_per_pair,
            decode_s_per_seq: self.decode_s_per_seq,
            decode_s_per_ctx_token: self.decode_s_per_ctx_token,
            admit_s_per_token: self.admit_s_per_token,
            admit_s_per_request: self.admit_s_per_request,
            request_overhead_s: self.request_overhead_s,
            busy_handling_s: self.busy_handling_s,
            max_num_batched_tokens: self.max_num_batched_tokens,
        }
    }

    /// Every parameter by name (derived capacity filled in), for reports and run metadata.
    pub fn to_pairs(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("block_size", self.block_size as f64),
            ("kv_block_size", self.kv_block_size as f64),
            ("max_num_batched_tokens", self.max_num_batched_tokens as f64),
            ("max_num_seqs", self.max_num_seqs as f64),
            ("kv_capacity_tokens", self.capacity_tokens() as f64),
            ("hbm_bytes", self.hbm_bytes),
            ("gpu_memory_utilization", self.gpu_memory_utilization),
            ("weight_bytes", self.weight_bytes),
            ("reserved_bytes", self.reserved_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
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

    /// The KV pool in tokens: the override, or what the memory facts leave for it.
    pub fn capacity_tokens(&self) -> u64 {
        if self.kv_capacity_tokens > 0 {
            return self.kv_capacity_tokens;
        }
        let bytes = self.hbm_bytes * self.gpu_memory_utilization - self.weight_bytes - self.reserved_bytes;
        if bytes <= 0.0 || self.kv_bytes_per_token <= 0.0 {
            return 0;
        }
        (bytes / self.kv_bytes_per_token) as u64
    }

    /// The KV pool in blocks of `kv_block_size` tokens.
    pub fn total_blocks(&self) -> u64 {
        self.capacity_tokens() / self.kv_block_size.max(1)
    }

    /// Reject settings the engine cannot run with, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        let fail = |m: String| Err(Error::InvalidArgument(m));
        if self.kv_block_size == 0 || self.block_size == 0 {
            return fail("engine block_size and kv_block_size must be positive".into());
        }
        if self.block_size % self.kv_block_size != 0 {
            return fail(format!(
                "the trace's block size ({}) must be a multiple of the engine's kv_block_size \
                 ({}); set kv_block_size to a divisor of it",
                self.block_size, self.kv_block_size
            ));
        }
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 {
            return fail("max_num_batched_tokens and max_num_seqs must be positive".into());
        }
        if self.total_blocks() == 0 {
            return fail(format!(
                "the KV pool is empty: hbm_bytes {} × gpu_memory_utilization {} leaves nothing \
                 after weight_bytes {} and reserved_bytes {}; set kv_capacity_tokens",
                self.hbm_bytes, self.gpu_memory_utilization, self.weight_bytes, self.reserved_bytes
            ));
        }
        if !(self.step_overhead_s > 0.0 && self.step_overhead_s.is_finite()) {
            return fail("step_overhead_s must be positive (a step takes time)".into());
        }
        for (name, v) in [
            ("prefill_s_per_token", self.prefill_s_per_token),
            ("prefill_s_per_pair", self.prefill_s_per_pair),
            ("decode_s_per_seq", self.decode_s_per_seq),
            ("decode_s_per_ctx_token", self.decode_s_per_ctx_token),
            ("admit_s_per_token", self.admit_s_per_token),
            ("admit_s_per_request", self.admit_s_per_request),
            ("request_overhead_s", self.request_overhead_s),
            ("busy_handling_s", self.busy_handling_s),
        ] {
            // A step then lasts at least step_overhead_s, which the simulator relies on.
            if !(v >= 0.0 && v.is_finite()) {
                return fail(format!("{name} must be a cost >= 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// Fit `per_token` and `per_pair` so an idle engine with `overhead` per step of `budget`
/// tokens prefills each anchor `(tokens, seconds)` in that time; the quadratic share is
/// clamped at 0 (anchors in exact proportion leave none).
pub fn fit_prefill(anchors: [(f64, f64); 2], budget: u64, overhead: f64) -> (f64, f64) {
    let b = budget as f64;
    let rest = |(n, t): (f64, f64)| t - (n / b).ceil() * overhead;
    let (n1, n2) = (anchors[0].0, anchors[1].0);
    let (r1, r2) = (rest(anchors[0]), rest(anchors[1]));
    // r = n · a + n² / 2 · p  for both anchors.
    let det = n1 * n2 * n2 / 2.0 - n2 * n1 * n1 / 2.0;
    let p = ((n1 * r2 - n2 * r1) / det).max(0.0);
    let a = (r1 - n1 * n1 / 2.0 * p) / n1;
    (a, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle_prefill(p: &EngineParams, n: u64) -> f64 {
        let steps = n.div_ceil(p.max_num_batched_tokens) as f64;
        let n = n as f64;
        steps * p.step_overhead_s + n * p.prefill_s_per_token + n * n / 2.0 * p.prefill_s_per_pair
    }

    #[test]
    fn h20_preset_meets_the_anchors() {
        let p = EngineParams::preset("h20-qwen3-coder-30b-a3b").unwrap();
        p.validate().unwrap();
        assert!((idle_prefill(&p, 32_768) - 5.0).abs() < 0.01);
        assert!((idle_prefill(&p, 65_536) - 10.0).abs() < 0.05);
        let lone = p.step_overhead_s + p.decode_s_per_seq + 1000.0 * p.decode_s_per_ctx_token;
        assert!((0.0065..0.0075).contains(&lone), "{lone}");
        let four = p.step_overhead_s + 4.0 * p.decode_s_per_seq + 80_000.0 * p.decode_s_per_ctx_token;
        assert!((0.009..0.0105).contains(&four), "{four}");
        assert!((250_000..350_000).contains(&p.capacity_tokens()));
        let h200 = EngineParams::preset("h200-qwen3-coder-30b-a3b").unwrap();
        assert!(h200.capacity_tokens() > 2 * p.capacity_tokens());
        assert!(idle_prefill(&h200, 32_768) < 1.0);
    }

    #[test]
    fn fit_recovers_a_quadratic() {
        let (a, p) = fit_prefill(
            [(1000.0, 1.0 + 1000.0 * 1e-3 + 5e5 * 1e-6), (4000.0, 1.0 + 4.0 + 8e6 * 1e-6)],
            1_000_000,
            1.0,
        );
        assert!((a - 1e-3).abs() < 1e-12 && (p - 1e-6).abs() < 1e-15, "{a} {p}");
    }

    #[test]
    fn set_and_validate_name_the_parameter() {
        let mut p = EngineParams::preset("h20-qwen3-coder-30b-a3b").unwrap();
        p.set("max_num_seqs", 8.0).unwrap();
        assert_eq!(p.max_num_seqs, 8);
        let e = p.set("max_num_seqs", 1.5).unwrap_err().to_string();
        assert!(e.contains("max_num_seqs") && e.contains("whole"));
        assert!(p.set("warp_speed", 1.0).unwrap_err().to_string().contains("warp_speed"));
        assert!(p.set("hbm_bytes", -1.0).is_err());
        p.set("kv_capacity_tokens", 1600.0).unwrap();
        assert_eq!(p.total_blocks(), 100);
        p.set("block_size", 100.0).unwrap();
        assert!(p.validate().unwrap_err().to_string().contains("kv_block_size"));
        assert!(EngineParams::preset("a100").unwrap_err().to_string().contains("h20-qwen3"));
    }
}
