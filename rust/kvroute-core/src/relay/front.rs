//! One client connection: requests read one at a time (keep-alive; pipelined requests wait
//! their turn), refusals of what cannot be served, and the relay of everything but the
//! generation endpoints to the side application.
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

use super::http::{head_end, parse_request_head, BodyReader, HttpError, RequestHead, MAX_HEAD};
use super::reply::{error_json, Down};
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
                refuse(&sh, &mut wr, &e).await;
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

async fn refuse(sh: &Shared, wr: &mut OwnedWriteHalf, e: &HttpError) {
    let kind = if e.status == 505 { "not_supported" } else { "invalid_request_error" };
    let body = error_json(&e.message, kind, e.status);
    Down::closing(wr, sh.config.request_timeout).send_json(e.status, &body).await;
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
