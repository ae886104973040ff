"""OpenAI response bodies as vLLM writes them: completions and chat, whole and as SSE chunks.

:class:`Reply` holds one request's fixed parts (id, model, creation time, kind); its methods
return ready-to-send bytes. Stream chunks are built from pre-encoded prefixes, so one chunk
costs one ``json.dumps`` of its text. Generated text is synthetic: token ``i`` of every reply
is ``" " + WORDS[i % len(WORDS)]``.

Usage carries ``prompt_tokens_details.cached_tokens`` when ``details`` is set (vLLM with
``--enable-prompt-tokens-details``), else ``prompt_tokens_details`` is null. A chunk may carry
its tokens' ids (``token_ids``, as vLLM writes them for ``return_token_ids``: the built-in
tokenizer's ids of the words, :func:`token_ids`) and the emulator's ``engine_time`` (the
engine-clock seconds of its last token; an emulator extension, ``docs/proxy.md`` "The
emulator").

O(tokens) per reply; instances are per request, the module is stateless.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from kvroute.tokenize import BuiltinTokenizer

WORDS = ("the", "cache", "keeps", "every", "prefix", "warm", "for", "next", "turn", "of", "it")
#: Each word's id: the built-in tokenizer reads ``" " + word`` as one token.
WORD_IDS = tuple(int(BuiltinTokenizer().encode(" " + w)[0]) for w in WORDS)
_ids = itertools.count()
#: A request header asking for the engine's clock: each chunk of the stream then carries
#: ``engine_time`` (seconds), one chunk per engine step.
ENGINE_CLOCK_HEADER = "X-Kvroute-Engine-Clock"
#: The response header with the engine time the request arrived at (with the one above).
ENGINE_ARRIVED_HEADER = "X-Kvroute-Engine-Arrived"


def token_text(start: int, n: int) -> str:
    """The text of generated tokens ``start .. start + n``."""
    return "".join(" " + WORDS[i % len(WORDS)] for i in range(start, start + n))


def token_ids(start: int, n: int) -> list[int]:
    """The ids of generated tokens ``start .. start + n`` (those of :func:`token_text`)."""
    return [WORD_IDS[i % len(WORDS)] for i in range(start, start + n)]


def usage(prompt: int, completion: int, cached: int, details: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if details else None,
    }


class Reply:
    """The response builder of one request."""

    def __init__(self, model: str, chat: bool) -> None:
        self.chat = chat
        n = next(_ids)
        self.id = f"chatcmpl-{n}" if chat else f"cmpl-{n}"
        self.created = int(time.time())
        self.model = model
        head = {
            "id": self.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": model,
        }
        head_json = json.dumps(head)[:-1]
        if chat:
            self._pre = (head_json + ', "choices": [{"index": 0, "delta": {"content": ').encode()
            self._post = b'}, "logprobs": null, "finish_reason": null}], "usage": null}\n\n'
        else:
            self._pre = (head_json + ', "choices": [{"index": 0, "text": ').encode()
            self._post = (
                b', "logprobs": null, "finish_reason": null, "stop_reason": null}],'
                b' "usage": null}\n\n'
            )
        self._head = head

    def _event(self, obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def role_chunk(self) -> bytes:
        """Chat only: the first chunk, with the assistant role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return self._event({**self._head, "choices": [{**choice, "finish_reason": None}]})

    def text_chunk(
        self, text: str, ids: list[int] | None = None, engine_time: float | None = None
    ) -> bytes:
        """A chunk of generated ``text``, with its token ``ids`` and ``engine_time`` when
        given."""
        if ids is None and engine_time is None:
            return b"data: " + self._pre + json.dumps(text).encode() + self._post
        return self._choice_chunk(text, None, ids, engine_time)

    def final_chunk(
        self,
        finish_reason: str,
        text: str = "",
        ids: list[int] | None = None,
        engine_time: float | None = None,
    ) -> bytes:
        """The last chunk: the last tokens' ``text`` with the finish reason (as vLLM sends
        it, so a client timing chunks sees one per decode step)."""
        return self._choice_chunk(text, finish_reason, ids, engine_time)

    def _choice_chunk(
        self,
        text: str,
        finish_reason: str | None,
        ids: list[int] | None,
        engine_time: float | None,
    ) -> bytes:
        if self.chat:
            delta = {"content": text} if text else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "stop_reason": None}
        choice["finish_reason"] = finish_reason
        if ids is not None:
            choice["token_ids"] = ids
        obj: dict[str, Any] = {**self._head, "choices": [choice], "usage": None}
        if engine_time is not None:
            obj["engine_time"] = engine_time
        return self._event(obj)

    def usage_chunk(self, u: dict[str, Any]) -> bytes:
        return self._event({**self._head, "choices": [], "usage": u})

    def whole(
        self, text: str, finish_reason: str, u: dict[str, Any], ids: list[int] | None = None
    ) -> dict[str, Any]:
        """The non-streaming response (with the generated ``ids`` when given)."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        if ids is not None:
            choice["token_ids"] = ids
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head, "object": obj, "choices": [choice], "usage": u}


DONE = b"data: [DONE]\n\n"
