//! What a simulation run produces: per-request record columns (indexed by trace row, the
//! layout of `kvroute.records`), per-instance time series, and run statistics.
//! Plain columnar data: O(requests + samples) memory; thread-safe once built.

/// `error` codes of a record.
pub const OK: u8 = 0;
/// The request needs more KV than an engine's whole pool.
pub const EXCEEDS_KV: u8 = 1;
/// The run was stopped before the request was sent.
pub const NOT_SENT: u8 = 2;

/// Per-request columns; entry i is trace row i. NaN stands for null.
#[derive(Debug, Clone, Default)]
pub struct Records {
    pub instance: Vec<i32>,
    pub send: Vec<f64>,
    pub first_token: Vec<f64>,
    pub finish: Vec<f64>,
    pub output_length: Vec<i64>,
    pub cached_tokens: Vec<i64>,
    pub estimated_hit_tokens: Vec<i64>,
    pub queue_wait: Vec<f64>,
    /// Seconds from arrival at the router to routing (admission's queue; 0 without it).
    pub router_wait: Vec<f64>,
    pub preemptions: Vec<i32>,
    pub decode_overlaps_prefill: Vec<bool>,
    pub error: Vec<u8>,
}

impl Records {
    /// `n` records of requests not sent yet.
    pub fn new(n: usize) -> Self {
        Self {
            instance: vec![-1; n],
            send: vec![f64::NAN; n],
            first_token: vec![f64::NAN; n],
            finish: vec![f64::NAN; n],
            output_length: vec![0; n],
            cached_tokens: vec![0; n],
            estimated_hit_tokens: vec![0; n],
            queue_wait: vec![f64::NAN; n],
            router_wait: vec![f64::NAN; n],
            preemptions: vec![0; n],
            decode_overlaps_prefill: vec![false; n],
            error: vec![NOT_SENT; n],
        }
    }
}

/// Per-instance samples every `sample_interval` seconds of simulated time, taken at step
/// boundaries (within a closed-form decode run, as of the run's start).
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub time: Vec<f64>,
    pub instance: Vec<i32>,
    pub running: Vec<i32>,
    pub waiting: Vec<i32>,
    pub kv_used_blocks: Vec<i64>,
    pub kv_cached_blocks: Vec<i64>,
}

/// Facts about one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunStats {
    /// Events taken from the queue (sends, segment ends, samples).
    pub events: u64,
    /// Engine steps simulated, each step of a closed-form run counted.
    pub engine_steps: u64,
    /// Segments (single steps and closed-form runs).
    pub segments: u64,
    pub preemptions: u64,
    pub evictions: u64,
    pub finished: u64,
    pub rejected: u64,
    /// Simulated seconds from 0 to the last finish.
    pub makespan: f64,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
    /// KV blocks per engine.
    pub kv_total_blocks: u64,
    /// Requests the router still counts in flight at the end (0 when conserved).
    pub router_in_flight: u64,
    /// Sum over instances of every router counter at the end (0 when conserved).
    pub router_counters_sum: u64,
    /// Most requests in flight at once across the cluster.
    pub max_in_flight: u64,
    /// Most requests waiting at the router at once (admission; 0 without it).
    pub max_waiting: u64,
    /// Segment ends whose engine settled on the second thread (0 without one).
    pub second_thread_settles: u64,
}

/// Everything one run produced.
#[derive(Debug, Clone, Default)]
pub struct SimOutput {
    pub records: Records,
    pub series: Series,
    pub stats: RunStats,
}
