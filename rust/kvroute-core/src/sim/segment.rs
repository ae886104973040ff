//! The segment an engine is in: one step, or a closed-form run of decode-only steps whose
//! j-th step lasts `a + s·(j-1)`; and [`KvOp`], the pool's share of a finished segment that
//! its commit (`commit.rs`) leaves for the second phase. O(1) to query (a square root and
//! two corrections); plain data.

/// The segment in progress: `steps` steps from `start`, step j (1-based) lasting
/// `a + s · (j - 1)`. A plain step has `steps = 1`; a decode run has `run = true`.
#[derive(Debug, Clone, Default)]
pub(super) struct Segment {
    pub start: f64,
    pub end: f64,
    pub steps: u64,
    pub a: f64,
    pub s: f64,
    pub run: bool,
    pub has_prefill: bool,
    /// (handle, tokens scheduled) in running order.
    pub batch: Vec<(u32, u64)>,
}

impl Segment {
    /// Seconds from `start` to the end of step `k`.
    pub fn offset(&self, k: u64) -> f64 {
        let k = k as f64;
        k * self.a + self.s * k * (k - 1.0) / 2.0
    }

    /// Steps finished by time `t` (at most `steps`).
    pub fn steps_done(&self, t: f64) -> u64 {
        let d = t - self.start;
        if d <= 0.0 {
            return 0;
        }
        let guess = if self.s > 0.0 {
            let b = self.a - self.s / 2.0;
            ((-b + (b * b + 2.0 * self.s * d).sqrt()) / self.s).floor()
        } else {
            (d / self.a).floor()
        };
        let mut k = (guess.max(0.0) as u64).min(self.steps);
        // Compare end times exactly as they are reported (start + offset).
        while k < self.steps && self.start + self.offset(k + 1) <= t {
            k += 1;
        }
        while k > 0 && self.start + self.offset(k) > t {
            k -= 1;
        }
        k
    }
}

/// A pool operation left for the engine's `settle` (`commit.rs`), in segment order.
#[derive(Debug, Clone, Copy)]
pub(super) enum KvOp {
    /// A decode run's request: its blocks for the run's tokens.
    Grow(u32),
    /// A prefill chunk computed: cache the keys it filled.
    Register(u32),
    /// A finished request: release its blocks.
    Release(u32),
}
