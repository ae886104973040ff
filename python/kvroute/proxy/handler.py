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
disconnects closes the upstream connection (vLLM then aborts the request). The body is sent
upstream byte for byte.

Per request: O(prompt) keying plus one router decision; loop-affine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

import kvroute
from kvroute.errors import NoInstanceAvailableError
from kvroute.proxy.backends import Backend, BackendPool
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.keys import Keyer, Keys, session_of
from kvroute.proxy.observe import BackendMetrics, DecisionLog, ProxyMetrics
from kvroute.proxy.prompts import BadRequest, error_body, parse_body, wants_stream

if TYPE_CHECKING:
    from kvroute._core import RouteInfo

_HOP = frozenset(
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
        "accept-encoding",
    )
)
_DROP = frozenset(
    (
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "date",
        "server",
    )
)
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_RETRY_STATUS = frozenset((500, 502, 503, 504))
_TAIL = 2048


def json_error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, status, param), status=status)


@dataclass
class _Fail(Exception):
    kind: str
    status: int
    message: str
    retry: bool
    body: bytes | None = None
    content_type: str = "application/json"

    def response(self) -> web.Response:
        if self.body is not None:
            return web.Response(body=self.body, status=self.status, content_type=self.content_type)
        kind = "gateway_timeout" if self.status == 504 else "bad_gateway"
        return json_error(self.status, self.message, kind)


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
        self.session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(config.max_concurrency)
        self._ids = itertools.count(1)

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """``POST /v1/completions`` or ``/v1/chat/completions``."""
        t0 = time.perf_counter()
        limit = self.config.max_body_bytes
        if (request.content_length or 0) > limit:
            return json_error(
                413, f"the request body exceeds {limit} bytes", "invalid_request_error"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return json_error(
                413, f"the request body exceeds {limit} bytes", "invalid_request_error"
            )
        try:
            body = parse_body(raw)
            stream = wants_stream(body)
            keys, n_in = await self.keyer.keys(body, chat)
        except BadRequest as exc:
            self.metrics.error("bad_request")
            return json_error(400, str(exc), "invalid_request_error", exc.param)
        session = session_of(request, body, self.config.session_header, self.config.session_field)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._sem:
            return await self._forward(request, raw, headers, stream, keys, n_in, session, t0)

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
        request: web.Request,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        keys: Keys,
        n_in: int,
        session: Any,
        t0: float,
    ) -> web.StreamResponse:
        rid = next(self._ids)
        tried: list[int] = []
        fail: _Fail | None = None
        try:
            for attempt in range(self.config.retries + 1):
                terms = None if self.log is None else DecisionLog.terms(self.router, keys, n_in)
                try:
                    info = self._route(rid, keys, n_in, session, tried)
                except NoInstanceAvailableError:
                    if fail is not None:
                        return fail.response()
                    self.metrics.error("no_backend")
                    return json_error(503, "no backend is available", "service_unavailable")
                if attempt == 0:
                    self.metrics.routing.observe(time.perf_counter() - t0)
                b = self.pool.get(info["instance"])
                bm = self.metrics.backend(b.url)
                bm.decision(info["branch"])
                bm.estimated.inc(info["hit_tokens"])
                if self.log is not None:
                    self._log_decision(rid, session, n_in, info, b, attempt, terms)
                try:
                    upstream, first = await self._attempt(b, request.path, raw, headers, stream)
                except _Fail as f:
                    self.router.finish(rid)
                    bm.error(f.kind)
                    self.pool.failure(b)
                    tried.append(b.index)
                    fail = f
                    if f.retry and attempt < self.config.retries:
                        bm.retries.inc()
                        continue
                    return f.response()
                break
            else:  # pragma: no cover - the loop always returns or breaks
                raise AssertionError("unreachable")
            self.pool.success(b)
            extra = {
                "X-Kvroute-Instance": str(b.index),
                "X-Kvroute-Backend": b.url,
                "X-Kvroute-Hit-Tokens": str(info["hit_tokens"]),
            }
            if stream and upstream.status == 200:
                return await self._relay(request, upstream, first, b, bm, rid, extra, t0)
            upstream.release()
            self._usage(bm, first)
            bm.e2e.observe(time.perf_counter() - t0)
            return web.Response(body=first, status=upstream.status, headers=_relay(upstream, extra))
        except asyncio.CancelledError:
            self.metrics.error("client_disconnect")
            raise
        finally:
            self.router.finish(rid)

    async def _attempt(
        self, b: Backend, path: str, raw: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send to ``b``; the response and its first bytes (a stream's first chunk, or the
        whole body)."""
        assert self.session is not None
        try:
            upstream = await self.session.post(b.url + path, data=raw, headers=headers)
        except aiohttp.SocketTimeoutError as exc:
            raise _Fail("timeout", 504, f"backend {b.index} timed out", False) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _Fail("connect", 502, f"backend {b.index} failed: {exc!r}", True) from exc
        try:
            if upstream.status in _RETRY_STATUS:
                body = await upstream.read()
                ctype = upstream.content_type
                raise _Fail("status", upstream.status, "", True, body, ctype)
            if stream and upstream.status == 200:
                first = await upstream.content.readany()
                if not first:
                    raise _Fail("connect", 502, f"backend {b.index} sent an empty stream", True)
                return upstream, first
            return upstream, await upstream.read()
        except _Fail:
            upstream.close()
            raise
        except aiohttp.SocketTimeoutError as exc:
            upstream.close()
            raise _Fail("timeout", 504, f"backend {b.index} timed out", False) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            upstream.close()
            raise _Fail("connect", 502, f"backend {b.index} failed: {exc!r}", True) from exc
        except BaseException:
            upstream.close()
            raise

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        b: Backend,
        bm: BackendMetrics,
        rid: int,
        extra: dict[str, str],
        t0: float,
    ) -> web.StreamResponse:
        """Relay a stream chunk by chunk, as it comes."""
        self.router.first_token(rid)
        bm.ttft.observe(time.perf_counter() - t0)
        clean = False
        resp = web.StreamResponse(status=200, headers=_relay(upstream, extra))
        try:
            await resp.prepare(request)
            await resp.write(first)
            tail = first[-_TAIL:]
            content = upstream.content
            while True:
                try:
                    chunk = await content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    timeout = isinstance(exc, asyncio.TimeoutError)
                    bm.error("timeout" if timeout else "midstream")
                    self.pool.failure(b)
                    what = "timed out" if timeout else f"failed: {exc!r}"
                    err = error_body(f"backend {b.index} {what} mid-stream", "bad_gateway", 502)
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    await resp.write_eof()
                    return resp
                if not chunk:
                    break
                await resp.write(chunk)
                tail = (tail + chunk)[-_TAIL:]
            clean = True
            self._usage(bm, tail)
            await resp.write_eof()
            bm.e2e.observe(time.perf_counter() - t0)
            return resp
        except ConnectionError:  # the client went away while we wrote
            bm.error("client_disconnect")
            return resp
        finally:
            if clean:
                upstream.release()
            else:
                upstream.close()

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
                "backend": b.url,
                "branch": info["branch"],
                "input_length": n_in,
                "estimated_hit_tokens": info["hit_tokens"],
                "new_prefill": info["new_prefill"],
                "terms": terms,
            }
        )


def _relay(upstream: aiohttp.ClientResponse, extra: dict[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in upstream.headers.items() if k.lower() not in _DROP
    )
    out.update(extra)
    return out
