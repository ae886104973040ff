//! The trace as the simulator reads it (columns borrowed from Arrow/numpy, never copied),
//! and its sessions: each session's requests in `(turn, timestamp, row)` order, and the
//! order sessions start in. Building [`Sessions`] is O(n log n) time, O(n) memory; both
//! types are read only afterwards and shared freely between threads.

use crate::error::{Error, Result};

/// Columns of a canonical trace (`docs/trace-format.md`), one entry per request (row).
#[derive(Debug, Clone)]
pub struct SimTrace<'a> {
    /// Seconds.
    pub timestamp: &'a [f64],
    /// Dense session index per row (0..sessions).
    pub session: &'a [u32],
    pub turn: &'a [i32],
    pub input_length: &'a [i64],
    pub output_length: &'a [i64],
    /// `keys[offsets[i]..offsets[i+1]]` are row i's keys; `offsets.len() == rows + 1`.
    pub offsets: &'a [i64],
    /// All rows' keys, end to end, in one or more chunks (as Arrow reads them).
    pub keys: KeyChunks<'a>,
    /// `time_to_parent_chat` (NaN where null), when the trace has the column.
    pub ttp: Option<&'a [f64]>,
    /// Tokens per key.
    pub block_size: u64,
}

impl<'a> SimTrace<'a> {
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.timestamp.len()
    }

    /// Whether the trace has no requests.
    pub fn is_empty(&self) -> bool {
        self.timestamp.is_empty()
    }

    /// Row `i`'s keys.
    pub fn keys_of(&self, i: usize) -> &'a [u64] {
        self.keys.range(self.offsets[i] as usize, self.offsets[i + 1] as usize)
    }

    /// Check lengths and values; errors name the column.
    pub fn validate(&self) -> Result<()> {
        let n = self.len();
        let bad = |m: String| Err(Error::InvalidArgument(m));
        for (name, len) in [
            ("session", self.session.len()),
            ("turn", self.turn.len()),
            ("input_length", self.input_length.len()),
            ("output_length", self.output_length.len()),
        ] {
            if len != n {
                return bad(format!("trace column {name} has {len} rows, timestamp has {n}"));
            }
        }
        if self.ttp.is_some_and(|t| t.len() != n) {
            return bad("trace column time_to_parent_chat has the wrong length".into());
        }
        if self.offsets.len() != n + 1
            || self.offsets.first().is_some_and(|&o| o != 0)
            || self.offsets.windows(2).any(|w| w[1] < w[0])
            || self.offsets.last().is_some_and(|&o| o as usize != self.keys.len())
        {
            return bad("trace hash_ids offsets are not a valid list layout".into());
        }
        if let Some(i) = (0..n)
            .find(|&i| !self.keys.is_within_a_chunk(self.offsets[i] as usize, self.offsets[i + 1] as usize))
        {
            return bad(format!("trace row {i}: hash_ids span two key chunks"));
        }
        if self.block_size == 0 {
            return bad("trace block size must be positive".into());
        }
        if let Some(i) = self.timestamp.iter().position(|t| !t.is_finite()) {
            return bad(format!("trace row {i}: timestamp is not finite"));
        }
        for (name, col) in [("input_length", self.input_length), ("output_length", self.output_length)] {
            if let Some(i) = col.iter().position(|&v| v < 0) {
                return bad(format!("trace row {i}: {name} is negative"));
            }
        }
        Ok(())
    }
}

/// Sessions of a trace: rows grouped per session in send order, and the launch order.
#[derive(Debug, Clone)]
pub struct Sessions {
    /// Rows, session after session.
    pub rows: Vec<u32>,
    /// Session s's rows are `rows[start[s]..start[s + 1]]`.
    pub start: Vec<u32>,
    /// Sessions by first-turn timestamp (ties: session index).
    pub launch: Vec<u32>,
    /// The trace's earliest timestamp (trace time 0 of the run).
    pub t0: f64,
}

impl Sessions {
    /// Group `trace`'s rows. Session indices must be dense (`0..max+1`).
    pub fn new(trace: &SimTrace<'_>) -> Result<Self> {
        let n_sess = trace.session.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        let mut start = vec![0u32; n_sess + 1];
        for &s in trace.session {
            start[s as usize + 1] += 1;
        }
        for i in 0..n_sess {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut rows = vec![0u32; trace.len()];
        for (i, &s) in trace.session.iter().enumerate() {
            rows[fill[s as usize] as usize] = i as u32;
            fill[s as usize] += 1;
        }
        for s in 0..n_sess {
            let slice = &mut rows[start[s] as usize..start[s + 1] as usize];
            if slice.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "session indices must be dense: session {s} has no request"
                )));
            }
            slice.sort_by(|&a, &b| {
                let (a, b) = (a as usize, b as usize);
                trace.turn[a]
                    .cmp(&trace.turn[b])
                    .then(trace.timestamp[a].total_cmp(&trace.timestamp[b]))
                    .then(a.cmp(&b))
            });
        }
        let first_ts = |s: u32| trace.timestamp[rows[start[s as usize] as usize] as usize];
        let mut launch: Vec<u32> = (0..n_sess as u32).collect();
        launch.sort_by(|&a, &b| first_ts(a).total_cmp(&first_ts(b)).then(a.cmp(&b)));
        let t0 = trace.timestamp.iter().copied().fold(f64::INFINITY, f64::min);
        Ok(Self { rows, start, launch, t0: if t0.is_finite() { t0 } else { 0.0 } })
    }

    /// Number of sessions.
    pub fn len(&self) -> usize {
        self.start.len() - 1
    }

    /// Whether there are no sessions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Session s's rows in send order.
    pub fn rows_of(&self, s: u32) -> &[u32] {
        &self.rows[self.start[s as usize] as usize..self.start[s as usize + 1] as usize]
    }
}

/// Key chunks seen as one sequence; a row's keys lie within one chunk. Finding a range is a
/// binary search over the chunks.
#[derive(Debug, Clone, Default)]
pub struct KeyChunks<'a> {
    chunks: Vec<&'a [u64]>,
    /// `starts[c]`: position of chunk `c`'s first key; one more entry for the total.
    starts: Vec<usize>,
}

impl<'a> KeyChunks<'a> {
    /// The chunks, in order.
    pub fn new(chunks: Vec<&'a [u64]>) -> Self {
        let mut starts = vec![0];
        starts.extend(chunks.iter().scan(0, |total, c| {
            *total += c.len();
            Some(*total)
        }));
        Self { chunks, starts }
    }

    /// Total number of keys.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn chunk_of(&self, start: usize) -> usize {
        self.starts
            .partition_point(|&s| s <= start)
            .saturating_sub(1)
            .min(self.chunks.len().saturating_sub(1))
    }

    fn is_within_a_chunk(&self, start: usize, end: usize) -> bool {
        start == end || {
            let c = self.chunk_of(start);
            end <= self.starts[c + 1]
        }
    }

    /// Keys `start..end` (within one chunk, as [`SimTrace::validate`] checks).
    pub fn range(&self, start: usize, end: usize) -> &'a [u64] {
        if start == end {
            return &[];
        }
        let c = self.chunk_of(start);
        &self.chunks[c][start - self.starts[c]..end - self.starts[c]]
    }
}
