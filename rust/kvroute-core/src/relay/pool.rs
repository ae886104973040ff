//! Keep-alive connections to the backends and the side application: hyper's HTTP/1.1 client
//! connections (`hyper::client::conn::http1`), kept per address in [`Pool`], each driven by
//! the task of the request that uses it rather than by a task of its own.
//!
//! Why not hyper-util's pooled client: it gives every connection a task, so each relayed
//! chunk crossed from that task to the client connection's through a channel, and one read
//! off a backend became one write per SSE event; measured on the proxy benchmark, that cost
//! 10-20% more CPU per request than the relay it replaced. Driven inline, a read off the
//! backend and the write to the client are one task's work, and the events one read brought
//! are written together ([`super::stream`]).
//!
//! [`Pool::exchange`] sends a request on the newest idle connection to its address that is
//! still open (an idle connection is polled once, which reads the end a backend sent), or on
//! a new one (connected with a time limit). [`Pool::release`] takes back a connection whose answer was read to
//! its end. A connection dropped anywhere else is closed, which is how a request is cancelled
//! upstream (vLLM aborts a request whose connection closes). Idle connections are closed after
//! the idle timeout (by [`Pool::sweep`], or when next met).
//!
//! O(1) per acquire and release besides the connect; the pool is shared by the relay's tasks
//! (one short lock, never held across an await), a connection belongs to one task at a time.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http1::{Builder, Connection, SendRequest};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use super::connect::{Address, Stream};
use super::request::describe;
use crate::jobs::locked;

/// Why a request got no answer, or an answer no body.
#[derive(Debug)]
pub(super) enum Failure {
    /// No byte within the request timeout.
    Timeout,
    /// No connection, or the connection failed or closed: what happened.
    Failed(String),
}

/// A request's answer head could not be had on a connection; `fresh`: it was new (else it
/// had carried requests).
struct SendError {
    message: String,
    fresh: bool,
}

/// One connection (see the module doc).
pub(super) struct Upstream {
    send: SendRequest<Full<Bytes>>,
    conn: Connection<TokioIo<Stream>, Full<Bytes>>,
    /// The connection future has finished: closed or failed.
    ended: bool,
    gate: Arc<Gate>,
    /// The waker of `gate`.
    waker: Waker,
    address: Address,
    uses: u32,
    idle_since: Instant,
}

/// The waker a connection and its answer's body are polled with: while their task polls
/// them, the wakes they cause each other (data handed over, room made) are dropped, for the
/// task polls them again anyway; at other times a wake (the socket is ready) goes to the
/// task. On the relay's one thread nothing else can wake them while their task runs.
struct Gate {
    open: AtomicBool,
    /// A wake came while closed.
    woken: AtomicBool,
    task: Mutex<Waker>,
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.open.load(Ordering::SeqCst) {
            locked(&self.task).wake_by_ref();
        } else {
            self.woken.store(true, Ordering::SeqCst);
        }
    }
}

impl Upstream {
    /// Let the connection do its I/O (write the request, read the answer into its body), then
    /// poll `what` (the answer's head or body, which the connection feeds; told whether the
    /// connection has ended), through the [`Gate`]. A wake the connection asked for itself
    /// (hyper yields after a long run) is passed on.
    fn feed<T>(
        &mut self,
        cx: &mut Context<'_>,
        what: impl FnOnce(&mut Context<'_>, bool) -> Poll<T>,
    ) -> Poll<T> {
        {
            let mut task = locked(&self.gate.task);
            if !task.will_wake(cx.waker()) {
                task.clone_from(cx.waker());
            }
        }
        self.gate.open.store(false, Ordering::SeqCst);
        self.gate.woken.store(false, Ordering::SeqCst);
        let mut gated = Context::from_waker(&self.waker);
        if !self.ended && Pin::new(&mut self.conn).poll(&mut gated).is_ready() {
            self.ended = true;
        }
        let asked = self.gate.woken.load(Ordering::SeqCst);
        let got = what(&mut gated, self.ended);
        self.gate.open.store(true, Ordering::SeqCst);
        if got.is_pending() && asked {
            cx.waker().wake_by_ref();
        }
        got
    }

    /// Send `req`; the answer's head, the connection driven meanwhile.
    async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, SendError> {
        let fresh = self.uses == 0;
        let mut answer = std::pin::pin!(self.send.send_request(req));
        let got = poll_fn(|cx| {
            self.feed(cx, |cx, ended| match answer.as_mut().poll(cx) {
                Poll::Pending if ended => Poll::Ready(Err("the connection closed".to_string())),
                Poll::Pending => Poll::Pending,
                Poll::Ready(got) => Poll::Ready(got.map_err(|e| describe(&e))),
            })
        })
        .await;
        got.map_err(|message| SendError { message, fresh })
    }

    /// The next frame of `body`, an answer on this connection, the connection driven meanwhile.
    pub fn poll_frame(
        &mut self,
        body: &mut Incoming,
        cx: &mut Context<'_>,
    ) -> Poll<Option<hyper::Result<Frame<Bytes>>>> {
        self.feed(cx, |cx, _| Pin::new(body).poll_frame(cx))
    }

    /// The next data of `body` (None at its end), each wait bounded by `timeout`.
    pub async fn next_data(
        &mut self,
        body: &mut Incoming,
        timeout: Duration,
    ) -> Result<Option<Bytes>, Failure> {
        loop {
            let frame = poll_fn(|cx| self.poll_frame(body, cx));
            match tokio::time::timeout(timeout, frame).await {
                Err(_) => return Err(Failure::Timeout),
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => return Err(Failure::Failed(describe(&e))),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Ok(Some(data)),
                    _ => {}
                },
            }
        }
    }

    /// The whole of `body`, each wait bounded by `timeout`.
    pub async fn whole(&mut self, body: &mut Incoming, timeout: Duration) -> Result<Bytes, Failure> {
        let mut out = Vec::new();
        while let Some(data) = self.next_data(body, timeout).await? {
            out.extend_from_slice(&data);
        }
        Ok(out.into())
    }

    /// Whether it can take another request now (its last answer was read to the end).
    fn reusable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        if !self.ended && Pin::new(&mut self.conn).poll(&mut cx).is_ready() {
            self.ended = true;
        }
        !self.ended && matches!(self.send.poll_ready(&mut cx), Poll::Ready(Ok(())))
    }
}

/// Idle connections per address (see the module doc).
pub(super) struct Pool {
    /// Boxed: a connection (about 1 KB) moves between the pool and its requests as a pointer.
    #[allow(clippy::vec_box)]
    idle: Mutex<HashMap<Address, Vec<Box<Upstream>>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl Pool {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self { idle: Mutex::new(HashMap::new()), connect_timeout, idle_timeout }
    }

    /// Send the request `make` builds to `address`: the connection and the answer's head,
    /// within `timeout` of sending. A connection that had carried requests and closes before
    /// answering (the backend was closing it as the request went out) is replaced once by a
    /// new one.
    pub async fn exchange(
        &self,
        address: &Address,
        timeout: Duration,
        make: impl Fn() -> Request<Full<Bytes>>,
    ) -> Result<(Box<Upstream>, Response<Incoming>), Failure> {
        let mut fresh = false;
        loop {
            let mut up = self.acquire(address, fresh).await?;
            match tokio::time::timeout(timeout, up.send(make())).await {
                Err(_) => return Err(Failure::Timeout),
                Ok(Ok(answer)) => return Ok((up, answer)),
                Ok(Err(e)) if !e.fresh => fresh = true,
                Ok(Err(e)) => return Err(Failure::Failed(e.message)),
            }
        }
    }

    /// A connection to `address`: the newest idle one still open (unless `fresh`), else a
    /// new one.
    async fn acquire(&self, address: &Address, fresh: bool) -> Result<Box<Upstream>, Failure> {
        loop {
            if fresh {
                break;
            }
            let got = locked(&self.idle).get_mut(address).and_then(Vec::pop);
            let Some(mut up) = got else { break };
            if up.idle_since.elapsed() < self.idle_timeout && up.reusable() {
                return Ok(up);
            }
        }
        let stream = Stream::connect(address, self.connect_timeout)
            .await
            .map_err(|e| Failure::Failed(format!("cannot connect to {address}: {e}")))?;
        let (send, conn) = Builder::new()
            .max_headers(1000)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::Failed(e.to_string()))?;
        let task = Mutex::new(Waker::noop().clone());
        let gate = Arc::new(Gate { open: AtomicBool::new(true), woken: AtomicBool::new(false), task });
        Ok(Box::new(Upstream {
            send,
            conn,
            ended: false,
            waker: Waker::from(Arc::clone(&gate)),
            gate,
            address: address.clone(),
            uses: 0,
            idle_since: Instant::now(),
        }))
    }

    /// Take back a connection whose answer was read to its end (one that cannot take another
    /// request is closed).
    pub fn release(&self, mut up: Box<Upstream>) {
        if up.reusable() {
            up.uses += 1;
            up.idle_since = Instant::now();
            locked(&self.idle).entry(up.address.clone()).or_default().push(up);
        }
    }

    /// Close connections idle for longer than the limit.
    pub fn sweep(&self) {
        let limit = self.idle_timeout;
        let mut idle = locked(&self.idle);
        for conns in idle.values_mut() {
            conns.retain(|up| up.idle_since.elapsed() < limit);
        }
        idle.retain(|_, conns| !conns.is_empty());
    }

    /// Close every idle connection.
    pub fn clear(&self) {
        locked(&self.idle).clear();
    }
}
