"""What each engine says of its own load, read from its ``/metrics`` in the background and fed
to the router (``docs/proxy.md``, "Load signals").

Every ``load_interval_s`` each live backend's Prometheus text is read off the request path:
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (summed over the engine's
data-parallel ranks), ``vllm:kv_cache_usage_perc`` (``gpu_cache_usage_perc`` before vLLM 0.10;
averaged) and the prompt and generation token counters (their rate between two reads is the
engine's throughput). The router gets the report (:meth:`kvroute.Router.set_engine_load`) and
counts the requests it sends the engine until the next one; its overload rule reads both. A
read that fails, or an engine that serves none of these gauges, clears the report: the router
then counts only its own requests for that engine, and the failure is shown
(``kvroute_proxy_engine_load_failures_total``, the admin listing).

O(backends x metrics text) per round; loop-affine (runs on the side application's loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

import kvroute
from kvroute.proxy.backends import Backend, BackendPool

log = logging.getLogger("kvroute.proxy")

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT, GENERATION = "vllm:prompt_tokens", "vllm:generation_tokens"
_NAMES = (RUNNING, WAITING, *KV_USAGE, PROMPT, GENERATION)
_ERRORS = (TimeoutError, aiohttp.ClientError, OSError, ValueError)


@dataclass
class EngineReport:
    """One engine's load as its metrics said it at ``read_at`` (monotonic seconds)."""

    running: int
    waiting: int
    kv_usage: float
    #: Prompt and generation tokens so far (None when not served), and per second since the
    #: read before.
    prompt_tokens: float | None
    generation_tokens: float | None
    prompt_tps: float | None
    generation_tps: float | None
    read_at: float


def engine_report(text: str, now: float, before: EngineReport | None) -> EngineReport | None:
    """The load in an engine's Prometheus ``text`` (None when it has no running and waiting
    gauges); rates against the report ``before``."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + sample.value
            counts[name] = counts.get(name, 0) + 1
    if RUNNING not in sums or WAITING not in sums:
        return None
    usage = next((sums[n] / counts[n] for n in KV_USAGE if n in sums), 0.0)

    def rate(now_total: float | None, then_total: float | None) -> float | None:
        if now_total is None or then_total is None or before is None or now <= before.read_at:
            return None
        return max(now_total - then_total, 0.0) / (now - before.read_at)

    prompt, generation = sums.get(PROMPT), sums.get(GENERATION)
    return EngineReport(
        running=int(sums[RUNNING]),
        waiting=int(sums[WAITING]),
        kv_usage=min(max(usage, 0.0), 1.0),
        prompt_tokens=prompt,
        generation_tokens=generation,
        prompt_tps=rate(prompt, before.prompt_tokens if before else None),
        generation_tps=rate(generation, before.generation_tokens if before else None),
        read_at=now,
    )


class EngineLoads:
    """The background reads of every backend's load (see the module doc)."""

    def __init__(self, pool: BackendPool, router: kvroute.Router, interval_s: float) -> None:
        self.pool, self.router, self.interval_s = pool, router, interval_s
        #: Backend index -> its last report (absent: none, or its last read failed).
        self.reports: dict[int, EngineReport] = {}
        #: Backend index -> reads that failed, and why the last one did.
        self.failures: dict[int, int] = {}
        self.last_error: dict[int, str] = {}
        self._timeout = aiohttp.ClientTimeout(total=max(min(interval_s, 5.0), 0.5))

    async def read(self, session: aiohttp.ClientSession, b: Backend) -> None:
        """Read ``b``'s load and hand it to the router; a failure clears its report."""
        try:
            async with session.get(b.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"/metrics answered {resp.status}")
                text = await resp.text()
            report = engine_report(text, time.monotonic(), self.reports.get(b.index))
            if report is None:
                raise ValueError("its /metrics has no vllm:num_requests_running and _waiting")
        except _ERRORS as exc:
            self._failed(b, f"{type(exc).__name__}: {exc}")
            return
        self.reports[b.index] = report
        self.last_error.pop(b.index, None)
        self.router.set_engine_load(b.index, report.running, report.waiting, report.kv_usage)

    def _failed(self, b: Backend, why: str) -> None:
        if b.index not in self.last_error:
            log.info("backend %s: its load cannot be read (%s): its own counts only", b.label, why)
        self.failures[b.index] = self.failures.get(b.index, 0) + 1
        self.last_error[b.index] = why
        self.reports.pop(b.index, None)
        self.router.clear_engine_load(b.index)

    async def round(self, session: aiohttp.ClientSession) -> None:
        """Read every live backend once; forget the reports of the others."""
        live = [b for b in self.pool.backends if b.up and not b.removed]
        for b in self.pool.backends:
            if b not in live and b.index in self.reports:
                self.reports.pop(b.index)
                self.router.clear_engine_load(b.index)
        await asyncio.gather(*(self.read(session, b) for b in live))

    async def loop(self, session: aiohttp.ClientSession) -> None:
        """:meth:`round` every ``interval_s`` seconds, forever."""
        while True:
            await self.round(session)
            await asyncio.sleep(self.interval_s)


class EngineLoadCollector(Collector):
    """The engines' own load in the proxy's metrics, per ``{backend}``: ``engine_running``,
    ``engine_waiting``, ``engine_kv_usage``, ``engine_prompt_tokens_per_second``,
    ``engine_generation_tokens_per_second``, ``engine_sent_since_read``, ``engine_outside`` and
    ``engine_load_age_seconds`` (for a backend with a report), ``overloaded`` and
    ``engine_load_failures_total``."""

    def __init__(self, loads: EngineLoads, urls: Callable[[], list[str]]) -> None:
        self._loads, self._urls = loads, urls

    def collect(self) -> Iterable[Metric]:
        name = "kvroute_proxy_"
        gauges = {
            key: GaugeMetricFamily(name + suffix, text, labels=["backend"])
            for key, suffix, text in (
                ("running", "engine_running", "Requests running, as the engine reports."),
                ("waiting", "engine_waiting", "Requests waiting, as the engine reports."),
                ("kv_usage", "engine_kv_usage", "KV-cache usage (0 to 1), as it reports."),
                ("prompt_tps", "engine_prompt_tokens_per_second", "Prompt tokens/s."),
                ("generation_tps", "engine_generation_tokens_per_second", "Output tokens/s."),
                ("sent_since", "engine_sent_since_read", "Requests sent since its report."),
                ("outside", "engine_outside", "Requests it reported beyond this router's."),
                ("age", "engine_load_age_seconds", "Seconds since its load was read."),
                ("overloaded", "overloaded", "1 while the overload rule leaves it out."),
            )
        }
        failures = CounterMetricFamily(
            name + "engine_load_failures", "Reads of its load that failed.", labels=["backend"]
        )
        now = time.monotonic()
        state = self._loads.router.state()
        for i, url in enumerate(self._urls()):
            failures.add_metric([url], self._loads.failures.get(i, 0))
            gauges["overloaded"].add_metric([url], float(state[i]["overloaded"]))
            report, engine = self._loads.reports.get(i), state[i]["engine"]
            if report is None or engine is None:
                continue
            age = now - report.read_at
            values = {**vars(report), "age": age}
            values.update(sent_since=engine["sent_since"], outside=engine["outside"])
            for key, fam in gauges.items():
                if key != "overloaded" and values.get(key) is not None:
                    fam.add_metric([url], float(values[key]))
        yield from (*gauges.values(), failures)
