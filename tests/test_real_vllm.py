"""kvroute against real vLLM engines on CPU (``make test-vllm``; ``tests/realvllm.py`` makes
them): the ``openai`` client through the proxy, streamed usage, the engines' endpoints,
replay, a killed engine and the interference benchmark. The model is tiny with random
weights, so answers are gibberish, but caching, scheduling and the API are vLLM's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvroute
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.replay import ReplayConfig, replay
from kvroute.trace import read_trace
from livekit import http, sse_events, wait_until
from realvllm import BLOCK_SIZE, MODEL_NAME, Engines

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]


class RealStack:
    """A proxy in front of the real engines, on a background loop."""

    def __init__(self, engines: Engines, **config: Any) -> None:
        options = {
            "tokenizer": "backend",
            "router_options": {"block_size": BLOCK_SIZE},
            "health_interval_s": 0.5,
        }
        self.st = ServerThread()
        self.proxy = Proxy(ProxyConfig(backends=engines.urls, **{**options, **config}))
        self.url = self.st.start(self.proxy)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    def metric(self, name: str) -> float:
        return metric_total(http("GET", self.url + "/metrics")[2].decode(), name)

    def assert_idle(self) -> None:
        wait_until(lambda: self.proxy.router.in_flight == 0, 30, "the proxy to drain")
        for s in self.proxy.router.state():
            for key in ("num_requests", "ongoing_tokens", "pending_prefill_tokens"):
                assert s[key] == 0, (key, s)  # type: ignore[literal-required]
            assert s["ongoing_decode_tokens"] == 0, s

    def close(self) -> None:
        self.client.close()
        self.st.close()

    def __enter__(self) -> RealStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def metric_total(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def engine_metric(url: str, name: str) -> float:
    return metric_total(http("GET", url + "/metrics")[2].decode(), name)


def test_the_openai_client_through_the_proxy(engines: Engines) -> None:
    with RealStack(engines, policy="unified") as s:
        c = s.client
        ids = list(range(300, 400))
        raw = c.completions.with_raw_response.create(model=MODEL_NAME, prompt=ids, max_tokens=4)
        out = raw.parse()
        assert raw.headers["X-Kvroute-Instance"] in ("0", "1")
        assert out.usage is not None and out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == 4 and out.choices[0].text
        text = c.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=3)
        assert text.usage is not None and text.usage.completion_tokens == 3
        chat = c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=3
        )
        assert chat.choices[0].message.content and chat.usage is not None
        tokenized = http("POST", engines[0].url + "/tokenize", {"messages": [
            {"role": "user", "content": "hello"}], "add_generation_prompt": True})  # fmt: skip
        assert chat.usage.prompt_tokens == json.loads(tokenized[2])["count"]
        for prompt in (ids, "def add(a, b):"):
            chunks = list(
                c.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert sum(len(ch.choices) for ch in chunks) >= 5
            usage = [ch.usage for ch in chunks if ch.usage is not None]
            assert len(usage) == 1 and usage[0].completion_tokens == 5
        stream = c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        s.assert_idle()


def test_sessions_stick_under_sticky(engines: Engines) -> None:
    with RealStack(engines, policy="sticky") as s:
        seen: dict[str, set[str]] = {}
        for turn in range(3):
            # The first turns are in flight together (streams not read yet), so they spread.
            streams = [
                s.client.completions.with_raw_response.create(
                    model=MODEL_NAME,
                    prompt=[ord(session)] * (40 + turn),
                    max_tokens=8,
                    stream=True,
                    extra_headers={"X-Session-Id": session},
                )
                for session in "abcd"
            ]
            for session, raw in zip("abcd", streams, strict=True):
                seen.setdefault(session, set()).add(raw.headers["X-Kvroute-Instance"])
                assert len(list(raw.parse())) >= 8
        assert all(len(v) == 1 for v in seen.values())
        assert set().union(*seen.values()) == {"0", "1"}  # new sessions spread by load


def test_streamed_usage_is_counted_exactly(engines: Engines) -> None:
    """The ``openai`` client closes at ``data: [DONE]``, before vLLM's last chunk: every
    stream still counts as complete, with its usage."""
    with RealStack(engines, policy="round_robin") as s:
        seen = 0
        for i in range(30):
            chunks = s.client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"question {i} " * (1 + i % 7)}],
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [ch.usage for ch in chunks if ch.usage is not None]
            seen += usage[0].prompt_tokens
        s.assert_idle()
        assert s.metric("kvroute_proxy_prompt_tokens_total") == seen
        errors = http("GET", s.url + "/metrics")[2].decode()
        assert 'kind="client_disconnect"' not in errors


def test_the_engines_endpoints_through_the_proxy(engines: Engines) -> None:
    with RealStack(engines) as s:
        body = b'{"model": "tiny", "prompt": "hi there"}'
        headers = {"Content-Type": "application/json"}
        status, _, raw = http("POST", s.url + "/tokenize", body, headers)
        assert status == 200, raw
        direct = http("POST", engines[0].url + "/tokenize", body, headers)[2]
        assert json.loads(raw)["tokens"] == json.loads(direct)["tokens"]
        status, _, raw = http("GET", s.url + "/v1/models")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL_NAME
        for i in (0, 1):
            assert http("GET", f"{s.url}/backends/{i}/health")[0] == 200
            status, _, raw = http("GET", f"{s.url}/backends/{i}/metrics")
            assert status == 200 and b"vllm:prefix_cache_queries_total" in raw
        status, _, raw = http("GET", s.url + "/health")
        assert status == 200 and json.loads(raw)["backends_up"] == 2
        assert b"# TYPE kvroute_proxy_in_flight gauge" in http("GET", s.url + "/metrics")[2]
        status, _, raw = http("POST", s.url + "/reset_prefix_cache", b"")
        assert status == 200 and len(json.loads(raw)["reset"]) == 2


def chat_turns(s: RealStack, session: str, turns: int, **extra: Any) -> list[tuple[int, int]]:
    """A conversation of ``turns`` turns through the proxy, each turn's prompt holding the
    answers before it; per turn, the router's estimate and the engine's ``cached_tokens``."""
    messages: list[dict[str, str]] = []
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{session} asks question {turn}: why?"})
        raw = s.client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=40,
            extra_headers={"X-Session-Id": session},
            **extra,
        )
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached = answer.usage.prompt_tokens_details.cached_tokens or 0
        out.append((int(raw.headers["X-Kvroute-Hit-Tokens"]), cached))
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    return out


@pytest.mark.parametrize("keys", ["backend", "model"])
@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0.0},  # greedy: the answers' text tokenizes back to the ids generated
        {"extra_body": {"return_token_ids": True}},  # sampled: the engine returns the ids
    ],
    ids=["text", "token_ids"],
)
def test_the_estimate_equals_the_engines_cached_tokens(
    engines: Engines, extra: dict[str, Any], keys: str
) -> None:
    """Multi-turn chat, no eviction: the router's estimate is the engine's ``cached_tokens``
    on every request, including the blocks vLLM stored while decoding each answer; with the
    backend's ``/tokenize``, and with the model's folder (keyed by the relay in Rust)."""
    tokenizer = str(engines.model) if keys == "model" else "backend"
    with RealStack(engines, policy="unified", tokenizer=tokenizer) as s:
        got = [pair for session in "abcd" for pair in chat_turns(s, session, 4, **extra)]
        s.assert_idle()
    assert [est for est, _ in got] == [cached for _, cached in got], got
    assert sum(cached for _, cached in got) > 0


def test_the_estimate_follows_token_id_conversations(engines: Engines) -> None:
    """The same for completions whose prompts are token ids (keyed by the relay itself):
    each turn's prompt is the last one, the ids it generated, and new ids."""
    with RealStack(engines, policy="sticky") as s:
        pairs = []
        for session in range(3):
            prompt = [2000 + session] * 45
            for _ in range(4):
                raw = s.client.completions.with_raw_response.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=37,
                    extra_headers={"X-Session-Id": str(session)},
                    extra_body={"return_token_ids": True},
                )
                out = raw.parse()
                assert out.usage is not None and out.usage.prompt_tokens_details is not None
                cached = out.usage.prompt_tokens_details.cached_tokens or 0
                pairs.append((int(raw.headers["X-Kvroute-Hit-Tokens"]), cached))
                generated = out.choices[0].model_extra["token_ids"]  # type: ignore[index]
                prompt = prompt + list(generated) + [3000 + session] * 11
        s.assert_idle()
    assert [e for e, _ in pairs] == [c for _, c in pairs], pairs
    assert sum(c for _, c in pairs) > 0


def small_real_trace(rows: int = 24) -> pa.Table:
    """The first Mooncake conversation requests whose prompts fit the tiny model's context,
    with answers cut to 4 tokens."""
    trace = read_trace(REPO / "traces" / "mooncake_conversation_head1000.jsonl")
    trace = trace.filter(pc.less_equal(trace["input_length"], 6000)).slice(0, rows)
    out = pa.array([4] * trace.num_rows, trace.schema.field("output_length").type)
    return trace.set_column(trace.schema.get_field_index("output_length"), "output_length", out)


def test_replay_of_a_real_trace_through_the_proxy(engines: Engines, tmp_path: Path) -> None:
    trace = small_real_trace()
    with RealStack(engines, policy="unified") as s:
        # Warm a cache first: --reset-cache must make the run start cold again.
        s.client.completions.create(model=MODEL_NAME, prompt=list(range(500, 3000)), max_tokens=1)
        before = {
            name: sum(engine_metric(e.url, name) for e in engines)
            for name in ("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_total")
        }
        config = ReplayConfig(url=s.url, mode="tracets", time_scale=0.01, reset_cache=True)
        records = replay(trace, config)
        s.assert_idle()
    assert records.num_rows == trace.num_rows
    assert records["error"].null_count == records.num_rows  # every request answered
    after = {name: sum(engine_metric(e.url, name) for e in engines) for name in before}
    cached = pc.sum(records["cached_tokens"]).as_py()
    prompt = pc.sum(records["input_length"]).as_py()
    assert (
        cached
        == after["vllm:prompt_tokens_cached_total"] - before["vllm:prompt_tokens_cached_total"]
    )
    assert prompt == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert 0 < cached < prompt  # the trace's sessions reuse their prefixes
    # And from the command line, records written.
    path = tmp_path / "trace.parquet"
    import pyarrow.parquet as pq

    pq.write_table(trace.slice(0, 6), path)
    out = tmp_path / "records.parquet"
    with RealStack(engines) as s:
        done = subprocess.run(
            [sys.executable, "-m", "kvroute", "replay", str(path), "--url", s.url,
             "--mode", "tracets", "--time-scale", "0.01", "--reset-cache", "--no-progress",
             "-o", str(out)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert pq.read_table(out).num_rows == 6


def test_an_engine_killed_mid_run(engines: Engines) -> None:
    config = {"policy": "round_robin", "unhealthy_after": 2, "healthy_after": 2}
    with RealStack(engines, **config) as s:
        import asyncio

        import aiohttp

        async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, list[Any]]:
            body = {"model": MODEL_NAME, "prompt": [1000 + i] * 64, "max_tokens": 400,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            async with session.post(s.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                return int(resp.headers["X-Kvroute-Instance"]), sse_events(await resp.read())

        async def run() -> list[tuple[int, list[Any]]]:
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                tasks = [asyncio.create_task(one(session, i)) for i in range(4)]
                await asyncio.sleep(2.0)
                engines.kill(1)
                return await asyncio.gather(*tasks)

        try:
            results = asyncio.run(run())
            on = {inst for inst, _ in results}
            assert on == {0, 1}
            for inst, events in results:
                errors = [e for e in events if isinstance(e, dict) and "error" in e]
                if inst == 1:
                    assert errors and "mid-stream" in errors[0]["error"]["message"]
                else:
                    assert not errors and events[-1] == "[DONE]"
            wait_until(lambda: not s.proxy.pool.get(1).up, 20, "engine 1 marked down")
            for i in range(4):
                raw = s.client.completions.with_raw_response.create(
                    model=MODEL_NAME, prompt=[7, i], max_tokens=1
                )
                assert raw.headers["X-Kvroute-Instance"] == "0"
            s.assert_idle()
        finally:
            engines.restart(1)
        wait_until(lambda: s.proxy.pool.get(1).up, 30, "engine 1 back up")
        # Its events view started over: nothing from before the restart is a hit there.
        router = s.proxy.router

        def restarted() -> bool:
            view = router.kv_view(1)
            return view is not None and any(r["resets"] for r in view["ranks"])

        wait_until(restarted, 30, "engine 1's view reset")
        for i in range(4):
            keys = kvroute.block_hashes([1000 + i] * 65, BLOCK_SIZE)
            assert router.estimate_cache_hits(keys, 65, view="events")[1] == 0
        got = {
            s.client.completions.with_raw_response.create(
                model=MODEL_NAME, prompt=[9, i], max_tokens=1
            ).headers["X-Kvroute-Instance"]
            for i in range(4)
        }
        assert got == {"0", "1"}
        s.assert_idle()


def test_bench_interference_against_a_real_engine(engines: Engines, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvroute", "bench", "interference",
         "--decode-endpoint", engines[0].url, "--prefill-endpoint", engines[1].url,
         "--sizes", "2048", "--duration", "6", "--decode-rate", "3", "--decode-prompt", "64",
         "--decode-tokens", "24", "--injections", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "interference.json").read_text())
    assert result and (tmp_path / "interference.png").exists()
    assert "same" in done.stdout and "different" in done.stdout
