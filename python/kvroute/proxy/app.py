"""The proxy: its parts, its two servers, start-up and shutdown.

Clients talk to the relay (``kvroute._core.Relay``, :mod:`.relay`: hyper's HTTP/1.1 server
on a Rust thread of its own). ``POST /v1/completions`` and ``POST /v1/chat/completions`` are
forwarded from there; every other request is relayed to an aiohttp application on a private
Unix socket, which serves the engines' own endpoints (:mod:`.engines`: ``/v1/models``,
``/tokenize``, each backend's ``/health`` and ``/metrics``, ``POST /reset_prefix_cache``),
``GET /health`` (200 while a backend is up, else 503), ``GET /metrics`` (:mod:`.observe`)
and the admin API (:mod:`.admin`) when there is a token. The aiohttp application also owns
the health-check task, the decision-log flusher, the refits of ``ttft``'s costs
(:mod:`.ttft_fit`, policy ``ttft`` without an engine profile) and the ``ClientSession`` of
those side calls.

:class:`Proxy` holds the router, backends, metrics and relay of one proxy; build it
anywhere, then ``url = await proxy.start(host, port)`` on the loop that will serve it, and
``await proxy.close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

import kvroute
from kvroute import _core
from kvroute.errors import InvalidArgumentError
from kvroute.kv_events import Source, Subscriber
from kvroute.proxy.admin import Admin
from kvroute.proxy.backends import BackendPool
from kvroute.proxy.caches import EngineCaches
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.engines import EngineEndpoints
from kvroute.proxy.keys import Keyer
from kvroute.proxy.load import EngineLoads
from kvroute.proxy.observe import proxy_registry
from kvroute.proxy.relay import RelayHooks, listen
from kvroute.proxy.serving import app_runner, http_url
from kvroute.proxy.ttft_fit import MIN_SAMPLES, OnlineTtftCosts

log = logging.getLogger("kvroute.proxy")
#: Sessions whose affinity the proxy's router keeps by default (the most recently routed;
#: with session ids of at most 256 bytes, a few tens of MiB at most).
MAX_SESSIONS = 1 << 18


class Proxy:
    """One proxy (see the module doc)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        options: dict[str, Any] = {
            "cache_rule": "vllm",
            "max_sessions": MAX_SESSIONS,
            "load_source": config.load_source,
        }
        if config.uses_kv_events:
            options["cache_view"] = "events"
        elif config.kv_events == "auto":
            log.info(
                "KV events are not used: --tokenizer approx keys bytes, not the engine's "
                "tokens (use --tokenizer backend or a tokenizer.json)"
            )
        self.router = kvroute.Router(
            len(config.backends), config.policy, **{**options, **config.policy_options()}
        )
        self.router.set_overload_rule(
            config.overload_waiting,
            config.overload_kv_usage,
            config.max_in_flight,
            config.max_in_flight_tokens,
        )
        self.pool = BackendPool(config, self.router)
        self.loads = EngineLoads(self.pool, self.router, config.load_interval_s)
        self._relay: Any = None
        explicit = {
            url: [Source(0, e[0], e[1] if len(e) > 1 else None)]
            for url, e in config.kv_event_sources.items()
        }
        bound = "cache_capacity_blocks" not in config.router_options
        self.caches = EngineCaches(self.pool, self.router, None, explicit, bound)
        self.ttft_costs: OnlineTtftCosts | None = None
        if config.fits_ttft_costs:
            self.ttft_costs = OnlineTtftCosts(lambda: self._relay, self.router)
            log.info(
                "policy ttft without an engine profile: prefill tokens alone until %d first "
                "tokens have come (leastwork's rule, with the delay term), then costs fitted "
                "to them every %.0f s",
                MIN_SAMPLES,
                self.ttft_costs.interval_s,
            )
        self.registry = proxy_registry(
            config.policy,
            self.router,
            self._urls,
            self._relay_stats,
            lambda: self.caches.subscriber,
            self.loads,
            self.ttft_costs,
        )
        self.engines = EngineEndpoints(self.pool, self.router)
        self.keyer = Keyer(config.tokenizer, config.block_size, self.engines.remote_tokenize)
        self.session: aiohttp.ClientSession | None = None
        self._side: web.AppRunner | None = None
        self._dir: str | None = None
        self._grace = 5.0

    async def start(self, host: str = "127.0.0.1", port: int = 0, grace: float = 5.0) -> str:
        """Serve on ``host:port`` (0: a free port); the proxy's URL. ``grace``: how long
        :meth:`close` lets running requests finish."""
        if not hasattr(_core, "Relay"):
            raise InvalidArgumentError("the proxy needs a Unix build of kvroute (its relay)")
        self._grace = grace
        self._side = app_runner(self.side_app(), grace)
        await self._side.setup()
        try:
            self._dir = tempfile.mkdtemp(prefix="kvroute-proxy-")
            side = os.path.join(self._dir, "side.sock")
            await web.UnixSite(self._side, side).start()
            bound = self._start_relay(host, port, side)
        except BaseException:
            await self.close()
            raise
        return http_url(host, bound)

    def _start_relay(self, host: str, port: int, side: str) -> int:
        c = self.config
        sock = listen(host, port)
        bound = int(sock.getsockname()[1])
        hooks = RelayHooks(self.keyer, self.pool, asyncio.get_running_loop(), c.session_field)
        self._relay = _core.Relay(
            sock.detach(),
            self.router,
            ("unix", side, 0),
            hooks,
            max_body=c.max_body_bytes,
            request_timeout_s=c.request_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
            max_concurrency=c.max_concurrency,
            retries=c.retries,
            session_header=c.session_header,
            session_field=c.session_field,
            decision_log=c.decision_log,
            header_read_timeout_s=c.header_read_timeout_s,
            body_read_timeout_s=c.body_read_timeout_s,
            max_connections=c.max_connections,
            model=self.keyer.model,
            queue_size=c.queue_size,
            queue_timeout_s=c.queue_timeout_s,
            queue_patience_s=c.queue_patience_s,
            queue_hold_s=c.queue_hold_s,
            queue_hold_yield_s=c.queue_hold_yield_s,
            priority_header=c.priority_header,
            first_tokens=c.fits_ttft_costs,
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
        if self._side is not None:
            await self._side.cleanup()
            self._side = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

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
        if self.router.cache_view == "events":
            self.caches.subscriber = Subscriber(self.router)
        tasks = [
            asyncio.create_task(self.pool.health_loop(self.session)),
            asyncio.create_task(self.caches.loop(self.session, c.health_interval_s)),
            asyncio.create_task(self.loads.loop(self.session)),
        ]
        if self.config.decision_log:
            tasks.append(asyncio.create_task(self._flush_loop()))
        if self.ttft_costs is not None:
            tasks.append(asyncio.create_task(self.ttft_costs.loop()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self.session.close()
            if self.caches.subscriber is not None:
                self.caches.subscriber.close()
                self.caches.subscriber = None

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.flush_decision_log()

    def flush_decision_log(self) -> None:
        """Write out the decision log's buffered lines (done every second anyway)."""
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

        body = generate_latest(self.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")
