"""HTTP/1.1 framing of the proxy's data path: heads, body readers, chunk encoding."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.proxy.http1 import (
    LAST_CHUNK,
    BodyReader,
    HttpError,
    RequestHead,
    ResponseHead,
    body_reader,
    chunk,
    parse_request_head,
    parse_response_head,
    response_head,
    without,
)


def request(*headers: str, line: str = "POST /v1/completions HTTP/1.1") -> RequestHead:
    return parse_request_head("\r\n".join([line, *headers]).encode())


def feed_all(reader: BodyReader, parts: list[bytes]) -> tuple[bytes, bytes]:
    """Feed ``parts`` in order until the body is done; the body and all bytes after it."""
    body, rest = [], b""
    for i, part in enumerate(parts):
        got, rest = reader.feed(part)
        body += got
        if reader.done:
            return b"".join(body), rest + b"".join(parts[i + 1 :])
    return b"".join(body), rest


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def test_request_head_parts() -> None:
    head = request(
        "Host: x",
        "Content-Length: 5",
        "X-Session-Id:  s1 ",
        "Connection: Keep-Alive, Foo",
        line="POST /v1/completions?x=1 HTTP/1.1",
    )
    assert (head.method, head.target, head.path, head.version) == (
        "POST",
        "/v1/completions?x=1",
        "/v1/completions",
        (1, 1),
    )
    assert head.get("x-session-id") == "s1" and head.get("absent") is None
    assert head.headers[2] == ("X-Session-Id", "s1")  # names keep their case
    assert head.keep_alive
    assert not request("Connection: close").keep_alive
    assert not request(line="GET / HTTP/1.0").keep_alive
    assert request("connection: keep-alive", line="GET / HTTP/1.0").keep_alive


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /v1/completions", 400),
        (b"post / HTTP/1.1", 400),
        (b"GET / HTTP/2.0", 505),
        (b"GET / HTTP/1.1\r\nbad header", 400),
        (b"GET / HTTP/1.1\r\nBad Name: x", 400),
        (b"GET / HTTP/1.1\r\n continued: x", 400),
    ],
)
def test_malformed_request_heads(raw: bytes, status: int) -> None:
    with pytest.raises(HttpError) as exc:
        parse_request_head(raw)
    assert exc.value.status == status


def test_response_heads() -> None:
    head = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream")
    assert isinstance(head, ResponseHead) and head.status == 200 and head.keep_alive
    assert not parse_response_head(b"HTTP/1.0 200 OK").keep_alive
    assert not parse_response_head(b"HTTP/1.1 503 x\r\nConnection: close").keep_alive
    assert parse_response_head(b"HTTP/1.1 204").status == 204
    with pytest.raises(HttpError):
        parse_response_head(b"SPDY/3 200 OK")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (("Content-Length: 3", "Transfer-Encoding: chunked"), 400),
        (("Content-Length: 3", "Content-Length: 4"), 400),
        (("Content-Length: -3",), 400),
        (("Content-Length: 0x3",), 400),
        (("Transfer-Encoding: gzip, chunked",), 501),
        (("Transfer-Encoding: identity",), 501),
    ],
)
def test_request_framing_that_could_smuggle_is_refused(
    headers: tuple[str, ...], status: int
) -> None:
    with pytest.raises(HttpError) as exc:
        body_reader(request(*headers))
    assert exc.value.status == status


def test_bodies_by_length_and_absent() -> None:
    reader = body_reader(request("Content-Length: 5", "content-length: 5"))
    assert feed_all(reader, [b"he", b"llo", b"GET /"]) == (b"hello", b"GET /")
    assert body_reader(request()).done  # a request without framing has no body
    empty = body_reader(parse_response_head(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9"))
    assert empty.done


def test_response_without_framing_reads_to_the_end() -> None:
    reader = body_reader(parse_response_head(b"HTTP/1.0 200 OK"))
    assert feed_all(reader, [b"abc", b"def"]) == (b"abcdef", b"")
    assert not reader.done
    reader.eof()
    assert reader.done


def test_a_short_body_fails_at_eof() -> None:
    reader = body_reader(request("Content-Length: 10"))
    reader.feed(b"abc")
    with pytest.raises(HttpError):
        reader.eof()


@given(
    st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    st.binary(max_size=10),
)
def test_chunked_bodies_survive_any_split(
    pieces: list[bytes], cuts: list[int], after: bytes
) -> None:
    wire = b"".join(chunk(p) for p in pieces) + LAST_CHUNK
    reader = body_reader(request("Transfer-Encoding: chunked"))
    body, rest = feed_all(reader, [*split(wire + after, cuts)])
    assert reader.done and body == b"".join(pieces) and rest == after


def test_chunk_extensions_and_trailers() -> None:
    wire = b"3;name=value\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT"
    reader = body_reader(request("Transfer-Encoding: chunked"))
    assert feed_all(reader, [wire]) == (b"abc", b"NEXT")


@pytest.mark.parametrize(
    "wire",
    [b"zz\r\nabc\r\n", b"3\r\nabcd\r\n", b"-1\r\n", b"\r\n", b"1" * 5000],
)
def test_malformed_chunks(wire: bytes) -> None:
    reader = body_reader(request("Transfer-Encoding: chunked"))
    with pytest.raises(HttpError):
        reader.feed(wire)


def test_what_the_proxy_writes() -> None:
    assert chunk(b"hello") == b"5\r\nhello\r\n"
    head = response_head(200, [("Content-Type", "text/plain"), ("content-length", "2")])
    assert head == b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\ncontent-length: 2\r\n\r\n"
    assert response_head(599, []).startswith(b"HTTP/1.1 599 Unknown")
    kept = without(
        [("Connection", "close"), ("X-A", "1"), ("host", "h")], frozenset({"connection", "host"})
    )
    assert kept == [("X-A", "1")]
