//! A client's request as the relay holds it ([`Request`]: head, whole body, when its head
//! was read), the headers not passed on either way (hop-by-hop, framing, compression), and
//! [`describe`], an error with its causes as one line. The server reads requests into it and
//! relays the side application's; the forwarding sends the generation requests on; the pool
//! describes its connections' errors with it.
//!
//! O(headers) to strip them or to build a request's upstream copy (the body is shared, not
//! copied); plain data, owned by the request's task.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, ACCEPT_ENCODING, CONNECTION, CONTENT_LENGTH, EXPECT, HOST,
    PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};

/// Request headers not forwarded (hop-by-hop, framing, and compression).
pub(super) const HOP: [HeaderName; 12] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION,
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    HOST,
    CONTENT_LENGTH,
    EXPECT,
    ACCEPT_ENCODING,
];
/// Answer headers not relayed (hyper frames the relay's answers); the side application's
/// answers keep their length (an answer to `HEAD` has one and no body).
pub(super) const DROP: [HeaderName; 4] =
    [CONNECTION, HeaderName::from_static("keep-alive"), TRANSFER_ENCODING, CONTENT_LENGTH];

/// `headers` without those named in `names`.
pub(super) fn strip(headers: &mut HeaderMap, names: &[HeaderName]) {
    for name in names {
        headers.remove(name);
    }
}

/// An answer's headers as relayed to the client.
pub(super) fn relayed(headers: &mut HeaderMap) {
    strip(headers, &DROP);
}

/// An error with its causes, as one line.
pub(super) fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// One request: head (without its hop-by-hop headers), whole body, and when its head was
/// read.
pub(super) struct Request {
    pub head: hyper::http::request::Parts,
    pub body: Bytes,
    pub t0: Instant,
}

impl Request {
    /// Path and query, as sent.
    pub fn target(&self) -> &str {
        self.head.uri.path_and_query().map_or("/", |p| p.as_str())
    }

    /// This request as sent upstream: to `uri` (origin form), with `host` as its `Host`.
    pub fn upstream(&self, uri: &hyper::Uri, host: &HeaderValue) -> hyper::Request<Full<Bytes>> {
        let mut up = hyper::Request::new(Full::new(self.body.clone()));
        *up.method_mut() = self.head.method.clone();
        *up.uri_mut() = uri.clone();
        *up.headers_mut() = self.head.headers.clone();
        up.headers_mut().insert(HOST, host.clone());
        up
    }

    /// A header's value (`lower_name`), its bytes read as latin-1.
    pub fn header(&self, lower_name: &str) -> Option<String> {
        let v = self.head.headers.get(lower_name)?;
        Some(v.as_bytes().iter().map(|&b| char::from(b)).collect())
    }
}
