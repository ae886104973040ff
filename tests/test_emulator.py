"""The engine emulator: its timing model, and the OpenAI-compatible server around it."""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from kvroute.emulator import (
    EMULATOR,
    Emulator,
    EmulatorConfig,
    EngineEvent,
    FaultConfig,
    SimpleEngine,
    TimingParams,
    emulator_app,
)
from kvroute.emulator.server import output_plan
from kvroute.proxy import ServerThread
from livekit import MODEL, http, sse_events, wait_until

# -- the timing model ---------------------------------------------------------------------


def run_all(engine: SimpleEngine, until: float = 1e9) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    while (t := engine.next_event_time()) is not None and t <= until:
        events += engine.advance(t)
    return events


def test_lifecycle_events_in_order() -> None:
    e = SimpleEngine(TimingParams())
    e.submit("a", [1, 2], 1000, 4, now=0.0)
    events = run_all(e)
    assert [ev.kind for ev in events] == ["first_token", "tokens", "tokens", "tokens", "finish"]
    assert sum(ev.tokens for ev in events) == 4
    assert all(a.time <= b.time for a, b in itertools.pairwise(events))
    assert e.next_event_time() is None
    assert e.stats()["running"] == 0 and e.stats()["kv_usage"] == 0


def test_prefix_cache_hit_follows_vllm() -> None:
    e = SimpleEngine(TimingParams())
    e.submit(1, [10, 11, 12], 1300, 1, now=0.0)
    first = [ev for ev in run_all(e) if ev.kind == "first_token"]
    assert first[0].cached_tokens == 0
    # Same prompt again: vLLM recomputes the last token (rounded down to its 16-token block).
    e.submit(2, [10, 11, 12], 1300, 1, now=10.0)
    assert [ev.cached_tokens for ev in run_all(e) if ev.kind == "first_token"] == [1296]
    # A prompt sharing two leading blocks hits 1024 tokens.
    e.submit(3, [10, 11, 99], 1400, 1, now=20.0)
    assert [ev.cached_tokens for ev in run_all(e) if ev.kind == "first_token"] == [1024]
    assert e.stats()["prefix_hits_tokens"] == 1296 + 1024


def test_chunked_prefill_takes_several_steps() -> None:
    p = TimingParams(max_num_batched_tokens=8192)
    e = SimpleEngine(p)
    e.submit("long", list(range(40)), 20_000, 2, now=0.0)
    events = run_all(e)
    first = next(ev for ev in events if ev.kind == "first_token")
    # Three prefill steps: 8192 + 8192 + 3616 tokens.
    expected = 3 * p.step_base_s + 20_000 * p.prefill_s_per_token
    assert first.time == pytest.approx(expected)


def test_decode_is_slowed_by_a_prefill_beside_it() -> None:
    e = SimpleEngine(TimingParams())
    e.submit("d", [1], 100, 50, now=0.0)
    e.advance(0.05)
    t0 = e.next_event_time()
    assert t0 is not None
    e.submit("p", list(range(2, 20)), 8000, 1, now=t0)
    events = run_all(e)
    d_times = [ev.time for ev in events if ev.request_id == "d"]
    steps = [b - a for a, b in itertools.pairwise(d_times)]
    assert max(steps) > 5 * min(steps)  # the step carrying the prefill is long


def test_cancel_drops_a_request() -> None:
    e = SimpleEngine(TimingParams())
    e.submit("a", [1], 600, 1000, now=0.0)
    e.submit("b", [2], 600, 3, now=0.0)
    e.advance(0.1)
    e.cancel("a")
    e.cancel("a")  # second cancel: no-op
    events = run_all(e)
    assert {ev.request_id for ev in events} == {"b"}
    assert e.stats()["running"] == 0


def test_kv_pool_makes_requests_wait() -> None:
    e = SimpleEngine(TimingParams(kv_capacity_blocks=4))
    e.submit("a", [1, 2, 3], 1500, 200, now=0.0)
    e.submit("b", [4, 5, 6], 1500, 2, now=0.0)
    e.advance(0.0001)
    assert e.stats()["waiting"] == 1
    events = run_all(e)
    a_done = next(ev.time for ev in events if ev.kind == "finish" and ev.request_id == "a")
    b_first = next(ev.time for ev in events if ev.kind == "first_token" and ev.request_id == "b")
    assert b_first > a_done


def test_lru_evicts_the_tail_of_a_prefix_first() -> None:
    e = SimpleEngine(TimingParams(kv_capacity_blocks=4))
    e.submit(1, [1, 2, 3], 1536, 1, now=0.0)
    run_all(e)
    e.submit(2, [7, 8], 1024, 1, now=1.0)  # evicts key 3 (least recently touched)
    run_all(e)
    e.submit(3, [1, 2, 3], 1536, 1, now=2.0)
    assert [ev.cached_tokens for ev in run_all(e) if ev.kind == "first_token"] == [1024]


def test_output_plan() -> None:
    assert output_plan(10, 0, True, 123) == (10, "length")
    n, reason = output_plan(1000, 0, False, 42)
    assert (n < 1000) == (reason == "stop")
    assert output_plan(1000, 0, False, 42) == (n, reason)  # deterministic
    assert output_plan(10, 10, False, 42) == (10, "length")  # min_tokens


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sim", "simple"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, str, Emulator]]:
    """An emulator with the simulator's engine model, and one with the simple model."""
    with ServerThread() as st:
        app = emulator_app(EmulatorConfig(speedup=50, engine=request.param))
        url = st.start(app)
        yield st, url, app[EMULATOR]


def test_completion_with_token_ids_reports_cached_tokens(server: tuple) -> None:
    _, url, _ = server
    body = {"model": MODEL, "prompt": list(range(100, 2100)), "max_tokens": 7, "ignore_eos": True}
    status, _, raw = http("POST", url + "/v1/completions", body)
    assert status == 200
    out = json.loads(raw)
    assert out["object"] == "text_completion"
    assert out["usage"]["prompt_tokens"] == 2000 and out["usage"]["completion_tokens"] == 7
    assert out["choices"][0]["finish_reason"] == "length"
    assert len(out["choices"][0]["text"].split()) == 7
    hits = server[2].engine.stats()["prefix_hits_tokens"]
    _, _, raw = http("POST", url + "/v1/completions", body)
    cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 1024 <= cached < 2000  # at least the full blocks but the last, never all
    assert server[2].engine.stats()["prefix_hits_tokens"] - hits == cached


def test_stream_with_usage(server: tuple) -> None:
    _, url, _ = server
    body = {
        "prompt": list(range(5000, 5600)),
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = http("POST", url + "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == 600
    text = "".join(e["choices"][0]["text"] for e in events[:-2] if e["choices"])
    assert len(text.split()) == 12
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_token_ids_and_the_engine_clock(server: tuple) -> None:
    """``return_token_ids`` gives each chunk its tokens' ids (those of its text, as vLLM
    does); with the engine-clock header the stream has one chunk per engine step, each
    stamped with its engine time, after the arrival time the response's header gives."""
    from kvroute.emulator.responses import ENGINE_ARRIVED_HEADER, ENGINE_CLOCK_HEADER
    from kvroute.tokenize import BuiltinTokenizer

    _, url, _ = server
    body = {"prompt": list(range(7000, 7300)), "max_tokens": 9, "ignore_eos": True}
    body |= {"return_token_ids": True}
    status, _, raw = http("POST", url + "/v1/completions", body)
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and len(choice["token_ids"]) == 9
    assert choice["token_ids"] == BuiltinTokenizer().encode(choice["text"]).tolist()
    headers = {ENGINE_CLOCK_HEADER: "1"}
    for chat in (False, True):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1, 2]}
        body = {**prompt, "max_tokens": 9, "ignore_eos": True, "stream": True}
        status, got, raw = http("POST", url + path, {**body, "return_token_ids": True}, headers)
        chunks = [e for e in sse_events(raw)[:-1] if e["choices"] and "engine_time" in e]
        assert status == 200 and len(chunks) == 9
        assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
        times = [c["engine_time"] for c in chunks]
        assert float(got[ENGINE_ARRIVED_HEADER]) < times[0] and times == sorted(set(times))
    # Without the header and the field, the stream is as vLLM's.
    status, got, raw = http("POST", url + "/v1/completions", {**body, "prompt": [1, 2]})
    assert ENGINE_ARRIVED_HEADER not in got and b"engine_time" not in raw
    assert b"token_ids" not in raw


def test_chat_stream_starts_with_the_role(server: tuple) -> None:
    _, url, _ = server
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
    }
    status, _, raw = http("POST", url + "/v1/chat/completions", body)
    events = sse_events(raw)
    assert status == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["object"] == "chat.completion.chunk"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert len(content.split()) == 3


def test_text_prompt_matches_tokenize(server: tuple) -> None:
    _, url, _ = server
    text = "def f(x):\n    return x * 2  # double it\n" * 20
    _, _, raw = http("POST", url + "/tokenize", {"prompt": text})
    count = json.loads(raw)["count"]
    _, _, raw = http("POST", url + "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == count
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, _, raw = http("POST", url + "/tokenize", {"messages": msgs})
    n_chat = json.loads(raw)["count"]
    _, _, raw = http("POST", url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == n_chat


def test_without_ignore_eos_a_request_may_stop_early(server: tuple) -> None:
    _, url, _ = server
    reasons = set()
    for i in range(12):
        body = {"prompt": [7 + i] * 40, "max_tokens": 30}
        _, _, raw = http("POST", url + "/v1/completions", body)
        choice = json.loads(raw)["choices"][0]
        reasons.add(choice["finish_reason"])
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": 12}', "prompt"),
        (b'{"prompt": [1, -2]}', "prompt"),
        (b'{"prompt": [1], "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": [1], "n": 2}', "n"),
        (b'{"prompt": [1], "stream": "yes"}', "stream"),
    ],
)
def test_bad_bodies_get_400(server: tuple, body: bytes, param: str | None) -> None:
    _, url, _ = server
    status, _, raw = http("POST", url + "/v1/completions", body)
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["code"] == 400 and err["param"] == param and err["message"]


def test_unknown_model_is_404(server: tuple) -> None:
    _, url, _ = server
    status, _, raw = http("POST", url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and "nope" in json.loads(raw)["error"]["message"]


def test_models_health_and_metrics(server: tuple) -> None:
    _, url, _ = server
    status, _, raw = http("GET", url + "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL
    assert http("GET", url + "/health")[0] == 200
    status, _, raw = http("GET", url + "/metrics")
    text = raw.decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f"{name}{{" in text, name
    assert 'model_name="Qwen/Qwen3-Coder-30B-A3B-Instruct"' in text


def test_faults() -> None:
    with ServerThread() as st:
        app = emulator_app(EmulatorConfig(speedup=50))
        url = st.start(app)
        emu = app[EMULATOR]
        emu.faults = FaultConfig(error_rate=1.0, error_status=503)
        status, _, raw = http("POST", url + "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert status == 503 and json.loads(raw)["error"]["code"] == 503
        emu.faults = FaultConfig(die_rate=1.0, die_after_tokens=2)
        body = {"prompt": [1] * 10, "max_tokens": 8, "ignore_eos": True, "stream": True}
        with pytest.raises(Exception) as info:
            http("POST", url + "/v1/completions", body)
        assert "IncompleteRead" in repr(info.value) or "closed" in repr(info.value).lower()
        emu.faults = FaultConfig(stall_rate=1.0, stall_s=0.5)
        t0 = time.monotonic()
        assert http("POST", url + "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
        assert time.monotonic() - t0 >= 0.5
        emu.faults = FaultConfig(unhealthy=True)
        assert http("GET", url + "/health")[0] == 503
        with pytest.raises(ValueError, match="at most 1"):
            FaultConfig(error_rate=0.6, die_rate=0.6)
        wait_until(lambda: emu.active == 0, what="the engine to drain")


def test_client_disconnect_cancels_the_request() -> None:
    with ServerThread() as st:
        app = emulator_app(EmulatorConfig(speedup=1))
        url = st.start(app)
        emu = app[EMULATOR]
        parts = urlsplit(url)
        body = json.dumps(
            {"prompt": [3] * 100, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        ).encode()
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert b"200" in sock.recv(4096)
            wait_until(lambda: emu.active == 1, what="the request to run")
        # Uncancelled, its 100,000 tokens would take about 12 minutes.
        wait_until(lambda: emu.active == 0, timeout=30, what="the request to be cancelled")
        assert emu.engine.stats()["running"] == 0
