//! One generation request: key it, route it, send it, relay the answer, and close the
//! router's lifecycle for it whatever happens (the rules of the Python forwarder,
//! `kvroute.proxy.handler`, which the proxy's docs describe).
//!
//! `route` when the request is sent, `first_token` at the first streamed body bytes, `finish`
//! when the request's guard drops (success, error, client gone, panic). An attempt that
//! fails to connect or gets a 5xx answer before any byte reached the client is finished and
//! retried on the next choice, the failed backends hidden from the router for that one
//! decision; a stalled backend gives 504 without retry; a failure mid-stream ends the
//! client's stream with an error event; a client that hangs up drops the upstream connection
//! (vLLM then aborts the request). A kept-alive connection that turns out closed before a
//! byte of answer is replaced once.
//!
//! Per request: one hook call for the keys (on the blocking pool when the hooks say it may
//! take a round-trip), O(keys + instances) under the router lock per attempt, O(bytes) for
//! the relay; one task per request.

use std::sync::atomic::Ordering;

use super::front::{upstream_request, without, Request, DROP, HOP};
use super::http::Headers;
use super::log::{Record, Terms};
use super::reply::{error_json, Down};
use super::stats::{BackendStats, ErrorKind};
use super::upstream::{Exchange, ReadError, Watch};
use super::usage::{usage, Tail};
use super::{Backend, Keyed, Refusal, Shared};
use crate::jobs::locked;
use crate::keys::sequence_keys;
use crate::{Decision, Error, Id};

const RETRY_STATUS: [u16; 4] = [500, 502, 503, 504];
/// The longest answer whose output is modelled (longer ones are relayed all the same).
const MAX_OUTPUT: usize = 16 << 20;

/// An attempt that failed before any byte reached the client.
struct Fail {
    kind: ErrorKind,
    status: u16,
    message: String,
    retry: bool,
    /// A 5xx answer to pass on as it came, with its headers.
    answer: Option<(Vec<u8>, Headers)>,
}

impl Fail {
    fn new(kind: ErrorKind, status: u16, message: String, retry: bool) -> Self {
        Self { kind, status, message, retry, answer: None }
    }

    fn of(b: usize, e: &ReadError) -> Self {
        match e {
            ReadError::Timeout => Fail::new(ErrorKind::Timeout, 504, format!("backend {b} timed out"), false),
            e => Fail::new(ErrorKind::Connect, 502, format!("backend {b} failed: {e}"), true),
        }
    }

    async fn answer(&self, down: &mut Down<'_>) {
        if let Some((body, headers)) = &self.answer {
            let headers: Vec<_> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            down.send(self.status, &headers, body, None).await;
            return;
        }
        let kind = if self.status == 504 { "gateway_timeout" } else { "bad_gateway" };
        down.send_json(self.status, &error_json(&self.message, kind, self.status)).await;
    }
}

enum Outcome {
    Fail(Fail),
    ClientGone,
}

impl From<Fail> for Outcome {
    fn from(f: Fail) -> Self {
        Outcome::Fail(f)
    }
}

/// Finishes the request in the router when dropped.
struct Finish<'a>(&'a Shared, Id);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        locked(&self.0.router).finish(&self.1);
    }
}

/// Forward one generation request and answer it.
pub(super) async fn forward(sh: &Shared, req: &Request, down: &mut Down<'_>, mut w: Watch<'_>, chat: bool) {
    let keyed = match key(sh, req, chat).await {
        Ok(k) => k,
        Err(refusal) => {
            if refusal.status == 400 {
                sh.stats.error(ErrorKind::BadRequest);
            }
            down.send_json(refusal.status, &refusal.body).await;
            return;
        }
    };
    let Ok(_slot) = sh.forwarding.acquire().await else { return };
    let number = sh.next_request.fetch_add(1, Ordering::Relaxed);
    let rid = Id::Int(number);
    let _finish = Finish(sh, rid.clone());
    let headers = without(&req.head.headers, &HOP);
    let mut tried: Vec<usize> = Vec::new();
    let mut fail: Option<Fail> = None;
    for attempt in 0..=sh.config.retries {
        let (decision, terms) = match route(sh, &rid, &keyed, &tried) {
            Ok(routed) => routed,
            Err(Error::NoInstanceAvailable) => {
                if let Some(f) = &fail {
                    f.answer(down).await;
                } else {
                    sh.stats.error(ErrorKind::NoBackend);
                    let body = error_json("no backend is available", "service_unavailable", 503);
                    down.send_json(503, &body).await;
                }
                return;
            }
            Err(e) => {
                sh.hooks.log_error(&format!("routing failed: {e}"));
                down.send_json(500, &error_json("internal proxy error", "internal_error", 500)).await;
                return;
            }
        };
        if attempt == 0 {
            sh.stats.routing.observe(req.t0.elapsed());
        }
        let i = decision.instance;
        let Some(b) = sh.backends.get(i) else {
            sh.hooks.log_error(&format!("router instance {i} has no backend"));
            down.send_json(500, &error_json("internal proxy error", "internal_error", 500)).await;
            return;
        };
        let bs = sh.stats.backend(i);
        bs.decision(decision.branch, decision.hit_tokens);
        if let (Some(log), Some(terms)) = (&sh.log, terms) {
            let session = keyed.session.as_ref();
            let input_length = keyed.input_length;
            log.write(&Record {
                request: number,
                session,
                attempt,
                decision: &decision,
                backend: &b.url,
                input_length,
                terms,
            });
        }
        let a = Attempt { sh, req, keyed: &keyed, b: &b, bs: &bs, decision: &decision, rid: &rid };
        match a.run(&headers, keyed.stream, down, &mut w).await {
            Ok(()) => return,
            Err(Outcome::ClientGone) => {
                sh.stats.error(ErrorKind::ClientDisconnect);
                down.gone = true;
                return;
            }
            Err(Outcome::Fail(f)) => {
                locked(&sh.router).finish(&rid);
                bs.error(f.kind);
                failure(sh, i, &b);
                tried.push(i);
                if f.retry && attempt < sh.config.retries {
                    bs.retries.fetch_add(1, Ordering::Relaxed);
                    fail = Some(f);
                    continue;
                }
                f.answer(down).await;
                return;
            }
        }
    }
}

/// The request's routing inputs, from the hooks (off the event loop when they may block).
async fn key(sh: &Shared, req: &Request, chat: bool) -> Result<Keyed, Refusal> {
    let header = req.head.get(&sh.config.session_header);
    if !chat {
        let c = &sh.config;
        if let Some(k) =
            super::body::token_prompt(&req.body, c.block_size, c.session_field.as_deref(), header)
        {
            return Ok(k);
        }
    }
    if !sh.hooks.key_may_block() {
        return sh.hooks.key(&req.body, chat, header);
    }
    let (hooks, body, header) =
        (std::sync::Arc::clone(&sh.hooks), req.body.clone(), header.map(str::to_owned));
    let keyed = tokio::task::spawn_blocking(move || hooks.key(&body, chat, header.as_deref())).await;
    keyed.unwrap_or_else(|_| {
        let body = error_json("internal proxy error", "internal_error", 500);
        Err(Refusal { status: 500, body })
    })
}

/// Route, with the backends already tried hidden for this one decision; the score terms
/// before it when the decision log wants them.
fn route(sh: &Shared, rid: &Id, k: &Keyed, tried: &[usize]) -> crate::Result<(Decision, Option<Terms>)> {
    let mut router = locked(&sh.router);
    let terms = sh.log.as_ref().map(|_| Terms::read(&router, &k.keys, k.input_length));
    let hidden: Vec<usize> = tried.iter().copied().filter(|&i| router.is_available(i)).collect();
    for &i in &hidden {
        router.set_available(i as i64, false)?;
    }
    let decision = router.route(rid.clone(), &k.keys, k.input_length, k.session.as_ref());
    for &i in &hidden {
        router.set_available(i as i64, true)?;
    }
    Ok((decision?, terms))
}

fn failure(sh: &Shared, i: usize, b: &Backend) {
    b.failing.store(true, Ordering::SeqCst);
    sh.hooks.failure(i);
}

fn success(sh: &Shared, i: usize, b: &Backend) {
    if b.failing.swap(false, Ordering::SeqCst) {
        sh.hooks.success(i);
    }
}

/// One attempt on one backend.
struct Attempt<'a> {
    sh: &'a Shared,
    req: &'a Request,
    keyed: &'a Keyed,
    b: &'a Backend,
    bs: &'a BackendStats,
    decision: &'a Decision,
    rid: &'a Id,
}

impl Attempt<'_> {
    async fn run(
        &self,
        headers: &[(&str, &str)],
        stream: bool,
        down: &mut Down<'_>,
        w: &mut Watch<'_>,
    ) -> Result<(), Outcome> {
        let (sh, b, i) = (self.sh, self.b, self.decision.instance);
        let timeout = sh.config.request_timeout;
        let target = format!("{}{}", b.prefix, self.req.head.target);
        let data = upstream_request(&self.req.head.method, &target, &b.host, headers, &self.req.body);
        let mut fresh = false;
        let (mut ex, head) = loop {
            let up = sh.pool.acquire(&b.address, fresh).await.map_err(|e| Fail::of(i, &ReadError::Io(e)))?;
            let (mut ex, sent) = Exchange::send(up, &data, false).await;
            let head = match sent {
                Ok(()) => ex.head(w, timeout).await,
                Err(e) => Err(ReadError::Io(e)),
            };
            match head {
                Ok(head) => break (ex, head),
                Err(ReadError::ClientGone) => return Err(Outcome::ClientGone),
                Err(ReadError::Timeout) => return Err(Fail::of(i, &ReadError::Timeout).into()),
                Err(_) if ex.reused() && ex.received == 0 && !fresh => fresh = true,
                Err(e) => return Err(Fail::of(i, &e).into()),
            }
        };
        let gone_or_fail = |e: ReadError| match e {
            ReadError::ClientGone => Outcome::ClientGone,
            e => Outcome::Fail(Fail::of(i, &e)),
        };
        if RETRY_STATUS.contains(&head.status) {
            let body = ex.whole_body(w, timeout).await.map_err(gone_or_fail)?;
            ex.finish(&sh.pool);
            let mut f = Fail::new(ErrorKind::Status, head.status, String::new(), true);
            let relayed = without(&head.headers, &DROP)
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect();
            f.answer = Some((body, relayed));
            return Err(f.into());
        }
        let extra = [
            ("X-Kvroute-Instance", i.to_string()),
            ("X-Kvroute-Backend", b.url.clone()),
            ("X-Kvroute-Hit-Tokens", self.decision.hit_tokens.to_string()),
        ];
        let mut answer = without(&head.headers, &DROP);
        answer.extend(extra.iter().map(|(k, v)| (*k, v.as_str())));
        let mut output =
            (head.status == 200 && sh.config.model_output && self.keyed.tail.is_some()).then(Vec::new);
        if !(stream && head.status == 200) {
            let body = ex.whole_body(w, timeout).await.map_err(gone_or_fail)?;
            ex.finish(&sh.pool);
            success(sh, i, b);
            if output.is_some() {
                self.extend(body.clone(), false).await;
            }
            usage(self.bs, &body);
            self.bs.e2e.observe(self.req.t0.elapsed());
            down.send(head.status, &answer, &body, None).await;
            return Ok(());
        }
        let mut piece = Vec::new();
        let mut done = ex.body(w, timeout, &mut piece).await.map_err(gone_or_fail)?;
        if piece.is_empty() {
            return Err(Fail::new(
                ErrorKind::Connect,
                502,
                format!("backend {i} sent an empty stream"),
                true,
            )
            .into());
        }
        locked(&sh.router).first_token(self.rid);
        self.bs.ttft.observe(self.req.t0.elapsed());
        success(sh, i, b);
        let mut tail = Tail::default();
        tail.push(&piece);
        self.collect(&mut output, &piece, &tail).await;
        down.start(200, &answer, &piece).await;
        // Once `data: [DONE]` went out the request is complete: a client that hangs up then
        // (the openai package does, before the body's last chunk) or a backend that fails
        // after it changes nothing but the connections.
        while !done && !down.gone {
            piece.clear();
            match ex.body(w, timeout, &mut piece).await {
                Ok(end) => {
                    done = end;
                    tail.push(&piece);
                    self.collect(&mut output, &piece, &tail).await;
                    down.write(&piece, end).await;
                }
                Err(ReadError::ClientGone) => down.gone = true,
                Err(_) if tail.ended() => break,
                Err(e) => {
                    self.midstream(&e, down).await;
                    return Ok(());
                }
            }
        }
        if down.gone && !tail.ended() {
            return Err(Outcome::ClientGone);
        }
        down.write(&[], true).await;
        ex.finish(&sh.pool);
        usage(self.bs, tail.bytes());
        self.bs.e2e.observe(self.req.t0.elapsed());
        Ok(())
    }

    /// Keep a streamed answer's bytes while its output is modelled (`output`), and once its
    /// `[DONE]` is in, before the client can see it, record the output's blocks.
    async fn collect(&self, output: &mut Option<Vec<u8>>, piece: &[u8], tail: &Tail) {
        let Some(answer) = output.as_mut() else { return };
        answer.extend_from_slice(piece);
        if answer.len() > MAX_OUTPUT {
            *output = None; // too long to keep: this answer's output is not modelled
        } else if tail.ended() {
            let answer = output.take().unwrap_or_default();
            self.extend(answer, true).await;
        }
    }

    /// Record in the router the blocks the engine stored for this request's output (vLLM keeps
    /// the blocks it completes), from the token ids the hooks find in `answer`.
    async fn extend(&self, answer: Vec<u8>, stream: bool) {
        let (sh, k) = (self.sh, self.keyed);
        let Some(tail) = &k.tail else { return };
        if !sh.config.output_from_text && !answer.windows(11).any(|w| w == b"\"token_ids\"") {
            return; // nothing the hooks could read the output's ids from
        }
        let got = if sh.hooks.key_may_block() {
            let hooks = std::sync::Arc::clone(&sh.hooks);
            tokio::task::spawn_blocking(move || hooks.output(&answer, stream)).await.ok().flatten()
        } else {
            sh.hooks.output(&answer, stream)
        };
        let Some((ids, generated)) = got else { return };
        let keys = sequence_keys(&k.keys, k.input_length, tail, &ids, generated, sh.config.block_size);
        if keys.len() as u64 > k.input_length / sh.config.block_size as u64 {
            locked(&sh.router).extend(self.rid, &keys);
        }
    }

    async fn midstream(&self, e: &ReadError, down: &mut Down<'_>) {
        let i = self.decision.instance;
        let timeout = matches!(e, ReadError::Timeout);
        self.bs.error(if timeout { ErrorKind::Timeout } else { ErrorKind::Midstream });
        failure(self.sh, i, self.b);
        let what = if timeout { "timed out".to_string() } else { format!("failed: {e}") };
        let err = error_json(&format!("backend {i} {what} mid-stream"), "bad_gateway", 502);
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&err);
        event.extend_from_slice(b"\n\n");
        down.write(&event, true).await;
    }
}
