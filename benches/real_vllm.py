"""kvroute against real vLLM engines on this machine's CPU (``tests/realvllm.py`` makes them).

Measures, in one run: how long two engines take to answer ``/health``; a 2,000-token prompt
cold and then cached (one output token, straight to an engine); and what ``kvroute proxy``
adds to small requests, direct and through two proxies in turn (p50 and p90 of the whole
request, the same prompts): one with the proxy's default vLLM cache rule, which reads each
answer's output to record its blocks, and one with the trace rule, which does not. Prints a
table; ``--json`` prints the numbers.

    .venv/bin/python benches/real_vllm.py [--requests 60] [--json]

Run it on an otherwise idle machine; the engines take one core each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import realvllm
from kvroute.proxy import Proxy, ProxyConfig, ServerThread


def post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t0, out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ports = realvllm.free_ports(4)
    with tempfile.TemporaryDirectory() as logs:
        t0 = time.monotonic()
        engines = realvllm.start_engines(2, ports[:2], ports[2:], Path(logs))
        start_s = time.monotonic() - t0
        try:
            result = measure(engines, args.requests)
        finally:
            engines.stop()
    result["start_to_health_s"] = round(start_s, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"two engines, start to /health: {result['start_to_health_s']} s")
    for key in ("prefill_2000_cold_ms", "prefill_2000_cached_ms"):
        print(f"{key}: {result[key]}")
    for key in ("direct", "proxy", "proxy_trace_rule"):
        print(f"{key:>16}: p50 {result[key]['p50_ms']} ms, p90 {result[key]['p90_ms']} ms")
        if key != "direct":
            print(f"{'':>16}  added at p50: {result[f'added_p50_ms_{key}']} ms")
    return 0


def measure(engines: realvllm.Engines, requests: int) -> dict[str, Any]:
    url = engines[0].url + "/v1/completions"
    cold, cached = [], []
    for i in range(5):
        prompt = [1000 + i, *range(2000, 3999)]
        cold.append(post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 1})[0])
        t, out = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 1984
        cached.append(t)
    with ServerThread() as st:
        targets = {"direct": url}
        for name, rule in (("proxy", "vllm"), ("proxy_trace_rule", "trace")):
            options = {"block_size": 32, "cache_rule": rule}
            config = ProxyConfig(backends=[engines[0].url], router_options=options)
            targets[name] = st.start(Proxy(config)) + "/v1/completions"
        times: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for i in range(requests):
            body = {"model": "tiny", "prompt": [5000 + i % 7] * 200, "max_tokens": 4}
            for name in names[i % 3 :] + names[: i % 3]:  # each goes first in turn
                times[name].append(post(targets[name], body)[0])

    def ms(x: float) -> float:
        return round(1000 * x, 2)

    out: dict[str, Any] = {
        "prefill_2000_cold_ms": [ms(x) for x in cold],
        "prefill_2000_cached_ms": [ms(x) for x in cached],
    }
    for name, xs in times.items():
        out[name] = {"p50_ms": ms(pct(xs, 0.5)), "p90_ms": ms(pct(xs, 0.9))}
    direct = statistics.median(times["direct"])
    for name in ("proxy", "proxy_trace_rule"):
        out[f"added_p50_ms_{name}"] = ms(statistics.median(times[name]) - direct)
    return out


if __name__ == "__main__":
    sys.exit(main())
