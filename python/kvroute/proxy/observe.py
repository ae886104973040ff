"""What the proxy tells about itself: Prometheus metrics and the JSONL decision log.

Metrics (all ``kvroute_proxy_*``, ``backend`` = the backend URL):

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

The decision log writes one JSON object per decision (request, session, instance, backend,
branch, estimated hit, new prefill, and per instance the score terms: hit, new prefill,
pending prefill, requests, ``lmetric`` score); lines are buffered and flushed every second.

O(1) per observation (labelled children are cached per backend); loop-affine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
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


class BackendMetrics:
    """The labelled children of one backend."""

    def __init__(self, m: ProxyMetrics, url: str) -> None:
        self._m, self.url = m, url
        self._decisions: dict[str, Any] = {}
        self.estimated = m.estimated.labels(url)
        self.reported = m.reported.labels(url)
        self.prompt = m.prompt.labels(url)
        self.ttft = m.ttft.labels(url)
        self.e2e = m.e2e.labels(url)
        self.retries = m.retries.labels(url)

    def decision(self, branch: str) -> None:
        child = self._decisions.get(branch)
        if child is None:
            child = self._decisions[branch] = self._m.decisions.labels(
                self.url, self._m.policy, branch
            )
        child.inc()

    def error(self, kind: str) -> None:
        self._m.errors.labels(self.url, kind).inc()


class ProxyMetrics:
    """The proxy's registry (see the module doc)."""

    def __init__(
        self,
        policy: str,
        router: kvroute.Router,
        urls: Callable[[], list[str]],
        python_path: bool = True,
    ) -> None:
        """``python_path``: the counters below are the registry's (the native data path
        registers a collector of its own counters under the same names instead)."""
        self.policy = policy
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_RouterCollector(router, urls))
        reg = self.registry if python_path else None
        b = ["backend"]
        self.decisions = Counter(
            "kvroute_proxy_decisions",
            "Routing decisions.",
            ["backend", "policy", "branch"],
            registry=reg,
        )
        self.estimated = Counter(
            "kvroute_proxy_estimated_hit_tokens", "Router-estimated cached tokens.", b, registry=reg
        )
        self.reported = Counter(
            "kvroute_proxy_reported_cached_tokens",
            "Engine-reported cached tokens.",
            b,
            registry=reg,
        )
        self.prompt = Counter(
            "kvroute_proxy_prompt_tokens", "Engine-reported prompt tokens.", b, registry=reg
        )
        self.ttft = Histogram(
            "kvroute_proxy_ttft_seconds",
            "Time to first streamed byte.",
            b,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "kvroute_proxy_e2e_seconds",
            "Request received to response end.",
            b,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.errors = Counter(
            "kvroute_proxy_errors",
            "Failed requests and attempts.",
            ["backend", "kind"],
            registry=reg,
        )
        self.retries = Counter(
            "kvroute_proxy_retries", "Attempts retried on another backend.", b, registry=reg
        )
        self.routing = Histogram(
            "kvroute_proxy_routing_seconds",
            "Keying plus routing decision.",
            buckets=ROUTING_BUCKETS,
            registry=reg,
        )
        self._backends: dict[str, BackendMetrics] = {}

    def backend(self, url: str) -> BackendMetrics:
        got = self._backends.get(url)
        if got is None:
            got = self._backends[url] = BackendMetrics(self, url)
        return got

    def error(self, kind: str) -> None:
        """An error before any backend was chosen."""
        self.errors.labels("", kind).inc()


class DecisionLog:
    """Buffered JSONL of routing decisions."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1 << 20)

    @staticmethod
    def terms(router: kvroute.Router, keys: Any, input_length: int) -> list[dict[str, Any]]:
        """Per-instance score terms before a decision."""
        hits = router.estimate_cache_hits(keys, input_length)
        out = []
        for i, (hit, st) in enumerate(zip(hits, router.state(), strict=False)):
            new = max(0, input_length - hit)
            pending = st["pending_prefill_tokens"]
            out.append(
                {
                    "instance": i,
                    "available": st["available"],
                    "hit_tokens": hit,
                    "new_prefill": new,
                    "pending_prefill_tokens": pending,
                    "num_requests": st["num_requests"],
                    "lmetric_score": (pending + new) * st["num_requests"],
                }
            )
        return out

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
