//! What the relay answers with itself: the body type of every answer ([`Out`]), whole
//! answers and JSON error bodies in OpenAI's shape.
//!
//! O(bytes) per answer; stateless.

use std::io::Write;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

/// The body of the relay's answers: whole, relayed from the side application, or a
/// relayed stream.
pub(super) type Out = UnsyncBoxBody<Bytes, hyper::Error>;

/// A whole body.
pub(super) fn full(data: impl Into<Bytes>) -> Out {
    Full::new(data.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A whole JSON answer.
pub(super) fn json(status: u16, body: impl Into<Bytes>) -> Response<Out> {
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An OpenAI-style JSON error answer (`kind`: the error's `type`).
pub(super) fn error(status: u16, message: &str, kind: &str) -> Response<Out> {
    json(status, error_json(message, kind, status))
}

/// Appends `s` as a JSON string; `ascii`: escape DEL and non-ASCII as `\uXXXX` (as Python's `json`).
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
