//! A streamed answer on its way to the client: [`Relayed`], the body that hyper's server
//! writes out as the backend's body yields it, with nothing held back, and that keeps the
//! request's books as it goes.
//!
//! The backend's connection is driven from here (`super::pool`), and the data frames it has
//! ready go out as one frame, so that what one read off the backend brought is one write to
//! the client. The wait for the next bytes is bounded by the request timeout (restarted by
//! every frame); a backend that fails or stalls mid-stream ends the client's stream with an
//! SSE error event. Once the stream's `data: [DONE]` is in, the request is complete: the
//! blocks its output completed are recorded in the router before the client sees the event
//! (when modelled), and a client or backend that goes away after it changes nothing but the
//! connections. A body dropped before that (the client hung up; hyper drops the body) counts
//! a client disconnect and closes the backend's connection (vLLM then aborts the request).
//! A connection whose answer was read to its end goes back to the pool. Whatever way the
//! stream ends, the request's [`Job`] drops with it and finishes the request in the router.
//!
//! O(bytes) per stream (the tail kept for the usage is bounded; the output kept for the
//! router is at most 16 MiB); one body per request, polled by its connection's task.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use hyper::body::Incoming;
use hyper::body::{Body, Frame};
use tokio::time::Sleep;

use super::job::{output, At, Job, Output, MAX_OUTPUT};
use super::pool::Upstream;
use super::reply::error_json;
use super::stats::ErrorKind;
use super::usage::{usage, Tail};

/// A streamed answer (see the module doc).
pub(super) struct Relayed {
    job: Job,
    at: At,
    /// The backend's connection (None once given back to the pool) and its answer's body.
    up: Option<Box<Upstream>>,
    upstream: Incoming,
    /// The first data frame, read before the answer began, until it is sent.
    first: Option<Bytes>,
    tail: Tail,
    /// The answer so far, while its output is modelled.
    kept: Option<Vec<u8>>,
    /// The output being read off the whole answer, and the frame held back meanwhile.
    reading: Option<(Output, Bytes)>,
    timer: Pin<Box<Sleep>>,
    last: Instant,
    timeout: Duration,
    /// The stream has ended (cleanly, or with an error event): nothing more to send.
    ended: bool,
    /// Data frames in from the backend, not yet sent (see [`Relayed::gather`]).
    batch: Vec<Bytes>,
    /// The backend's body has ended, or failed, after the data gathered with it.
    upstream_done: bool,
    upstream_failed: Option<String>,
}

impl Relayed {
    /// The stream whose first data frame `first` was read off `upstream`; `model`: keep the
    /// answer to record its output's blocks.
    pub(super) fn new(
        job: Job,
        at: At,
        (up, upstream): (Box<Upstream>, Incoming),
        first: Bytes,
        model: bool,
    ) -> Self {
        let timeout = job.sh.config.request_timeout;
        let mut r = Relayed {
            job,
            at,
            up: Some(up),
            upstream,
            first: None,
            tail: Tail::default(),
            kept: model.then(Vec::new),
            reading: None,
            timer: Box::pin(tokio::time::sleep(timeout)),
            last: Instant::now(),
            timeout,
            ended: false,
            batch: Vec::new(),
            upstream_done: false,
            upstream_failed: None,
        };
        match r.take(first) {
            Frame1::Send(data) => r.first = Some(data),
            Frame1::Held => {}
        }
        r
    }

    /// A data frame from the backend: into the tail and the kept answer; held back when the
    /// answer's output must be read first.
    fn take(&mut self, data: Bytes) -> Frame1 {
        self.last = Instant::now();
        self.tail.push(&data);
        let Some(kept) = self.kept.as_mut() else { return Frame1::Send(data) };
        kept.extend_from_slice(&data);
        if kept.len() > MAX_OUTPUT {
            self.kept = None; // too long to keep: this answer's output is not modelled
        } else if self.tail.ended() {
            let answer = self.kept.take().unwrap_or_default();
            self.reading = Some((output(&self.job.sh, answer, true), data));
            return Frame1::Held;
        }
        Frame1::Send(data)
    }

    /// The backend's body ended (cleanly or after `[DONE]`): the request is complete.
    fn complete(&mut self) {
        self.ended = true;
        usage(&self.at.bs, self.tail.bytes());
        self.at.bs.e2e.observe(self.job.t0.elapsed());
        self.job.settle();
    }

    /// The backend failed or stalled mid-stream: the error event that ends the stream.
    fn failed(&mut self, timeout: bool, what: &str) -> Bytes {
        self.ended = true;
        self.at.bs.error(if timeout { ErrorKind::Timeout } else { ErrorKind::Midstream });
        self.at.failure(&self.job.sh);
        self.job.settle();
        let err = error_json(&format!("backend {} {what} mid-stream", self.at.instance), "bad_gateway", 502);
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&err);
        event.extend_from_slice(b"\n\n");
        event.into()
    }
}

enum Frame1 {
    Send(Bytes),
    Held,
}

type Polled = Poll<Option<Result<Frame<Bytes>, hyper::Error>>>;

/// What the backend's body had ready.
enum Gathered {
    /// Data, coalesced.
    Data(Bytes),
    /// Its end, with nothing before it.
    End,
    /// A failure, with nothing before it.
    Failed(String),
    /// Nothing yet.
    Pending,
}

impl Relayed {
    /// The data frames the backend's body has ready, as one: what one read off the backend
    /// brought goes to the client in one write (the connection is driven here, so each frame
    /// it decodes is taken at once, until its socket has nothing more).
    fn gather(&mut self, cx: &mut Context<'_>) -> Gathered {
        let Some(up) = self.up.as_mut() else { return Gathered::End };
        loop {
            match up.poll_frame(&mut self.upstream, cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() {
                            self.batch.push(data);
                        }
                    }
                }
                Poll::Ready(None) => {
                    self.upstream_done = true;
                    if let Some(up) = self.up.take() {
                        self.job.sh.pool.release(up);
                    }
                    break;
                }
                Poll::Ready(Some(Err(e))) if self.batch.is_empty() => return Gathered::Failed(e.to_string()),
                Poll::Ready(Some(Err(e))) => {
                    self.upstream_failed = Some(e.to_string());
                    break;
                }
                Poll::Pending if self.batch.is_empty() => return Gathered::Pending,
                Poll::Pending => break,
            }
        }
        match self.batch.len() {
            0 => Gathered::End,
            1 => Gathered::Data(self.batch.pop().unwrap_or_default()),
            _ => {
                let mut all = BytesMut::with_capacity(self.batch.iter().map(Bytes::len).sum());
                for data in self.batch.drain(..) {
                    all.extend_from_slice(&data);
                }
                Gathered::Data(all.freeze())
            }
        }
    }
}

impl Body for Relayed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = self.get_mut();
        if let Some(data) = this.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        loop {
            if let Some((reading, _)) = this.reading.as_mut() {
                let got = std::task::ready!(Pin::new(reading).poll(cx));
                let (_, data) = this.reading.take().expect("reading");
                this.job.record_output(got);
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let failed = this.upstream_failed.take();
            let got = match failed {
                Some(e) => Gathered::Failed(e),
                None if this.upstream_done => Gathered::End,
                None => this.gather(cx),
            };
            match got {
                Gathered::Data(data) => match this.take(data) {
                    Frame1::Send(data) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Frame1::Held => {}
                },
                Gathered::End => {
                    this.complete();
                    return Poll::Ready(None);
                }
                Gathered::Failed(_) if this.tail.ended() => {
                    this.complete();
                    return Poll::Ready(None);
                }
                Gathered::Failed(e) => {
                    let event = this.failed(false, &format!("failed: {e}"));
                    return Poll::Ready(Some(Ok(Frame::data(event))));
                }
                Gathered::Pending => loop {
                    std::task::ready!(this.timer.as_mut().poll(cx));
                    let due = this.last + this.timeout;
                    if Instant::now() >= due {
                        let event = this.failed(true, "timed out");
                        return Poll::Ready(Some(Ok(Frame::data(event))));
                    }
                    this.timer.as_mut().reset(due.into());
                },
            }
        }
    }

    /// The backend's body has ended and everything is sent: hyper ends the client's stream
    /// with the last data (the books are kept when the body drops).
    fn is_end_stream(&self) -> bool {
        (self.ended || self.upstream_done) && self.first.is_none() && self.reading.is_none()
    }
}

impl Drop for Relayed {
    /// The stream is dropped (sent, or the client hung up): the job drops with it.
    fn drop(&mut self) {
        // Complete: the backend's body ended, or the client hung up after `[DONE]`.
        if !self.ended && (self.upstream_done || self.tail.ended()) {
            self.complete();
        }
    }
}
