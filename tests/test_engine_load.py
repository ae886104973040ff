"""The engines' own load (``kvroute.proxy.load``): read from their ``/metrics`` in the
background, shown in the router's state and the proxy's metrics, cleared when a read fails,
and the overload rule that leaves a loaded engine out while another is not."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

import kvroute
from kvroute.emulator import EmulatorConfig, emulator_app
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.proxy.load import engine_report
from livekit import FakeEngine, http, wait_until

METRICS = """# HELP vllm:num_requests_running Requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} {prompt}
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
"""


def test_an_engines_report_sums_its_ranks_and_rates_its_counters() -> None:
    first = engine_report(METRICS.replace("{prompt}", "100.0"), 10.0, None)
    assert first is not None
    assert (first.running, first.waiting, first.kv_usage) == (5, 5, pytest.approx(0.6))
    assert first.prompt_tps is None  # no read before
    second = engine_report(METRICS.replace("{prompt}", "300.0"), 12.0, first)
    assert second is not None and second.prompt_tps == pytest.approx(100.0)
    assert second.generation_tps == 0.0
    v0 = (
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.25\n"
    )
    old = engine_report(v0, 1.0, None)
    assert old is not None and (old.running, old.kv_usage) == (1, 0.25)
    assert engine_report("other_metric 1\n", 1.0, None) is None


class LoadedEngine(FakeEngine):
    """A fake engine that answers completions at once and reports ``waiting`` requests."""

    def __init__(self, waiting: int, running: int = 0) -> None:
        self.waiting, self.running, self.served = waiting, running, 0
        self.hang = False  # /metrics answers only after 30 s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)

    async def metrics(self, _r: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(30)
        text = (
            f"vllm:num_requests_running {self.running}\n"
            f"vllm:num_requests_waiting {self.waiting}\n"
            "vllm:kv_cache_usage_perc 0.1\n"
        )
        return web.Response(text=text)

    async def completions(self, _r: web.Request) -> web.Response:
        self.served += 1
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": {"completion_tokens": 1}})


def proxy_of(st: ServerThread, engines: list[Any], **kw: Any) -> tuple[str, Proxy]:
    backends = [st.start(e.app()) for e in engines]
    proxy = Proxy(ProxyConfig(backends=backends, load_interval_s=0.1, **kw))
    return st.start(proxy), proxy


def test_an_overloaded_engine_is_left_out_while_another_is_not() -> None:
    busy, idle = LoadedEngine(waiting=12), LoadedEngine(waiting=0)
    with ServerThread() as st:
        url, proxy = proxy_of(st, [busy, idle], policy="round_robin", overload_waiting=8)
        wait_until(lambda: all(s["engine"] is not None for s in proxy.router.state()), what="reads")
        assert [s["overloaded"] for s in proxy.router.state()] == [True, False]
        for n in range(6):
            assert http("POST", url + "/v1/completions", {"prompt": [1, 2, n]})[0] == 200
        assert (busy.served, idle.served) == (0, 6)
        # The other one fills up too: both take part again.
        idle.waiting = 30
        wait_until(lambda: all(s["overloaded"] for s in proxy.router.state()), what="a read")
        for n in range(6):
            assert http("POST", url + "/v1/completions", {"prompt": [3, 4, n]})[0] == 200
        assert busy.served > 0
        _, _, body = http("GET", url + "/metrics")
        text = body.decode()
        assert 'kvroute_proxy_engine_waiting{backend="' in text
        assert "kvroute_proxy_overloaded{" in text


@pytest.mark.parametrize("source", ["engine", "router"])
def test_requests_an_engine_serves_for_others_steer_the_policy(source: str, tmp_path: Any) -> None:
    """Traffic that bypassed this router (the engine reports 5 requests it never sent there)
    moves new requests to the other engine with the engine load source, and only with it."""
    bypassed, quiet = LoadedEngine(waiting=2, running=3), LoadedEngine(waiting=0)
    log = tmp_path / "decisions.jsonl"
    with ServerThread() as st:
        url, proxy = proxy_of(
            st, [bypassed, quiet], policy="load_only", load_source=source, decision_log=str(log)
        )
        wait_until(lambda: all(s["engine"] is not None for s in proxy.router.state()), what="reads")
        assert [s["engine"]["outside"] for s in proxy.router.state()] == [5, 0]  # type: ignore[index]
        for n in range(4):
            assert http("POST", url + "/v1/completions", {"prompt": [1, 2, n]})[0] == 200
        # load_only's ties go to the first engine: only the outside requests move them.
        assert (bypassed.served, quiet.served) == ((0, 4) if source == "engine" else (4, 0))
        proxy.flush_decision_log()
        first = json.loads(log.read_text().splitlines()[0])
        terms = first["terms"]
        assert terms[0]["engine"]["outside"] == 5 and terms[1]["engine"]["outside"] == 0
        assert terms[0]["num_requests"] == (5 if source == "engine" else 0)
        assert terms[0]["overloaded"] is False
        _, _, body = http("GET", url + "/metrics")
        assert "kvroute_proxy_engine_outside{" in body.decode()


def test_a_failed_read_clears_the_report_and_is_counted() -> None:
    with ServerThread() as st:
        engine = st.start(emulator_app(EmulatorConfig()))
        proxy = Proxy(ProxyConfig(backends=[engine], load_interval_s=0.1))
        url = st.start(proxy)
        wait_until(lambda: proxy.router.state()[0]["engine"] is not None, what="a read")
        engine_state = proxy.router.state()[0]["engine"]
        assert engine_state is not None and engine_state["waiting"] == 0
        # A backend without /metrics (here: an address where nothing answers).
        proxy.loads.pool.backends[0].url = "http://127.0.0.1:9"
        wait_until(lambda: proxy.router.state()[0]["engine"] is None, what="the failure")
        assert proxy.loads.failures[0] >= 1 and proxy.loads.last_error[0]
        _, _, body = http("GET", url + "/metrics")
        assert "kvroute_proxy_engine_load_failures_total{" in body.decode()


def test_a_read_that_hangs_is_cut_and_the_report_cleared() -> None:
    """A stale report never stands: a read is cut after the interval (0.5 s at least)."""
    engine = LoadedEngine(waiting=12)
    with ServerThread() as st:
        _, proxy = proxy_of(st, [engine, LoadedEngine(waiting=0)], overload_waiting=8)
        wait_until(lambda: proxy.router.state()[0]["overloaded"], what="a read")
        engine.hang = True
        wait_until(lambda: proxy.router.state()[0]["engine"] is None, what="the cut read")
        assert proxy.loads.last_error[0].startswith("TimeoutError")
        assert not proxy.router.state()[0]["overloaded"]


def test_the_overload_rule_checks_its_arguments() -> None:
    r = kvroute.Router(2)
    with pytest.raises(kvroute.InvalidArgumentError, match="kv_usage"):
        r.set_overload_rule(kv_usage=1.5)
    with pytest.raises(kvroute.InvalidArgumentError, match="waiting"):
        r.set_overload_rule(waiting=0)
    with pytest.raises(kvroute.InvalidArgumentError, match="kv_usage"):
        r.set_engine_load(0, 1, 1, -0.1)
    r.set_engine_load(1, 2, 3, 0.5)
    assert r.state()[1]["engine"] == {
        "running": 2,
        "waiting": 3,
        "kv_usage": 0.5,
        "sent_since": 0,
        "outside": 5,
    }
    with pytest.raises(kvroute.InvalidArgumentError, match="load_interval_s"):
        ProxyConfig(backends=["http://a:1"], load_interval_s=float("nan"))


def test_the_token_cap_counts_a_prefix_held_in_flight_once() -> None:
    """Three requests of one 32-token prefix and a block of their own are 108 prompt tokens,
    of which the engine holds the prefix once: 44, under a cap of 50; two requests with no
    block in common are 72, over it. Counts follow the requests as they end."""
    prefix = list(range(1, 9))  # 8 blocks of 4 tokens
    r = kvroute.Router(2, "round_robin", block_size=4)
    r.set_overload_rule(tokens=50)
    r.set_available(1, False)
    for j in range(3):
        r.route(f"p{j}", [*prefix, 100 + j], 36)
    assert not r.state()[0]["overloaded"]
    r.route("other", list(range(200, 209)), 36)  # 44 + 36
    assert r.state()[0]["overloaded"]
    for j in range(3):
        r.finish(f"p{j}")
    assert not r.state()[0]["overloaded"]  # 36
    r.route("twin", list(range(300, 309)), 36)
    assert r.state()[0]["overloaded"]  # 72, nothing shared
    r.finish("twin")
    # The cap off and on again while requests are in flight: no count goes wrong.
    r.set_overload_rule()
    r.route("untracked", [*prefix, 7], 36)
    r.set_overload_rule(tokens=50)
    r.route("tracked", [*prefix, 8], 36)
    r.finish("untracked")
    assert r.state()[0]["overloaded"]  # other and tracked: 72
    r.finish("tracked")
    r.finish("other")
    assert [s["num_requests"] for s in r.state()] == [0, 0]
    assert not r.state()[0]["overloaded"]
