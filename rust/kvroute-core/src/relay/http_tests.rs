//! Tests of the HTTP/1.1 framing in `http.rs`.

use super::*;

fn request(head: &str) -> Result<RequestHead, HttpError> {
    parse_request_head(head.as_bytes())
}

fn response(head: &str) -> Result<ResponseHead, HttpError> {
    parse_response_head(head.as_bytes())
}

fn status<T: fmt::Debug>(result: Result<T, HttpError>) -> u16 {
    result.expect_err("an error").status
}

fn chunked() -> BodyReader {
    BodyReader::for_request(&request("POST / HTTP/1.1\r\nTransfer-Encoding: chunked").unwrap()).unwrap()
}

/// Feeds `data` in the pieces `splits` marks; returns the body, the bytes consumed and `done`.
fn feed_split(
    mut reader: BodyReader,
    data: &[u8],
    splits: &[usize],
) -> Result<(Vec<u8>, usize, bool), HttpError> {
    let mut out = Vec::new();
    let mut consumed = 0;
    let mut start = 0;
    for &end in splits.iter().chain([data.len()].iter()) {
        let piece = &data[start..end];
        let n = reader.feed(piece, &mut out)?;
        assert!(n <= piece.len());
        consumed += n;
        if reader.done() {
            break;
        }
        assert_eq!(n, piece.len(), "a reader not done consumes everything");
        start = end;
    }
    Ok((out, consumed, reader.done()))
}

#[test]
fn finds_the_end_of_a_head() {
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody"), Some(23));
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: a\r\n"), None);
    assert_eq!(head_end(b""), None);
    assert_eq!(head_end(b"\r\n\r\n"), Some(0));
}

#[test]
fn parses_a_request_head() {
    let head = request(
        "POST /v1/chat?x=1&y=2 HTTP/1.1\r\nHost: a:80\r\nX-Thing:\t two words \r\nx-thing: 3\r\nE: caf\u{e9}",
    )
    .unwrap();
    assert_eq!(head.method, "POST");
    assert_eq!(head.target, "/v1/chat?x=1&y=2");
    assert_eq!(head.path(), "/v1/chat");
    assert_eq!(head.version, (1, 1));
    assert_eq!(head.headers[0], ("Host".to_owned(), "a:80".to_owned()));
    assert_eq!(head.headers[1], ("X-Thing".to_owned(), "two words".to_owned()));
    assert_eq!(head.get("x-thing"), Some("two words"));
    assert_eq!(head.get("X-THING"), Some("two words"));
    assert_eq!(head.get("missing"), None);
    // Values are latin-1: the UTF-8 bytes of "é" are two chars.
    assert_eq!(head.get("e"), Some("caf\u{c3}\u{a9}"));
    let head = parse_request_head(b"GET / HTTP/1.0\r\nName: \xe9").unwrap();
    assert_eq!(head.get("name"), Some("\u{e9}"));
    assert_eq!(head.path(), "/");
    assert_eq!(head.version, (1, 0));
    assert!(request("GET * HTTP/1.9").is_ok());
}

#[test]
fn refuses_malformed_request_heads() {
    for bad in [
        "",
        "get / HTTP/1.1",
        "GET  / HTTP/1.1",
        "GET / HTTP/1.1 ",
        "GET /\tx HTTP/1.1",
        "GET / http/1.1",
        "GET / HTTP/1.10",
        "GET / HTTP/11",
        "GET / HTTP/1.x",
        "GET /",
        "G3T / HTTP/1.1",
    ] {
        let err = request(bad).expect_err(bad);
        assert_eq!(err.status, 400, "{bad:?}");
        assert!(err.message.starts_with("malformed request line"), "{}", err.message);
    }
    let err = request("GET / HTTP/2.0").unwrap_err();
    assert_eq!((err.status, err.message.as_str()), (505, "HTTP/2.0 is not supported"));
    assert_eq!(status(request("GET / HTTP/0.9")), 505);
    for bad in ["no colon", "Host : a", ": empty", "", "Bad\u{e9}: x", "Sp ace: x", "(x): y"] {
        let err = request(&format!("GET / HTTP/1.1\r\nHost: a\r\n{bad}")).expect_err(bad);
        assert_eq!(err.status, 400, "{bad:?}");
        assert!(err.message.starts_with("malformed header line"), "{}", err.message);
    }
    // The head is passed without its blank line: a trailing CRLF is an empty header line.
    assert_eq!(status(request("GET / HTTP/1.1\r\n")), 400);
    assert!(request("GET / HTTP/1.1\r\n!#$%&'*+-.^_`|~09azAZ: ok").is_ok());
}

#[test]
fn keep_alive_follows_version_and_connection() {
    let keep = |head: &str| request(head).unwrap().keep_alive();
    assert!(keep("GET / HTTP/1.1"));
    assert!(!keep("GET / HTTP/1.1\r\nConnection: close"));
    assert!(!keep("GET / HTTP/1.1\r\nconnection: Upgrade, CLOSE "));
    assert!(!keep("GET / HTTP/1.1\r\nConnection: upgrade\r\nConnection: close"));
    assert!(keep("GET / HTTP/1.1\r\nConnection: keep-alive"));
    assert!(keep("GET / HTTP/1.1\r\nConnection: closed"));
    assert!(!keep("GET / HTTP/1.0"));
    assert!(keep("GET / HTTP/1.0\r\nConnection: Keep-Alive"));
    assert!(!keep("GET / HTTP/1.0\r\nConnection: close"));
    let keep = |head: &str| response(head).unwrap().keep_alive();
    assert!(keep("HTTP/1.1 200 OK"));
    assert!(!keep("HTTP/1.1 200 OK\r\nConnection: close"));
    assert!(!keep("HTTP/1.0 200 OK"));
    assert!(!keep("HTTP/1.0 200 OK\r\nConnection: keep-alive"));
}

#[test]
fn parses_a_response_head() {
    let head = response("HTTP/1.1 404 Not Found\r\nContent-Length: 0").unwrap();
    assert_eq!((head.status, head.http10), (404, false));
    assert_eq!(head.get("content-length"), Some("0"));
    let head = response("HTTP/1.0 200").unwrap();
    assert_eq!((head.status, head.http10, head.headers.len()), (200, true, 0));
    assert_eq!(response("HTTP/1.1 500 ").unwrap().status, 500);
    assert_eq!(response("HTTP/1.1 299 Whatever you like: \u{e9}").unwrap().status, 299);
    for bad in [
        "",
        "HTTP/2 200 OK",
        "HTTP/1.1 20 OK",
        "HTTP/1.1 200OK",
        "HTTP/1.1  200 OK",
        "http/1.1 200 OK",
        "HTTP/1.1 2x0",
        "HTTP/1.1 200 a\nb",
    ] {
        let err = response(bad).expect_err(bad);
        assert_eq!(err.status, 502, "{bad:?}");
        assert!(err.message.starts_with("malformed status line"), "{}", err.message);
    }
    assert_eq!(status(response("HTTP/1.1 200 OK\r\nbad")), 400);
}

#[test]
fn request_framing_and_smuggling_refusals() {
    let reader = |extra: &str| BodyReader::for_request(&request(&format!("POST / HTTP/1.1{extra}")).unwrap());
    assert!(matches!(reader(""), Ok(BodyReader::Length(0))));
    assert!(matches!(reader("\r\nContent-Length: 12"), Ok(BodyReader::Length(12))));
    assert!(matches!(reader("\r\nContent-Length: 5\r\ncontent-length: 5"), Ok(BodyReader::Length(5))));
    assert!(matches!(reader("\r\nTransfer-Encoding: chunked"), Ok(BodyReader::Chunked(_))));
    assert!(matches!(reader("\r\nTransfer-Encoding:  Chunked "), Ok(BodyReader::Chunked(_))));
    // As in Python: spaces inside the coding are dropped before the comparison.
    assert!(matches!(reader("\r\nTransfer-Encoding: chun ked"), Ok(BodyReader::Chunked(_))));
    let err = reader("\r\nContent-Length: 5\r\nTransfer-Encoding: chunked").unwrap_err();
    assert_eq!((err.status, err.message.as_str()), (400, "both Content-Length and Transfer-Encoding"));
    for bad in ["5\r\nContent-Length: 6", "-1", "+5", "0x5", "", "5 5", "1e3", "99999999999999999999999"] {
        let err = reader(&format!("\r\nContent-Length: {bad}")).expect_err(bad);
        assert_eq!(err.status, 400, "{bad:?}");
        assert!(err.message.starts_with("bad Content-Length"), "{}", err.message);
    }
    for bad in [
        "gzip",
        "gzip, chunked",
        "chunked, chunked",
        "chunked\r\nTransfer-Encoding: chunked",
        "",
        "chun\tked",
    ] {
        let err = reader(&format!("\r\nTransfer-Encoding: {bad}")).expect_err(bad);
        assert_eq!(err.status, 501, "{bad:?}");
        assert!(err.message.starts_with("transfer coding"), "{}", err.message);
    }
}

#[test]
fn response_framing() {
    let reader = |head: &str| BodyReader::for_response(&response(head).unwrap());
    for head in [
        "HTTP/1.1 100 Continue",
        "HTTP/1.1 204 No Content\r\nContent-Length: 9",
        "HTTP/1.1 304 x\r\nTransfer-Encoding: gzip",
    ] {
        assert!(matches!(reader(head), Ok(BodyReader::Length(0))), "{head}");
    }
    assert!(matches!(reader("HTTP/1.1 200 OK"), Ok(BodyReader::UntilClose(false))));
    assert!(matches!(reader("HTTP/1.1 200 OK\r\nContent-Length: 3"), Ok(BodyReader::Length(3))));
    assert!(matches!(reader("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"), Ok(BodyReader::Chunked(_))));
    assert_eq!(status(reader("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip")), 502);
    assert_eq!(status(reader("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3")), 400);
    assert_eq!(status(reader("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4")), 400);
}

#[test]
fn length_and_until_close_bodies() {
    let mut out = Vec::new();
    let mut none = BodyReader::none();
    assert!(none.done());
    assert_eq!(none.feed(b"next", &mut out), Ok(0));
    assert_eq!(none.eof(), Ok(()));

    let mut reader = BodyReader::Length(5);
    assert_eq!(reader.feed(b"hel", &mut out), Ok(3));
    assert!(!reader.done());
    let err = reader.clone().eof().unwrap_err();
    assert_eq!((err.status, err.message.as_str()), (502, "the connection closed inside a message body"));
    assert_eq!(reader.feed(b"loGET", &mut out), Ok(2));
    assert!(reader.done());
    assert_eq!(reader.feed(b"GET", &mut out), Ok(0));
    assert_eq!(reader.eof(), Ok(()));
    assert_eq!(out, b"hello");

    let mut out = Vec::new();
    let mut reader = BodyReader::UntilClose(false);
    assert_eq!(reader.feed(b"all ", &mut out), Ok(4));
    assert_eq!(reader.feed(b"", &mut out), Ok(0));
    assert_eq!(reader.feed(b"of it", &mut out), Ok(5));
    assert!(!reader.done());
    assert_eq!(reader.eof(), Ok(()));
    assert!(reader.done());
    assert_eq!(out, b"all of it");
}

const STREAM: &[u8] =
    b"5\r\nhello\r\n6;name=\"v\"\r\n world\r\nA \t\r\n0123456789\r\n000000000000001\r\n!\r\n0\r\nTrailer: x\r\nMore: y\r\n\r\nGET / HTTP/1.1\r\n";
const NEXT: &[u8] = b"GET / HTTP/1.1\r\n";

#[test]
fn chunked_body_fed_whole() {
    let (out, consumed, done) = feed_split(chunked(), STREAM, &[]).unwrap();
    assert_eq!(out, b"hello world0123456789!");
    assert_eq!(consumed, STREAM.len() - NEXT.len());
    assert!(done);
    // 16 hex digits are one too many.
    assert_eq!(status(feed_split(chunked(), b"0000000000000001\r\nx\r\n0\r\n\r\n", &[])), 400);
}

#[test]
fn chunked_body_split_anywhere() {
    let whole = feed_split(chunked(), STREAM, &[]).unwrap();
    for i in 0..=STREAM.len() {
        assert_eq!(feed_split(chunked(), STREAM, &[i]).unwrap(), whole, "split at {i}");
        for j in i..=STREAM.len() {
            assert_eq!(feed_split(chunked(), STREAM, &[i, j]).unwrap(), whole, "split at {i}, {j}");
        }
    }
    let every: Vec<usize> = (1..STREAM.len()).collect();
    assert_eq!(feed_split(chunked(), STREAM, &every).unwrap(), whole);
}

#[test]
fn chunked_reader_stops_at_its_end() {
    let mut reader = chunked();
    let mut out = Vec::new();
    assert_eq!(reader.feed(b"3\r\nabc\r\n0\r\n\r\n", &mut out), Ok(13));
    assert!(reader.done());
    assert_eq!(reader.feed(b"more", &mut out), Ok(0));
    assert_eq!(reader.eof(), Ok(()));
    assert_eq!(out, b"abc");
}

#[test]
fn chunked_errors() {
    let fed = |data: &[u8]| feed_split(chunked(), data, &[]);
    let err = fed(b"3\r\nhello\r\n0\r\n\r\n").unwrap_err();
    assert_eq!((err.status, err.message.as_str()), (400, "chunk data longer than its size"));
    assert_eq!(status(fed(b"3\r\nabc\n0\r\n\r\n")), 400);
    assert_eq!(status(fed(b"3\r\nabc\rx")), 400);
    for bad in [
        &b"xyz\r\n"[..],
        b"\r\n",
        b"-1\r\n",
        b"5x\r\n",
        b"5 x\r\n",
        b" 5\r\n",
        b"0x5\r\n",
        b"ffffffffffffffff\r\n",
    ] {
        let err = fed(bad).unwrap_err();
        assert_eq!(err.status, 400, "{bad:?}");
        assert!(err.message.starts_with("malformed chunk size"), "{}", err.message);
    }
    let err = fed(b"zz\xff\r\n").unwrap_err();
    assert_eq!(err.message, "malformed chunk size \"zz\\xff\"");
    // A body that stops short is an error at the stream's end.
    for cut in [&b""[..], b"5", b"5\r\nhel", b"5\r\nhello\r", b"5\r\nhello\r\n0\r\n", b"0\r\nTrailer: x\r\n"]
    {
        let mut reader = chunked();
        assert_eq!(reader.feed(cut, &mut Vec::new()), Ok(cut.len()));
        assert!(!reader.done());
        assert_eq!(reader.eof().unwrap_err().status, 502, "{cut:?}");
    }
}

#[test]
fn chunk_lines_are_limited_however_split() {
    let line = |len: usize| {
        let mut data = b"1;".to_vec();
        data.resize(len, b'e');
        data.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
        data
    };
    let longest = line(MAX_CHUNK_LINE - 1);
    let too_long = line(MAX_CHUNK_LINE);
    let every = |data: &[u8]| (1..data.len()).collect::<Vec<_>>();
    for splits in
        [vec![], every(&longest), vec![MAX_CHUNK_LINE - 1], vec![MAX_CHUNK_LINE], vec![MAX_CHUNK_LINE + 1]]
    {
        assert_eq!(feed_split(chunked(), &longest, &splits).unwrap().0, b"x");
    }
    for splits in [vec![], every(&too_long), vec![MAX_CHUNK_LINE], vec![MAX_CHUNK_LINE + 1], vec![10]] {
        let err = feed_split(chunked(), &too_long, &splits).unwrap_err();
        assert_eq!((err.status, err.message.as_str()), (400, "chunk-size line too long"));
    }
    // A line that never ends is refused once it passes the limit.
    let mut reader = chunked();
    assert_eq!(reader.feed(&vec![b'1'; MAX_CHUNK_LINE], &mut Vec::new()), Ok(MAX_CHUNK_LINE));
    assert_eq!(reader.feed(b"1", &mut Vec::new()).unwrap_err().status, 400);
    // Trailer lines too.
    let mut trailer = b"0\r\nX: ".to_vec();
    trailer.resize(3 + MAX_CHUNK_LINE, b'y');
    trailer.extend_from_slice(b"\r\n\r\n");
    assert_eq!(status(feed_split(chunked(), &trailer, &[])), 400);
}

#[test]
fn writes_chunks_that_read_back() {
    let mut out = Vec::new();
    chunk(b"hello", &mut out);
    assert_eq!(out, b"5\r\nhello\r\n");
    chunk(b"", &mut out);
    assert_eq!(out, b"5\r\nhello\r\n");
    let big = vec![b'z'; 255];
    chunk(&big, &mut out);
    assert!(out.ends_with(b"\r\n") && out[10..].starts_with(b"ff\r\nzzz"));
    out.extend_from_slice(LAST_CHUNK);
    let (body, consumed, done) = feed_split(chunked(), &out, &[]).unwrap();
    assert_eq!(&body[..5], b"hello");
    assert_eq!(body.len(), 260);
    assert_eq!((consumed, done), (out.len(), true));
}

#[test]
fn writes_response_heads() {
    let mut out = Vec::new();
    response_head(200, &[("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")], &mut out);
    assert_eq!(
        out,
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let mut out = Vec::new();
    response_head(599, &[], &mut out);
    assert_eq!(out, b"HTTP/1.1 599 Unknown\r\n\r\n");
    let mut out = Vec::new();
    response_head(505, &[("X", "caf\u{e9} \u{20ac}")], &mut out);
    assert_eq!(out, b"HTTP/1.1 505 HTTP Version Not Supported\r\nX: caf\xe9 ?\r\n\r\n");
    for (code, phrase) in [
        (413, "Request Entity Too Large"),
        (422, "Unprocessable Entity"),
        (431, "Request Header Fields Too Large"),
    ] {
        let mut out = Vec::new();
        response_head(code, &[], &mut out);
        assert_eq!(out, format!("HTTP/1.1 {code} {phrase}\r\n\r\n").as_bytes());
    }
    // What it writes parses back.
    let mut out = Vec::new();
    response_head(404, &[("Connection", "close")], &mut out);
    let end = head_end(&out).unwrap();
    let head = parse_response_head(&out[..end]).unwrap();
    assert_eq!((head.status, head.keep_alive()), (404, false));
}

#[test]
fn errors_display_their_message() {
    let err = HttpError::new(431, "head too large");
    assert_eq!((err.status, err.to_string()), (431, "head too large".to_owned()));
    let boxed: Box<dyn std::error::Error> = Box::new(err);
    assert_eq!(boxed.to_string(), "head too large");
}
