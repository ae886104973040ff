//! Keep-alive HTTP/1.1 connections from the relay to its backends, and one response read
//! off such a connection as it arrives.
//!
//! [`Pool`] keeps idle connections per address, newest first; one idle for longer than its
//! limit, or that the backend has closed (seen by a zero-time poll), is dropped instead of
//! handed out. [`Exchange`] sends one request and reads its response: the head (interim 1xx
//! answers skipped), then the body piece by piece, each wait bounded by the read timeout
//! (which restarts with every byte) and watching the client's socket meanwhile, so a client
//! that hangs up ends the wait at once. A response that ended cleanly on a connection the
//! backend keeps open goes back to the pool.
//!
//! O(bytes) per response; the pool is shared by all connection threads (one short lock per
//! acquire and release), an exchange belongs to one thread.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::io::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::http::{head_end, parse_response_head, BodyReader, HttpError, ResponseHead, MAX_HEAD};
use super::io::{wait, Address, Ready, Stream};

const READ_SIZE: usize = 64 << 10;

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
    pub fn acquire(&self, address: &Address, fresh: bool) -> io::Result<Upstream> {
        if !fresh {
            loop {
                let got = super::lock(&self.idle).get_mut(address).and_then(Vec::pop);
                let Some(up) = got else { break };
                if up.idle_since.elapsed() < self.idle_timeout && !closed_by_peer(&up.stream) {
                    return Ok(up);
                }
            }
        }
        let stream = Stream::connect(address, self.connect_timeout)?;
        Ok(Upstream { stream, address: address.clone(), uses: 0, idle_since: Instant::now() })
    }

    fn release(&self, mut up: Upstream) {
        up.uses += 1;
        up.idle_since = Instant::now();
        super::lock(&self.idle).entry(up.address.clone()).or_default().push(up);
    }

    /// Close connections idle for longer than the limit.
    pub fn sweep(&self) {
        let limit = self.idle_timeout;
        let mut idle = super::lock(&self.idle);
        for conns in idle.values_mut() {
            conns.retain(|up| up.idle_since.elapsed() < limit);
        }
        idle.retain(|_, conns| !conns.is_empty());
    }

    /// Close every idle connection.
    pub fn clear(&self) {
        super::lock(&self.idle).clear();
    }
}

/// An idle connection with something to read has been closed (or sent junk): unusable.
fn closed_by_peer(stream: &Stream) -> bool {
    !matches!(wait(stream.as_raw_fd(), None, Instant::now() + Duration::from_millis(0)), Ok(Ready::Timeout))
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
/// (pipelined requests) are kept in `pending`, up to `cap` bytes; its end is [`ReadError::ClientGone`].
#[derive(Debug)]
pub struct Watch<'a> {
    /// The client (None: not watched).
    pub client: Option<&'a TcpStream>,
    /// Bytes read from it meanwhile.
    pub pending: &'a mut Vec<u8>,
    /// Stop watching once this much is pending.
    pub cap: usize,
}

impl Watch<'_> {
    fn readable(&mut self) -> Result<(), ReadError> {
        let Some(mut client) = self.client else { return Ok(()) };
        let mut buf = [0u8; 4096];
        match client.read(&mut buf) {
            Ok(0) => Err(ReadError::ClientGone),
            Ok(n) => {
                self.pending.extend_from_slice(&buf[..n]);
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
    keep: bool,
    done: bool,
    bodiless: bool,
}

impl Exchange {
    /// Write a request (`data`: head and body) on `up`. `bodiless`: the answer has no body
    /// whatever its headers say (a `HEAD` request).
    pub fn send(mut up: Upstream, data: &[u8], bodiless: bool) -> (Self, io::Result<()>) {
        let sent = up.stream.write_all(data);
        let ex = Self { up, received: 0, buf: Vec::new(), reader: None, keep: true, done: false, bodiless };
        (ex, sent)
    }

    /// Whether the connection had carried earlier requests.
    pub fn reused(&self) -> bool {
        self.up.uses > 0
    }

    fn fill(&mut self, watch: &mut Watch<'_>, timeout: Duration) -> Result<usize, ReadError> {
        let deadline = Instant::now() + timeout;
        loop {
            let client = watch.client.map(AsRawFd::as_raw_fd);
            match wait(self.up.stream.as_raw_fd(), client, deadline)? {
                Ready::Timeout => return Err(ReadError::Timeout),
                Ready::Second => watch.readable()?,
                Ready::First => {
                    let start = self.buf.len();
                    self.buf.resize(start + READ_SIZE, 0);
                    let got = self.up.stream.read(&mut self.buf[start..]);
                    let n = *got.as_ref().unwrap_or(&0);
                    self.buf.truncate(start + n);
                    match got {
                        Ok(n) => {
                            self.received += n;
                            return Ok(n);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }

    /// The response head (after any interim answers).
    pub fn head(&mut self, watch: &mut Watch<'_>, timeout: Duration) -> Result<ResponseHead, ReadError> {
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
            if self.fill(watch, timeout)? == 0 {
                return Err(ReadError::Closed);
            }
        }
    }

    /// Body bytes as they come, appended to `out`: returns once some are there or the body
    /// is complete (true).
    pub fn body(
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
            if self.fill(watch, timeout)? == 0 {
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
    pub fn whole_body(&mut self, watch: &mut Watch<'_>, timeout: Duration) -> Result<Vec<u8>, ReadError> {
        let mut out = Vec::new();
        while !self.body(watch, timeout, &mut out)? {}
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
