//! Keep-alive HTTP/1.1 connections from the relay to its backends, and one response read
//! off such a connection as it arrives.
//!
//! [`Pool`] keeps idle connections per address, newest first; one idle for longer than its
//! limit, or that the backend has closed (a non-blocking read sees its end), is dropped instead of
//! handed out. [`Exchange`] sends one request and reads its response: the head (interim 1xx
//! answers skipped), then the body piece by piece, each wait bounded by the read timeout
//! (which restarts with every byte) and watching the client's socket meanwhile, so a client
//! that hangs up ends the wait at once. A response that ended cleanly on a connection the
//! backend keeps open goes back to the pool.
//!
//! O(bytes) per response; the pool is shared by the relay's tasks (one short lock per
//! acquire and release, never held across an await), an exchange belongs to one task.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::time::Sleep;

use super::http::{head_end, parse_response_head, BodyReader, HttpError, ResponseHead, MAX_HEAD};
use super::io::{Address, Stream};
use crate::jobs::locked;

const READ_SIZE: usize = 16 << 10;

/// One connection to a backend.
#[derive(Debug)]
pub struct Upstream {
    stream: Stream,
    address: Address,
    /// Requests sent on it before the current one.
    uses: u32,
    idle_since: Instant,
}

/// Idle connections per address (see the module doc).
#[derive(Debug)]
pub struct Pool {
    idle: Mutex<HashMap<Address, Vec<Upstream>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl Pool {
    /// An empty pool.
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self { idle: Mutex::new(HashMap::new()), connect_timeout, idle_timeout }
    }

    /// A connection to `address`: the newest live idle one (unless `fresh`), else a new one.
    pub async fn acquire(&self, address: &Address, fresh: bool) -> io::Result<Upstream> {
        if !fresh {
            loop {
                let got = locked(&self.idle).get_mut(address).and_then(Vec::pop);
                let Some(up) = got else { break };
                if up.idle_since.elapsed() < self.idle_timeout && !up.stream.closed_by_peer() {
                    return Ok(up);
                }
            }
        }
        let stream = Stream::connect(address, self.connect_timeout).await?;
        Ok(Upstream { stream, address: address.clone(), uses: 0, idle_since: Instant::now() })
    }

    fn release(&self, mut up: Upstream) {
        up.uses += 1;
        up.idle_since = Instant::now();
        locked(&self.idle).entry(up.address.clone()).or_default().push(up);
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

/// Why a response could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// No byte from the backend within the read timeout.
    Timeout,
    /// The client hung up while we waited.
    ClientGone,
    /// The backend closed the connection before the response was complete.
    Closed,
    /// A socket error.
    Io(io::Error),
    /// A malformed response.
    Http(HttpError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Timeout => write!(f, "timed out"),
            ReadError::ClientGone => write!(f, "the client disconnected"),
            ReadError::Closed => write!(f, "the backend closed the connection"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Http(e) => write!(f, "{e}"),
        }
    }
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl From<HttpError> for ReadError {
    fn from(e: HttpError) -> Self {
        ReadError::Http(e)
    }
}

/// The client's socket, watched while a response is awaited: bytes it sends meanwhile
/// (pipelined requests) are kept in `pending`, up to `cap` bytes; its end is
/// [`ReadError::ClientGone`].
#[derive(Debug)]
pub struct Watch<'a> {
    /// The client's reading side (None: not watched).
    pub client: Option<&'a mut OwnedReadHalf>,
    /// Bytes read from it meanwhile.
    pub pending: &'a mut Vec<u8>,
    /// Stop watching once this much is pending.
    pub cap: usize,
}

impl Watch<'_> {
    /// Wait for the client's next bytes (never returns when not watching).
    async fn readable(&mut self) -> Result<(), ReadError> {
        let Some(client) = self.client.as_mut() else { return std::future::pending().await };
        match client.read_buf(self.pending).await {
            Ok(0) => Err(ReadError::ClientGone),
            Ok(_) => {
                if self.pending.len() > self.cap {
                    self.client = None;
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(_) => Err(ReadError::ClientGone),
        }
    }
}

/// One request and its response on an upstream connection (see the module doc).
#[derive(Debug)]
pub struct Exchange {
    up: Upstream,
    /// Response bytes received so far.
    pub received: usize,
    buf: Vec<u8>,
    reader: Option<BodyReader>,
    /// The read timeout's timer, and when the last byte came (or the request went out).
    deadline: Option<Pin<Box<Sleep>>>,
    last_byte: Instant,
    keep: bool,
    done: bool,
    bodiless: bool,
}

impl Exchange {
    /// Write a request (`data`: head and body) on `up`. `bodiless`: the answer has no body
    /// whatever its headers say (a `HEAD` request).
    pub async fn send(mut up: Upstream, data: &[u8], bodiless: bool) -> (Self, io::Result<()>) {
        let sent = up.stream.write_all(data).await;
        let ex = Self {
            up,
            received: 0,
            buf: Vec::new(),
            reader: None,
            deadline: None,
            last_byte: Instant::now(),
            keep: true,
            done: false,
            bodiless,
        };
        (ex, sent)
    }

    /// Whether the connection had carried earlier requests.
    pub fn reused(&self) -> bool {
        self.up.uses > 0
    }

    /// Read more of the response into `buf`. The read timeout restarts with every byte; its
    /// timer is set once per exchange and moved on only when it fires early.
    async fn fill(&mut self, watch: &mut Watch<'_>, timeout: Duration) -> Result<usize, ReadError> {
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        self.buf.reserve(READ_SIZE);
        loop {
            let watching = watch.client.is_some();
            tokio::select! {
                biased;
                got = self.up.stream.read_buf(&mut self.buf) => match got {
                    Ok(n) => {
                        self.received += n;
                        self.last_byte = Instant::now();
                        return Ok(n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                },
                got = watch.readable(), if watching => got?,
                () = deadline.as_mut() => {
                    let due = self.last_byte + timeout;
                    if Instant::now() >= due {
                        return Err(ReadError::Timeout);
                    }
                    deadline.as_mut().reset(due.into());
                }
            }
        }
    }

    /// The response head (after any interim answers).
    pub async fn head(
        &mut self,
        watch: &mut Watch<'_>,
        timeout: Duration,
    ) -> Result<ResponseHead, ReadError> {
        loop {
            if let Some(end) = head_end(&self.buf) {
                let head = parse_response_head(&self.buf[..end])?;
                self.buf.drain(..end + 4);
                if head.status < 200 {
                    continue;
                }
                self.keep = head.keep_alive();
                self.reader =
                    Some(if self.bodiless { BodyReader::none() } else { BodyReader::for_response(&head)? });
                return Ok(head);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(HttpError::new(502, "response head too long").into());
            }
            if self.fill(watch, timeout).await? == 0 {
                return Err(ReadError::Closed);
            }
        }
    }

    /// Body bytes as they come, appended to `out`: returns once some are there or the body
    /// is complete (true).
    pub async fn body(
        &mut self,
        watch: &mut Watch<'_>,
        timeout: Duration,
        out: &mut Vec<u8>,
    ) -> Result<bool, ReadError> {
        let start = out.len();
        loop {
            let reader = self.reader.as_mut().expect("body() follows head()");
            if !self.buf.is_empty() && !reader.done() {
                let used = reader.feed(&self.buf, out)?;
                self.buf.drain(..used);
            }
            if reader.done() {
                self.done = true;
                return Ok(true);
            }
            if out.len() > start {
                return Ok(false);
            }
            if self.fill(watch, timeout).await? == 0 {
                let reader = self.reader.as_mut().expect("body() follows head()");
                if reader.eof().is_err() {
                    return Err(ReadError::Closed);
                }
                self.keep = false;
                self.done = true;
                return Ok(true);
            }
        }
    }

    /// The whole body.
    pub async fn whole_body(
        &mut self,
        watch: &mut Watch<'_>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ReadError> {
        let mut out = Vec::new();
        while !self.body(watch, timeout, &mut out).await? {}
        Ok(out)
    }

    /// Hand the connection back to `pool` when the response ended cleanly and the backend
    /// keeps it open; otherwise close it (mid-response: the backend sees the request
    /// cancelled).
    pub fn finish(self, pool: &Pool) {
        if self.done && self.keep && self.buf.is_empty() {
            pool.release(self.up);
        }
    }
}
