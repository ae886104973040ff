"""The proxy's HTTP/1.1 on the wire: keep-alive, pipelining, request framings, refusals,
HTTP/1.0 clients, slow readers and slow clients, the connection cap, and backends that
close kept-alive connections. Requests go out as raw bytes; answers are read with h11."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import h11
import pytest
from aiohttp import web

from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from livekit import http, wait_until


class Backend:
    """A fake engine: echoes bodies, streams ``n`` chunks of ``size`` bytes on request (with
    ``pause`` seconds before each; with ``hold``, chunk ``hold`` and those after it wait until
    :attr:`gate` is set, from the server's loop), and records the client ports it saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.ports: set[int] = set()
        self.gate = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", _ok)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:
            self.ports.add(peer[1])
        body = json.loads(raw)
        if not body.get("stream"):
            return web.json_response({"echo": len(raw)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n, size = body.get("n", 2), body.get("size", 8)
        for i in range(n):
            if i == body.get("hold"):
                await asyncio.wait_for(self.gate.wait(), 60)
            await asyncio.sleep(body.get("pause", 0))
            await resp.write(b"data: " + str(i % 10).encode() * size + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()


LOOPS = ["asyncio", *(["uvloop"] if importlib.util.find_spec("uvloop") else [])]


@pytest.fixture(scope="module", params=LOOPS)
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[str, Backend, Proxy]]:
    """A proxy in front of a :class:`Backend`, on asyncio's event loop and on uvloop's (the
    command line's), whose transports differ."""
    with ServerThread(use_uvloop=request.param == "uvloop") as st:
        backend = Backend()
        proxy = Proxy(ProxyConfig(backends=[st.start(backend.app())], max_body_bytes=100_000))
        yield st.start(proxy), backend, proxy


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def post(body: dict[str, Any] | bytes, *headers: str, version: str = "1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"POST /v1/completions HTTP/{version}", "Host: x", f"Content-Length: {len(data)}"]
    return ("\r\n".join([*head, *headers]) + "\r\n\r\n").encode() + data


class Head:
    """An answer's status and headers."""

    def __init__(self, event: h11.Response | h11.InformationalResponse) -> None:
        self.status = event.status_code
        self.headers = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)


class Reader:
    """Answers off a socket, one after another, parsed by h11 (each read as the answer to a
    request of ``method``: the requests themselves went out raw)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT)
        self.interim = False  # an interim answer came: the final one is still due

    def response(self, method: str = "POST") -> tuple[Head, bytes]:
        c = self.conn
        if not self.interim:
            if c.our_state is h11.DONE and c.their_state is h11.DONE:
                c.start_next_cycle()
            c.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
            c.send(h11.EndOfMessage())
        head, body = None, b""
        while True:
            event = c.next_event()
            if event is h11.NEED_DATA:
                c.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.InformationalResponse):
                self.interim = True
                return Head(event), b""
            elif isinstance(event, h11.Response):
                self.interim, head = False, Head(event)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, body
            else:
                raise EOFError(f"the connection ended before an answer: {event!r}")

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_keep_alive_and_pipelining(proxied: tuple[str, Backend, Proxy]) -> None:
    url, backend, proxy = proxied
    with connect(url) as sock:
        r = Reader(sock)
        sock.sendall(post({"prompt": [1]}) + post({"prompt": [2], "stream": True}))
        head, body = r.response()
        assert head.status == 200 and json.loads(body)["echo"] == len(b'{"prompt": [1]}')
        head, body = r.response()
        assert head.status == 200 and head.get("transfer-encoding") == "chunked"
        assert body.endswith(b"data: [DONE]\n\n")
        for i in range(10):
            sock.sendall(post({"prompt": [3, i]}))
            assert r.response()[0].status == 200
    assert len(backend.ports) <= 2  # kept-alive upstream connections, reused
    wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")


def test_chunked_and_expect_continue_requests(proxied: tuple[str, Backend, Proxy]) -> None:
    url, backend, _ = proxied
    data = json.dumps({"prompt": [7, 8, 9]}).encode()
    with connect(url) as sock:
        r = Reader(sock)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\n" + data[:5] + b"\r\n")
        time.sleep(0.05)
        sock.sendall(b"%x\r\n" % (len(data) - 5) + data[5:] + b"\r\n0\r\n\r\n")
        assert r.response()[0].status == 200
        assert backend.bodies[-1] == data  # forwarded as one body with its length
        sock.sendall(post(data, "Expect: 100-continue").split(b"\r\n\r\n")[0] + b"\r\n\r\n")
        assert r.response()[0].status == 100
        sock.sendall(data)
        assert r.response()[0].status == 200
    # Transfer-Encoding wins over a Content-Length beside it (dropped, RFC 9112 6.3), and the
    # connection closes after the answer.
    with connect(url) as sock:
        r = Reader(sock)
        both = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        both += b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
        sock.sendall(both)
        assert r.response()[0].status == 200
        assert backend.bodies[-1] == data


def test_http10_client_gets_a_close_delimited_stream(proxied: tuple[str, Backend, Proxy]) -> None:
    url, _, _ = proxied
    with connect(url) as sock:
        sock.sendall(post({"prompt": [1], "stream": True, "n": 3}, version="1.0"))
        r = Reader(sock)
        head, body = r.response()
        assert head.status == 200 and head.get("transfer-encoding") is None
        assert body.count(b"data: ") == 4 and r.closed()


#: Requests hyper refuses before the relay sees them (a bare status, no body; ``ours`` 0), and
#: those the relay refuses itself (with an OpenAI-style JSON error; ``ours`` 1).
UNREADABLE = [
    (b"NOT HTTP\r\n\r\n", 400, 0),
    (b"GET / HTTP/2.0\r\n\r\n", 400, 0),  # a version hyper does not parse
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, 0),
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, 0),
    # RFC 9110 section 5.5: a bare CR, a NUL or a lone LF inside a header value
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400, 0),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400, 0),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\nb\r\n\r\n", 400, 0),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, 1),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, 1),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400, 0),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 200000\r\n\r\n", 413, 1),
    (
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"8000\r\n" + b"1" * 0x8000 + b"\r\n") * 4,
        413,
        1,
    ),
]


@pytest.mark.parametrize(("raw", "status", "ours"), UNREADABLE)
def test_unreadable_requests_are_refused_and_closed(
    proxied: tuple[str, Backend, Proxy], raw: bytes, status: int, ours: int
) -> None:
    url, _, proxy = proxied
    with connect(url) as sock:
        sock.sendall(raw)
        r = Reader(sock)
        head, body = r.response()
        assert head.status == status
        if ours:
            assert json.loads(body)["error"]["code"] == status
        assert r.closed()
    wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")


def test_requests_the_side_application_is_not_sent(
    proxied: tuple[str, Backend, Proxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A method that is not upper case, and a request target over 8 KiB, are answered by the
    relay (405, 414) on a connection that stays open; the side application logs nothing."""
    url, _, _ = proxied
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    with connect(url) as sock:
        r = Reader(sock)
        for raw, status, method in [
            (b"get /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, "GET"),
            (
                b"post /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
                405,
                "POST",
            ),
            (b"GET /health?" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "GET"),
            (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200, "GET"),
        ]:
            sock.sendall(raw)
            head, body = r.response(method)
            assert head.status == status, body
            if status != 200:
                assert json.loads(body)["error"]["code"] == status
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text


def test_a_slow_reader_gets_every_byte(proxied: tuple[str, Backend, Proxy]) -> None:
    url, _, proxy = proxied
    with connect(url) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(post({"prompt": [1], "stream": True, "n": 300, "size": 20000}))
        # the relay waits on its write to this client and reads nothing upstream meanwhile
        time.sleep(0.3)  # the proxy's buffer to this client fills up meanwhile
        head, body = Reader(sock).response()
    events = [e for e in body.split(b"\n\n") if e]
    assert head.status == 200 and len(events) == 301
    assert all(e == b"data: " + str(i % 10).encode() * 20000 for i, e in enumerate(events[:-1]))
    wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")


class OneShotBackend:
    """A raw engine that answers one request per connection and closes it when the next
    request arrives (a keep-alive timeout that races the proxy), or, with ``http10``,
    answers with an HTTP/1.0 body that ends with the connection."""

    def __init__(self, http10: bool = False) -> None:
        self.http10 = http10
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if answered and not self.http10:
                    break  # closes without a byte, as a server whose idle timer fired
                answered += 1
                if self.http10:
                    writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
                    writer.write(b"data: 1\n\ndata: [DONE]\n\n")
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.mark.parametrize("http10", [False, True])
def test_backends_closing_kept_alive_connections(http10: bool) -> None:
    fake = OneShotBackend(http10)

    async def start() -> asyncio.Server:
        return await asyncio.start_server(fake.serve, "127.0.0.1", 0)

    async def stop(server: asyncio.Server) -> None:
        server.close()
        await server.wait_closed()

    with ServerThread() as st:
        server = st.call(start())
        backend = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        proxy = Proxy(ProxyConfig(backends=[backend], retries=0))
        url = st.start(proxy)
        for i in range(5):
            body = {"prompt": [i], "stream": http10}
            status, _, raw = http("POST", url + "/v1/completions", body)
            assert status == 200, raw
            assert raw.endswith(b"data: [DONE]\n\n") if http10 else raw == b"{}"
        text = http("GET", url + "/metrics")[2].decode()
        assert "kvroute_proxy_errors_total{" not in text  # nothing counted as a failure
        wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")
        assert proxy.router.state()[0]["available"]
        assert fake.connections >= 5
        st.stop(url)
        st.call(stop(server))


def test_head_requests_to_the_side_endpoints(proxied: tuple[str, Backend, Proxy]) -> None:
    url, _, _ = proxied
    with connect(url) as sock:
        sock.sendall(
            b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        r = Reader(sock)
        head, body = r.response("HEAD")  # an answer to HEAD: its length, no body
        assert head.status == 200 and int(head.get("content-length") or 0) > 0 and not body
        head, body = r.response("GET")
        assert head.status == 200 and json.loads(body)["backends_up"] == 1


@pytest.mark.parametrize("command", [["proxy", "--backend", "http://127.0.0.1:9"], ["engine"]])
def test_a_port_in_use_is_a_clear_error(command: list[str]) -> None:
    from click.testing import CliRunner

    from kvroute.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, [*command, "--port", str(port)])
    assert result.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in result.output


def test_closing_lets_streams_finish_for_the_grace_period() -> None:
    """Closing the proxy: no new connections; a stream that ends within the grace period
    (5 s here) ends normally, one that does not is cut; the router's counters go back to
    zero either way. Both streams are running when the proxy closes (their first chunk came)
    and wait until it has stopped listening; then the short one needs 2 more chunks, the long
    one 100,000 more at 0.05 s each."""
    with ServerThread() as st:
        backend = Backend()
        proxy = Proxy(ProxyConfig(backends=[st.start(backend.app())]))
        url = st.start(proxy, grace=5.0)
        with connect(url) as short, connect(url) as long:
            short.sendall(post({"prompt": [1], "stream": True, "n": 3, "hold": 1}))
            n = 100_001
            long.sendall(post({"prompt": [2], "stream": True, "n": n, "hold": 1, "pause": 0.05}))
            got = {short: b"", long: b""}
            for sock in got:
                while b"data: " not in got[sock]:
                    chunk = sock.recv(65536)
                    assert chunk, "the stream ended before its first chunk"
                    got[sock] += chunk
            closing = threading.Thread(target=st.stop, args=(url,))
            closing.start()

            def refused() -> bool:
                try:
                    connect(url).close()
                except OSError:
                    return True
                return False

            wait_until(refused, what="the proxy to stop listening")
            st.run(backend.gate.set)
            r = Reader(short)
            r.conn.receive_data(got[short])
            head, body = r.response()
            assert head.status == 200 and body.count(b"data: ") == 4
            cut = got[long]
            while chunk := long.recv(65536):
                cut += chunk
            closing.join()
        # Cut: no end of the chunked body; chunks kept coming during the grace period.
        assert b"0\r\n\r\n" not in cut and 3 <= cut.count(b"data: ") < n
        wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")
        with pytest.raises(OSError):
            connect(url).close()


def open_now(sock: socket.socket) -> bool:
    """Whether the other end has not closed ``sock`` (nothing may have arrived on it)."""
    if not select.select([sock], [], [], 0)[0]:
        return True  # nothing to read, not even the end
    try:
        got = sock.recv(1)
    except ConnectionResetError:
        return False
    assert got == b"", f"an answer to a request head that was never complete: {got!r}"
    return False


def test_slow_clients_are_cut_at_the_header_deadline_and_others_are_served() -> None:
    """Clients that drip their request head a byte at a time (or send nothing) hold a
    connection for at most the header-read deadline (10 s here): however long they go on
    dripping, they are cut. A client beside them is served at once, again and again, while
    they are all still open."""
    deadline_s = 10.0
    with ServerThread() as st:
        backend = Backend()
        config = ProxyConfig(backends=[st.start(backend.app())], header_read_timeout_s=deadline_s)
        proxy = Proxy(config)
        url = st.start(proxy)
        t0 = time.monotonic()
        slow = [connect(url) for _ in range(8)]
        try:
            # A head that never ends: a header value that grows by a byte at each drip.
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Drip: "
            for sock in slow[:4]:
                sock.sendall(head)
            for _ in range(6):  # the others drip on; a fast client meanwhile
                for sock in slow[:4]:
                    with contextlib.suppress(OSError):
                        sock.send(b"a")
                status, _, _ = http("POST", url + "/v1/completions", {"prompt": [2]})
                assert status == 200
            # All served while every slow client still held its connection.
            assert all(open_now(sock) for sock in slow)
            # Dripping on does not keep a connection: each is cut (a head of a few hundred
            # bytes at most; 64 KiB would be refused as too large instead).
            open_ = list(slow)
            while open_:
                assert time.monotonic() - t0 < 60, f"{len(open_)} slow clients never cut"
                time.sleep(0.05)
                for sock in slow[:4]:
                    if sock in open_:
                        with contextlib.suppress(OSError):
                            sock.send(b"a")
                open_ = [sock for sock in open_ if open_now(sock)]
            # Not before the deadline (the clock of each began after its connect).
            assert time.monotonic() - t0 >= deadline_s
        finally:
            for sock in slow:
                sock.close()
        wait_until(lambda: proxy.router.in_flight == 0, what="the router to finish")


@pytest.mark.parametrize(
    "body",
    [
        b"1000000000000000\r\n" + b"x" * 100,  # a chunk of 2^60 bytes announced, 100 sent
        b"10\r\n12345",  # a chunk that stops arriving
    ],
)
def test_a_body_not_complete_in_time_gets_408(body: bytes) -> None:
    """A chunked body that stops arriving (whatever chunk it announced) is answered 408 at
    the body-read deadline, and the connection closed; others are served meanwhile."""
    with ServerThread() as st:
        backend = Backend()
        config = ProxyConfig(backends=[st.start(backend.app())], body_read_timeout_s=1.0)
        url = st.start(Proxy(config))
        with connect(url) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            sock.sendall(head + body)
            assert http("POST", url + "/v1/completions", {"prompt": [2]})[0] == 200
            r = Reader(sock)
            answer, text = r.response()
            assert answer.status == 408
            assert "not complete within 1" in json.loads(text)["error"]["message"]
            assert r.closed()


def test_connections_beyond_the_cap_get_503() -> None:
    """With ``max_connections=4`` and four connections open, a fifth gets a 503 with an
    OpenAI-style error and is closed; once one of the four closes, a new one is served."""
    with ServerThread() as st:
        backend = Backend()
        config = ProxyConfig(backends=[st.start(backend.app())], max_connections=4)
        proxy = Proxy(config)
        url = st.start(proxy)
        held = [connect(url) for _ in range(4)]
        try:
            for sock in held:  # each is served (kept alive)
                sock.sendall(post({"prompt": [1]}))
                assert Reader(sock).response()[0].status == 200
            with connect(url) as extra:
                extra.sendall(post({"prompt": [2]}))
                r = Reader(extra)
                head, body = r.response()
                assert head.status == 503 and json.loads(body)["error"]["code"] == 503
                assert b"limit" in body and r.closed()
            held.pop().close()

            def served() -> bool:
                return http("POST", url + "/v1/completions", {"prompt": [3]})[0] == 200

            wait_until(served, what="a connection to be served once one closed")
        finally:
            for sock in held:
                sock.close()
