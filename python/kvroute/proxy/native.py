"""The proxy's compiled data path (``data_path="native"``, the default on Unix).

``kvroute._core.Relay`` serves the proxy's port from one Rust thread (an event
loop of its own, off the GIL): it reads requests, forwards ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (routing each with the shared :class:`kvroute.Router`, relaying the
answer chunk by chunk, retrying and failing as :mod:`.handler` does), and relays every other
request to the proxy's side application (health, metrics, models, tokenize, admin), which
stays in Python on the event loop. What it needs from Python it asks through
:class:`RelayHooks`, with the GIL, from its own thread: the keys of a body (the same
:class:`~kvroute.proxy.keys.Keyer` as the Python path; ``backend`` mode runs its round-trip on
the event loop), the tokens an answer generated (when the router keeps vLLM's cache rule, so
that the blocks they complete are recorded), and a backend's failures and recoveries (applied to the
:class:`~kvroute.proxy.backends.BackendPool` on the event loop). Its counters are read at
scrape time by :class:`RelayCollector`, under the same metric names as the Python path's.

Thread-safety: the hooks run on the relay's threads; everything they touch besides the
keyer goes through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.proxy.backends import BackendPool
from kvroute.proxy.front import dumps_json
from kvroute.proxy.keys import Keyer, TextOutput, session_of
from kvroute.proxy.observe import LATENCY_BUCKETS, ROUTING_BUCKETS
from kvroute.proxy.prompts import BadRequest, error_body, wants_stream

log = logging.getLogger("kvroute.proxy")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class RelayHooks:
    """What the relay asks of Python (see the module doc)."""

    def __init__(
        self,
        keyer: Keyer,
        pool: BackendPool,
        loop: asyncio.AbstractEventLoop,
        session_field: str | None,
    ) -> None:
        self.keyer, self.pool, self.loop = keyer, pool, loop
        self.session_field = session_field
        #: ``key`` may wait for a backend's ``/tokenize``: the relay calls it off its loop.
        self.key_may_block = keyer.mode == "backend"
        #: ``output`` can tokenize an answer's text (else the relay only asks about answers
        #: that carry the engine's ``token_ids``).
        self.output_from_text = keyer.exact

    def key(self, raw: bytes, chat: bool, header: str | None) -> tuple[Any, ...]:
        """``(keys, input_length, stream, session, tail)``, or ``(400, error body)``."""
        try:
            body, got = self.keyer.parse_now(raw, chat)
            if got is None:
                remote = self.keyer.remote_keys(body, chat)
                got = asyncio.run_coroutine_threadsafe(remote, self.loop).result()
            stream = wants_stream(body)
            session = session_of(header, body, self.session_field)
        except BadRequest as exc:
            return 400, dumps_json(error_body(str(exc), "invalid_request_error", 400, exc.param))
        return got.keys, got.input_length, stream, session, got.tail

    def output(self, answer: bytes, stream: bool) -> tuple[Any, int] | None:
        """The ids an answer generated and how many tokens it sampled, or None."""
        got = self.keyer.output_now(answer, stream)
        if isinstance(got, TextOutput):  # text only the backend can tokenize: on the loop
            later = self.keyer.tokenize_output(got)
            return asyncio.run_coroutine_threadsafe(later, self.loop).result()
        return got

    def failure(self, index: int) -> None:
        self.loop.call_soon_threadsafe(self.pool.failure, self.pool.get(index))

    def success(self, index: int) -> None:
        self.loop.call_soon_threadsafe(self.pool.success, self.pool.get(index))

    def log_error(self, message: str) -> None:
        log.error("%s", message)


def _buckets(bounds: Iterable[float], counts: list[int]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


class RelayCollector(Collector):
    """The relay's counters as the Python path's metrics (names, labels, buckets)."""

    def __init__(
        self, policy: str, stats: Callable[[], dict[str, Any] | None], urls: Callable[[], list[str]]
    ) -> None:
        self._policy, self._stats, self._urls = policy, stats, urls

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        b = ["backend"]
        decisions = CounterMetricFamily(
            "kvroute_proxy_decisions", "Routing decisions.", labels=["backend", "policy", "branch"]
        )
        estimated = CounterMetricFamily(
            "kvroute_proxy_estimated_hit_tokens", "Router-estimated cached tokens.", labels=b
        )
        reported = CounterMetricFamily(
            "kvroute_proxy_reported_cached_tokens", "Engine-reported cached tokens.", labels=b
        )
        prompt = CounterMetricFamily(
            "kvroute_proxy_prompt_tokens", "Engine-reported prompt tokens.", labels=b
        )
        ttft = HistogramMetricFamily(
            "kvroute_proxy_ttft_seconds", "Time to first streamed byte.", labels=b
        )
        e2e = HistogramMetricFamily(
            "kvroute_proxy_e2e_seconds", "Request received to response end.", labels=b
        )
        errors = CounterMetricFamily(
            "kvroute_proxy_errors", "Failed requests and attempts.", labels=["backend", "kind"]
        )
        retries = CounterMetricFamily(
            "kvroute_proxy_retries", "Attempts retried on another backend.", labels=b
        )
        routing = HistogramMetricFamily(
            "kvroute_proxy_routing_seconds", "Keying plus routing decision."
        )
        if stats is not None:
            urls = self._urls()
            for url, s in zip(urls, stats["backends"], strict=False):
                for kind, n in s["errors"].items():
                    if n:
                        errors.add_metric([url, kind], n)
                if not any(s["decisions"].values()):
                    continue
                for branch, n in s["decisions"].items():
                    if n:
                        decisions.add_metric([url, self._policy, branch], n)
                estimated.add_metric([url], s["estimated"])
                reported.add_metric([url], s["reported"])
                prompt.add_metric([url], s["prompt"])
                retries.add_metric([url], s["retries"])
                for fam, key in ((ttft, "ttft"), (e2e, "e2e")):
                    counts, total = s[key]
                    fam.add_metric([url], _buckets(LATENCY_BUCKETS, counts), total)
            for kind, n in stats["errors"].items():
                if n:
                    errors.add_metric(["", kind], n)
            counts, total = stats["routing"]
            routing.add_metric([], _buckets(ROUTING_BUCKETS, counts), total)
        yield from (decisions, estimated, reported, prompt, ttft, e2e, errors, retries, routing)
