//! What an engine reports: events to its driver, per-request facts at finish, refusals,
//! counters and snapshots. Plain `Copy`/`Clone` data; thread-safe.

/// What an engine tells its driver. `tag` is the caller's request handle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// Prefill done, first token out; `cached_tokens` is the prefix-cache hit at admission.
    FirstToken { tag: u64, time: f64, cached_tokens: u64 },
    /// `generated` tokens out so far (only when token events are on).
    Tokens { tag: u64, time: f64, generated: u64 },
    /// The last token is out.
    Finish { tag: u64, time: f64, info: FinishInfo },
}

/// Per-request facts reported at finish.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FinishInfo {
    /// Tokens generated.
    pub generated: u64,
    /// Prefix-cache hit at the first admission (tokens).
    pub cached_tokens: u64,
    /// Seconds from arrival to first admission.
    pub queue_wait: f64,
    /// Times it was preempted (recomputed).
    pub preemptions: u32,
    /// Whether one of its decode steps shared a batch with another request's prefill.
    pub overlap: bool,
}

/// Why `submit` refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Prompt plus output need more KV blocks than the whole pool.
    ExceedsKvCapacity { need_blocks: u64, total_blocks: u64 },
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Reject::ExceedsKvCapacity { need_blocks, total_blocks } = self;
        write!(f, "input_length + output_length need {need_blocks} KV blocks, the pool has {total_blocks}")
    }
}

/// Counters of one engine since it started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineCounters {
    /// Engine steps simulated (each step of a closed-form run counts).
    pub steps: u64,
    /// Segments (single steps or runs) simulated.
    pub segments: u64,
    /// Prompt tokens looked up at admissions, and those found cached.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Preemptions, finished and rejected requests.
    pub preemptions: u64,
    pub finished: u64,
    pub rejected: u64,
}

/// A snapshot of an engine's queues and pool.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_used_blocks: u64,
    pub kv_cached_blocks: u64,
    pub kv_total_blocks: u64,
    pub counters: EngineCounters,
}
