//! The relay's server side: each client connection served by hyper's HTTP/1.1 server
//! (keep-alive, pipelining, `Expect: 100-continue`, HTTP/1.0 clients), each request read
//! whole (within the body limit) and sent on: the two generation endpoints to
//! [`super::forward`], everything else to the side application.
//!
//! hyper refuses what it cannot parse with a bare status and closes the connection: a
//! malformed head or header value (a bare CR or a NUL in it, 400), a head over 64 KiB (431),
//! another HTTP version (505), a request head not complete within the header-read deadline,
//! which also bounds an idle kept-alive connection. The relay refuses, with an OpenAI-style
//! JSON error and a closed connection: a transfer coding besides `chunked` (501), a body over
//! the limit (413, before reading it when announced), a body not complete within the
//! body-read deadline (408: a client that stops sending, or announces a chunk it never sends)
//! and a body that cannot be read (a malformed chunk, 400). The side application is not sent
//! a method that is not upper case (405) or a request target over 8 KiB (414).
//!
//! O(bytes) per request; one task per connection.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;

use super::forward::forward;
use super::pool::Failure;
use super::reply::{error, full, Out};
use super::request::{describe, strip, Request, DROP, HOP};
use super::Shared;

/// The longest request head accepted.
pub const MAX_HEAD: usize = 64 << 10;

/// Serve one client connection until it closes, times out, or the relay stops (then its
/// requests being answered finish first).
pub(super) async fn serve(sh: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut stop = sh.stop.subscribe();
    let conn_sh = Arc::clone(&sh);
    let service = service_fn(move |req| {
        let sh = Arc::clone(&conn_sh);
        async move { Ok::<_, Infallible>(handle(sh, req).await) }
    });
    let conn = builder(&sh).serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    if stop.borrow().is_none() {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = stop.changed() => {}
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Answer a connection beyond the cap with 503 and close it.
pub(super) async fn refuse_busy(sh: Arc<Shared>, stream: TcpStream) {
    let cap = sh.config.max_connections;
    let service = service_fn(move |_req| async move {
        let message = format!("the proxy has {cap} connections open, its limit; try again later");
        Ok::<_, Infallible>(closing(error(503, &message, "service_unavailable")))
    });
    let mut b = builder(&sh);
    b.keep_alive(false);
    let _ = b.serve_connection(TokioIo::new(stream), service).await;
}

fn builder(sh: &Shared) -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(sh.config.header_read_timeout)
        .max_header_size(MAX_HEAD)
        .max_headers(1000)
        .writev(false); // one contiguous write per flush: cheaper in the kernel than 3 pieces a chunk
    b
}

/// An answer after which the connection closes.
fn closing(mut r: Response<Out>) -> Response<Out> {
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A framing hyper reads but the relay refuses (501): transfer codings besides `chunked`,
/// which the relay does not decode. (With `Content-Length` beside `Transfer-Encoding`, hyper
/// has dropped the length, as RFC 9112 §6.3 asks.)
fn framing(headers: &HeaderMap) -> Option<Response<Out>> {
    let mut codings = headers.get_all(TRANSFER_ENCODING).iter();
    let chunked_only = codings.all(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked"));
    (!chunked_only).then(|| {
        let message = "transfer codings other than chunked are not supported";
        closing(error(501, message, "not_supported"))
    })
}

async fn handle(sh: Arc<Shared>, req: hyper::Request<Incoming>) -> Response<Out> {
    let t0 = Instant::now();
    let (mut head, body) = req.into_parts();
    let max = sh.config.max_body;
    let too_big =
        || closing(error(413, &format!("the request body exceeds {max} bytes"), "invalid_request_error"));
    if let Some(refusal) = framing(&head.headers) {
        return refusal;
    }
    let announced = head.headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max as u64) {
        return too_big();
    }
    let deadline = sh.config.body_read_timeout;
    let Ok(read) = tokio::time::timeout(deadline, Limited::new(body, max).collect()).await else {
        let message = format!("the request body was not complete within {} s", deadline.as_secs_f64());
        return closing(error(408, &message, "invalid_request_error"));
    };
    let body = match read {
        Ok(body) => body.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return too_big(),
        Err(e) => {
            let message = format!("the request body could not be read: {}", describe(e.as_ref()));
            return closing(error(400, &message, "invalid_request_error"));
        }
    };
    strip(&mut head.headers, &HOP);
    let req = Request { head, body, t0 };
    let path = req.head.uri.path();
    if req.head.method == Method::POST && matches!(path, "/v1/completions" | "/v1/chat/completions") {
        let chat = path == "/v1/chat/completions";
        return forward(sh, req, chat).await;
    }
    if let Some(refusal) = unfit_for_side(&req) {
        return refusal;
    }
    to_side(&sh, req).await
}

/// The longest request target relayed to the side application (its endpoints have short
/// paths and queries).
const MAX_SIDE_TARGET: usize = 8 << 10;

/// A request the side application is not to see: a method that is not upper case (every
/// method it serves is; HTTP's are case-sensitive), or a target over [`MAX_SIDE_TARGET`].
fn unfit_for_side(req: &Request) -> Option<Response<Out>> {
    let method = req.head.method.as_str();
    if !method.bytes().all(|b| b.is_ascii_uppercase()) {
        let message = format!("unknown method {method:?} (methods are upper case)");
        return Some(error(405, &message, "invalid_request_error"));
    }
    let len = req.target().len();
    (len > MAX_SIDE_TARGET).then(|| {
        let message = format!("the request target is {len} bytes, over {MAX_SIDE_TARGET}");
        error(414, &message, "invalid_request_error")
    })
}

/// Relay a request to the side application and its answer back.
async fn to_side(sh: &Shared, req: Request) -> Response<Out> {
    let failed = |what: String| {
        sh.hooks.log_error(&format!("the proxy's side application failed: {what}"));
        error(502, "internal proxy error", "internal_error")
    };
    let uri: hyper::Uri = match req.target().parse() {
        Ok(uri) => uri,
        Err(e) => return failed(format!("{e}")),
    };
    let host = HeaderValue::from_static("kvroute");
    let make = || req.upstream(&uri, &host);
    let timeout = sh.config.request_timeout;
    let got = async {
        let (mut up, answer) = sh.pool.exchange(&sh.config.side, timeout, make).await?;
        let (mut head, mut body) = answer.into_parts();
        let body = up.whole(&mut body, timeout).await?;
        sh.pool.release(up);
        strip(&mut head.headers, &DROP[..3]);
        head.version = hyper::Version::HTTP_11;
        Ok::<_, Failure>(Response::from_parts(head, full(body)))
    };
    match got.await {
        Ok(answer) => answer,
        Err(Failure::Timeout) => failed("timed out".into()),
        Err(Failure::Failed(e)) => failed(e),
    }
}
