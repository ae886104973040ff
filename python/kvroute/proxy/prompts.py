"""OpenAI request bodies: validation of what routing needs, and the prompt a body carries.

Shared by the proxy (to key requests) and the emulator (to serve them). Only the fields
kvroute reads are checked (``prompt`` or ``messages``, ``stream``, and for the emulator the
generation limits); everything else passes through to the engine, which checks it.

:func:`render_chat` turns chat messages into one prompt string with a ChatML template
(``<|im_start|>role\\ncontent<|im_end|>\\n`` ..., then the assistant header), as Qwen models
use: later turns of a conversation extend the text of earlier ones, which is what prefix
keys need. It is not any model's exact template (for that, key through the backend's
``/tokenize``).

Bodies are parsed with ``orjson`` when it is installed (the ``fast`` extra; several times
faster than ``json`` on a token-id prompt), with ``json`` as the fallback and for anything
``orjson`` refuses (``NaN``, lone surrogates, UTF-16 bodies), so both accept the same bodies
and give the same errors. One difference remains: ``orjson`` reads integers beyond 64 bits as
floats; the fields kvroute reads refuse those either way (the body itself is forwarded
unchanged).

O(body size); stateless, thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson

    _fast_loads: Callable[[bytes], Any] | None = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    _fast_loads = None

Prompt = str | list[int]


class BadRequest(ValueError):
    """A body the OpenAI API would refuse with 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = _fast_loads(raw) if _fast_loads is not None else json.loads(raw)
    except (ValueError, RecursionError):  # orjson refuses NaN and >64-bit integers: json decides
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise BadRequest("the request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def completion_prompt(body: dict[str, Any]) -> Prompt:
    """The prompt of a ``/v1/completions`` body (the first one of a batch). A token-id list
    is returned unchecked beyond its first item: ``kvroute.block_hashes`` checks every id
    (callers map its ``KvrouteError`` to :class:`BadRequest`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if _is_int(first):
            return prompt
        if all(isinstance(p, str) for p in prompt):
            return str(first)
        if all(isinstance(p, list) and p and _is_int(p[0]) for p in prompt):
            return list(first)
    if prompt is None:
        raise BadRequest("missing field 'prompt'", "prompt")
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a non-empty list of either",
        "prompt",
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a ``/v1/chat/completions`` body, checked."""
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
    return messages


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def render_chat(messages: list[dict[str, Any]]) -> str:
    """One prompt string for chat messages (ChatML; see the module doc)."""
    out = []
    for m in messages:
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += _content_text(m["tool_calls"])
        out.append(f"<|im_start|>{m['role']}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def request_prompt(body: dict[str, Any], chat: bool) -> Prompt:
    """The prompt a completions or chat body carries (chat rendered with :func:`render_chat`).
    Text must be valid Unicode: JSON's ``\\ud800`` escapes can make lone surrogates, which no
    tokenizer takes."""
    prompt = render_chat(chat_messages(body)) if chat else completion_prompt(body)
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            field = "messages" if chat else "prompt"
            raise BadRequest(
                f"{field}: the text has a lone surrogate at {exc.start}", field
            ) from exc
    return prompt


def wants_stream(body: dict[str, Any]) -> bool:
    """``stream`` of a body (checked to be a boolean)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    return stream


def int_field(body: dict[str, Any], name: str, default: int | None, minimum: int = 0) -> int | None:
    """An optional integer field, checked."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"'{name}' must be an integer >= {minimum}", name)
    return value


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
