//! What the relay writes to a client: [`Down`], the answer writer (a whole answer with
//! `Content-Length`, or a stream: chunked for HTTP/1.1 clients, up to the connection's end for
//! HTTP/1.0 ones), and the JSON of its error bodies.
//!
//! O(bytes) per answer; each writer belongs to one connection's task.

use std::io::Write;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;

use super::http::{chunk, response_head, RequestHead, LAST_CHUNK};

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
    pub(super) fn new(
        stream: &'a mut OwnedWriteHalf,
        head: &RequestHead,
        limit: std::time::Duration,
    ) -> Self {
        let (http11, keep) = (head.version >= (1, 1), head.keep_alive());
        Self { stream, http11, keep, state: 0, gone: false, out: Vec::new(), limit }
    }

    /// A writer for the one answer before the connection closes (a refused request).
    pub(super) fn closing(stream: &'a mut OwnedWriteHalf, limit: std::time::Duration) -> Self {
        Self { stream, http11: true, keep: false, state: 0, gone: false, out: Vec::new(), limit }
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
