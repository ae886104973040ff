"""What the proxy tells about itself: its Prometheus metrics.

Metrics (all ``kvroute_proxy_*``, ``backend`` = the backend URL without credentials):

* ``decisions_total{backend,policy,branch}``: routing decisions and the policy branch taken;
* ``estimated_hit_tokens_total`` / ``reported_cached_tokens_total`` / ``prompt_tokens_total``
  ``{backend}``: the router's estimated cache hit, the engine's reported
  ``cached_tokens`` and ``prompt_tokens`` (from the usage of responses that carry one);
* ``in_flight``, ``pending_prefill_tokens``, ``cached_blocks``, ``backend_up``
  ``{backend}``: read from ``Router.state()`` at scrape time, so they are the router's own
  counters, never a second copy that could drift;
* ``ttft_seconds``, ``e2e_seconds`` ``{backend}`` histograms (TTFT: request received to the
  first streamed byte; streaming requests only);
* ``errors_total{backend,kind}`` (``connect``, ``status``, ``timeout``, ``midstream``,
  ``client_disconnect``, ``bad_request``, ``no_backend``), ``retries_total{backend}``;
* ``routing_seconds``: keying plus the routing decision.

The counters are the relay's (``kvroute._core.Relay.stats``), read at scrape time by
:class:`RelayCollector`; the gauges are the router's. O(backends) per scrape; the collectors
are read on the event loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import kvroute

disable_created_metrics()  # type: ignore[no-untyped-call]
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1)


class _RouterCollector(Collector):
    def __init__(self, router: kvroute.Router, urls: Callable[[], list[str]]) -> None:
        self._router = router
        self._urls = urls

    def collect(self) -> Iterable[Metric]:
        urls = self._urls()
        fams = {
            "num_requests": GaugeMetricFamily(
                "kvroute_proxy_in_flight", "Requests routed and not finished.", labels=["backend"]
            ),
            "pending_prefill_tokens": GaugeMetricFamily(
                "kvroute_proxy_pending_prefill_tokens",
                "Estimated prefill tokens of requests without a first token.",
                labels=["backend"],
            ),
            "cached_blocks": GaugeMetricFamily(
                "kvroute_proxy_cached_blocks",
                "Keys in the router's cache model.",
                labels=["backend"],
            ),
            "available": GaugeMetricFamily(
                "kvroute_proxy_backend_up", "1 when the backend takes requests.", labels=["backend"]
            ),
        }
        for url, st in zip(urls, self._router.state(), strict=False):
            for key, fam in fams.items():
                fam.add_metric([url], float(st[key]))  # type: ignore[literal-required]
        yield from fams.values()


def _buckets(bounds: Iterable[float], counts: list[int]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


class RelayCollector(Collector):
    """The relay's counters as metrics (see the module doc)."""

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


def proxy_registry(
    policy: str,
    router: kvroute.Router,
    urls: Callable[[], list[str]],
    stats: Callable[[], dict[str, Any] | None],
) -> CollectorRegistry:
    """The proxy's registry: the router's gauges and the relay's counters (``stats``: the
    relay's, None before it starts)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_RouterCollector(router, urls))
    registry.register(RelayCollector(policy, stats, urls))
    return registry
