//! The relay's JSONL decision log: one object per routing decision (request, session,
//! attempt, instance, backend, branch, input length, estimated hit, new prefill, the wait in
//! the admission queue, and per
//! instance the score terms seen just before the decision, with `ttft`'s predicted time),
//! the shape `docs/proxy.md` documents.
//!
//! Lines are buffered and written out at least once a second (on the next decision, or by
//! [`DecisionLog::flush`]). O(instances) per decision; shared by all the relay's tasks
//! behind one mutex.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::reply::json_str;
use crate::jobs::locked;
use crate::picker::{predicted_ttft, InstanceLoad};
use crate::{Decision, Id, Policy, Router};

/// Per-instance score terms before a decision.
pub(super) struct Terms(Vec<u8>);

impl Terms {
    /// Read off `router` for a request of `keys` and `input_length` tokens, with `loads`
    /// (its [`Router::policy_loads_now`]).
    pub fn read(router: &Router, loads: &[InstanceLoad], keys: &[u64], input_length: u64) -> Terms {
        let hits = router.estimate_cache_hits(keys, input_length);
        let mut out = b"[".to_vec();
        let costs = match router.policy() {
            Policy::Ttft => router.config().params.ttft_costs.as_ref(),
            _ => None,
        };
        for (i, ((hit, st), load)) in hits.iter().zip(router.state()).zip(loads).enumerate() {
            let new = input_length.saturating_sub(*hit);
            let pending = load.pending_prefill_tokens;
            if i > 0 {
                out.push(b',');
            }
            let _ = write!(
                out,
                "{{\"instance\":{i},\"available\":{},\"hit_tokens\":{hit},\"new_prefill\":{new},\
                 \"pending_prefill_tokens\":{pending},\"num_requests\":{},\"lmetric_score\":{},\
                 \"cache_view\":\"{}\",\"overloaded\":{}",
                st.load.available,
                load.num_requests,
                (pending + new).saturating_mul(load.num_requests),
                st.cache_view,
                st.overloaded,
            );
            if let Some(c) = costs {
                let _ =
                    write!(out, ",\"predicted_ttft_s\":{:.6}", predicted_ttft(c, load, new, input_length));
            }
            let _ = match st.engine {
                Some(e) => write!(
                    out,
                    ",\"engine\":{{\"running\":{},\"waiting\":{},\"kv_usage\":{},\"sent_since\":{},\"outside\":{}}}}}",
                    e.running, e.waiting, e.kv_usage, e.sent_since, e.outside
                ),
                None => write!(out, ",\"engine\":null}}"),
            };
        }
        out.push(b']');
        Terms(out)
    }
}

/// One decision to log.
pub(super) struct Record<'a> {
    pub request: i64,
    pub session: Option<&'a Id>,
    pub attempt: usize,
    pub decision: &'a Decision,
    pub backend: &'a str,
    pub input_length: u64,
    /// Seconds the request waited in the admission queue (0: it did not).
    pub queue_wait: f64,
    pub terms: Terms,
}

/// The log file (see the module doc).
pub(super) struct DecisionLog {
    out: Mutex<(BufWriter<File>, Instant)>,
}

impl DecisionLog {
    /// Append to `path` (created with its folders).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self { out: Mutex::new((BufWriter::with_capacity(1 << 20, file), Instant::now())) })
    }

    pub fn write(&self, r: &Record<'_>) {
        let d = r.decision;
        let mut line = format!("{{\"request\":{},\"session\":", r.request).into_bytes();
        match r.session {
            None => line.extend_from_slice(b"null"),
            Some(Id::Int(i)) => line.extend_from_slice(i.to_string().as_bytes()),
            Some(Id::Str(s)) => json_str(s, true, &mut line),
        }
        let _ = write!(line, ",\"attempt\":{},\"instance\":{},\"backend\":", r.attempt, d.instance);
        json_str(r.backend, true, &mut line);
        let _ = write!(
            line,
            ",\"branch\":\"{}\",\"input_length\":{},\"estimated_hit_tokens\":{},\"new_prefill\":{},\
             \"queue_wait_s\":{:.6},\"terms\":",
            d.branch.name(),
            r.input_length,
            d.hit_tokens,
            d.new_prefill,
            r.queue_wait
        );
        line.extend_from_slice(&r.terms.0);
        line.extend_from_slice(b"}\n");
        let mut out = locked(&self.out);
        let _ = out.0.write_all(&line);
        if out.1.elapsed() >= Duration::from_secs(1) {
            let _ = out.0.flush();
            out.1 = Instant::now();
        }
    }

    pub fn flush(&self) {
        let mut out = locked(&self.out);
        let _ = out.0.flush();
        out.1 = Instant::now();
    }
}
