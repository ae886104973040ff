"""The proxy: keys and sessions, pass-through, limits, admin API, metrics, decision log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from kvroute._core import prompt_ids
from kvroute.emulator import EmulatorConfig, emulator_app
from kvroute.errors import InvalidArgumentError
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.proxy.keys import Keyer, approx_keys, session_of
from kvroute.proxy.prompts import (
    BadRequest,
    completion_prompt,
    parse_body,
    render_chat,
    wants_stream,
)
from livekit import MODEL, FakeEngine, Stack, http, sse_events, wait_until

# -- keys and prompts -----------------------------------------------------------------------


def test_completion_prompt_forms() -> None:
    assert completion_prompt({"prompt": "hi"}) == "hi"
    assert completion_prompt({"prompt": [1, 2]}) == [1, 2]
    assert completion_prompt({"prompt": ["a", "b"]}) == "a"
    assert completion_prompt({"prompt": [[5, 6], [7]]}) == [5, 6]
    for bad in ({}, {"prompt": 3}, {"prompt": []}, {"prompt": [None]}, {"prompt": [[]]}):
        with pytest.raises(BadRequest):
            completion_prompt(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [1, 2, 3], "stream": true}',
        b'{"prompt": "x", "temperature": NaN}',
        '{"prompt": "caf\u00e9 \u2603"}'.encode(),
        b'{"a": 1, "a": 2}',
    ],
)
def test_parse_body_equals_json(raw: bytes) -> None:
    got, want = parse_body(raw), json.loads(raw)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize("first", ["1", "123456789012345678901234567890"])
def test_token_ids_beyond_64_bits_are_refused(first: str) -> None:
    # orjson reads such integers as floats, json as ints: the prompt is refused either way.
    body = parse_body(f'{{"prompt": [{first}, 123456789012345678901234567890]}}'.encode())
    with pytest.raises(BadRequest):
        asyncio.run(Keyer("approx", 16).keys(body, chat=False))


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'{"a": 1}x', b"\xff\xfe"])
def test_parse_body_refuses_what_json_refuses(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_body(raw)


def test_chat_rendering_is_prefix_stable() -> None:
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    r1, r2 = render_chat(turn1), render_chat(turn2)
    assert r2.startswith(r1.removesuffix("<|im_start|>assistant\n"))
    parts = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}]
    assert "x" in render_chat(parts)


def test_approx_keys_share_prefixes() -> None:
    base = "word " * 2000
    k1, n1 = approx_keys(base, 512)
    k2, n2 = approx_keys(base + "more text " * 500, 512)
    assert n1 == 2500 and n2 > n1
    assert len(k1) == 5 and list(k2[: len(k1) - 1]) == list(k1[:-1])


def test_keyer_keys_token_ids_exactly() -> None:
    keyer = Keyer("approx", 16)
    ids = list(range(100))
    keys, n, _ = asyncio.run(keyer.keys({"prompt": ids}, chat=False))
    assert n == 100 and list(keys) == list(kvroute.block_hashes(ids, 16))
    with pytest.raises(BadRequest):
        asyncio.run(keyer.keys({"prompt": [1, 2**40]}, chat=False))


def test_huggingface_tokenizer_mode(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 1, "b": 2, "[UNK]": 0}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    keys, n, _ = asyncio.run(Keyer(str(path), 2).keys({"prompt": "a b a b c"}, chat=False))
    assert n == 5 and list(keys) == list(kvroute.block_hashes([1, 2, 1, 2, 0], 2))


def test_config_checks() -> None:
    with pytest.raises(InvalidArgumentError, match="policy"):
        ProxyConfig(backends=["http://127.0.0.1:1"], policy="nope")
    with pytest.raises(InvalidArgumentError, match="twice"):
        ProxyConfig(backends=["127.0.0.1:1", "http://127.0.0.1:1/"])
    assert ProxyConfig(backends=["127.0.0.1:9"]).backends == ["http://127.0.0.1:9"]
    with pytest.raises(InvalidArgumentError, match="TLS"):
        ProxyConfig(backends=["https://example.com"])
    for name in ("max_connections", "header_read_timeout_s"):
        with pytest.raises(InvalidArgumentError, match=name):
            ProxyConfig(**{name: 0})


def test_default_policy_and_its_options() -> None:
    """The proxy routes with unified_dynamo, prefill weighed 8, unless told otherwise."""
    config = ProxyConfig(backends=["127.0.0.1:9"])
    assert Proxy(config).router.policy == "unified_dynamo" == config.policy
    assert config.policy_options() == {"overlap_weight": 8.0}
    mine = ProxyConfig(router_options={"overlap_weight": 2.0, "block_size": 16})
    assert mine.policy_options() == {"overlap_weight": 2.0, "block_size": 16}
    assert ProxyConfig(policy="unified").policy_options() == {}


# -- against a recording backend ------------------------------------------------------------


class Recorder:
    """A fake engine that records what it receives and streams in two chunks: the second
    once :attr:`next_chunk` is set (by the client that read the first; from the server's
    loop), or after ``HOLD_S`` (:attr:`released` then says so)."""

    HOLD_S = 20.0

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[Mapping[str, str]] = []  # names case-insensitive
        self.next_chunk = asyncio.Event()
        self.released: bool | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        for method, path in [("POST", "/tokenize"), ("GET", "/v1/models"), ("GET", "/metrics")]:
            app.router.add_route(method, path, self.echo)
        app.router.add_post("/reset_prefix_cache", self.reset)
        self.resets = 0
        self.refuse_reset = False
        return app

    async def echo(self, request: web.Request) -> web.Response:
        """What the request was, as JSON, with a header of the engine's own."""
        seen = {
            "method": request.method,
            "path": request.path,
            "query": request.query_string,
            "content_type": request.headers.get("Content-Type"),
            "x_client": request.headers.get("X-Client"),
            "body": (await request.read()).decode(),
        }
        return web.json_response(seen, headers={"X-Engine": "e"})

    async def reset(self, _r: web.Request) -> web.Response:
        if self.refuse_reset:
            return web.json_response({"detail": "Not Found"}, status=404)
        self.resets += 1
        return web.Response()

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        self.headers.append(request.headers.copy())
        if not json.loads(raw).get("stream"):
            return web.json_response({"choices": [], "usage": {"prompt_tokens": 3}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Extra": "1"})
        await resp.prepare(request)
        self.next_chunk.clear()
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        try:
            await asyncio.wait_for(self.next_chunk.wait(), self.HOLD_S)
            self.released = True
        except TimeoutError:
            self.released = False
        await resp.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def recorded() -> Iterator[tuple[ServerThread, str, Recorder, Any]]:
    with ServerThread() as st:
        rec = Recorder()
        backend = st.start(rec.app())
        proxy = Proxy(ProxyConfig(backends=[backend], max_body_bytes=100_000))
        url = st.start(proxy)
        yield st, url, rec, proxy


def test_bodies_pass_through_unchanged(recorded: tuple) -> None:
    _, url, rec, _ = recorded
    raw = (
        b'{"model": "m",  "prompt": [1, 2, 3], "ignore_eos": true, "max_tokens": 4,'
        b' "stream_options": {"include_usage": true}, "weird": [1.5e3, null]}'
    )
    status, headers, _ = http(
        "POST", url + "/v1/completions", raw, {"Authorization": "Bearer k", "X-Session-Id": "s"}
    )
    assert status == 200 and rec.bodies[-1] == raw
    assert rec.headers[-1]["Authorization"] == "Bearer k"
    assert rec.headers[-1]["X-Session-Id"] == "s"
    assert headers["X-Kvroute-Instance"] == "0"


def test_engine_endpoints_keep_the_request_as_it_came(recorded: tuple) -> None:
    """``/tokenize`` reached vLLM without its content type (vLLM then answers 400): every
    relayed request keeps its method, path, query, body and end-to-end headers."""
    _, url, _, _ = recorded
    body = b'{"model": "tiny", "prompt": "hi"}'
    headers = {"Content-Type": "application/json", "X-Client": "c"}
    status, got_headers, raw = http("POST", url + "/tokenize?x=1&y=2", body, headers)
    assert status == 200 and got_headers["X-Engine"] == "e"
    assert json.loads(raw) == {
        "method": "POST",
        "path": "/tokenize",
        "query": "x=1&y=2",
        "content_type": "application/json",
        "x_client": "c",
        "body": body.decode(),
    }
    assert json.loads(http("GET", url + "/v1/models")[2])["path"] == "/v1/models"
    status, _, raw = http("GET", url + "/backends/0/metrics")
    assert status == 200 and json.loads(raw)["path"] == "/metrics"
    assert http("GET", url + "/backends/0/health")[0] == 200
    assert http("GET", url + "/backends/7/health")[0] == 404


def test_reset_prefix_cache_reaches_every_backend_and_the_router(recorded: tuple) -> None:
    _, url, rec, proxy = recorded
    http("POST", url + "/v1/completions", {"prompt": [1, 2, 3] * 300, "max_tokens": 1})
    assert proxy.router.state()[0]["cached_blocks"] > 0
    before = rec.resets
    status, _, raw = http("POST", url + "/reset_prefix_cache", b"")
    assert status == 200 and json.loads(raw)["reset"] == [proxy.pool.get(0).url]
    assert rec.resets == before + 1 and proxy.router.state()[0]["cached_blocks"] == 0
    http("POST", url + "/v1/completions", {"prompt": [1, 2, 3] * 300, "max_tokens": 1})
    rec.refuse_reset = True
    try:
        status, _, raw = http("POST", url + "/reset_prefix_cache", b"")
    finally:
        rec.refuse_reset = False
    message = json.loads(raw)["error"]["message"]
    assert status == 502 and "backend 0" in message and "VLLM_SERVER_DEV_MODE" in message
    assert proxy.router.state()[0]["cached_blocks"] > 0  # not reset: the model stays


def test_streams_are_relayed_chunk_by_chunk(recorded: tuple) -> None:
    """The backend sends its second chunk only once the client has read the first: a relay
    that held the stream back would make it wait ``HOLD_S`` for nothing."""
    st, url, rec, _ = recorded

    async def read() -> list[bytes]:
        got = []
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [1], "stream": True}
            async with s.post(url + "/v1/completions", json=body) as resp:
                assert resp.headers["X-Extra"] == "1"
                async for chunk in resp.content.iter_any():
                    got.append(chunk)
                    rec.next_chunk.set()  # the backend's loop: this one
        return got

    rec.released = None
    chunks = st.call(read(), timeout=60)
    assert chunks[0].startswith(b'data: {"choices": [{"text": "a"}]}')
    assert b'"b"' not in chunks[0]
    assert rec.released, "the first chunk reached the client only with the rest"
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{oops", None),
        ("/v1/completions", b'"a string"', None),
        ("/v1/completions", b'{"max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt"),
        ("/v1/completions", b'{"prompt": [1, -1]}', "prompt"),
        ("/v1/completions", b'{"prompt": [1, 2.5]}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stream": 1}', "stream"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "messages"),
        ("/v1/chat/completions", b"\xff\xfe", None),
        ("/v1/completions", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages",
        ),
        (
            "/v1/completions",
            b'{"prompt": [1, 2], "session_id": 1180591620717411303424}',
            "session_id",
        ),
        (
            "/v1/completions",
            b'{"prompt": "a", "session_id": 1180591620717411303424}',
            "session_id",
        ),
        (
            "/v1/completions",
            b'{"prompt": [1], "session_id": "' + b"s" * 257 + b'"}',
            "session_id",
        ),
    ],
)
def test_malformed_bodies_get_openai_400(
    recorded: tuple, path: str, body: bytes, param: str | None
) -> None:
    _, url, rec, app = recorded
    n = len(rec.bodies)
    status, _, raw = http("POST", url + path, body)
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == 400
    assert len(rec.bodies) == n  # nothing reached the backend
    assert app.router.in_flight == 0


def test_an_overlong_session_header_is_refused(recorded: tuple) -> None:
    _, url, rec, app = recorded
    n = len(rec.bodies)
    for body in ({"prompt": [1, 2]}, {"prompt": "text"}):
        status, _, raw = http("POST", url + "/v1/completions", body, {"X-Session-Id": "s" * 257})
        assert status == 400 and "256 bytes" in json.loads(raw)["error"]["message"]
    assert len(rec.bodies) == n and app.router.in_flight == 0
    status, _, _ = http(
        "POST", url + "/v1/completions", {"prompt": [1]}, {"X-Session-Id": "s" * 256}
    )
    assert status == 200


def test_body_size_limit(recorded: tuple) -> None:
    _, url, _, _ = recorded
    big = json.dumps({"prompt": list(range(50_000))}).encode()
    status, _, raw = http("POST", url + "/v1/completions", big)
    assert status == 413 and json.loads(raw)["error"]["code"] == 413


# -- with emulators -------------------------------------------------------------------------


def test_health_models_and_no_backend_503() -> None:
    with Stack(2, proxy={"admin_token": "t0p"}) as s:
        status, _, raw = http("GET", s.url + "/health")
        assert status == 200 and json.loads(raw)["backends_up"] == 2
        status, _, raw = http("GET", s.url + "/v1/models")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL
        auth = {"Authorization": "Bearer t0p"}
        for i in range(2):
            assert http("DELETE", f"{s.url}/admin/backends/{i}", headers=auth)[0] == 200
        status, _, raw = http("POST", s.url + "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
        assert http("GET", s.url + "/health")[0] == 503
        s.assert_counters_zero()


@pytest.mark.parametrize(
    "bad", ["http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://[::1", "http://", "ftp://x"]
)
def test_admin_refuses_a_url_that_does_not_parse(bad: str) -> None:
    """It answered 500 and left a router instance with no backend, to which later requests
    were routed (and failed): a 400 naming the field, and the router is unchanged."""
    with Stack(1, proxy={"admin_token": "k", "policy": "round_robin"}) as s:
        auth = {"Authorization": "Bearer k"}
        status, _, raw = http("POST", s.url + "/admin/backends", {"url": bad}, auth)
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "url" and err["message"].startswith("url: ")
        assert s.proxy.router.num_instances == 1 and len(s.proxy.pool) == 1
        for i in range(4):
            body = {"prompt": [i], "max_tokens": 1}
            assert http("POST", s.url + "/v1/completions", body)[0] == 200
        s.assert_counters_zero()


def test_the_session_map_is_bounded() -> None:
    """It kept every session id forever: the router keeps the most recently routed ones."""
    config = {"policy": "sticky", "router_options": {"max_sessions": 50}}
    with Stack(2, proxy=config) as s:
        for i in range(200):
            body = {"prompt": [i], "max_tokens": 1}
            assert (
                http("POST", s.url + "/v1/completions", body, {"X-Session-Id": f"s{i}"})[0] == 200
            )
        assert s.proxy.router.num_sessions == 50
        assert s.proxy.router.session_affinity("s199") is not None
        assert s.proxy.router.session_affinity("s0") is None
    assert Proxy(ProxyConfig(backends=[])).router.num_sessions == 0


def test_backend_credentials_stay_out_of_metrics_and_headers() -> None:
    with ServerThread() as st:
        engine = st.start(emulator_app(EmulatorConfig(speedup=50)))
        secret_url = engine.replace("http://", "http://user:s3cret@")
        proxy = Proxy(ProxyConfig(backends=[secret_url], admin_token="k"))
        url = st.start(proxy)
        status, headers, _ = http("POST", url + "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 200 and headers["X-Kvroute-Backend"] == engine
        for path in ("/metrics", "/admin/backends"):
            text = http("GET", url + path, headers={"Authorization": "Bearer k"})[2].decode()
            assert engine in text and "s3cret" not in text, path


def test_admin_api() -> None:
    with Stack(1, proxy={"admin_token": "secret"}) as s:
        auth = {"Authorization": "Bearer secret"}
        assert http("GET", s.url + "/admin/backends")[0] == 401
        assert (
            http("GET", s.url + "/admin/backends", headers={"Authorization": "Bearer x"})[0] == 401
        )
        status, _, raw = http("GET", s.url + "/admin/backends", headers=auth)
        assert status == 200 and len(json.loads(raw)["backends"]) == 1
        new = s.add_engine(speedup=50)
        status, _, raw = http("POST", s.url + "/admin/backends", {"url": new}, auth)
        assert status == 201 and json.loads(raw)["index"] == 1
        assert http("POST", s.url + "/admin/backends", {"url": new}, auth)[0] == 400
        assert http("POST", s.url + "/admin/backends", {"nope": 1}, auth)[0] == 400
        assert s.proxy.router.num_instances == 2
        assert http("DELETE", s.url + "/admin/backends/0", headers=auth)[0] == 200
        for i in range(3):
            _, headers, _ = http(
                "POST", s.url + "/v1/completions", {"prompt": [i], "max_tokens": 1}
            )
            assert headers["X-Kvroute-Instance"] == "1"
        assert http("DELETE", s.url + "/admin/backends/7", headers=auth)[0] == 404
        # The relay speaks plain HTTP to its backends.
        tls = http("POST", s.url + "/admin/backends", {"url": "https://127.0.0.1:9"}, auth)
        assert tls[0] == 400 and b"TLS" in tls[2]
        assert s.proxy.router.num_instances == 2
        # Re-adding a removed URL brings its index back.
        status, _, raw = http("POST", s.url + "/admin/backends", {"url": s.engine_urls[0]}, auth)
        assert status == 201 and json.loads(raw)["index"] == 0
        s.assert_counters_zero()
    with Stack(1) as s:  # no token: no admin API
        assert http("GET", s.url + "/admin/backends")[0] == 404


def test_metrics_and_decision_log(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    with Stack(2, proxy={"decision_log": str(log), "policy": "unified"}) as s:
        prompt = list(range(3000))
        for _ in range(3):
            body = {
                "prompt": prompt,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            status, _, raw = http("POST", s.url + "/v1/completions", body, {"X-Session-Id": "a"})
            assert status == 200 and sse_events(raw)[-1] == "[DONE]"
        status, _, raw = http("GET", s.url + "/metrics")
        text = raw.decode()
        for name in (
            "kvroute_proxy_decisions_total",
            "kvroute_proxy_estimated_hit_tokens_total",
            "kvroute_proxy_reported_cached_tokens_total",
            "kvroute_proxy_in_flight",
            "kvroute_proxy_ttft_seconds_bucket",
            "kvroute_proxy_e2e_seconds_bucket",
            "kvroute_proxy_routing_seconds_bucket",
            "kvroute_proxy_backend_up",
        ):
            assert name in text, name
        assert 'branch="affinity"' in text and 'policy="unified"' in text
        reported = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvroute_proxy_reported_cached_tokens_total{")
        )
        hits = sum(e.engine.stats()["prefix_hits_tokens"] for e in s.emulators)
        assert reported == hits > 0
        s.assert_counters_zero()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 3 and all(d["session"] == "a" for d in lines)
    # vLLM's rule (the proxy's default): a prompt's last token is recomputed, so at most
    # floor(2999 / 512) = 5 blocks hit, as the engine reports.
    assert lines[1]["branch"] == "affinity" and lines[1]["estimated_hit_tokens"] == 2560
    assert {t["instance"] for t in lines[0]["terms"]} == {0, 1}
    assert {"hit_tokens", "new_prefill", "num_requests", "lmetric_score"} <= set(
        lines[0]["terms"][0]
    )


def test_sessions_from_the_body_and_backend_tokenizer(tmp_path: Path) -> None:
    log = tmp_path / "d.jsonl"
    config = {"decision_log": str(log), "tokenizer": "backend", "policy": "sticky"}
    with Stack(3, proxy=config) as s:
        text = "the quick brown fox " * 300
        _, _, raw = http("POST", s.engine_urls[0] + "/tokenize", {"prompt": text})
        count = json.loads(raw)["count"]
        for i in range(4):
            body = {"prompt": text, "max_tokens": 1, "session_id": "body-session"}
            status, headers, _ = http("POST", s.url + "/v1/completions", body)
            assert status == 200
            if i == 0:
                first = headers["X-Kvroute-Instance"]
            assert headers["X-Kvroute-Instance"] == first
        s.proxy.flush_decision_log()
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert {d["session"] for d in lines} == {"body-session"}
        assert {d["input_length"] for d in lines} == {count}
        assert s.proxy.router.session_affinity("body-session") == int(first)
        wait_until(s.idle)


def test_keys_are_numpy_friendly() -> None:
    keys, n = approx_keys("é" * 10, 4)
    assert keys.dtype == np.uint64 and n == 5


# -- the prompt scan ------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text()
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(), inner)),
    max_leaves=12,
)
PROMPTS = st.one_of(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    st.lists(st.integers(-3, 2**32 + 3), max_size=5),
    JSON_VALUES,
)


@settings(max_examples=300, deadline=None)
@given(
    extra=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5),
    prompt=PROMPTS,
    first=st.booleans(),
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
)
def test_prompt_scan_agrees_with_the_parser(
    extra: dict[str, Any], prompt: Any, first: bool, indent: int | None, ascii_only: bool
) -> None:
    """The scan of a completions body finds exactly the prompt the JSON parser finds, or
    leaves the body to it; keying a body either way gives the same keys, body and errors."""
    body = {"prompt": prompt, **extra} if first else {**extra, "prompt": prompt}
    raw = json.dumps(body, indent=indent, ensure_ascii=ascii_only).encode()
    found = prompt_ids(raw)
    if found is not None:
        ids, start, end = found
        assert ids.tolist() == body["prompt"] == json.loads(raw[start:end])
    keyer = Keyer("approx", 4)

    def keyed(full: bool) -> Any:
        async def go() -> Any:
            if full:
                parsed = parse_body(raw)
                return parsed, *(await keyer.keys(parsed, False))
            return await keyer.parse(raw, False)

        try:
            parsed, keys, n, _ = asyncio.run(go())
        except BadRequest as exc:
            return str(exc), exc.param
        return {k: v for k, v in parsed.items() if k != "prompt"}, keys.tolist(), n

    assert keyed(full=False) == keyed(full=True)


def test_prompt_scan_on_real_shapes() -> None:
    ids = list(range(1000, 1512))
    for raw in (
        json.dumps({"model": "m", "prompt": ids, "stream": True}).encode(),
        json.dumps({"prompt": ids}, separators=(",", ":")).encode(),
        b'{"stream": true,\n  "prompt": [\n    '
        + b",\n    ".join(b"%d" % i for i in ids)
        + b"\n  ]\n}",
    ):
        found = prompt_ids(raw)
        assert found is not None and found[0].tolist() == ids
    assert prompt_ids(b'{"prompt": "text"}') is None
    assert prompt_ids(b'{"prompt": [1], "prompt": [2]}') is None  # the parser's call


# -- the native data path's own keying -------------------------------------------------------

SESSIONS = st.one_of(
    st.none(), st.text(max_size=6), st.integers(-(2**70), 2**70), st.floats(), JSON_VALUES
)


@settings(max_examples=400, deadline=None)
@given(
    extra=st.dictionaries(
        st.sampled_from(["stream", "session_id", "model", "n", "x", "str\\u0065am"]),
        st.one_of(JSON_VALUES, st.booleans(), SESSIONS),
        max_size=4,
    ),
    prompt=PROMPTS,
    header=st.sampled_from([None, "", "hdr"]),
    indent=st.sampled_from([None, 2]),
    ascii_only=st.booleans(),
    junk=st.sampled_from([b"", b" ", b"x", b"NaN"]),
)
def test_relay_keying_agrees_with_the_python_keyer(
    extra: dict[str, Any],
    prompt: Any,
    header: str | None,
    indent: int | None,
    ascii_only: bool,
    junk: bytes,
) -> None:
    """When the relay keys a completions body itself (``relay_token_prompt``), it reads the
    keys, length, stream flag and session the Python keyer reads; every body it leaves to
    the hooks is one the Python keyer is asked about instead."""
    from kvroute._core import relay_token_prompt

    raw = json.dumps({"prompt": prompt, **extra}, indent=indent, ensure_ascii=ascii_only)
    raw_bytes = raw.encode()
    if junk == b" ":
        raw_bytes += junk
    elif junk:  # a member with a value strict JSON refuses, or not a value at all
        raw_bytes = raw_bytes.replace(b"}", b', "j": ' + junk + b"}", 1)
    got = relay_token_prompt(raw_bytes, 4, "session_id", header)
    if got is None:
        return
    keyer = Keyer("approx", 4)
    body, keyed = keyer.parse_now(raw_bytes, False)
    assert keyed is not None
    session = session_of(header, body, "session_id")
    python = (keyed[0].tolist(), keyed[1], wants_stream(body), session)
    assert (got[0].tolist(), got[1], got[2], got[3]) == python


# -- the blocks an answer's output completes ------------------------------------------------


def test_answer_output_reads_ids_text_and_usage() -> None:
    from kvroute.proxy.keys import answer_output

    whole = {
        "choices": [{"index": 0, "text": "ab", "token_ids": [5, 6]}, {"index": 1, "text": "x"}],
        "usage": {"completion_tokens": 2},
    }
    assert answer_output(json.dumps(whole).encode(), False) == ([5, 6], "ab", 2)
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "he"}}]},
        {"choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    assert answer_output(stream + b"data: [DONE]\n\n", True) == (None, "hello", 2)
    assert answer_output(b"data: {oops\n\n", True) is None
    keyer = Keyer("approx", 4)
    assert keyer.output_now(stream, True) is None  # approx: text cannot be tokenized exactly
    assert keyer.output_now(json.dumps(whole).encode(), False) == ([5, 6], 2)


class IdsEngine(FakeEngine):
    """A fake engine whose answers carry ``token_ids``, as vLLM's do with
    ``return_token_ids``: 20 ids after the prompt, 20 tokens sampled."""

    OUTPUT: ClassVar[list[int]] = list(range(900, 920))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        choice = {"index": 0, "text": "t", "token_ids": self.OUTPUT, "finish_reason": "length"}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(self.OUTPUT)}
        if not body.get("stream"):
            return web.json_response({"choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await asyncio.sleep(0.05)
        tail = {"choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("stream", [False, True])
def test_the_router_records_the_blocks_an_output_completes(stream: bool) -> None:
    """A 45-token prompt with 20 tokens sampled: the engine holds the KV of 64 tokens, two
    blocks of 32, the second made of the prompt's last 13 ids and 19 of the output."""
    with ServerThread() as st:
        backend = st.start(IdsEngine().app())
        config = ProxyConfig(backends=[backend], router_options={"block_size": 32})
        proxy = Proxy(config)
        url = st.start(proxy)
        prompt = list(range(100, 145))
        body = {"prompt": prompt, "max_tokens": 20, "stream": stream}
        status, _, _ = http("POST", url + "/v1/completions", body)
        assert status == 200
        sequence = prompt + IdsEngine.OUTPUT
        held = kvroute.block_hashes(sequence[:64], 32)
        assert [int(k) for k in proxy.router.cached_keys(0)] == [int(k) for k in held]
        # The next turn (the whole conversation and more) hits both blocks.
        more = sequence + [7] * 10
        assert proxy.router.estimate_cache_hits(kvroute.block_hashes(more, 32), len(more)) == [64]
