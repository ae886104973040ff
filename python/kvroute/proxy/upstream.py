"""Keep-alive HTTP/1.1 connections from the proxy to its backends, on raw asyncio transports.

:class:`UpstreamPool` hands out connections per backend address (TCP, TLS for ``https``, or a
Unix socket), newest idle one first, and takes a connection back by itself when its
response ended cleanly and the backend keeps it open. :meth:`UpstreamConnection.send` writes
one request and returns its :class:`Exchange`, which the connection fills as the response
arrives, from ``data_received``, with no task of its own:

* ``status`` and ``headers`` once the head is in (interim 1xx answers are skipped);
* body bytes into ``body`` until the forwarder sets ``relay``, then straight to
  ``relay(data, end)``, ``end`` true with the last bytes (the proxy's streaming path: one
  read and one write per upstream read);
* ``ready`` resolves at the first body bytes of a streamed 200 answer (after calling
  ``on_first(exchange)``, which may set ``relay``), or else at the end; ``done`` at the
  end. Failures (the connection lost mid-message, a malformed answer,
  ``read_timeout`` seconds without a byte) resolve both, with ``error`` set.

An idle connection that the backend closes leaves the pool at once; one idle for
``idle_timeout`` seconds is closed (by a sweep, or when next met). Backpressure:
:meth:`UpstreamConnection.pause` and :meth:`~UpstreamConnection.resume` stop and restart
reading.

O(bytes) per response; loop-affine (one event loop owns a pool and its connections).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from kvroute.errors import InvalidArgumentError
from kvroute.proxy.http1 import (
    MAX_HEAD,
    BodyReader,
    Headers,
    HttpError,
    NoBody,
    body_reader,
    parse_response_head,
)

#: ``(scheme, host, port)``; scheme ``unix`` has the socket's path as host and port 0.
Address = tuple[str, str, int]


def address_of(url: str) -> tuple[Address, str]:
    """The address of an ``http(s)://host:port[/prefix]`` URL and its path prefix; an
    :class:`InvalidArgumentError` for anything else (no host, a port that is not a number
    in 1-65535, an unclosed IPv6 bracket, ...)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"backend URL {url!r} does not parse: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise InvalidArgumentError(f"backend URL must be http(s)://host:port, got {url!r}")
    port = port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, parts.hostname, port), parts.path.rstrip("/")


def without_credentials(url: str) -> str:
    """``url`` without a ``user:password@`` part (for labels, logs and headers)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


class Exchange:
    """One request's response as it arrives (see the module doc)."""

    __slots__ = (
        "_conn",
        "body",
        "done",
        "error",
        "headers",
        "on_first",
        "ready",
        "received",
        "relay",
        "reused",
        "status",
        "stream",
    )

    def __init__(self, conn: UpstreamConnection, stream: bool) -> None:
        loop = conn.pool.loop
        self._conn = conn
        self.stream = stream
        self.reused = conn.uses > 0
        self.status = 0
        self.headers: Headers = []
        self.body: list[bytes] = []
        self.received = 0
        self.error: BaseException | None = None
        self.relay: Callable[[bytes, bool], None] | None = None
        self.on_first: Callable[[Exchange], None] | None = None
        self.ready: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()

    def abort(self) -> None:
        """Give up on the answer: the connection is dropped (the backend sees the request
        cancelled). Nothing once the answer is complete (the connection is no longer ours)."""
        if self._conn.exchange is self:
            self._conn.abort()

    def pause(self) -> None:
        """Stop reading the answer (backpressure)."""
        if self._conn.exchange is self:
            self._conn.pause()

    def resume(self) -> None:
        if self._conn.exchange is self:
            self._conn.resume()

    def _data(self, data: bytes, end: bool) -> None:
        if self.relay is not None:
            self.relay(data, end)
            return
        if not data:
            return
        self.body.append(data)
        if self.stream and self.status == 200 and not self.ready.done():
            if self.on_first is not None:
                self.on_first(self)
            self.ready.set_result(None)

    def _end(self, error: BaseException | None = None) -> None:
        self.error = error
        for fut in (self.ready, self.done):
            if not fut.done():
                fut.set_result(None)


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a backend (see the module doc)."""

    def __init__(self, pool: UpstreamPool, address: Address) -> None:
        self.pool, self.address = pool, address
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.uses = 0
        self.idle_since = 0.0
        self._buf = b""
        self._reader: BodyReader | None = None
        self._keep = True
        self._bodiless = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the forwarder's side
    def send(self, data: bytes, stream: bool, bodiless: bool = False) -> Exchange:
        """Write one request (head and body); its exchange. ``bodiless``: the answer has no
        body whatever its headers say (a ``HEAD`` request)."""
        assert self.transport is not None and self.exchange is None
        loop = self.pool.loop
        ex = self.exchange = Exchange(self, stream)
        self.uses += 1
        self._buf, self._reader, self._keep = b"", None, True
        self._bodiless = bodiless
        self._last = loop.time()
        self._timer = loop.call_at(self._last + self.pool.read_timeout, self._watch)
        self.transport.write(data)
        return ex

    def abort(self, error: BaseException | None = None) -> None:
        """Drop the connection (the backend sees the request cancelled); the exchange, if
        any, ends with ``error``."""
        self._fail(error or ConnectionAbortedError("the proxy dropped the request"))
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # -- asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # nothing was asked: the connection is not in a state to reuse
            self.transport.close()  # type: ignore[union-attr]
            return
        self._last = self.pool.loop.time()
        ex.received += len(data)
        try:
            if self._reader is None:
                data = self._head(ex, data)
                if self._reader is None:
                    return
            pieces, rest = self._reader.feed(data)
        except HttpError as exc:
            self.abort(exc)
            return
        end = self._reader.done
        if pieces or end:
            ex._data(pieces[0] if len(pieces) == 1 else b"".join(pieces), end)
        if end:
            self._complete(clean=not rest)

    def _head(self, ex: Exchange, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise HttpError(502, "response head too long")
                self._buf = buf
                return b""
            head = parse_response_head(buf[:end])
            buf = buf[end + 4 :]
            if head.status >= 200:  # interim 1xx answers are skipped
                break
        self._buf = b""
        ex.status, ex.headers = head.status, head.headers
        self._reader = NoBody() if self._bodiless else body_reader(head)
        self._keep = head.keep_alive
        return buf

    def _complete(self, clean: bool) -> None:
        ex = self.exchange
        self.exchange = None
        if self._timer is not None:
            self._timer.cancel()
        if clean and self._keep and self.transport is not None:
            self.pool._release(self)
        elif self.transport is not None:
            self.transport.close()
        if ex is not None:
            ex._end()

    def _fail(self, error: BaseException) -> None:
        ex = self.exchange
        self.exchange = None
        if self._timer is not None:
            self._timer.cancel()
        if ex is not None:
            ex._end(error)

    def _watch(self) -> None:
        if self.exchange is None:
            return
        loop = self.pool.loop
        due = self._last + self.pool.read_timeout
        if loop.time() < due:
            self._timer = loop.call_at(due, self._watch)
            return
        self.abort(TimeoutError(f"no byte from the backend in {self.pool.read_timeout:g} s"))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._forget(self)
        if self.exchange is None:
            return
        if self._reader is not None:
            try:
                self._reader.eof()
            except HttpError:
                pass
            else:
                self._keep = False
                self.exchange._data(b"", True)
                self._complete(clean=True)
                return
        self._fail(exc or ConnectionResetError("the backend closed the connection"))


class UpstreamPool:
    """Idle keep-alive connections per address (see the module doc)."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        idle_timeout: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.idle_timeout = idle_timeout
        self._ssl = ssl_context
        self._idle: dict[Address, list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    async def acquire(self, address: Address, fresh: bool = False) -> UpstreamConnection:
        """A connection to ``address``: an idle one (unless ``fresh``), else a new one."""
        idle = self._idle.get(address)
        now = self.loop.time()
        while idle and not fresh:
            conn = idle.pop()
            t = conn.transport
            if t is not None and not t.is_closing() and now - conn.idle_since < self.idle_timeout:
                return conn
            if t is not None:
                t.close()
        conn = UpstreamConnection(self, address)
        scheme, host, port = address
        async with asyncio.timeout(self.connect_timeout):
            if scheme == "unix":
                await self.loop.create_unix_connection(lambda: conn, host)
            else:
                tls = None
                if scheme == "https":
                    tls = self._ssl or ssl.create_default_context()
                    self._ssl = tls
                await self.loop.create_connection(lambda: conn, host, port, ssl=tls)
        self._all.add(conn)
        return conn

    def _release(self, conn: UpstreamConnection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.address, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for ``idle_timeout`` (each list is oldest first)."""
        self._sweeper = None
        now = self.loop.time()
        for idle in self._idle.values():
            stale = 0
            while stale < len(idle) and now - idle[stale].idle_since >= self.idle_timeout:
                stale += 1
            for conn in idle[:stale]:
                if conn.transport is not None:
                    conn.transport.close()
            del idle[:stale]
        if any(self._idle.values()):
            self._sweeper = self.loop.call_later(self.idle_timeout / 2, self._sweep)

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.address)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every connection (in-flight exchanges fail)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            if conn.transport is not None:
                conn.transport.abort()
        self._idle.clear()
