//! One client connection: requests read one at a time (keep-alive; pipelined requests wait
//! their turn), refusals of what cannot be served, and the answer writer the forwarder uses.
//!
//! Refused with an OpenAI-style JSON error and a closed connection: a malformed head or
//! chunked body (400), smuggling shapes (400), codings other than chunked (501), a head over
//! 64 KiB (431), a body over the limit (413, before reading it when announced), HTTP/2 (505).
//! `Expect: 100-continue` is answered; HTTP/1.0 clients get streams delimited by the
//! connection's end. Requests other than the two generation endpoints go to the side
//! application.
//!
//! O(bytes) per request; one task per connection.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::http::{chunk, head_end, parse_request_head, response_head, BodyReader, HttpError, RequestHead};
use super::http::{LAST_CHUNK, MAX_HEAD};
use super::upstream::{Exchange, ReadError, Watch};
use super::Shared;

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Request headers not forwarded (hop-by-hop, framing, and compression).
pub(super) const HOP: [&str; 12] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "expect",
    "accept-encoding",
];
/// Answer headers not relayed (the relay frames its own answers).
pub(super) const DROP: [&str; 4] = ["connection", "keep-alive", "transfer-encoding", "content-length"];

/// One request: head, whole body, and when its head was read.
pub(super) struct Request {
    pub head: RequestHead,
    pub body: Vec<u8>,
    pub t0: Instant,
}

/// `headers` but those named in `names` (lower-case).
pub(super) fn without<'a>(headers: &'a [(String, String)], names: &[&str]) -> Vec<(&'a str, &'a str)> {
    headers
        .iter()
        .filter(|(k, _)| !names.iter().any(|n| k.eq_ignore_ascii_case(n)))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// An upstream request: head and body.
pub(super) fn upstream_request(
    method: &str,
    target: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + body.len());
    let _ = write!(out, "{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        out.extend(k.bytes());
        out.extend_from_slice(b": ");
        out.extend(v.chars().map(|c| u8::try_from(u32::from(c)).unwrap_or(b'?')));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Appends `s` as a JSON string; `ascii`: escape non-ASCII as `\uXXXX` (as Python's `json`).
pub(super) fn json_str(s: &str, ascii: bool, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => {
                let mut b = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// An OpenAI-style error body.
pub(super) fn error_json(message: &str, kind: &str, code: u16) -> Vec<u8> {
    let mut out = b"{\"error\":{\"message\":".to_vec();
    json_str(message, false, &mut out);
    out.extend_from_slice(b",\"type\":");
    json_str(kind, false, &mut out);
    let _ = write!(out, ",\"param\":null,\"code\":{code}}}}}");
    out
}

/// The answer to a client (see the module doc); a write that fails (or stalls for the
/// request timeout) marks the client gone.
pub(super) struct Down<'a> {
    stream: &'a mut OwnedWriteHalf,
    http11: bool,
    pub keep: bool,
    /// 0: not begun, 1: streaming, 2: complete.
    state: u8,
    pub gone: bool,
    out: Vec<u8>,
    limit: std::time::Duration,
}

impl<'a> Down<'a> {
    fn new(stream: &'a mut OwnedWriteHalf, head: &RequestHead, limit: std::time::Duration) -> Self {
        let (http11, keep) = (head.version >= (1, 1), head.keep_alive());
        Self { stream, http11, keep, state: 0, gone: false, out: Vec::new(), limit }
    }

    pub fn complete(&self) -> bool {
        self.state == 2
    }

    async fn put(&mut self) {
        if !self.gone {
            let sent = tokio::time::timeout(self.limit, self.stream.write_all(&self.out)).await;
            self.gone = !matches!(sent, Ok(Ok(())));
        }
        self.out.clear();
    }

    /// A whole answer; `length` stands for `len(body)` (an answer to `HEAD`).
    pub async fn send(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8], length: Option<&str>) {
        let n = body.len().to_string();
        let mut all = headers.to_vec();
        all.push(("content-length", length.unwrap_or(&n)));
        if !self.keep {
            all.push(("connection", "close"));
        }
        response_head(status, &all, &mut self.out);
        self.out.extend_from_slice(body);
        self.state = 2;
        self.put().await;
    }

    /// A whole JSON answer.
    pub async fn send_json(&mut self, status: u16, body: &[u8]) {
        self.send(status, &[("content-type", "application/json")], body, None).await;
    }

    /// Begin a streamed answer with its first body bytes.
    pub async fn start(&mut self, status: u16, headers: &[(&str, &str)], first: &[u8]) {
        let mut all = headers.to_vec();
        if self.http11 {
            all.push(("transfer-encoding", "chunked"));
            response_head(status, &all, &mut self.out);
            chunk(first, &mut self.out);
        } else {
            self.keep = false;
            all.push(("connection", "close"));
            response_head(status, &all, &mut self.out);
            self.out.extend_from_slice(first);
        }
        self.state = 1;
        self.put().await;
    }

    /// More body bytes of a streamed answer; `end`: the last.
    pub async fn write(&mut self, data: &[u8], end: bool) {
        if self.state != 1 {
            return;
        }
        if self.http11 {
            chunk(data, &mut self.out);
            if end {
                self.out.extend_from_slice(LAST_CHUNK);
            }
        } else {
            self.out.extend_from_slice(data);
        }
        if end {
            self.state = 2;
        }
        if !self.out.is_empty() {
            self.put().await;
        }
    }
}

/// Serve one client connection until it closes, idles out, or the relay stops.
pub(super) async fn serve(sh: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let mut stop = sh.stop.subscribe();
    let mut pending = Vec::new();
    loop {
        if stop.borrow().is_some() {
            return;
        }
        let req = tokio::select! {
            req = read_request(&sh, &mut rd, &mut wr, &mut pending) => req,
            _ = stop.changed() => return,
        };
        let req = match req {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) => {
                refuse(&mut wr, &e).await;
                return;
            }
        };
        let mut down = Down::new(&mut wr, &req.head, sh.config.request_timeout);
        let path = req.head.path();
        if req.head.method == "POST" && matches!(path, "/v1/completions" | "/v1/chat/completions") {
            let chat = path == "/v1/chat/completions";
            super::forward::forward(&sh, &req, &mut down, watch(&sh, &mut rd, &mut pending), chat).await;
        } else {
            to_side(&sh, &req, &mut down, watch(&sh, &mut rd, &mut pending)).await;
        }
        if !down.complete() || !down.keep || down.gone {
            return;
        }
    }
}

/// More bytes from the client into `buf`; false at its end, an error, or the idle timeout.
async fn read_more(sh: &Shared, rd: &mut OwnedReadHalf, buf: &mut Vec<u8>) -> bool {
    buf.reserve(16 << 10);
    matches!(tokio::time::timeout(sh.config.idle_timeout, rd.read_buf(buf)).await, Ok(Ok(n)) if n > 0)
}

/// The next request (None: the client closed or idled out).
async fn read_request(
    sh: &Shared,
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    buf: &mut Vec<u8>,
) -> Result<Option<Request>, HttpError> {
    let max_body = sh.config.max_body;
    let end = loop {
        let blank = buf.iter().take_while(|&&b| b == b'\r' || b == b'\n').count();
        buf.drain(..blank);
        match head_end(buf) {
            Some(end) if end > MAX_HEAD => {
                return Err(HttpError::new(431, "the request head exceeds 64 KiB"))
            }
            Some(end) => break end,
            None if buf.len() > MAX_HEAD => {
                return Err(HttpError::new(431, "the request head exceeds 64 KiB"))
            }
            None if !read_more(sh, rd, buf).await => return Ok(None),
            None => {}
        }
    };
    let head = parse_request_head(&buf[..end])?;
    let mut reader = BodyReader::for_request(&head)?;
    buf.drain(..end + 4);
    let too_big = || HttpError::new(413, format!("the request body exceeds {max_body} bytes"));
    if head.get("content-length").and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n > max_body as u64) {
        return Err(too_big());
    }
    let t0 = Instant::now();
    let expect = head.get("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
    if expect && !reader.done() && buf.is_empty() {
        let _ = wr.write_all(CONTINUE).await;
    }
    let mut body = Vec::new();
    loop {
        let used = reader.feed(buf, &mut body)?;
        buf.drain(..used);
        if body.len() > max_body {
            return Err(too_big());
        }
        if reader.done() {
            return Ok(Some(Request { head, body, t0 }));
        }
        if !read_more(sh, rd, buf).await {
            return Ok(None);
        }
    }
}

async fn refuse(wr: &mut OwnedWriteHalf, e: &HttpError) {
    let kind = if e.status == 505 { "not_supported" } else { "invalid_request_error" };
    let body = error_json(&e.message, kind, e.status);
    let n = body.len().to_string();
    let mut out = Vec::new();
    let headers = [("content-type", "application/json"), ("content-length", &n), ("connection", "close")];
    response_head(e.status, &headers, &mut out);
    out.extend_from_slice(&body);
    let _ = wr.write_all(&out).await;
}

/// The client's socket watched while an upstream answer is awaited.
fn watch<'a>(sh: &Shared, rd: &'a mut OwnedReadHalf, pending: &'a mut Vec<u8>) -> Watch<'a> {
    Watch { client: Some(rd), pending, cap: MAX_HEAD + sh.config.max_body }
}

/// Relay a request to the side application and its answer back.
async fn to_side(sh: &Shared, req: &Request, down: &mut Down<'_>, mut w: Watch<'_>) {
    let headers = without(&req.head.headers, &HOP);
    let data = upstream_request(&req.head.method, &req.head.target, "kvroute", &headers, &req.body);
    let bodiless = req.head.method == "HEAD";
    let got = async {
        let up = sh.pool.acquire(&sh.config.side, false).await?;
        let (mut ex, sent) = Exchange::send(up, &data, bodiless).await;
        sent?;
        let head = ex.head(&mut w, sh.config.request_timeout).await?;
        let body = ex.whole_body(&mut w, sh.config.request_timeout).await?;
        Ok::<_, ReadError>((ex, head, body))
    };
    match got.await {
        Ok((ex, head, body)) => {
            ex.finish(&sh.pool);
            let length = head.get("content-length").unwrap_or("0").to_string();
            let relayed = without(&head.headers, &DROP);
            down.send(head.status, &relayed, &body, bodiless.then_some(length.as_str())).await;
        }
        Err(ReadError::ClientGone) => down.gone = true,
        Err(e) => {
            sh.hooks.log_error(&format!("the proxy's side application failed: {e}"));
            down.send_json(502, &error_json("internal proxy error", "internal_error", 502)).await;
        }
    }
}
