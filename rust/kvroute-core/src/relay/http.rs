//! HTTP/1.1 framing for the relay's data path (RFC 9112): message heads, body readers, chunk
//! encoding. A port of the Python proxy's `kvroute.proxy.http1`, with the same rules and the
//! same answer statuses.
//!
//! - [`head_end`], [`parse_request_head`], [`parse_response_head`]: find a head in a buffer
//!   and split it into its start line and header fields; a malformed head is an [`HttpError`]
//!   carrying the status to answer (400, 502, 505).
//! - [`BodyReader`]: the reader a head calls for (`Content-Length`, `chunked`, or up to the
//!   connection's end); [`BodyReader::feed`] takes bytes as they arrive, split anywhere.
//! - [`chunk`], [`response_head`], [`LAST_CHUNK`]: what the relay writes.
//!
//! Header names keep their case (lookups ignore it); values are latin-1 decoded, as on the
//! wire. Messages with both `Content-Length` and `Transfer-Encoding`, conflicting lengths, or a
//! transfer coding other than `chunked` are refused (the request-smuggling cases).
//!
//! Every call is O(bytes) in its input. There is no shared state: the functions are pure and a
//! [`BodyReader`] holds only its own position, so each connection owns its readers.

use std::fmt;

/// The longest head (start line and header fields) accepted (64 KiB).
pub const MAX_HEAD: usize = 64 << 10;
/// The longest chunk-size line (size and extensions) or trailer line accepted.
pub const MAX_CHUNK_LINE: usize = 4096;
/// The chunk that ends a chunked body (no trailers).
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// A message that cannot be read; `status` is the answer it gets (400, 501, 502, 505).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpError {
    /// The HTTP status to answer with.
    pub status: u16,
    /// What is wrong with the message.
    pub message: String,
}

impl HttpError {
    /// An error answered with `status`.
    #[must_use]
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
}

impl fmt::Display for HttpError {
    /// The message alone, as the Python exception's `str()`; the status is a field.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HttpError {}

/// Header fields in order; names keep their case, values are latin-1 decoded (each byte one
/// `char`) and trimmed of spaces and tabs.
pub type Headers = Vec<(String, String)>;

/// A request's start line and header fields.
#[derive(Debug, Clone)]
pub struct RequestHead {
    /// The method (upper-case letters).
    pub method: String,
    /// The request target, as sent.
    pub target: String,
    /// The protocol version; the major is always 1.
    pub version: (u8, u8),
    /// The header fields.
    pub headers: Headers,
}

impl RequestHead {
    /// The first value of header `lower_name` (names compared ignoring ASCII case), if any.
    #[must_use]
    pub fn get(&self, lower_name: &str) -> Option<&str> {
        field(&self.headers, lower_name)
    }

    /// Whether the connection stays open after this exchange: HTTP/1.1 unless `Connection`
    /// says `close`; HTTP/1.0 only when it says `keep-alive`.
    #[must_use]
    pub fn keep_alive(&self) -> bool {
        if self.version >= (1, 1) {
            !has_token(&self.headers, "connection", "close")
        } else {
            has_token(&self.headers, "connection", "keep-alive")
        }
    }

    /// The target without its query (the part before the first `?`).
    #[must_use]
    pub fn path(&self) -> &str {
        self.target.split_once('?').map_or(&self.target, |(path, _)| path)
    }
}

/// A response's status line and header fields.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// The status code (three digits).
    pub status: u16,
    /// Whether the status line says HTTP/1.0.
    pub http10: bool,
    /// The header fields.
    pub headers: Headers,
}

impl ResponseHead {
    /// The first value of header `lower_name` (names compared ignoring ASCII case), if any.
    #[must_use]
    pub fn get(&self, lower_name: &str) -> Option<&str> {
        field(&self.headers, lower_name)
    }

    /// Whether the connection stays open after this response: not HTTP/1.0, and `Connection`
    /// does not say `close`.
    #[must_use]
    pub fn keep_alive(&self) -> bool {
        !self.http10 && !has_token(&self.headers, "connection", "close")
    }
}

fn field<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

fn values<'a>(headers: &'a Headers, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    headers.iter().filter(move |(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// Python's `str.isspace()` over latin-1 (also what its regex `\s` matches).
fn is_py_space(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}')
}

/// Whether a comma-separated token of header `name` is `token` (ignoring case and spaces).
fn has_token(headers: &Headers, name: &str, token: &str) -> bool {
    values(headers, name)
        .flat_map(|v| v.split(','))
        .any(|t| t.trim_matches(is_py_space).eq_ignore_ascii_case(token))
}

/// Position of the `"\r\n\r\n"` that ends a head in `buf`, if any (the index of its first byte).
#[must_use]
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// The first 80 characters of `line`, quoted, for error messages.
fn excerpt(line: &str) -> String {
    format!("{:?}", line.chars().take(80).collect::<String>())
}

fn is_token(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn parse_fields<'a>(lines: impl Iterator<Item = &'a str>) -> Result<Headers, HttpError> {
    lines
        .map(|line| match line.split_once(':') {
            Some((name, value)) if is_token(name) => {
                Ok((name.to_owned(), value.trim_matches([' ', '\t']).to_owned()))
            }
            _ => Err(HttpError::new(400, format!("malformed header line {}", excerpt(line)))),
        })
        .collect()
}

/// Parses a request head: the request line and header fields (without the blank line).
///
/// # Errors
///
/// 400 for a malformed request line or header line (a header name must be an RFC 9110
/// token); 505 for a version `HTTP/x.y` with `x` other than 1.
pub fn parse_request_head(head: &[u8]) -> Result<RequestHead, HttpError> {
    let text = latin1(head);
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let bad = || HttpError::new(400, format!("malformed request line {}", excerpt(first)));
    let parts: Vec<&str> = first.split(' ').collect();
    let &[method, target, version] = parts.as_slice() else { return Err(bad()) };
    let v = version.as_bytes();
    let digit = |i: usize| v.get(i).filter(|b| b.is_ascii_digit()).map(|b| b - b'0');
    let (Some(major), Some(minor)) = (digit(5), digit(7)) else { return Err(bad()) };
    if method.is_empty()
        || !method.bytes().all(|b| b.is_ascii_uppercase())
        || target.is_empty()
        || target.contains(is_py_space)
        || v.len() != 8
        || !v.starts_with(b"HTTP/")
        || v[6] != b'.'
    {
        return Err(bad());
    }
    if major != 1 {
        return Err(HttpError::new(505, format!("HTTP/{major}.{minor} is not supported")));
    }
    Ok(RequestHead {
        method: method.to_owned(),
        target: target.to_owned(),
        version: (major, minor),
        headers: parse_fields(lines)?,
    })
}

/// Parses a response head: the status line and header fields (without the blank line).
///
/// # Errors
///
/// 502 for a malformed status line (`HTTP/1.x NNN[ reason]`); 400 for a malformed header line.
pub fn parse_response_head(head: &[u8]) -> Result<ResponseHead, HttpError> {
    let text = latin1(head);
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let b = first.as_bytes();
    let ok = b.len() >= 12
        && b.starts_with(b"HTTP/1.")
        && b[7].is_ascii_digit()
        && b[8] == b' '
        && b[9..12].iter().all(u8::is_ascii_digit)
        && (b.len() == 12 || (b[12] == b' ' && !first[13..].contains('\n')));
    if !ok {
        return Err(HttpError::new(502, format!("malformed status line {}", excerpt(first))));
    }
    let status = b[9..12].iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0'));
    Ok(ResponseHead { status, http10: b[7] == b'0', headers: parse_fields(lines)? })
}

/// Reads one body off a byte stream; see [`BodyReader::feed`].
#[derive(Debug, Clone)]
pub enum BodyReader {
    /// A body of known length (`Content-Length`, or none at all): the bytes still to read.
    Length(u64),
    /// A `Transfer-Encoding: chunked` body.
    Chunked(ChunkedReader),
    /// A body that ends with the connection; `true` once it has.
    UntilClose(bool),
}

/// The state of a chunked body's reader: where it is, and a partial line held between feeds.
#[derive(Debug, Clone, Default)]
pub struct ChunkedReader {
    state: Chunk,
    /// A line (size or trailer) begun but not ended; never holds a CRLF.
    line: Vec<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line.
    #[default]
    Size,
    /// Chunk data, with the bytes still to read.
    Data(u64),
    /// The CR, then the LF, that end a chunk's data.
    Cr,
    Lf,
    /// Trailer lines, dropped, up to the empty line.
    Trailer,
    Done,
}

impl BodyReader {
    /// A zero-length body (the answer to `HEAD`, 1xx/204/304, a request without framing).
    #[must_use]
    pub fn none() -> Self {
        Self::Length(0)
    }

    /// The reader of the body a request head announces; a request without framing has none.
    ///
    /// # Errors
    ///
    /// 400 for both `Content-Length` and `Transfer-Encoding`, or for conflicting or non-digit
    /// lengths; 501 for a transfer coding other than `chunked`.
    pub fn for_request(head: &RequestHead) -> Result<Self, HttpError> {
        Ok(framed(&head.headers, 501)?.unwrap_or(Self::none()))
    }

    /// The reader of the body a response head announces; unframed, it runs to the close.
    ///
    /// # Errors
    ///
    /// As [`BodyReader::for_request`], with 502 for a transfer coding other than `chunked`.
    pub fn for_response(head: &ResponseHead) -> Result<Self, HttpError> {
        if head.status < 200 || head.status == 204 || head.status == 304 {
            return Ok(Self::none());
        }
        Ok(framed(&head.headers, 502)?.unwrap_or(Self::UntilClose(false)))
    }

    /// Takes `data` as it arrives: appends the body bytes in it (de-chunked) to `out` and returns
    /// how many bytes of `data` were consumed. Once [`done`](Self::done), the rest of `data`
    /// belongs to the next message. Data may be split at any byte; a partial chunk-size line is
    /// kept inside the reader (and counts as consumed).
    ///
    /// # Errors
    ///
    /// 400 for a malformed chunk size, a chunk-size or trailer line of [`MAX_CHUNK_LINE`] bytes
    /// or more, or chunk data longer than its size.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
        match self {
            Self::Length(left) => {
                let take = usize::try_from(*left).map_or(data.len(), |left| left.min(data.len()));
                out.extend_from_slice(&data[..take]);
                *left -= take as u64;
                Ok(take)
            }
            Self::Chunked(reader) => reader.feed(data, out),
            Self::UntilClose(_) => {
                out.extend_from_slice(data);
                Ok(data.len())
            }
        }
    }

    /// Whether the whole body has been read.
    #[must_use]
    pub fn done(&self) -> bool {
        match self {
            Self::Length(left) => *left == 0,
            Self::Chunked(reader) => reader.state == Chunk::Done,
            Self::UntilClose(closed) => *closed,
        }
    }

    /// The stream ended: completes a body that runs to the close.
    ///
    /// # Errors
    ///
    /// 502 when the body is not complete.
    pub fn eof(&mut self) -> Result<(), HttpError> {
        if let Self::UntilClose(closed) = self {
            *closed = true;
        }
        if self.done() {
            Ok(())
        } else {
            Err(HttpError::new(502, "the connection closed inside a message body"))
        }
    }
}

/// The reader that `Transfer-Encoding` or `Content-Length` call for, if either is there;
/// `coding_status` answers a coding other than `chunked`.
fn framed(headers: &Headers, coding_status: u16) -> Result<Option<BodyReader>, HttpError> {
    let codings: Vec<&str> = values(headers, "transfer-encoding").collect();
    let mut lengths: Vec<&str> = values(headers, "content-length").collect();
    if !codings.is_empty() {
        if !lengths.is_empty() {
            return Err(HttpError::new(400, "both Content-Length and Transfer-Encoding"));
        }
        let joined: String = codings.join(",").chars().filter(|&c| c != ' ').collect();
        if !joined.eq_ignore_ascii_case("chunked") {
            return Err(HttpError::new(coding_status, format!("transfer coding {codings:?}")));
        }
        return Ok(Some(BodyReader::Chunked(ChunkedReader::default())));
    }
    if lengths.is_empty() {
        return Ok(None);
    }
    lengths.sort_unstable();
    lengths.dedup();
    let length = match lengths.as_slice() {
        [one] if !one.is_empty() && one.bytes().all(|b| b.is_ascii_digit()) => one.parse().ok(),
        _ => None,
    };
    let length = length.ok_or_else(|| HttpError::new(400, format!("bad Content-Length {lengths:?}")))?;
    Ok(Some(BodyReader::Length(length)))
}

impl ChunkedReader {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
        let mut pos = 0;
        while pos < data.len() && self.state != Chunk::Done {
            match self.state {
                Chunk::Data(left) => {
                    let take = usize::try_from(left).map_or(data.len() - pos, |l| l.min(data.len() - pos));
                    out.extend_from_slice(&data[pos..pos + take]);
                    pos += take;
                    let left = left - take as u64;
                    self.state = if left == 0 { Chunk::Cr } else { Chunk::Data(left) };
                }
                Chunk::Cr | Chunk::Lf => {
                    let (want, next) =
                        if self.state == Chunk::Cr { (b'\r', Chunk::Lf) } else { (b'\n', Chunk::Size) };
                    if data[pos] != want {
                        return Err(HttpError::new(400, "chunk data longer than its size"));
                    }
                    pos += 1;
                    self.state = next;
                }
                Chunk::Size | Chunk::Trailer => {
                    let Some((next, in_held)) = self.take_line(data, pos)? else {
                        return Ok(data.len());
                    };
                    let held = std::mem::take(&mut self.line);
                    let line = if in_held { &held[..] } else { &data[pos..next - 2] };
                    self.state = if self.state == Chunk::Trailer {
                        if line.is_empty() {
                            Chunk::Done
                        } else {
                            Chunk::Trailer
                        }
                    } else {
                        match chunk_size(line)? {
                            0 => Chunk::Trailer,
                            size => Chunk::Data(size),
                        }
                    };
                    self.line = held;
                    self.line.clear();
                    pos = next;
                }
                Chunk::Done => break,
            }
        }
        Ok(pos)
    }

    /// Where the line that starts at `data[pos..]` (after any held part) ends, past its CRLF,
    /// and whether it began in an earlier feed: then the whole line, without its CRLF, is left
    /// in `self.line`. `None` after holding a partial line.
    ///
    /// A line is refused at [`MAX_CHUNK_LINE`] bytes (CRLF excluded) however the data is split:
    /// a partial line over the limit may be all of such a line and its CR.
    fn take_line(&mut self, data: &[u8], pos: usize) -> Result<Option<(usize, bool)>, HttpError> {
        let too_long = || HttpError::new(400, "chunk-size line too long");
        let rest = &data[pos..];
        if self.line.last() == Some(&b'\r') && rest.first() == Some(&b'\n') {
            self.line.pop();
            return if self.line.len() >= MAX_CHUNK_LINE {
                Err(too_long())
            } else {
                Ok(Some((pos + 1, true)))
            };
        }
        let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else {
            if self.line.len() + rest.len() > MAX_CHUNK_LINE {
                return Err(too_long());
            }
            self.line.extend_from_slice(rest);
            return Ok(None);
        };
        if self.line.len() + end >= MAX_CHUNK_LINE {
            return Err(too_long());
        }
        let in_held = !self.line.is_empty();
        if in_held {
            self.line.extend_from_slice(&rest[..end]);
        }
        Ok(Some((pos + end + 2, in_held)))
    }
}

/// The size of a chunk-size line: 1 to 15 hex digits, spaces or tabs, then `;` and extensions.
fn chunk_size(line: &[u8]) -> Result<u64, HttpError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let blanks = line[digits..].iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    if !(1..=15).contains(&digits) || line.get(digits + blanks).is_some_and(|&b| b != b';') {
        let shown = &line[..line.len().min(40)];
        return Err(HttpError::new(400, format!("malformed chunk size \"{}\"", shown.escape_ascii())));
    }
    Ok(line[..digits].iter().fold(0, |n, &b| n << 4 | u64::from(char::from(b).to_digit(16).unwrap_or(0))))
}

/// Appends `data` as one chunk of a chunked body (`{len:x}\r\n`, data, `\r\n`); nothing for
/// empty data, which would read as the last chunk (write [`LAST_CHUNK`] for that).
pub fn chunk(data: &[u8], out: &mut Vec<u8>) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Request Entity Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Appends a status line (`HTTP/1.1 {status} {reason}`), the header fields and the blank line.
/// Reason phrases are Python's for the common statuses, else `Unknown`. Text is written as
/// latin-1: a `char` below 256 is one byte; any other (which latin-1 cannot hold) is `?`.
pub fn response_head(status: u16, headers: &[(&str, &str)], out: &mut Vec<u8>) {
    let mut latin1 = |s: &str| out.extend(s.chars().map(|c| u8::try_from(c).unwrap_or(b'?')));
    latin1(&format!("HTTP/1.1 {status} {}\r\n", reason(status)));
    for (name, value) in headers {
        latin1(name);
        latin1(": ");
        latin1(value);
        latin1("\r\n");
    }
    latin1("\r\n");
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
