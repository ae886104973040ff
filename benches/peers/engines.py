"""The peers benchmark's engines: two real vLLM CPU engines (``tests/realvllm.py``, one core
each, KV events with a replay socket), their counters read from ``/metrics`` (prefix-cache
hits and queries in tokens, finished requests, preemptions), and a reset to cold caches
between arms.
O(engines) HTTP calls per read.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from routers import Fleet

import realvllm


@dataclass(frozen=True)
class Counters:
    """One engine's counters at one moment."""

    hits: float
    queries: float
    requests: float
    running: float
    preemptions: float
    #: The engine's own time to first token (from its API server receiving a request), summed
    #: over its requests, and their count.
    ttft_sum: float
    ttft_count: float


def counters(url: str) -> Counters:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:request_success_total": "requests",
        "vllm:num_requests_running": "running",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:time_to_first_token_seconds_sum": "ttft_sum",
        "vllm:time_to_first_token_seconds_count": "ttft_count",
    }
    got = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                got[names[s.name]] += s.value
    return Counters(**got)


def reset(urls: list[str], timeout_s: float = 120.0) -> None:
    """Wait until no engine runs a request, then empty every prefix cache."""
    deadline = time.monotonic() + timeout_s
    while any(counters(u).running for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError("the engines did not go idle")
        time.sleep(0.2)
    for u in urls:
        req = urllib.request.Request(u + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def calibrate(fleet: Fleet, progress: Callable[[str], None] = print) -> dict[str, float]:
    """Fit an engine profile of the fleet's engines (the short grid, ``kvroute calibrate``),
    write it to ``fleet.profile`` and return its terms."""
    from kvroute.sim.calibrate import calibrate as fit

    assert fleet.profile is not None
    started = time.monotonic()
    doc = fit(list(fleet.urls), grid="short", model=fleet.model)
    fleet.profile.parent.mkdir(parents=True, exist_ok=True)
    fleet.profile.write_text(json.dumps(doc, indent=1) + "\n")
    error = doc["fit"]["error"]["all"]
    progress(
        f"calibrated {fleet.profile.name} in {time.monotonic() - started:.0f} s "
        f"(fit p50 {error['p50']:.1%}, max {error['max']:.1%})"
    )
    return dict(doc["params"])


class Engines:
    """Two engines with ``kv_bytes`` of KV cache each (see the module doc)."""

    def __init__(self, kv_bytes: int, log_dir: Path) -> None:
        ports = realvllm.free_ports(4)
        extra = [["--kv-cache-memory-bytes", str(kv_bytes)]] * 2
        self.engines = realvllm.start_engines(2, ports[:2], ports[2:], log_dir, extra_args=extra)
        model_dir = realvllm.ensure_model(realvllm.ensure_venv())
        self.fleet = Fleet(
            urls=tuple(self.engines.urls),
            events=tuple(f"tcp://127.0.0.1:{e.events_port}" for e in self.engines),
            replays=tuple(f"tcp://127.0.0.1:{e.replay_port}" for e in self.engines),
            block_size=realvllm.BLOCK_SIZE,
            model_dir=model_dir,
            model=realvllm.MODEL_NAME,
        )

    def stop(self) -> None:
        self.engines.stop()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
