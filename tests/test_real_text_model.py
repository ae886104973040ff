"""The model's tokenization in Rust (``kvroute._core.TextModel``) against real vLLM's
``/tokenize`` (``make test-vllm``): text prompts, and chats through the model's own template
and through the test templates of ``tests/chat_templates.py`` (sent in the request: the
engines run with ``--trust-request-chat-template``); and what ``kvroute proxy`` discovers
about real engines before it starts (their block size)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from chat_templates import TEMPLATES, write_model
from kvroute._core import TextModel
from livekit import http

pytestmark = pytest.mark.vllm

TEXTS = [
    "hello world",
    "  leading spaces\nand lines\t tabs, ünïcödé 日本語 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "def f(x):\n    return x ** 2  # code\n" * 20,
]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "  question  one "},
            {"role": "assistant", "content": "answer"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Météo",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
]


def tokenize(url: str, body: dict[str, Any]) -> list[int]:
    status, _, raw = http("POST", url + "/tokenize", {"model": "tiny", **body})
    assert status == 200, raw
    return list(json.loads(raw)["tokens"])


def test_text_and_chat_ids_are_the_engines(vllm_engines: Any, tmp_path: Path) -> None:
    url, model_dir = vllm_engines.urls[0], vllm_engines.model
    own = TextModel(model_dir)
    for text in TEXTS:
        assert own.encode(text, True) == tokenize(url, {"prompt": text}), text
    for chat in CHATS:
        raw = json.dumps(chat).encode()
        engine = tokenize(url, {"add_generation_prompt": True, **chat})
        assert own.prompt_ids(raw, True) == engine, chat
    tokenizer = model_dir / "tokenizer.json"
    # The engine's special tokens: only the template comes with the request.
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for name, template in TEMPLATES.items():
        model = TextModel(write_model(tmp_path / name, tokenizer, template, config))
        for chat in CHATS:
            body = {"add_generation_prompt": True, **chat, "chat_template": template}
            status, _, answer = http("POST", url + "/tokenize", {"model": "tiny", **body})
            if name == "alternating" and len(chat["messages"]) > 1:
                # The template raises on a system message: both refuse.
                assert status == 400, answer
                with pytest.raises(Exception, match="roles must alternate"):
                    model.prompt_ids(json.dumps(chat).encode(), True)
                continue
            assert status == 200, answer
            assert (
                model.prompt_ids(json.dumps(chat).encode(), True) == json.loads(answer)["tokens"]
            ), (name, chat)
    shutil.rmtree(tmp_path)


def test_the_proxy_discovers_the_engines_block_size(vllm_engines: Any) -> None:
    from kvroute.proxy.discover import block_size

    assert block_size(vllm_engines.urls) == (32, "vllm:cache_config_info of 2 of 2 backend(s)")
