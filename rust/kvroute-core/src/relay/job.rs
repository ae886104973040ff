//! One generation request's books from its routing to its end: its [`Job`] (finished in the
//! router when it drops, however the request ends), the backend an attempt went to ([`At`]:
//! its failures and recoveries told to the hooks), and [`output`], the answer's output read
//! (in Rust where it can be, else by the hooks) for the router to record the blocks it
//! completed.
//!
//! O(1) per job besides the router lock at its end; recording an output is O(its tokens)
//! under the router lock; reading it is O(the answer) plus tokenizing its text, on the event
//! loop for a short answer, else on the blocking pool (and there always when the hooks may
//! wait on the network). A job belongs to its request's task.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use super::output::{answer_output, AnswerOutput};
use super::stats::{BackendStats, ErrorKind};
use super::{Backend, Keyed, Shared};
use crate::jobs::locked;
use crate::keys::sequence_keys;
use crate::text::TextModel;
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
        let mut router = locked(&self.sh.router);
        let instance = router.instance_of(&self.rid);
        let finished = router.finish(&self.rid);
        drop(router);
        if let (true, Some(a)) = (finished, &self.sh.admission) {
            if let (true, Some(s), Some(i)) = (self.settled, &self.keyed.session, instance) {
                a.hold(s, i, self.keyed.input_length); // before the wake: a waiter woken sees the room held
            }
            a.wake(); // its engine may have room now
        }
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

/// Answers shorter than this are read on the event loop, longer ones on the blocking pool.
const INLINE_ANSWER_BYTES: usize = 4096;

/// Start reading the output of `answer` (`stream`: an SSE body): in Rust where it can be
/// ([`answer_output`], the model's tokenizer for its text), else with the hooks.
pub(super) fn output(sh: &Arc<Shared>, answer: Vec<u8>, stream: bool) -> Output {
    let from_text = sh.config.output_from_text;
    if !from_text && !has_token_ids(&answer) {
        return Output::Now(None); // nothing the hooks could read the output's ids from
    }
    let inline = answer.len() < INLINE_ANSWER_BYTES && !sh.hooks.key_may_block();
    let (hooks, model) = (Arc::clone(&sh.hooks), sh.config.text.clone());
    let read = move || {
        read_output(model.as_deref(), &answer, stream, from_text)
            .unwrap_or_else(|| hooks.output(&answer, stream))
    };
    if inline {
        return Output::Now(read());
    }
    Output::Later(tokio::task::spawn_blocking(read))
}

/// The ids an answer generated and how many tokens it sampled, read in Rust as the hooks
/// would read them (`Some(None)`: nothing to record); None where only the hooks can (an
/// answer [`answer_output`] is not sure of, text without a model to tokenize it).
fn read_output(
    model: Option<&TextModel>,
    answer: &[u8],
    stream: bool,
    from_text: bool,
) -> Option<Option<(Vec<u32>, u64)>> {
    let AnswerOutput { ids, text, generated } = answer_output(answer, stream)?;
    let counted = |ids: Vec<u32>| {
        let n = generated.unwrap_or(ids.len() as u64);
        (ids, n)
    };
    if let Some(ids) = ids {
        return Some(Some(counted(ids)));
    }
    if text.is_empty() || !from_text {
        return Some(None);
    }
    Some(model?.encode_answer(&text).ok().map(counted))
}
