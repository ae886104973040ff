"""HTTP/1.1 framing of the proxy's data path: heads, body readers, chunk encoding."""

from __future__ import annotations

import asyncio
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


# -- the front server and an upstream connection, fed bytes split anywhere ------------------


class FakeTransport:
    """Collects what a protocol writes; reading can be paused and the transport closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """The status and body of each response in ``data``."""
    out = []
    while data:
        raw, data = data.split(b"\r\n\r\n", 1)
        head = parse_response_head(raw)
        body, data = body_reader(head).feed(data)
        out.append((head.status, b"".join(body)))
    return out


@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=5),
    st.lists(st.booleans(), min_size=5, max_size=5),
    st.lists(st.integers(min_value=0, max_value=5000), max_size=15),
)
def test_front_reads_pipelined_requests_split_anywhere(
    bodies: list[bytes], chunked: list[bool], cuts: list[int]
) -> None:
    from kvroute.proxy.front import FrontConnection, FrontServer, Request

    async def echo(req: Request, down: FrontConnection) -> None:
        await asyncio.sleep(0)
        down.send(200, [("X-Path", req.head.path)], req.body)

    async def run() -> bytes:
        server = FrontServer(echo, max_body=1 << 20)
        conn = FrontConnection(server)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        wire = b""
        for i, body in enumerate(bodies):
            if chunked[i]:
                framed = b"".join(chunk(body[j : j + 7]) for j in range(0, len(body), 7))
                wire += b"POST /e%d HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" % i
                wire += framed + LAST_CHUNK
            else:
                wire += b"POST /e%d HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (i, len(body))
                wire += body
        for piece in split(wire, cuts):
            conn.data_received(piece)
            await asyncio.sleep(0)
        for _ in range(4 * len(bodies) + 4):
            await asyncio.sleep(0)
        assert not transport.closing
        return bytes(transport.out)

    got = responses(asyncio.run(run()))
    assert got == [(200, b) for b in bodies]


@given(
    st.lists(st.binary(min_size=1, max_size=50), max_size=6),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
)
def test_upstream_reads_answers_split_anywhere(
    pieces: list[bytes], chunked: bool, cuts: list[int]
) -> None:
    from kvroute.proxy.upstream import UpstreamConnection, UpstreamPool

    async def run() -> tuple[bytes, bool]:
        pool = UpstreamPool(connect_timeout=1.0, read_timeout=10.0)
        conn = UpstreamConnection(pool, ("http", "h", 80))
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        ex = conn.send(b"GET / HTTP/1.1\r\n\r\n", stream=True)
        body = b"".join(pieces)
        if chunked:
            wire = b"HTTP/1.1 100 Continue\r\n\r\n"  # an interim answer first
            wire += b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            wire += b"".join(chunk(p) for p in pieces) + LAST_CHUNK
        else:
            wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        got: list[bytes] = []
        for i, part in enumerate(split(wire, cuts)):
            conn.data_received(part)
            if i == 0:
                ex.relay = lambda data, end: got.append(data)
        await ex.done
        assert ex.error is None and ex.status == 200
        return b"".join(ex.body) + b"".join(got), conn.exchange is None

    body, released = asyncio.run(run())
    assert body == b"".join(pieces) and released


def test_idle_upstream_connections_are_closed() -> None:
    from kvroute.proxy.upstream import UpstreamConnection, UpstreamPool

    async def run() -> tuple[bool, bool, int]:
        pool = UpstreamPool(connect_timeout=1.0, read_timeout=10.0, idle_timeout=0.2)
        transports = []
        for _ in range(2):
            conn = UpstreamConnection(pool, ("http", "h", 80))
            transports.append(FakeTransport())
            conn.connection_made(transports[-1])  # type: ignore[arg-type]
            conn.send(b"GET / HTTP/1.1\r\n\r\n", stream=False)
            conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # back to idle
            await asyncio.sleep(0.15)
        first_closed, second_open = transports[0].closing, not transports[1].closing
        await asyncio.sleep(0.4)
        return (
            first_closed,
            second_open and transports[1].closing,
            len(pool._idle[("http", "h", 80)]),
        )

    assert asyncio.run(run()) == (True, True, 0)
