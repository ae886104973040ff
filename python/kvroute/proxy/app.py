"""The proxy: its parts, its two servers, start-up and shutdown.

Clients talk to the data path: by default the compiled relay (``kvroute._core.Relay``,
:mod:`.native`), else (``data_path="python"``) :class:`~kvroute.proxy.front.FrontServer`, the
proxy's own HTTP/1.1 server on asyncio. ``POST /v1/completions`` and ``POST
/v1/chat/completions`` are forwarded from there (by the relay itself, or :mod:`.handler`);
every other request is relayed to an aiohttp application on a private
Unix socket (a loopback port where there are no Unix sockets), which serves the
engines' own endpoints (:mod:`.engines`: ``/v1/models``, ``/tokenize``, each backend's
``/health`` and ``/metrics``, ``POST /reset_prefix_cache``), ``GET /health`` (200
while a backend is up, else 503), ``GET /metrics`` (:mod:`.observe`) and the admin API
(:mod:`.admin`) when there is a token. The aiohttp application also owns the health-check
task, the decision-log flusher and the ``ClientSession`` of those side calls.

:class:`Proxy` holds the router, backends, metrics and forwarder of one proxy; build it
anywhere, then ``url = await proxy.start(host, port)`` on the loop that will serve it, and
``await proxy.close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

import kvroute
from kvroute.proxy.admin import Admin
from kvroute.proxy.backends import BackendPool
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.engines import EngineEndpoints
from kvroute.proxy.front import FrontConnection, FrontServer, Request
from kvroute.proxy.handler import DROP, HOP, Forwarder, upstream_request
from kvroute.proxy.http1 import without
from kvroute.proxy.keys import Keyer
from kvroute.proxy.native import RelayCollector, RelayHooks, listen
from kvroute.proxy.observe import DecisionLog, ProxyMetrics
from kvroute.proxy.prompts import error_body
from kvroute.proxy.serving import app_runner, http_url
from kvroute.proxy.upstream import Address, UpstreamPool

log = logging.getLogger("kvroute.proxy")
#: Sessions whose affinity the proxy's router keeps by default (the most recently routed;
#: with session ids of at most 256 bytes, a few tens of MiB at most).
MAX_SESSIONS = 1 << 18


class Proxy:
    """One proxy (see the module doc)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        options = {"cache_rule": "vllm", "max_sessions": MAX_SESSIONS, **config.router_options}
        self.router = kvroute.Router(len(config.backends), config.policy, **options)
        self.pool = BackendPool(config, self.router)
        self.native = config.data_path == "native"
        self._relay: Any = None
        urls = self._urls
        self.metrics = ProxyMetrics(config.policy, self.router, urls, python_path=not self.native)
        if self.native:
            self.metrics.registry.register(RelayCollector(config.policy, self._relay_stats, urls))
        self.decision_log = (
            DecisionLog(config.decision_log) if config.decision_log and not self.native else None
        )
        self.engines = EngineEndpoints(self.pool, self.router)
        self.keyer = Keyer(config.tokenizer, config.block_size, self.engines.remote_tokenize)
        self.forwarder = Forwarder(
            config, self.router, self.pool, self.keyer, self.metrics, self.decision_log
        )
        self.session: aiohttp.ClientSession | None = None
        self.upstreams: UpstreamPool | None = None
        self._front: FrontServer | None = None
        self._side: web.AppRunner | None = None
        self._side_address: Address = ("unix", "", 0)
        self._dir: str | None = None
        self._grace = 5.0

    async def start(self, host: str = "127.0.0.1", port: int = 0, grace: float = 5.0) -> str:
        """Serve on ``host:port`` (0: a free port); the proxy's URL. ``grace``: how long
        :meth:`close` lets running requests finish."""
        c = self.config
        self._grace = grace
        if not self.native:  # the relay keeps upstream connections of its own
            self.upstreams = self.forwarder.upstreams = UpstreamPool(
                c.connect_timeout_s, c.request_timeout_s
            )
        self._side = app_runner(self.side_app(), grace)
        await self._side.setup()
        try:
            if hasattr(socket, "AF_UNIX") and sys.platform != "win32":
                self._dir = tempfile.mkdtemp(prefix="kvroute-proxy-")
                path = os.path.join(self._dir, "side.sock")
                await web.UnixSite(self._side, path).start()
                self._side_address = ("unix", path, 0)
            else:  # no Unix sockets in asyncio (Windows): a loopback port
                site = web.TCPSite(self._side, "127.0.0.1", 0)
                await site.start()
                self._side_address = ("http", "127.0.0.1", self._side.addresses[0][1])
            if self.native:
                bound = self._start_relay(host, port)
            else:
                self._front = FrontServer(self._serve, c.max_body_bytes)
                bound = await self._front.start(host, port)
        except BaseException:
            await self.close()
            raise
        return http_url(host, bound)

    def _start_relay(self, host: str, port: int) -> int:
        from kvroute._core import Relay

        c = self.config
        sock = listen(host, port)
        bound = int(sock.getsockname()[1])
        hooks = RelayHooks(self.keyer, self.pool, asyncio.get_running_loop(), c.session_field)
        self._relay = Relay(
            sock.detach(),
            self.router,
            self._side_address,
            hooks,
            max_body=c.max_body_bytes,
            request_timeout_s=c.request_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
            max_concurrency=c.max_concurrency,
            retries=c.retries,
            session_header=c.session_header,
            session_field=c.session_field,
            decision_log=c.decision_log,
        )
        self.pool.attach(self._relay)
        return bound

    def _urls(self) -> list[str]:
        return [b.label for b in self.pool.backends]

    def _relay_stats(self) -> dict[str, Any] | None:
        return None if self._relay is None else self._relay.stats()

    async def close(self) -> None:
        """Stop serving: running requests get the grace period, then everything closes."""
        if self._relay is not None:
            relay, self._relay = self._relay, None
            await asyncio.get_running_loop().run_in_executor(None, relay.stop, self._grace)
        if self._front is not None:
            await self._front.close(self._grace)
            self._front = None
        if self.upstreams is not None:
            self.upstreams.close()
        if self._side is not None:
            await self._side.cleanup()
            self._side = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def _serve(self, req: Request, down: FrontConnection) -> None:
        head = req.head
        if head.method == "POST" and head.path in _FORWARDED:
            await self.forwarder.handle(req, down, chat=head.path == "/v1/chat/completions")
        else:
            await self._to_side(req, down)

    async def _to_side(self, req: Request, down: FrontConnection) -> None:
        """Relay a request to the side application and its answer back."""
        assert self.upstreams is not None
        headers = without(req.head.headers, HOP)
        data = upstream_request(req.head.method, req.head.target, "kvroute", headers, req.body)
        bodiless = req.head.method == "HEAD"
        try:
            conn = await self.upstreams.acquire(self._side_address)
            ex = conn.send(data, stream=False, bodiless=bodiless)
        except (TimeoutError, OSError) as exc:
            self._side_failed(down, exc)
            return
        try:
            await ex.done
        except asyncio.CancelledError:
            ex.abort()
            raise
        if ex.error is not None:
            self._side_failed(down, ex.error)
            return
        length = next((v for k, v in ex.headers if k.lower() == "content-length"), "0")
        body = b"".join(ex.body)
        down.send(ex.status, without(ex.headers, DROP), body, length if bodiless else None)

    @staticmethod
    def _side_failed(down: FrontConnection, error: BaseException) -> None:
        log.error("the proxy's side application failed: %r", error)
        down.send_json(502, error_body("internal proxy error", "internal_error", 502))

    def side_app(self) -> web.Application:
        """The aiohttp application of everything but the forwarded requests."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        r = app.router
        self.engines.routes(app)
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
        self.engines.session = self.session
        tasks = [asyncio.create_task(self.pool.health_loop(self.session))]
        if self.config.decision_log:
            tasks.append(asyncio.create_task(self._flush_loop()))
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

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.flush_decision_log()

    def flush_decision_log(self) -> None:
        """Write out the decision log's buffered lines (done every second anyway)."""
        if self.decision_log is not None:
            self.decision_log.flush()
        if self._relay is not None:
            self._relay.flush_log()

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


_FORWARDED = frozenset(("/v1/completions", "/v1/chat/completions"))
