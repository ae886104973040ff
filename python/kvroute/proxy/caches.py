"""What each backend's engine says about its KV cache, fed to the router.

* **KV-event sources** (with ``--kv-events auto``): ``GET /kv_event_sources`` names each
  data-parallel rank's ZMQ endpoints (vLLM with ``--kv-events-config``); the proxy's
  :class:`~kvroute.kv_events.Subscriber` listens to them and the router's events view follows
  the engine exactly. A backend whose answer has no publisher (404, empty, events off) stays on
  the estimate view. Endpoints given with ``--kv-events-source`` are used instead.
* **KV capacity**: vLLM's ``/metrics`` carries ``vllm:cache_config_info`` with the engine's
  ``num_gpu_blocks`` and ``block_size``; the estimate view of that backend is bounded by it (in
  router blocks), unless ``cache_capacity_blocks`` was given.

A backend is probed when the proxy starts and again after it comes back from being down (its
engine may have restarted: its events view is reset first, and waits for sequence 0). Probes
that fail are retried at the next health round.

O(backends) per round; loop-affine (runs on the side application's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import kvroute
from kvroute.kv_events import Source, Subscriber, event_sources
from kvroute.proxy.backends import Backend, BackendPool

log = logging.getLogger("kvroute.proxy")

#: Time limit of one probe call.
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_ERRORS = (TimeoutError, aiohttp.ClientError, OSError, ValueError)


def kv_capacity(metrics_text: str) -> tuple[int, int] | None:
    """``(num_gpu_blocks, block_size)`` from an engine's Prometheus text, or None."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name.removesuffix("_info") != "vllm:cache_config":
            continue
        for sample in family.samples:
            labels = sample.labels
            with contextlib.suppress(KeyError, ValueError):
                blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
                if blocks > 0 and size > 0:
                    return blocks, size
    return None


class EngineCaches:
    """Probes of every backend (see the module doc)."""

    def __init__(
        self,
        pool: BackendPool,
        router: kvroute.Router,
        subscriber: Subscriber | None,
        explicit_sources: dict[str, list[Source]],
        bound_estimate: bool,
    ) -> None:
        self.pool, self.router, self.subscriber = pool, router, subscriber
        self.explicit = explicit_sources
        self.bound_estimate = bound_estimate
        #: Backend index -> what its last successful probe found.
        self.found: dict[int, dict[str, Any]] = {}
        pool.on_back.append(self._came_back)

    def _came_back(self, b: Backend) -> None:
        """``b``'s engine may have restarted: its events view starts over, probed again."""
        log.warning("backend %s is back: its KV-events view starts over", b.label)
        self.found.pop(b.index, None)
        if self.subscriber is not None:
            self.router.kv_reset(b.index)

    async def probe(self, session: aiohttp.ClientSession, b: Backend) -> None:
        """Read ``b``'s KV capacity and event sources and apply them (once it answers)."""
        found: dict[str, Any] = {}
        if self.bound_estimate:
            async with session.get(b.url + "/metrics", timeout=PROBE_TIMEOUT) as resp:
                text = await resp.text() if resp.status == 200 else ""
            found["capacity"] = capacity = kv_capacity(text)
            if capacity is not None:
                blocks = max(1, capacity[0] * capacity[1] // self.router.block_size)
                self.router.set_cache_capacity(b.index, blocks)
        if self.subscriber is not None:
            sources = self.explicit.get(b.url)
            if sources is None:
                async with session.get(b.url + "/kv_event_sources", timeout=PROBE_TIMEOUT) as resp:
                    answer = await resp.json() if resp.status == 200 else {}
                sources = event_sources(answer, b.url)
            found["sources"] = sources
            self.subscriber.watch(b.index, sources)
            if sources:
                log.info(
                    "backend %s: KV events from %s", b.label, ", ".join(s.endpoint for s in sources)
                )
            else:
                log.warning("backend %s publishes no KV events: routed on the estimate", b.label)
        self.found[b.index] = found

    async def round(self, session: aiohttp.ClientSession) -> None:
        """Stop listening to removed backends; probe the live ones not probed yet."""
        todo = []
        for b in self.pool.backends:
            up = b.up and not b.removed
            if b.removed and self.subscriber is not None and b.index in self.found:
                self.subscriber.unwatch(b.index)
                self.found.pop(b.index)
            if up and b.index not in self.found:
                todo.append(b)
        results = await asyncio.gather(
            *(self.probe(session, b) for b in todo), return_exceptions=True
        )
        for b, result in zip(todo, results, strict=True):
            if isinstance(result, _ERRORS):
                log.debug("backend %s: probe failed (%s); retried next round", b.label, result)
            elif isinstance(result, BaseException):
                raise result

    async def loop(self, session: aiohttp.ClientSession, interval: float) -> None:
        """:meth:`round` every ``interval`` seconds, forever."""
        while True:
            await self.round(session)
            await asyncio.sleep(interval)
