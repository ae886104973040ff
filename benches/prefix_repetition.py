"""Engine-reported prefix-cache hit rates per policy and cache view, with vLLM's own benchmark
client: ``vllm bench serve --dataset-name prefix_repetition`` (16 prefixes of 1,536 tokens,
128-token suffixes, 160 prompts, concurrency 8, no session ids) through ``kvroute proxy`` to
two real CPU engines with 32 MiB of KV cache each (16,384 tokens: the prefixes fit the two
caches together, not one).

For each policy, three cache views: the estimate unbounded (the router's model before the
events view; ``cache_capacity_blocks=None``), the estimate bounded by each engine's KV
capacity (the default without events), and the engines' KV events (``--kv-events auto``). The
hit rate is the engines' ``vllm:prefix_cache_hits_total`` over ``queries_total`` during the
run; the bound is what the best placement allows: every prompt but each prefix's first hits
its whole prefix.

    .venv/bin/python benches/prefix_repetition.py [--policies a,b] [--views ...] [--json F]

``--replicas 2``: two proxies in front of the same engines, each with its own client sending
half the prompts (the same ones: each prompt goes through both replicas), so each replica's
estimate misses what the other placed and only the events view sees both.

Run it on an otherwise idle machine; the engines take one core each (about 1 min per run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import realvllm
from kvroute.proxy import Proxy, ProxyConfig, ServerThread

PREFIXES, PREFIX_LEN, SUFFIX_LEN, PROMPTS, CONCURRENCY = 16, 1536, 128, 160, 8
POLICIES = ("round_robin", "unified", "lmetric", "dynamo_cost", "sglang_cache_aware")
#: View name -> proxy settings.
VIEWS: dict[str, dict[str, Any]] = {
    "estimate-unbounded": {"kv_events": "off", "router_options": {"cache_capacity_blocks": None}},
    "estimate-capacity": {"kv_events": "off", "router_options": {}},
    "events": {"kv_events": "auto", "router_options": {}},
}


def engine_counters(urls: list[str]) -> tuple[float, float]:
    """Σ prefix-cache hits and queries (tokens) of the engines."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


def run_one(
    engines: realvllm.Engines,
    policy: str,
    view: dict[str, Any],
    seed: int,
    extra: dict[str, Any],
    replicas: int = 1,
) -> dict[str, Any]:
    """One run; with ``replicas`` proxies in front of the same engines, each replica's client
    sends ``PROMPTS / replicas`` prompts of the same seed (the same prompts, each sent once
    through every replica), at ``CONCURRENCY / replicas`` each."""
    model = engines.model
    options = {"block_size": realvllm.BLOCK_SIZE, **extra, **view["router_options"]}
    config = ProxyConfig(
        backends=engines.urls,
        policy=policy,
        tokenizer=str(model / "tokenizer.json"),
        router_options=options,
        kv_events=view["kv_events"],
        health_interval_s=0.5,
    )
    with ServerThread() as st:
        proxies = [Proxy(config) for _ in range(replicas)]
        urls = [st.start(p) for p in proxies]
        deadline = time.monotonic() + 60
        while True:  # vLLM publishes a reset's AllBlocksCleared with its next step's batch
            req = urllib.request.Request(urls[0] + "/reset_prefix_cache", data=b"", method="POST")
            urllib.request.urlopen(req, timeout=30).read()
            body = json.dumps({"model": realvllm.MODEL_NAME, "prompt": [1, 2], "max_tokens": 1})
            for u in engines.urls:
                headers = {"Content-Type": "application/json"}
                post = urllib.request.Request(u + "/v1/completions", body.encode(), headers)
                urllib.request.urlopen(post, timeout=30).read()
            time.sleep(0.3)
            views = [p.router.kv_view(i) for p in proxies for i in range(len(engines.urls))]
            if view["kv_events"] == "off" or all(v and v["uses_events"] for v in views):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the events views did not become complete")
        for p in proxies[1:]:  # the other replicas' estimates start cold too
            for i in range(len(engines.urls)):
                p.router.clear_cache(i)
        before = engine_counters(engines.urls)
        t0 = time.monotonic()
        clients = []
        for url in urls:
            cmd = [
                str(realvllm.vllm_executable()), "bench", "serve", "--backend", "openai",
                "--base-url", url, "--endpoint", "/v1/completions",
                "--model", realvllm.MODEL_NAME, "--tokenizer", str(model),
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(PREFIX_LEN),
                "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
                "--prefix-repetition-num-prefixes", str(PREFIXES),
                "--num-prompts", str(PROMPTS // replicas),
                "--max-concurrency", str(CONCURRENCY // replicas),
                "--seed", str(seed), "--ignore-eos",
            ]  # fmt: skip
            clients.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=realvllm.engine_env(0),
                )
            )
        for c in clients:
            out, _ = c.communicate(timeout=1800)
            if c.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed:\n{out[-3000:]}")
        took = time.monotonic() - t0
        after = engine_counters(engines.urls)
        states = [p.router.kv_view(i) for p in proxies for i in range(len(engines.urls))]
    hits, queries = after[0] - before[0], after[1] - before[1]
    events = view["kv_events"] == "auto"
    return {
        "policy": policy,
        "replicas": replicas,
        "hit_rate": hits / queries if queries else 0.0,
        "seconds": round(took, 1),
        "degraded": [bool(v and not v["uses_events"]) for v in states] if events else None,
    }


def bound() -> float:
    """Hit rate of the best placement: each prefix's first prompt misses, the rest hit it."""
    hit = PREFIXES * (PROMPTS // PREFIXES - 1) * PREFIX_LEN
    return hit / (PROMPTS * (PREFIX_LEN + SUFFIX_LEN))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--views", default=",".join(VIEWS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1, help="proxies on the same engines")
    parser.add_argument(
        "--router-option", action="append", default=[], metavar="KEY=VALUE",
        help="a router keyword for every run (value read as JSON), e.g. overlap_weight=4",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    ports = realvllm.free_ports(4)
    small = ["--kv-cache-memory-bytes", str(realvllm.SMALL_KV_CACHE_BYTES)]
    extra = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.router_option)}
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        engines = realvllm.start_engines(
            2, ports[:2], ports[2:], Path(logs), extra_args=[small, small]
        )
        try:
            for policy in args.policies.split(","):
                for name in args.views.split(","):
                    result = run_one(engines, policy, VIEWS[name], args.seed, extra, args.replicas)
                    row = {"view": name, **result, **extra}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            engines.stop()
    if args.replicas == 1:
        print(f"\nbest placement: {bound():.1%}")
    views = args.views.split(",")
    print(f"| policy | {' | '.join(views)} |\n|---|{'---|' * len(views)}")
    for policy in args.policies.split(","):
        got = {r["view"]: f"{r['hit_rate']:.1%}" for r in rows if r["policy"] == policy}
        print(f"| {policy} | {' | '.join(got.get(v, '') for v in views)} |")
    if args.json:
        args.json.write_text(json.dumps({"bound": bound(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
