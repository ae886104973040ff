//! One generation request's books from its routing to its end: its [`Job`] (finished in the
//! router when it drops, however the request ends), the backend an attempt went to ([`At`]:
//! its failures and recoveries told to the hooks), and [`output`], the answer's output read by
//! the hooks for the router to record the blocks it completed.
//!
//! O(1) per job besides the router lock at its end; recording an output is O(its tokens)
//! under the router lock; reading it is one hook call (on the blocking pool when the hooks may
//! wait on the network). A job belongs to its request's task.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use super::stats::{BackendStats, ErrorKind};
use super::{Backend, Keyed, Shared};
use crate::jobs::locked;
use crate::keys::sequence_keys;
use crate::Id;

/// The longest answer whose output is modelled (longer ones are relayed all the same).
pub(super) const MAX_OUTPUT: usize = 16 << 20;

/// One request's place in the router, from its routing to its end: finished in the router
/// when dropped; dropped before it was settled, the client went away.
pub(super) struct Job {
    pub sh: Arc<Shared>,
    pub rid: Id,
    pub number: i64,
    pub keyed: Keyed,
    pub t0: Instant,
    settled: bool,
    _slot: OwnedSemaphorePermit,
}

impl Job {
    /// The relay's next request (numbered in order), routed with `keyed`, its head read at
    /// `t0`, holding its forwarding `slot` while it lives.
    pub fn new(sh: &Arc<Shared>, keyed: Keyed, t0: Instant, slot: OwnedSemaphorePermit) -> Self {
        let number = sh.next_request.fetch_add(1, Ordering::Relaxed);
        Job { sh: Arc::clone(sh), rid: Id::Int(number), number, keyed, t0, settled: false, _slot: slot }
    }

    /// The request has its answer (or the client needs none): not a disconnect.
    pub fn settle(&mut self) {
        self.settled = true;
    }

    /// Record in the router the blocks the engine stored for this request's output (vLLM
    /// keeps the blocks it completes), from the token ids the hooks found in its answer.
    pub fn record_output(&self, got: Option<(Vec<u32>, u64)>) {
        let (Some((ids, generated)), Some(tail)) = (got, &self.keyed.tail) else { return };
        let (k, bs) = (&self.keyed, self.sh.config.block_size);
        let keys = sequence_keys(&k.keys, k.input_length, tail, &ids, generated, bs);
        if keys.len() as u64 > k.input_length / bs as u64 {
            locked(&self.sh.router).extend(&self.rid, &keys);
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.settled {
            self.sh.stats.error(ErrorKind::ClientDisconnect);
        }
        locked(&self.sh.router).finish(&self.rid);
    }
}

/// The backend an attempt went to.
pub(super) struct At {
    pub instance: usize,
    pub backend: Arc<Backend>,
    pub bs: Arc<BackendStats>,
}

impl At {
    /// The backend failed a request: the hooks hear of it.
    pub fn failure(&self, sh: &Shared) {
        self.backend.failing.store(true, Ordering::SeqCst);
        sh.hooks.failure(self.instance);
    }

    /// The backend served a request well: the hooks hear of it if it was failing.
    pub fn success(&self, sh: &Shared) {
        if self.backend.failing.swap(false, Ordering::SeqCst) {
            sh.hooks.success(self.instance);
        }
    }
}

/// The token ids an answer generated and how many tokens it sampled, as the hooks read
/// them: at once, or on the blocking pool when the hooks may wait on the network.
pub(super) enum Output {
    Now(Option<(Vec<u32>, u64)>),
    Later(JoinHandle<Option<(Vec<u32>, u64)>>),
}

impl Future for Output {
    type Output = Option<(Vec<u32>, u64)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Output::Now(got) => Poll::Ready(got.take()),
            Output::Later(h) => Pin::new(h).poll(cx).map(|got| got.ok().flatten()),
        }
    }
}

/// Whether an answer carries the engine's token ids (`"token_ids"`).
pub(super) fn has_token_ids(answer: &[u8]) -> bool {
    super::usage::find(answer, "\"token_ids\"", false).is_some()
}

/// Start reading the output of `answer` (`stream`: an SSE body) with the hooks.
pub(super) fn output(sh: &Arc<Shared>, answer: Vec<u8>, stream: bool) -> Output {
    if !sh.config.output_from_text && !has_token_ids(&answer) {
        return Output::Now(None); // nothing the hooks could read the output's ids from
    }
    if !sh.hooks.key_may_block() {
        return Output::Now(sh.hooks.output(&answer, stream));
    }
    let hooks = Arc::clone(&sh.hooks);
    Output::Later(tokio::task::spawn_blocking(move || hooks.output(&answer, stream)))
}
