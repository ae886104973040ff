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
* ``routing_seconds``: keying plus the routing decision;
* with the events view (``docs/kv-events.md``), per ``{backend,rank}``:
  ``kv_batches_total``, ``kv_events_total``, ``kv_blocks_stored_total``,
  ``kv_blocks_removed_total``, ``kv_blocks_ignored_total``, ``kv_gaps_total``,
  ``kv_replays_total``, ``kv_replay_failures_total``, ``kv_resets_total``,
  ``kv_decode_errors_total``, and the gauges ``kv_degraded``, ``kv_last_seq``,
  ``kv_lag_seconds`` (the engine's batch timestamp to its application); per ``{backend}``:
  ``kv_uses_events``, ``kv_blocks_indexed``, ``kv_blocks_pending``; and ``kv_index_bytes``;
* the engines' own load (:class:`~kvroute.proxy.load.EngineLoadCollector`): per ``{backend}``
  ``engine_running``, ``engine_waiting``, ``engine_kv_usage``, their throughput, the requests
  sent since the read and its age, the requests beyond the router's (``engine_outside``),
  ``overloaded`` and ``engine_load_failures_total``;
* with policy ``ttft``: ``ttft_cost{term}``, the costs it predicts with (seconds; the term
  ``max_num_batched_tokens`` in tokens), and without a profile their fit to the first tokens
  (:mod:`~kvroute.proxy.ttft_fit`): ``ttft_fits_total``, ``ttft_fit_samples``,
  ``ttft_fit_error_seconds``.

The counters are the relay's (``kvroute._core.Relay.stats``), read at scrape time by
:class:`RelayCollector`; the gauges are the router's. O(backends) per scrape; the collectors
are read on the event loop's thread.
"""

from __future__ import annotations

import math
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
from kvroute.proxy.load import EngineLoadCollector, EngineLoads
from kvroute.proxy.ttft_fit import OnlineTtftCosts

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


class _TtftCostsCollector(Collector):
    """``ttft``'s costs and their fit, with ``--policy ttft`` (see the module doc)."""

    def __init__(self, fitter: OnlineTtftCosts | None, router: kvroute.Router) -> None:
        self._fitter, self._router = fitter, router

    def collect(self) -> Iterable[Metric]:
        costs = GaugeMetricFamily(
            "kvroute_proxy_ttft_cost",
            "The step costs policy ttft predicts with (seconds; the budget in tokens).",
            labels=["term"],
        )
        for term, value in (self._router.ttft_costs() or {}).items():
            costs.add_metric([term], float(value))
        yield costs
        f = self._fitter
        if f is None:
            return
        yield CounterMetricFamily(
            "kvroute_proxy_ttft_fits", "Fits of ttft's costs to first tokens.", value=f.fits
        )
        yield GaugeMetricFamily(
            "kvroute_proxy_ttft_fit_samples",
            "First tokens the costs are fitted to.",
            value=len(f.samples),
        )
        yield GaugeMetricFamily(
            "kvroute_proxy_ttft_fit_error_seconds",
            "Root-mean-square error of the last fit (NaN before the first).",
            value=math.nan if f.rms_s is None else f.rms_s,
        )


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
        waiting = GaugeMetricFamily("kvroute_proxy_queue_waiting", "Requests in the queue.")
        queued = CounterMetricFamily("kvroute_proxy_queued", "Requests that waited in the queue.")
        shed = CounterMetricFamily(
            "kvroute_proxy_shed", "Requests refused with 503 by admission.", labels=["reason"]
        )
        wait = HistogramMetricFamily(
            "kvroute_proxy_queue_wait_seconds", "Wait in the queue of the requests routed after."
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
            q = stats["queue"]
            waiting.add_metric([], q["waiting"])
            queued.add_metric([], q["queued"])
            shed.add_metric(["full"], q["shed_full"])
            shed.add_metric(["timeout"], q["shed_timeout"])
            counts, total = q["wait"]
            wait.add_metric([], _buckets(LATENCY_BUCKETS, counts), total)
        yield from (decisions, estimated, reported, prompt, ttft, e2e, errors, retries, routing)
        yield from (waiting, queued, shed, wait)


#: Per-rank counters of the router's view: (metric suffix, key, help).
_RANK_COUNTERS = (
    ("batches", "batches", "KV-event batches applied."),
    ("events", "events", "KV events applied."),
    ("blocks_stored", "blocks_stored", "Blocks the engine reported stored."),
    ("blocks_removed", "blocks_removed", "Blocks the engine reported removed."),
    ("blocks_ignored", "blocks_ignored", "Blocks outside the view (LoRA, other media, ...)."),
    ("gaps", "gaps", "Gaps in the batches' sequence numbers."),
    ("foreign_batches", "foreign_batches", "Batches naming another rank than their socket's."),
    ("resets", "resets", "Restarts seen (sequence backwards, or the backend came back)."),
)
#: Per-rank counters of the subscriber.
_SOURCE_COUNTERS = (
    ("replays", "replays", "Replays asked of the engine's replay socket."),
    ("replay_failures", "replay_failures", "Replays that could not fill a gap."),
    ("decode_errors", "decode_errors", "Messages that could not be decoded or applied."),
    ("reopened", "reopened", "Sockets opened again after their connection was dropped."),
)


class KvEventsCollector(Collector):
    """The events view's metrics (see the module doc); nothing with the estimate view."""

    def __init__(
        self,
        router: kvroute.Router,
        urls: Callable[[], list[str]],
        subscriber: Callable[[], Any],
    ) -> None:
        self._router, self._urls, self._subscriber = router, urls, subscriber

    def collect(self) -> Iterable[Metric]:
        if self._router.cache_view != "events":
            return
        name = "kvroute_proxy_kv_"
        rank = ["backend", "rank"]
        counters = {
            key: CounterMetricFamily(name + suffix, text, labels=rank)
            for suffix, key, text in (*_RANK_COUNTERS, *_SOURCE_COUNTERS)
        }
        gauges = {
            "degraded": GaugeMetricFamily(
                name + "degraded", "1 while a rank's view is not whole.", labels=rank
            ),
            "last_seq": GaugeMetricFamily(name + "last_seq", "Last batch applied.", labels=rank),
            "lag_s": GaugeMetricFamily(
                name + "lag_seconds", "Engine timestamp to applied, last batch.", labels=rank
            ),
        }
        per_backend = {
            "uses_events": GaugeMetricFamily(
                name + "uses_events", "1 when routing reads the events view.", labels=["backend"]
            ),
            "blocks": GaugeMetricFamily(
                name + "blocks_indexed", "Blocks in the events view.", labels=["backend"]
            ),
            "pending": GaugeMetricFamily(
                name + "blocks_pending", "Routed blocks not yet confirmed.", labels=["backend"]
            ),
        }
        sub = self._subscriber()
        seen = sub.stats() if sub is not None else {}
        for i, url in enumerate(self._urls()):
            view = self._router.kv_view(i)
            if view is None:
                continue
            for key, fam in per_backend.items():
                fam.add_metric([url], float(view[key]))  # type: ignore[literal-required]
            for r in view["ranks"]:
                labels = [url, str(r["rank"])]
                for key, _, _ in _RANK_COUNTERS:
                    counters[key].add_metric(labels, r[key])  # type: ignore[literal-required]
                stats = seen.get((i, r["rank"]))
                for key, _, _ in _SOURCE_COUNTERS:
                    counters[key].add_metric(labels, getattr(stats, key, 0))
                gauges["degraded"].add_metric(labels, float(r["state"] == "degraded"))
                gauges["last_seq"].add_metric(
                    labels, float(-1 if r["last_seq"] is None else r["last_seq"])
                )
                gauges["lag_s"].add_metric(labels, r["lag_s"])
        memory = GaugeMetricFamily(name + "index_bytes", "Bytes of the events view's tables.")
        memory.add_metric([], float(self._router.kv_memory_bytes))
        yield from (*counters.values(), *gauges.values(), *per_backend.values(), memory)


def proxy_registry(
    policy: str,
    router: kvroute.Router,
    urls: Callable[[], list[str]],
    stats: Callable[[], dict[str, Any] | None],
    subscriber: Callable[[], Any] = lambda: None,
    loads: EngineLoads | None = None,
    ttft: OnlineTtftCosts | None = None,
) -> CollectorRegistry:
    """The proxy's registry: the router's gauges, the relay's counters (``stats``: the
    relay's, None before it starts), the events view's (``subscriber``: the KV-event
    subscriber, None before it starts), the engines' own load (``loads``), and with policy
    ``ttft`` its costs (``ttft``: their fit while serving, None with a profile)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_RouterCollector(router, urls))
    if policy == "ttft":
        registry.register(_TtftCostsCollector(ttft, router))
    registry.register(RelayCollector(policy, stats, urls))
    registry.register(KvEventsCollector(router, urls, subscriber))
    if loads is not None:
        registry.register(EngineLoadCollector(loads, urls))
    return registry
