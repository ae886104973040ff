"""The emulator's Prometheus metrics, under vLLM's names (V1 engine, plus the V0 cache gauge).

``vllm:cache_config_info`` names the KV capacity (``num_gpu_blocks``, ``block_size``).
Gauges (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and its V0 name ``vllm:gpu_cache_usage_perc``) and the
prefix-cache counters (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
in tokens) are read from the engine's ``stats()`` at scrape time; request counters and latency
histograms are kept by the server. Every series has the ``model_name`` label, as vLLM's do.

O(1) per observation, O(series) per scrape; the registry is private to one server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()  # type: ignore[no-untyped-call]

# vLLM's FinishReason values.
FINISH_REASONS = ("stop", "length", "abort")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class _EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], dict[str, float]], block_size: int) -> None:
        self._model = model
        self._stats = stats
        self._block_size = block_size

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        labels = ["model_name"]
        # vLLM's cache-config info gauge: its KV capacity in blocks, and their size.
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            labels=["block_size", "num_gpu_blocks"],
        )
        # Blocks are counted in the engine's KV blocks (the model's kv_block_size).
        size = int(s.get("kv_block_size", self._block_size))
        info.add_metric([str(size), str(int(s.get("num_gpu_blocks", 0)))], 1.0)
        yield info
        for name, key, doc in (
            ("vllm:num_requests_running", "running", "Requests in model execution batches."),
            ("vllm:num_requests_waiting", "waiting", "Requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage; 1 means 100 percent."),
            ("vllm:gpu_cache_usage_perc", "kv_usage", "KV-cache usage (V0 name)."),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._model], s.get(key, 0.0))
            yield g
        for name, key, doc in (
            ("vllm:prefix_cache_queries", "prefix_queries_tokens", "Prefix-cache queried tokens."),
            ("vllm:prefix_cache_hits", "prefix_hits_tokens", "Prefix-cache hit tokens."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._model], s.get(key, 0.0))
            yield c


class EmulatorMetrics:
    """The metrics of one emulator server."""

    def __init__(self, model: str, stats: Callable[[], dict[str, float]], block_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model, stats, block_size))
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", ["model_name"], registry=reg
        ).labels(model)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", ["model_name"], registry=reg
        ).labels(model)
        self._success = Counter(
            "vllm:request_success",
            "Successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._model = model
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM does
            self._success.labels(model, reason)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ).labels(model)

    def success(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()
