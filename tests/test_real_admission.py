"""Admission and the rate search on real vLLM engines (``make test-vllm``): requests queued
at the router reach the engine holding their prefix and hit it there; ``kvroute bench
srr``'s search probes running engines through a proxy."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest

from kvroute.report import srr
from livekit import http, small_trace
from realvllm import BLOCK_SIZE, MODEL_NAME, Engines
from test_real_vllm import RealStack

pytestmark = pytest.mark.vllm


def complete(url: str, prompt: list[int], out: list[Any]) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    status, headers, raw = http("POST", url + "/v1/completions", body, timeout=120.0)
    out.append((status, headers, json.loads(raw)))


def in_parallel(url: str, prompts: list[list[int]]) -> list[Any]:
    out: list[Any] = []
    threads = [threading.Thread(target=complete, args=(url, p, out)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_queued_requests_wait_for_the_engine_holding_their_prefix(engines: Engines) -> None:
    """One request in flight per engine: six prompts at once, then each prompt extended, at
    once again. Every request of the second wave waits for the engine its first wave warmed
    (patience long enough never to run out) and hits its prefix there."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 30000) for _ in range(8 * BLOCK_SIZE)] for _ in range(6)]
    config = {"policy": "leastwork", "max_in_flight": 1, "queue_size": 16, "load_source": "router"}
    with RealStack(engines, **config, queue_patience_s=600.0) as s:
        first = in_parallel(s.url, prompts)
        second = in_parallel(s.url, [[*p, 7, 8, 9] for p in prompts])
        for status, headers, _ in first + second:
            assert status == 200 and float(headers["X-Kvroute-Queue-Wait"]) >= 0
        for _, _, body in second:
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 7 * BLOCK_SIZE, body["usage"]
        assert s.metric("kvroute_proxy_queued_total") > 0, "at most two of six go at once"
        s.assert_idle()


def test_the_rate_search_probes_running_engines(engines: Engines) -> None:
    trace = small_trace(sessions=3, turns=2, block_size=BLOCK_SIZE, ttp=0.05)
    cfg = srr.SrrConfig(
        urls=tuple(engines.urls),
        policies=("unified_dynamo",),
        slo_ttft_p90=60.0,
        slo_tpot_p90=60.0,
        start=2.0,
        max_rounds=2,
        model=MODEL_NAME,
    )
    found = srr.search(trace, cfg, srr.live_probe(trace, cfg))["unified_dynamo"]
    assert [(p["rate"], p["ok"], p["requests"], p["errors"]) for p in found["probes"]] == [
        (2.0, True, 6, 0),
        (4.0, True, 6, 0),
    ]
    assert found["rate"] == 4.0 and found["upper"] is None
