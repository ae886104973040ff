"""Forwarding one OpenAI request: key it, route it, send it, relay the answer, and close the
router's lifecycle for it whatever happens.

Lifecycle (``docs/semantics.md`` §2): ``route`` when the request is sent, ``first_token`` at
the first streamed chunk from the backend, ``finish`` in a ``finally`` that every path runs
(success, error, timeout, client disconnect, cancellation), so the router's counters go back
to zero.

Failures: an attempt that fails to connect, or gets a 5xx answer, before any byte reached the
client is finished in the router and retried on the next choice (the failed backends are
hidden from the router for that one decision), up to ``retries`` more times; a stalled
backend (no byte within ``request_timeout_s``) gives 504 without retry; a backend failing
mid-stream ends the client's stream with an OpenAI-style ``error`` event; a client that
disconnects closes the upstream connection (vLLM then aborts the request). A kept-alive
upstream connection that turns out closed before answering a byte is replaced by a new one
to the same backend once, without counting a failure. The body is sent upstream byte for
byte.

The relay of a stream runs in the upstream connection's ``data_received``: each chunk from
the backend is written to the client as it comes (:mod:`.upstream`, :mod:`.front`), with no
task switch per chunk. A stream whose ``data: [DONE]`` went out is complete whatever follows.

With the router on vLLM's cache rule and keys of token ids, the blocks an answer's output
completes are recorded (``Router.extend``) before its end goes to the client; when that needs
the backend's ``/tokenize`` (text, ``backend`` mode) this data path does it just after the
``[DONE]`` was written, so a client quick enough may route its next turn before (the native
path waits for it).

Per request: O(prompt) keying plus one router decision; loop-affine.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import kvroute
from kvroute._core import sequence_keys
from kvroute.errors import NoInstanceAvailableError
from kvroute.proxy.backends import Backend, BackendPool
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.front import FrontConnection, Request, dumps_json
from kvroute.proxy.http1 import Headers, without
from kvroute.proxy.keys import Keyed, Keyer, Keys, TextOutput, session_of
from kvroute.proxy.observe import BackendMetrics, DecisionLog, ProxyMetrics
from kvroute.proxy.prompts import BadRequest, error_body, wants_stream
from kvroute.proxy.upstream import Exchange, UpstreamPool

if TYPE_CHECKING:
    from kvroute._core import RouteInfo

#: Request headers not forwarded (hop-by-hop, framing, and compression: answers come plain).
HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "accept-encoding",
    )
)
#: Answer headers not relayed (hop-by-hop and framing: the proxy frames its own answers).
DROP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length"))
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_RETRY_STATUS = frozenset((500, 502, 503, 504))
_TAIL = 2048
_MAX_OUTPUT = 16 << 20
#: Records an answer's output blocks (see :meth:`Forwarder._model_now`).
_Model = Callable[[bytes, bool], "Coroutine[Any, Any, None] | None"]


def upstream_request(method: str, target: str, host: str, headers: Headers, body: bytes) -> bytes:
    """An HTTP/1.1 request: head and body."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    lines.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class _Fail(Exception):
    kind: str
    status: int
    message: str
    retry: bool
    body: bytes | None = None
    headers: Headers | None = None

    def answer(self, down: FrontConnection) -> None:
        if self.body is not None:
            down.send(self.status, self.headers or [], self.body)
            return
        kind = "gateway_timeout" if self.status == 504 else "bad_gateway"
        down.send_json(self.status, error_body(self.message, kind, self.status))


class Forwarder:
    """The request path of the proxy (see the module doc)."""

    def __init__(
        self,
        config: ProxyConfig,
        router: kvroute.Router,
        pool: BackendPool,
        keyer: Keyer,
        metrics: ProxyMetrics,
        decision_log: DecisionLog | None,
    ) -> None:
        self.config, self.router, self.pool, self.keyer = config, router, pool, keyer
        self.metrics, self.log = metrics, decision_log
        self.upstreams: UpstreamPool | None = None
        self._session_header = config.session_header.lower()
        self._sem = asyncio.Semaphore(config.max_concurrency)
        self._ids = itertools.count(1)
        self._model_output = router.cache_rule == "vllm"

    async def handle(self, req: Request, down: FrontConnection, chat: bool) -> None:
        """``POST /v1/completions`` or ``/v1/chat/completions``."""
        try:
            body, keys, n_in, tail = await self.keyer.parse(req.body, chat)
            stream = wants_stream(body)
            header = req.head.get(self._session_header)
            session = session_of(header, body, self.config.session_field)
        except BadRequest as exc:
            self.metrics.error("bad_request")
            down.send_json(400, error_body(str(exc), "invalid_request_error", 400, exc.param))
            return
        headers = without(req.head.headers, HOP)
        prompt = Keyed(keys, n_in, tail if self._model_output else None)
        async with self._sem:
            await self._forward(req, down, headers, stream, prompt, session)

    def _route(self, rid: int, keys: Keys, n_in: int, session: Any, hide: list[int]) -> RouteInfo:
        hidden = [i for i in hide if self.pool.get(i).up and not self.pool.get(i).removed]
        for i in hidden:
            self.router.set_available(i, False)
        try:
            return self.router.route_info(rid, keys, n_in, session)
        finally:
            for i in hidden:
                self.router.set_available(i, True)

    async def _forward(
        self,
        req: Request,
        down: FrontConnection,
        headers: Headers,
        stream: bool,
        prompt: Keyed,
        session: Any,
    ) -> None:
        keys, n_in = prompt.keys, prompt.input_length
        rid = next(self._ids)
        tried: list[int] = []
        fail: _Fail | None = None
        ex: Exchange | None = None
        try:
            for attempt in range(self.config.retries + 1):
                terms = None if self.log is None else DecisionLog.terms(self.router, keys, n_in)
                try:
                    info = self._route(rid, keys, n_in, session, tried)
                except NoInstanceAvailableError:
                    if fail is not None:
                        fail.answer(down)
                        return
                    self.metrics.error("no_backend")
                    down.send_json(
                        503, error_body("no backend is available", "service_unavailable", 503)
                    )
                    return
                if attempt == 0:
                    self.metrics.routing.observe(time.perf_counter() - req.t0)
                b = self.pool.get(info["instance"])
                bm = self.metrics.backend(b.label)
                bm.decision(info["branch"])
                bm.estimated.inc(info["hit_tokens"])
                if self.log is not None:
                    self._log_decision(rid, session, n_in, info, b, attempt, terms)
                start = partial(self._start_stream, down, b, info, bm, rid, prompt, req.t0)
                try:
                    ex = await self._attempt(b, req, headers, stream, start)
                except _Fail as f:
                    self.router.finish(rid)
                    bm.error(f.kind)
                    self.pool.failure(b)
                    tried.append(b.index)
                    fail = f
                    if f.retry and attempt < self.config.retries:
                        bm.retries.inc()
                        continue
                    f.answer(down)
                    return
                break
            else:  # pragma: no cover - the loop always returns or breaks
                raise AssertionError("unreachable")
            if isinstance(ex.relay, _Stream):
                await self._end_stream(down, ex, ex.relay, b, bm, req.t0)
                return
            self.pool.success(b)
            body = b"".join(ex.body)
            if prompt.tail is not None and ex.status == 200:
                await self._model(rid, prompt, body, stream=False)
            self._usage(bm, body)
            bm.e2e.observe(time.perf_counter() - req.t0)
            down.send(ex.status, _answer_headers(ex, b, info), body)
        except asyncio.CancelledError:
            if ex is not None and isinstance(ex.relay, _Stream) and ex.relay.ended:
                # Complete: a client may hang up between [DONE] and the body's last chunk.
                self._usage(bm, ex.relay.tail)
                bm.e2e.observe(time.perf_counter() - req.t0)
            else:
                self.metrics.error("client_disconnect")
            raise
        finally:
            if ex is not None:
                ex.abort()
            self.router.finish(rid)

    async def _attempt(
        self,
        b: Backend,
        req: Request,
        headers: Headers,
        stream: bool,
        start: Callable[[Exchange], None],
    ) -> Exchange:
        """Send to ``b``; the exchange, once a streamed answer has started (``start``, called
        from the upstream's callback at its first bytes) or the whole answer is in."""
        assert self.upstreams is not None
        data = upstream_request(
            req.head.method, b.prefix + req.head.target, b.host, headers, req.body
        )
        fresh = False
        while True:
            try:
                conn = await self.upstreams.acquire(b.address, fresh)
            except (TimeoutError, OSError) as exc:
                raise _Fail("connect", 502, f"backend {b.index} failed: {exc!r}", True) from exc
            ex = conn.send(data, stream)
            ex.on_first = start
            try:
                await ex.ready
            except asyncio.CancelledError:
                ex.abort()
                raise
            if ex.error is None or ex.relay is not None:
                break
            if isinstance(ex.error, TimeoutError):
                raise _Fail("timeout", 504, f"backend {b.index} timed out", False)
            if ex.reused and ex.received == 0 and not fresh:
                fresh = True  # a kept-alive connection the backend had closed: once more
                continue
            raise _Fail("connect", 502, f"backend {b.index} failed: {ex.error!r}", True)
        if ex.status in _RETRY_STATUS:
            await ex.done
            if ex.error is not None:
                raise _Fail("connect", 502, f"backend {b.index} failed: {ex.error!r}", True)
            relayed = without(ex.headers, DROP)
            raise _Fail("status", ex.status, "", True, b"".join(ex.body), relayed)
        if stream and ex.status == 200 and not ex.body:
            raise _Fail("connect", 502, f"backend {b.index} sent an empty stream", True)
        return ex

    def _start_stream(
        self,
        down: FrontConnection,
        b: Backend,
        info: RouteInfo,
        bm: BackendMetrics,
        rid: int,
        prompt: Keyed,
        t0: float,
        ex: Exchange,
    ) -> None:
        """A streamed 200 answer's first bytes are in: answer the client and relay the rest
        from the upstream's callbacks (this runs in one; no task switch before the client
        gets its first token)."""
        self.router.first_token(rid)
        bm.ttft.observe(time.perf_counter() - t0)
        self.pool.success(b)
        first = b"".join(ex.body)
        model = None if prompt.tail is None else partial(self._model_now, rid, prompt)
        ex.relay = _Stream(down, first, model)
        down.follow(ex)
        down.start(200, _answer_headers(ex, b, info), first)

    async def _end_stream(
        self,
        down: FrontConnection,
        ex: Exchange,
        stream: _Stream,
        b: Backend,
        bm: BackendMetrics,
        t0: float,
    ) -> None:
        """Wait for a relayed stream's end; end the client's stream (with an error event when
        the backend failed)."""
        await ex.done
        down.follow(None)
        if stream.later is not None:
            await stream.later
        if ex.error is not None and not stream.ended:
            timeout = isinstance(ex.error, TimeoutError)
            bm.error("timeout" if timeout else "midstream")
            self.pool.failure(b)
            what = "timed out" if timeout else f"failed: {ex.error!r}"
            err = error_body(f"backend {b.index} {what} mid-stream", "bad_gateway", 502)
            down.write(b"data: " + dumps_json(err) + b"\n\n")
            down.end()
            return
        self._usage(bm, stream.tail)
        down.end()
        bm.e2e.observe(time.perf_counter() - t0)

    def _model_now(
        self, rid: int, prompt: Keyed, answer: bytes, stream: bool
    ) -> Coroutine[Any, Any, None] | None:
        """Record the blocks an answer's output completed (vLLM stores them), when its ids
        are known at once; else the coroutine that asks the backend to tokenize its text."""
        got = self.keyer.output_now(answer, stream)
        if isinstance(got, TextOutput):
            return self._tokenize_then_extend(rid, prompt, got)
        if got is not None:
            self._extend(rid, prompt, *got)
        return None

    async def _model(self, rid: int, prompt: Keyed, answer: bytes, stream: bool) -> None:
        got = self._model_now(rid, prompt, answer, stream)
        if got is not None:
            await got

    async def _tokenize_then_extend(self, rid: int, prompt: Keyed, out: TextOutput) -> None:
        got = await self.keyer.tokenize_output(out)
        if got is not None:
            self._extend(rid, prompt, *got)

    def _extend(self, rid: int, prompt: Keyed, ids: Any, generated: int) -> None:
        keys, n = prompt.keys, prompt.input_length
        bs = self.keyer.block_size
        seq = sequence_keys(keys, n, prompt.tail, ids, generated, bs)
        if len(seq) > n // bs:
            self.router.extend(rid, seq)

    def _usage(self, bm: BackendMetrics, data: bytes) -> None:
        cached = _CACHED.findall(data)
        if cached:
            bm.reported.inc(int(cached[-1]))
        prompt = _PROMPT.findall(data)
        if prompt:
            bm.prompt.inc(int(prompt[-1]))

    def _log_decision(
        self,
        rid: int,
        session: Any,
        n_in: int,
        info: RouteInfo,
        b: Backend,
        attempt: int,
        terms: list[dict[str, Any]] | None,
    ) -> None:
        assert self.log is not None
        self.log.write(
            {
                "request": rid,
                "session": session,
                "attempt": attempt,
                "instance": info["instance"],
                "backend": b.label,
                "branch": info["branch"],
                "input_length": n_in,
                "estimated_hit_tokens": info["hit_tokens"],
                "new_prefill": info["new_prefill"],
                "terms": terms,
            }
        )


class _Stream:
    """A streamed answer being relayed: each upstream read is written to the client as it
    comes; the last ``_TAIL`` bytes are kept for the usage they may carry. With ``model``,
    the whole answer is kept until its ``[DONE]``, which ``model`` sees first (the router
    records its output's blocks before the client can send its next turn; when that takes
    the backend's tokenizer, ``later`` is the round-trip, awaited before the end)."""

    __slots__ = ("answer", "down", "later", "model", "tail")

    def __init__(self, down: FrontConnection, first: bytes, model: _Model | None = None) -> None:
        self.down = down
        self.tail = first[-_TAIL:]
        self.model = model
        self.answer = bytearray(first) if model is not None else None
        self.later: asyncio.Future[None] | None = None
        self._see()

    @property
    def ended(self) -> bool:
        """Whether the last event so far is ``data: [DONE]`` (the engine is done)."""
        end = self.tail.rstrip()
        return end.endswith((b"data: [DONE]", b"data:[DONE]"))

    def __call__(self, data: bytes, end: bool) -> None:
        self.tail = (self.tail + data)[-_TAIL:]
        if self.answer is not None:
            self.answer += data
            self._see()
        self.down.write(data, end)

    def _see(self) -> None:
        if self.answer is None or self.model is None:
            return
        if len(self.answer) > _MAX_OUTPUT:
            self.answer = None  # too long to keep: its output is not modelled
        elif self.ended:
            later = self.model(bytes(self.answer), True)
            self.answer = None
            if later is not None:
                self.later = asyncio.ensure_future(later)


def _answer_headers(ex: Exchange, b: Backend, info: RouteInfo) -> Headers:
    """The backend's answer headers to relay, and the proxy's own."""
    return [
        *without(ex.headers, DROP),
        ("X-Kvroute-Instance", str(b.index)),
        ("X-Kvroute-Backend", b.label),
        ("X-Kvroute-Hit-Tokens", str(info["hit_tokens"])),
    ]
