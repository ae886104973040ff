"""The proxy application: routes, shared state, start-up and shutdown.

``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`.handler`), ``GET /v1/models``
(relayed from a live backend), ``GET /health`` (200 while a backend is up, else 503),
``GET /metrics`` (:mod:`.observe`), ``POST /tokenize`` (relayed), and the admin API
(:mod:`.admin`) when there is a token. On start-up: one shared upstream ``ClientSession``
(no connection limit beyond ``max_concurrency``), the health-check task and the decision-log
flusher; on shutdown, all three are closed.

:class:`Proxy` holds the router, backends, metrics and forwarder of one proxy; build it
inside or outside a loop, then serve :meth:`Proxy.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

import kvroute
from kvroute.proxy.admin import Admin
from kvroute.proxy.backends import BackendPool
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.handler import Forwarder, json_error
from kvroute.proxy.keys import Keyer
from kvroute.proxy.observe import DecisionLog, ProxyMetrics

log = logging.getLogger("kvroute.proxy")
#: Time limit of the proxy's side calls to a backend (``/v1/models``, ``/tokenize``).
AUX_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


class Proxy:
    """One proxy (see the module doc)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        options = dict(config.router_options)
        self.router = kvroute.Router(len(config.backends), config.policy, **options)
        self.pool = BackendPool(config, self.router)
        self.metrics = ProxyMetrics(
            config.policy, self.router, lambda: [b.url for b in self.pool.backends]
        )
        self.decision_log = DecisionLog(config.decision_log) if config.decision_log else None
        self.keyer = Keyer(config.tokenizer, config.block_size, self._remote_tokenize)
        self.forwarder = Forwarder(
            config, self.router, self.pool, self.keyer, self.metrics, self.decision_log
        )
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app[PROXY] = self
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_get("/v1/models", self._relay_get)
        r.add_post("/tokenize", self._relay_post)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        if self.config.admin_token:
            Admin(self.pool, self.config.admin_token).routes(app)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, _app: web.Application) -> AsyncIterator[None]:
        c = self.config
        connector = aiohttp.TCPConnector(
            limit=c.max_concurrency + 64, limit_per_host=0, keepalive_timeout=30
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=c.connect_timeout_s, sock_read=c.request_timeout_s
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        self.forwarder.session = self.session
        tasks = [asyncio.create_task(self.pool.health_loop(self.session))]
        if self.decision_log is not None:
            tasks.append(asyncio.create_task(self._flush_loop(self.decision_log)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self.session.close()
            if self.decision_log is not None:
                self.decision_log.close()

    @staticmethod
    async def _flush_loop(decision_log: DecisionLog) -> None:
        while True:
            await asyncio.sleep(1.0)
            decision_log.flush()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.forwarder.handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.forwarder.handle(request, chat=True)

    async def _relay_once(self, method: str, path: str, data: bytes | None) -> web.Response:
        assert self.session is not None
        for b in self.pool.live():
            try:
                async with self.session.request(
                    method, b.url + path, data=data, timeout=AUX_TIMEOUT
                ) as resp:
                    body = await resp.read()
                    return web.Response(
                        body=body, status=resp.status, content_type=resp.content_type
                    )
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
        return json_error(503, "no backend is available", "service_unavailable")

    async def _relay_get(self, request: web.Request) -> web.Response:
        return await self._relay_once("GET", request.path, None)

    async def _relay_post(self, request: web.Request) -> web.Response:
        return await self._relay_once("POST", request.path, await request.read())

    async def _remote_tokenize(self, query: dict[str, Any]) -> list[int] | None:
        """Token ids from a live backend's ``/tokenize`` (None when none answers)."""
        assert self.session is not None
        for b in self.pool.live():
            try:
                async with self.session.post(
                    b.url + "/tokenize", json=query, timeout=AUX_TIMEOUT
                ) as resp:
                    if resp.status == 200:
                        tokens = (await resp.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                continue
        return None

    async def _health(self, _request: web.Request) -> web.Response:
        up = len(self.pool.live())
        status = 200 if up else 503
        body = {
            "status": "ok" if up else "no backend up",
            "backends_up": up,
            "backends": sum(not b.removed for b in self.pool.backends),
        }
        return web.json_response(body, status=status)

    async def _metrics(self, _request: web.Request) -> web.Response:
        from prometheus_client import generate_latest

        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")


PROXY: web.AppKey[Proxy] = web.AppKey("kvroute.proxy")


def proxy_app(config: ProxyConfig) -> web.Application:
    """A ready aiohttp application of a proxy with ``config``."""
    return Proxy(config).app()
