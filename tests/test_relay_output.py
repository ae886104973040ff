"""The relay's own reading of what an answer generated (``kvroute_core::relay::output``,
``relay_answer_output``) against the Python reader the hooks use (``answer_output``): where
the relay reads an answer itself, it reads what the hooks would; well-formed answers of vLLM
(completions and chat, streamed and whole) it always reads itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from chat_templates import TEMPLATES, write_model
from kvroute._core import TextModel, relay_answer_output
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.proxy.keys import answer_output
from kvroute.proxy.relay import RelayHooks
from livekit import FakeEngine, http

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def mostly(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` five times in six, else ``odd``."""
    return st.integers(0, 5).flatmap(lambda i: odd if i == 0 else good)


TEXTS = mostly(st.text(max_size=8), SCALARS)
MESSAGES = mostly(
    st.fixed_dictionaries({}, optional={"content": TEXTS, "role": st.just("assistant")}), VALUES
)
CHOICES = mostly(
    st.fixed_dictionaries(
        {},
        optional={
            "index": mostly(st.sampled_from([0, 0, 0, 1]), SCALARS),
            "text": TEXTS,
            "delta": MESSAGES,
            "message": MESSAGES,
            "token_ids": mostly(st.lists(st.integers(0, 2**32 + 1), max_size=4), VALUES),
        },
    ),
    VALUES,
)
USAGES = mostly(
    st.fixed_dictionaries({}, optional={"completion_tokens": mostly(st.integers(0, 99), SCALARS)}),
    VALUES,
)
EVENTS = mostly(
    st.fixed_dictionaries(
        {}, optional={"choices": mostly(st.lists(CHOICES, max_size=3), VALUES), "usage": USAGES}
    ),
    VALUES,
)


def sse(events: list[Any], crlf: bool, done: bool) -> bytes:
    end = b"\r\n\r\n" if crlf else b"\n\n"
    out = b"".join(b"data: " + json.dumps(e).encode() + end for e in events)
    return out + (b"data: [DONE]" + end if done else b"")


@settings(max_examples=600, deadline=None)
@given(
    events=st.lists(EVENTS, min_size=1, max_size=4),
    stream=st.booleans(),
    crlf=st.booleans(),
    done=st.booleans(),
)
def test_the_relay_reads_what_the_hooks_read(
    events: list[Any], stream: bool, crlf: bool, done: bool
) -> None:
    raw = sse(events, crlf, done) if stream else json.dumps(events[0]).encode()
    got = relay_answer_output(raw, stream)
    if got is not None:
        assert got == answer_output(raw, stream)


def vllm_answers(ids: bool) -> list[tuple[bytes, bool]]:
    """Answers as vLLM writes them (``token_ids`` when ``return_token_ids`` was asked)."""
    tok = {"token_ids": [11, 12]} if ids else {}
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    choice = {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length", **tok}
    whole_text = {**head, "choices": [choice], "usage": usage}
    message = {"role": "assistant", "content": "ab", "tool_calls": []}
    whole_chat = {**head, "choices": [{"index": 0, "message": message, **tok}], "usage": usage}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None}]},
        {**head, "choices": [{"index": 0, "text": "b", "finish_reason": "length", **tok}]},
        {**head, "choices": [], "usage": usage},
    ]
    return [
        (json.dumps(whole_text).encode(), False),
        (json.dumps(whole_chat).encode(), False),
        (sse(chunks, False, True), True),
    ]


def test_vllm_answers_are_read_by_the_relay() -> None:
    for ids in (False, True):
        for raw, stream in vllm_answers(ids):
            got = relay_answer_output(raw, stream)
            assert got is not None, raw
            assert got == answer_output(raw, stream)
            assert got[1] == "ab" and got[2] == 2
            assert got[0] == ([11, 12] if ids else None)


class TextEngine(FakeEngine):
    """A fake engine whose answers carry text only (no ``token_ids``), as vLLM's do unless
    asked: ``OUTPUT``, with ``completion_tokens`` its length in the test tokenizer's ids."""

    OUTPUT = "zq xv 42 jk pm"

    def __init__(self, generated: int) -> None:
        self.generated = generated

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        usage = {"completion_tokens": self.generated}
        if not body.get("stream"):
            choice = {"index": 0, "text": self.OUTPUT, "finish_reason": "length"}
            return web.json_response({"choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (self.OUTPUT[:9], self.OUTPUT[9:]):
            event = {"choices": [{"index": 0, "text": part}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        tail = {"choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("stream", [False, True])
def test_the_relay_records_a_text_output_without_the_hooks(
    stream: bool, tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the model's folder, the blocks a text answer completes are recorded from the
    relay's own reading and tokenizing of the answer: the hooks are not asked."""
    asked: list[bytes] = []
    monkeypatch.setattr(RelayHooks, "output", lambda _self, raw, _stream: asked.append(raw))
    model_dir = write_model(tmp_path / "m", tokenizer_json, TEMPLATES["chatml"])
    model = TextModel(model_dir)
    out_ids = model.encode(TextEngine.OUTPUT, False)
    prompt = "the cache keeps every prefix warm, hello world"
    prompt_ids = model.encode(prompt, True)
    with ServerThread() as st:
        backend = st.start(TextEngine(len(out_ids)).app())
        config = ProxyConfig(
            backends=[backend],
            tokenizer=str(model_dir),
            kv_events="off",
            router_options={"block_size": 4},
        )
        proxy = Proxy(config)
        url = st.start(proxy)
        body = {"prompt": prompt, "max_tokens": len(out_ids), "stream": stream}
        assert http("POST", url + "/v1/completions", body)[0] == 200
        held = (len(prompt_ids) + len(out_ids) - 1) // 4 * 4
        want = kvroute.block_hashes(prompt_ids + out_ids, 4)[: held // 4]
        assert held >= len(prompt_ids) + 8  # the output completes blocks
        assert [int(k) for k in proxy.router.cached_keys(0)] == [int(k) for k in want]
    assert asked == []
