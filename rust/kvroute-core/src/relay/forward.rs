//! One generation request: key it, route it, send it on a pooled hyper connection, answer it,
//! and close the router's lifecycle for it whatever happens (the rules in `docs/proxy.md`).
//!
//! `route` when the request is sent, `first_token` at the first streamed body bytes, `finish`
//! when the request's [`Job`] drops (a whole answer sent, a stream's body dropped, the client
//! gone: hyper drops the request's future, a panic). An attempt that fails to connect or gets
//! a 5xx answer before any byte reached the client is finished and retried on the next
//! choice, the failed backends hidden from the router for that one decision; a stalled backend
//! gives 504 without retry; a failure mid-stream ends the client's stream with an error event
//! ([`super::stream`]). A connection that closes before a byte of answer (a kept-alive one the
//! backend was closing) is replaced once by a new one before the attempt counts as failed. A
//! first attempt's first streamed byte is a sample for fitting `ttft`'s costs
//! ([`super::first_tokens`]).
//!
//! Per request: one hook call for the keys (on the blocking pool when the hooks say it may
//! take a round-trip), O(keys + instances) under the router lock per attempt, O(bytes) for
//! the relay; the request's future and its answer's body are polled by its connection's task.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Response, StatusCode};

use super::admission::{Ticket, POLL};
use super::first_tokens::FirstToken;
use super::job::{output, At, Job};
use super::log::{Record, Terms};
use super::pool::{Failure, Upstream};
use super::reply::{error, error_json, full, json, Out};
use super::request::{relayed, Request};
use super::stats::ErrorKind;
use super::stream::Relayed;
use super::usage::usage;
use super::{Keyed, Refusal, Shared};
use crate::jobs::locked;
use crate::picker::InstanceLoad;
use crate::{Decision, Error, Id, Router};

const RETRY_STATUS: [u16; 4] = [500, 502, 503, 504];

/// An attempt that failed before any byte reached the client.
struct Fail {
    kind: ErrorKind,
    status: u16,
    message: String,
    retry: bool,
    /// A 5xx answer to pass on as it came, with its headers.
    answer: Option<(Bytes, HeaderMap)>,
}

impl Fail {
    fn timeout(b: usize) -> Self {
        Fail {
            kind: ErrorKind::Timeout,
            status: 504,
            message: format!("backend {b} timed out"),
            retry: false,
            answer: None,
        }
    }

    fn failed(b: usize, what: &str) -> Self {
        Fail {
            kind: ErrorKind::Connect,
            status: 502,
            message: format!("backend {b} {what}"),
            retry: true,
            answer: None,
        }
    }

    fn answer(self) -> Response<Out> {
        if let Some((body, headers)) = self.answer {
            let mut r = Response::new(full(body));
            *r.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
            *r.headers_mut() = headers;
            return r;
        }
        let kind = if self.status == 504 { "gateway_timeout" } else { "bad_gateway" };
        error(self.status, &self.message, kind)
    }
}

/// Forward one generation request; its answer.
pub(super) async fn forward(sh: Arc<Shared>, req: Request, chat: bool) -> Response<Out> {
    let keyed = match key(&sh, &req, chat).await {
        Ok(k) => k,
        Err(refusal) => {
            if refusal.status == 400 {
                sh.stats.error(ErrorKind::BadRequest);
            }
            return json(refusal.status, refusal.body);
        }
    };
    let Ok(slot) = Arc::clone(&sh.forwarding).acquire_owned().await else {
        return error(503, "the proxy is stopping", "service_unavailable");
    };
    let mut job = Job::new(&sh, keyed, req.t0, slot);
    let answer = run(&job, &req).await;
    match answer {
        Answer::Whole(r) => {
            job.settle();
            r
        }
        Answer::Stream { head, up, upstream, first, at, model } => {
            let body = Relayed::new(job, at, (up, upstream), first, model);
            Response::from_parts(head, body.boxed_unsync())
        }
    }
}

/// What an attempt gives the client.
enum Answer {
    Whole(Response<Out>),
    /// A stream whose first data frame `first` came: the answer's head, the backend's body.
    Stream {
        head: hyper::http::response::Parts,
        up: Box<Upstream>,
        upstream: Incoming,
        first: Bytes,
        at: At,
        model: bool,
    },
}

/// The attempts of one request (see the module doc).
async fn run(job: &Job, req: &Request) -> Answer {
    let (sh, keyed) = (&*job.sh, &job.keyed);
    let mut tried: Vec<usize> = Vec::new();
    let mut fail: Option<Fail> = None;
    let mut queue_wait = 0.0;
    for attempt in 0..=sh.config.retries {
        let routed = match attempt {
            0 => match admit(job, req).await {
                Ok((routed, waited)) => {
                    queue_wait = waited;
                    routed
                }
                Err(refused) => return Answer::Whole(refused),
            },
            _ => route(&mut locked(&sh.router), sh, &job.rid, keyed, Target::Any(&tried)),
        };
        let (decision, terms, before) = match routed {
            Ok(routed) => routed,
            Err(Error::NoInstanceAvailable) => {
                return Answer::Whole(fail.map_or_else(
                    || {
                        sh.stats.error(ErrorKind::NoBackend);
                        error(503, "no backend is available", "service_unavailable")
                    },
                    Fail::answer,
                ));
            }
            Err(e) => {
                sh.hooks.log_error(&format!("routing failed: {e}"));
                return Answer::Whole(error(500, "internal proxy error", "internal_error"));
            }
        };
        if attempt == 0 {
            let waited = std::time::Duration::from_secs_f64(queue_wait);
            sh.stats.routing.observe(req.t0.elapsed().saturating_sub(waited));
        }
        let i = decision.instance;
        let Some(backend) = sh.backends.get(i) else {
            sh.hooks.log_error(&format!("router instance {i} has no backend"));
            return Answer::Whole(error(500, "internal proxy error", "internal_error"));
        };
        let at = At { instance: i, bs: sh.stats.backend(i), backend };
        at.bs.decision(decision.branch, decision.hit_tokens);
        if let (Some(log), Some(terms)) = (&sh.log, terms) {
            log.write(&Record {
                request: job.number,
                session: keyed.session.as_ref(),
                attempt,
                decision: &decision,
                backend: &at.backend.url,
                input_length: keyed.input_length,
                queue_wait,
                terms,
            });
        }
        let sample = before.filter(|_| attempt == 0);
        match attempt_on(job, req, &decision, at, queue_wait, sample).await {
            Ok(answer) => return answer,
            Err((f, at)) => {
                locked(&sh.router).finish(&job.rid);
                if let Some(a) = &sh.admission {
                    a.wake();
                }
                at.bs.error(f.kind);
                at.failure(sh);
                tried.push(i);
                if f.retry && attempt < sh.config.retries {
                    at.bs.retries.fetch_add(1, Ordering::Relaxed);
                    fail = Some(f);
                    continue;
                }
                return Answer::Whole(f.answer());
            }
        }
    }
    unreachable!("the last attempt answers")
}

/// Bodies at least this long are keyed with the model off the event loop (a tokenizer takes
/// about a microsecond a byte).
const TEXT_INLINE_BYTES: usize = 512;

/// The request's routing inputs: a token-id prompt's by the relay; a text or chat prompt's
/// with the model when there is one (off the event loop for a long body); the rest from the
/// hooks (off the event loop when they may block).
async fn key(sh: &Arc<Shared>, req: &Request, chat: bool) -> Result<Keyed, Refusal> {
    let header = req.header(&sh.config.session_header);
    let c = &sh.config;
    if !chat {
        let session = header.as_deref();
        if let Some(k) =
            super::body::token_prompt(&req.body, c.block_size, c.session_field.as_deref(), session)
        {
            return Ok(k);
        }
    }
    if let Some(model) = &c.text {
        let (model, body, field) = (Arc::clone(model), req.body.clone(), c.session_field.clone());
        let (block_size, session) = (c.block_size, header.clone());
        let keyed = move || {
            super::text::text_prompt(&model, &body, chat, block_size, field.as_deref(), session.as_deref())
        };
        let got = if req.body.len() < TEXT_INLINE_BYTES {
            keyed()
        } else {
            tokio::task::spawn_blocking(keyed).await.ok().flatten()
        };
        if let Some(k) = got {
            return Ok(k);
        }
    }
    if !sh.hooks.key_may_block() {
        return sh.hooks.key(&req.body, chat, header.as_deref());
    }
    let (hooks, body) = (Arc::clone(&sh.hooks), req.body.clone());
    let keyed = tokio::task::spawn_blocking(move || hooks.key(&body, chat, header.as_deref())).await;
    keyed.unwrap_or_else(|_| {
        Err(Refusal { status: 500, body: error_json("internal proxy error", "internal_error", 500) })
    })
}

/// What [`route`] gives.
type Routed = crate::Result<(Decision, Option<Terms>, Option<Before>)>;

/// The chosen engine's counters just before a decision, and when it was taken: a first
/// token's sample ([`super::first_tokens`]).
struct Before {
    load: InstanceLoad,
    at: Instant,
}

/// Route the first attempt: at once, or with admission once an engine has room and the
/// request is the first waiting ([`super::admission`]), with the seconds it waited; the
/// answer instead when refused.
async fn admit(job: &Job, req: &Request) -> Result<(Routed, f64), Response<Out>> {
    let (sh, keyed) = (&*job.sh, &job.keyed);
    let Some(adm) = &sh.admission else {
        return Ok((route(&mut locked(&sh.router), sh, &job.rid, keyed, Target::Any(&[])), 0.0));
    };
    let name = &adm.config.priority_header;
    let priority = match req.header(name) {
        None => 0,
        Some(v) => v.trim().parse::<i64>().map_err(|_| {
            sh.stats.error(ErrorKind::BadRequest);
            let message = format!("the {name} header must be an integer, got {v:?}");
            error(400, &message, "invalid_request_error")
        })?,
    };
    if let Some(h) = keyed.session.as_ref().and_then(|s| adm.take_hold(s)) {
        let mut router = locked(&sh.router);
        if router.takes(h, &keyed.keys, keyed.input_length, adm.held_on(h, keyed.session.as_ref())) {
            return Ok((route(&mut router, sh, &job.rid, keyed, Target::On(h)), 0.0));
        }
    }
    if adm.waiting() == 0 {
        let patient = !adm.config.patience.is_zero();
        if let Some(routed) = try_admit(&mut locked(&sh.router), job, None, patient) {
            return Ok((routed, 0.0));
        }
    }
    let Some(ticket) = adm.enter(priority, keyed.session.as_ref(), &sh.stats) else {
        sh.stats.queue.shed_full.fetch_add(1, Ordering::Relaxed);
        return Err(shed(&format!("the router's queue is full ({} waiting)", adm.config.queue)));
    };
    let deadline = ticket.since + adm.config.max_wait;
    loop {
        let woken = adm.woken(); // before looking: a wake-up after the look is not missed
        let patient = ticket.since.elapsed() < adm.config.patience;
        if let Some(routed) = try_admit(&mut locked(&sh.router), job, Some(&ticket), patient) {
            let waited = ticket.since.elapsed();
            sh.stats.queue.wait.observe(waited);
            return Ok((routed, waited.as_secs_f64()));
        }
        let now = Instant::now();
        if now >= deadline {
            sh.stats.queue.shed_timeout.fetch_add(1, Ordering::Relaxed);
            let waited = adm.config.max_wait.as_secs_f64();
            return Err(shed(&format!("no engine had room within {waited} s")));
        }
        let _ = tokio::time::timeout_at(deadline.min(now + POLL).into(), woken).await;
    }
}

/// Route a request now if admission lets it ([`super::admission`]): to its preferred engine
/// when that has room and no request before it prefers the same one; when `patient` is false
/// and it is first in the queue (or `ticket` is None: nobody waits), to any engine with
/// room; with no engine available at all, at once (to be answered 503 as without admission).
/// An engine has room when it [`Router::takes`] the request besides the rooms (and tokens) it
/// holds for other sessions.
fn try_admit(router: &mut Router, job: &Job, ticket: Option<&Ticket<'_>>, patient: bool) -> Option<Routed> {
    let (sh, k) = (&*job.sh, &job.keyed);
    let adm = sh.admission.as_ref()?;
    let session = k.session.as_ref();
    let room = |router: &Router, i: usize| router.takes(i, &k.keys, k.input_length, adm.held_on(i, session));
    let preferred = router.preferred(&k.keys, k.input_length, session);
    if let Some(t) = ticket {
        t.prefer(preferred);
    }
    let Some(x) = preferred else {
        return Some(route(router, sh, &job.rid, k, Target::Any(&[])));
    };
    if room(router, x) && ticket.is_none_or(|t| t.first_for(x)) {
        return Some(route(router, sh, &job.rid, k, Target::On(x)));
    }
    if patient || !ticket.is_none_or(Ticket::is_first) {
        return None;
    }
    let n = router.num_instances();
    if !(0..n).any(|i| room(router, i)) {
        return None;
    }
    let no_room: Vec<usize> = (0..n).filter(|&i| router.room_on(i) > 0 && !room(router, i)).collect();
    Some(route(router, sh, &job.rid, k, Target::Any(&no_room)))
}

/// 503 with `Retry-After`: the request was not admitted.
fn shed(message: &str) -> Response<Out> {
    let mut r = error(503, message, "service_unavailable");
    r.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Where a request may be routed: any backend but those already tried, or one bound by
/// admission ([`Router::route_on`]).
enum Target<'a> {
    Any(&'a [usize]),
    On(usize),
}

/// Route to `target`; the score terms before it when the decision log wants them, and the
/// chosen engine's counters when first tokens are sampled. The loads are read (copied) only
/// for those two.
fn route(router: &mut Router, sh: &Shared, rid: &Id, k: &Keyed, target: Target<'_>) -> Routed {
    let sampled = sh.config.first_tokens;
    let mut loads = match sampled || sh.log.is_some() {
        true => router.policy_loads_now(),
        false => Vec::new(),
    };
    let terms = sh.log.as_ref().map(|_| Terms::read(router, &loads, &k.keys, k.input_length));
    let (keys, n, session) = (&k.keys, k.input_length, k.session.as_ref());
    let decision = match target {
        Target::On(x) => router.route_on(x, rid.clone(), keys, n, session),
        Target::Any(tried) => router.route_excluding(tried, rid.clone(), keys, n, session),
    }?;
    let before = sampled.then(|| Before {
        load: loads.get_mut(decision.instance).map(std::mem::take).unwrap_or_default(),
        at: Instant::now(),
    });
    Ok((decision, terms, before))
}

/// Send the request to `at`'s backend: the connection and the answer's head.
async fn send(sh: &Shared, req: &Request, at: &At) -> Result<(Box<Upstream>, Response<Incoming>), Fail> {
    let (b, i) = (&at.backend, at.instance);
    let uri: hyper::Uri = format!("{}{}", b.prefix, req.target())
        .parse()
        .map_err(|e| Fail::failed(i, &format!("has no valid URI: {e}")))?;
    let host = HeaderValue::from_str(&b.host)
        .map_err(|_| Fail::failed(i, "has a host name that is not a header value"))?;
    let make = || req.upstream(&uri, &host);
    sh.pool.exchange(&b.address, sh.config.request_timeout, make).await.map_err(|e| fail(i, e))
}

fn fail(b: usize, e: Failure) -> Fail {
    match e {
        Failure::Timeout => Fail::timeout(b),
        Failure::Failed(e) => Fail::failed(b, &format!("failed: {e}")),
    }
}

/// One attempt on one backend: the answer, or why it failed (with the backend, to blame).
async fn attempt_on(
    job: &Job,
    req: &Request,
    decision: &Decision,
    at: At,
    queue_wait: f64,
    sample: Option<Before>,
) -> Result<Answer, (Fail, At)> {
    let sh = &*job.sh;
    let i = at.instance;
    let timeout = sh.config.request_timeout;
    let (mut up, answer) = match send(sh, req, &at).await {
        Ok(got) => got,
        Err(f) => return Err((f, at)),
    };
    let (mut head, mut upstream) = answer.into_parts();
    let status = head.status.as_u16();
    relayed(&mut head.headers);
    head.version = hyper::Version::HTTP_11;
    if RETRY_STATUS.contains(&status) {
        return match up.whole(&mut upstream, timeout).await {
            Ok(body) => {
                sh.pool.release(up);
                let mut f = Fail {
                    kind: ErrorKind::Status,
                    status,
                    message: String::new(),
                    retry: true,
                    answer: None,
                };
                f.answer = Some((body, head.headers));
                Err((f, at))
            }
            Err(e) => Err((fail(i, e), at)),
        };
    }
    let extra = [
        ("x-kvroute-instance", i.to_string()),
        ("x-kvroute-backend", at.backend.url.clone()),
        ("x-kvroute-hit-tokens", decision.hit_tokens.to_string()),
    ];
    let waited = sh.admission.as_ref().map(|_| ("x-kvroute-queue-wait", format!("{queue_wait:.6}")));
    for (k, v) in extra.into_iter().chain(waited) {
        if let Ok(v) = HeaderValue::from_str(&v) {
            head.headers.insert(HeaderName::from_static(k), v);
        }
    }
    let model = status == 200 && sh.config.model_output && job.keyed.tail.is_some();
    if !(job.keyed.stream && status == 200) {
        let body = match up.whole(&mut upstream, timeout).await {
            Ok(body) => body,
            Err(e) => return Err((fail(i, e), at)),
        };
        sh.pool.release(up);
        at.success(sh);
        if model {
            job.record_output(output(&job.sh, body.to_vec(), false).await);
        }
        usage(&at.bs, &body);
        at.bs.e2e.observe(job.t0.elapsed());
        return Ok(Answer::Whole(Response::from_parts(head, full(body))));
    }
    let first = match up.next_data(&mut upstream, timeout).await {
        Ok(Some(first)) => first,
        Ok(None) => return Err((Fail::failed(i, "sent an empty stream"), at)),
        Err(e) => return Err((fail(i, e), at)),
    };
    locked(&sh.router).first_token(&job.rid);
    at.bs.ttft.observe(job.t0.elapsed());
    if let Some(b) = sample {
        let n = job.keyed.input_length;
        let new_prefill = n.saturating_sub(decision.hit_tokens);
        let seconds = b.at.elapsed().as_secs_f64();
        sh.stats.first_tokens.push(FirstToken { load: b.load, new_prefill, input_length: n, seconds });
    }
    at.success(sh);
    Ok(Answer::Stream { head, up, upstream, first, at, model })
}
