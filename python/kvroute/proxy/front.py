"""The proxy's HTTP/1.1 server: reads requests off raw asyncio transports and writes answers.

:class:`FrontServer` listens; each client connection is a :class:`FrontConnection`, which
reads requests one at a time (keep-alive; pipelined requests wait their turn), refuses what
cannot be served (400 malformed head or body framing, 413 over ``max_body`` bytes, 431 head
over 64 KiB, 505 not HTTP/1.x; each with an OpenAI-style JSON error, then closes), answers
``Expect: 100-continue``, and runs ``handler(request, connection)`` as one task per request.
The handler answers through the connection:

* :meth:`FrontConnection.send`: a whole answer with ``Content-Length``;
* :meth:`~FrontConnection.start`, :meth:`~FrontConnection.write`, :meth:`~FrontConnection.end`:
  a streamed answer, chunked for HTTP/1.1 clients (to the end of the connection for
  HTTP/1.0); ``write`` is a plain call, so a relay can write from another protocol's
  ``data_received``. While the client's socket buffer is full, the connection keeps the
  ``flow`` it follows (:meth:`~FrontConnection.follow`: the upstream answer being relayed)
  paused.

A client that disconnects cancels its request's task at once. Connections idle for
``idle_timeout`` seconds are closed. :meth:`FrontServer.close` stops listening, lets running
requests finish for a grace period, then cancels them.

O(bytes) per request; loop-affine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kvroute.proxy.http1 import (
    LAST_CHUNK,
    MAX_HEAD,
    BodyReader,
    Headers,
    HttpError,
    RequestHead,
    body_reader,
    chunk,
    parse_request_head,
    response_head,
)
from kvroute.proxy.prompts import error_body

try:
    import orjson

    dumps_json: Callable[[Any], bytes] = orjson.dumps
except ImportError:  # pragma: no cover - orjson is optional
    import json

    def dumps_json(obj: Any) -> bytes:
        return json.dumps(obj).encode()


log = logging.getLogger("kvroute.proxy")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_KINDS = {400: "invalid_request_error", 413: "invalid_request_error", 505: "not_supported"}


@dataclass
class Request:
    """One request: its head, whole body, and when it was read (``time.perf_counter``)."""

    head: RequestHead
    body: bytes
    t0: float


Handler = Callable[[Request, "FrontConnection"], Coroutine[Any, Any, None]]


class Pausable(Protocol):
    """What a connection pauses while the client's buffer is full (an upstream reader)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class FrontConnection(asyncio.Protocol):
    """One client connection (see the module doc)."""

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.flow: Pausable | None = None
        self.last = server.loop.time()
        self._buf = b""
        self._head: RequestHead | None = None
        self._reader: BodyReader | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self._keep = True
        self._http11 = True
        self._state = 0  # of the answer: 0 not begun, 1 streaming, 2 complete
        self._reading_paused = False
        self._writing_paused = False

    # -- answering (the handler's side)
    def send(self, status: int, headers: Headers, body: bytes, length: str | None = None) -> None:
        """A whole answer; ``length`` (the ``Content-Length`` of an answer to ``HEAD``, which
        has no body) stands for ``len(body)``."""
        headers = [*headers, ("content-length", length or str(len(body)))]
        if not self._keep:
            headers.append(("connection", "close"))
        self._state = 2
        self._write(response_head(status, headers) + body)

    def send_json(self, status: int, obj: Any, headers: Headers | None = None) -> None:
        """A whole JSON answer."""
        self.send(status, [("content-type", "application/json"), *(headers or [])], dumps_json(obj))

    def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """Begin a streamed answer, with its first body bytes."""
        if self._http11:
            head = response_head(status, [*headers, ("transfer-encoding", "chunked")])
            self._write(head + chunk(first) if first else head)
        else:
            self._keep = False
            self._write(response_head(status, [*headers, ("connection", "close")]) + first)
        self._state = 1

    def write(self, data: bytes, end: bool = False) -> None:
        """More body bytes of a streamed answer; ``end``: the last (one write for both)."""
        if self._state != 1:
            return
        if self._http11:
            framed = chunk(data) if data else b""
            data = framed + LAST_CHUNK if end else framed
        if end:
            self._state = 2
        if data:
            self._write(data)

    def end(self) -> None:
        """The end of a streamed answer (when ``write`` has not ended it)."""
        self.write(b"", True)

    def follow(self, flow: Pausable | None) -> None:
        """Pause ``flow`` whenever the client's buffer is full (at once if it is now);
        None: stop following."""
        self.flow = flow
        if flow is not None and self._writing_paused:
            flow.pause()

    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    # -- asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last = self.server.loop.time()
        self._buf = self._buf + data if self._buf else data
        if self._task is None:
            self._advance()
        elif len(self._buf) > MAX_HEAD + self.server.max_body and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        return False  # a client that stops sending has gone (as vLLM's server sees it)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._task is not None:
            self._task.cancel()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.flow is not None:
            self.flow.pause()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.flow is not None:
            self.flow.resume()

    # -- reading requests
    def _advance(self) -> None:
        server = self.server
        while self._task is None and not self.closed:
            if self._head is None:
                self._buf = self._buf.lstrip(b"\r\n")
                end = self._buf.find(b"\r\n\r\n")
                if end > MAX_HEAD or (end < 0 and len(self._buf) > MAX_HEAD):
                    self._refuse(431, "the request head exceeds 64 KiB")
                    return
                if end < 0:
                    return
                try:
                    head = parse_request_head(self._buf[:end])
                    reader = body_reader(head)
                except HttpError as exc:
                    self._refuse(exc.status, str(exc))
                    return
                self._buf = self._buf[end + 4 :]
                length = head.get("content-length")
                if length is not None and int(length) > server.max_body:
                    self._refuse(413, f"the request body exceeds {server.max_body} bytes")
                    return
                self._head, self._reader, self._body, self._size = head, reader, [], 0
                self._t0 = time.perf_counter()
                expect = (head.get("expect") or "").lower() == "100-continue"
                if expect and not reader.done and not self._buf:
                    self._write(_CONTINUE)
            assert self._reader is not None
            try:
                pieces, rest = self._reader.feed(self._buf)
            except HttpError as exc:
                self._refuse(exc.status, str(exc))
                return
            self._body.extend(pieces)
            self._size += sum(map(len, pieces))
            if self._size > server.max_body:
                self._refuse(413, f"the request body exceeds {server.max_body} bytes")
                return
            if not self._reader.done:
                self._buf = b""
                return
            self._buf = rest
            self._dispatch()

    def _dispatch(self) -> None:
        head = self._head
        assert head is not None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._head, self._reader, self._body = None, None, []
        self._keep = head.keep_alive
        self._http11 = head.version >= (1, 1)
        self._state = 0
        request = Request(head, body, self._t0)
        self._task = self.server.loop.create_task(self.server.handler(request, self))
        self._task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._task = None
        self.flow = None
        self.last = self.server.loop.time()
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("request handler failed", exc_info=exc)
            if self._state == 0:
                self._keep = False
                self.send_json(500, error_body("internal proxy error", "internal_error", 500))
        if self.closed:
            return
        if self._state != 2 or not self._keep:
            self.transport.close()  # type: ignore[union-attr]
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self._buf:
            self._advance()

    def _refuse(self, status: int, message: str) -> None:
        self._keep = False
        self._http11 = True
        kind = _KINDS.get(status, "invalid_request_error")
        self.send_json(status, error_body(message, kind, status))
        self.transport.close()  # type: ignore[union-attr]
        self._buf = b""


class FrontServer:
    """The listening side (see the module doc)."""

    def __init__(self, handler: Handler, max_body: int, idle_timeout: float = 75.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler, self.max_body, self.idle_timeout = handler, max_body, idle_timeout
        self.connections: set[FrontConnection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the bound port."""
        self._server = await self.loop.create_server(
            lambda: FrontConnection(self), host, port, backlog=2048
        )
        self._sweeper = self.loop.call_later(self.idle_timeout / 4, self._sweep)
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if conn._task is None and now - conn.last > self.idle_timeout:
                conn.transport.close()  # type: ignore[union-attr]
        self._sweeper = self.loop.call_later(self.idle_timeout / 4, self._sweep)

    async def close(self, grace: float) -> None:
        """Stop listening; wait up to ``grace`` seconds for running requests, then end all."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + grace
        while any(c._task is not None for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        tasks = [c._task for c in self.connections if c._task is not None]
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace + 1.0)
        await asyncio.sleep(0)
