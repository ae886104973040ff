"""Block keys and sessions of incoming requests.

A prompt of token ids is keyed directly: ``kvroute.block_hashes(ids, block_size)`` (exact:
the keys a trace of these ids would have). Text prompts, and chat messages rendered with
:func:`~kvroute.proxy.prompts.render_chat`, are keyed by the configured mode:

* ``approx`` (default; no tokenizer, no round-trip): the UTF-8 bytes, at
  ``APPROX_BYTES_PER_TOKEN`` = 4 bytes per token: one key per ``4 * block_size`` bytes,
  ``input_length = ceil(bytes / 4)``. Prefix-stable (a prompt extending another shares its
  leading keys), about 5 µs per 10 kB, but lengths are estimates and block edges do not fall on
  the engine's token blocks: hit estimates are right in proportion, not to the token.
* a model folder (or its ``tokenizer.json``): the ids vLLM computes, by the model's own
  tokenizer and chat template in the Rust core (:class:`kvroute._core.TextModel`, the same
  object the relay keys text with, so the two agree); a chat its template cannot render
  (an image part, a template that raises) is rendered as ChatML and tokenized by the model's
  tokenizer. Costs the tokenizer's and the template's own time, with the GIL released.
* ``backend``: the ids the backend's ``/tokenize`` returns (vLLM applies the model's chat
  template too): exact, at the cost of one extra round-trip to a backend per text request.
  When it fails the request is keyed ``approx``.

Keys of token ids come with the prompt's ids after its last full block (:class:`Keyed`), and
an answer's generated ids are read back from it (:meth:`Keyer.output`: the engine's
``token_ids`` when the client asked for them, else its text tokenized as prompts are), so that
the proxy can record the blocks the output completes (``docs/semantics.md`` §1).

Sessions come from a header (``X-Session-Id`` by default) or else a body field; none means no
affinity. Stateless apart from the tokenizer; runs on the proxy's loop (``output_now`` on any
thread).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

import kvroute
from kvroute._core import TextModel, prompt_ids
from kvroute.errors import InvalidArgumentError, KvrouteError
from kvroute.proxy.prompts import BadRequest, Prompt, chat_messages, parse_body, request_prompt

APPROX_BYTES_PER_TOKEN = 4
#: Longest session id accepted (header or body field), in bytes.
MAX_SESSION_ID_BYTES = 256
Keys = npt.NDArray[np.uint64]
#: Asks a backend's ``/tokenize`` for the token ids of a body (None: no backend answered).
RemoteTokenize = Callable[[dict[str, Any]], Awaitable[list[int] | None]]


class Keyed(NamedTuple):
    """A prompt's block keys, its length in tokens, and (when the keys are of token ids) the
    ids after its last full block, from which the blocks its output completes are keyed."""

    keys: Keys
    input_length: int
    tail: Any = None


def approx_keys(text: str, block_size: int) -> tuple[Keys, int]:
    """Keys and estimated token count of text by byte chunking (see the module doc)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    keys = kvroute.block_hashes(data.astype(np.uint32), block_size * APPROX_BYTES_PER_TOKEN)
    return keys, -(-len(data) // APPROX_BYTES_PER_TOKEN)


def load_model(path: str) -> TextModel:
    """The model of a folder, or of the folder of a ``tokenizer.json``; a clear error when
    it has no usable tokenizer."""
    folder = Path(path)
    if folder.name == "tokenizer.json":
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidArgumentError(
            f"{path}: not a model folder (with tokenizer.json) nor a tokenizer.json"
        )
    return TextModel(folder)


class Keyer:
    """Turns request bodies into ``(keys, input_length)``."""

    def __init__(self, mode: str, block_size: int, remote: RemoteTokenize | None = None) -> None:
        self.mode = mode
        self.block_size = block_size
        self._remote = remote
        #: The model that keys text (a folder or ``tokenizer.json`` mode).
        self.model: TextModel | None = None
        if mode not in ("approx", "backend"):
            self.model = load_model(mode)

    def token_keys(self, ids: Any) -> Keyed:
        try:
            keys = kvroute.block_hashes(ids, self.block_size)
        except KvrouteError as exc:
            raise BadRequest(f"prompt: {exc}", "prompt") from exc
        n = len(ids)
        return Keyed(keys, n, np.asarray(ids[n - n % self.block_size :], dtype=np.uint32))

    async def parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], Keys, int, Any]:
        """A body's JSON object, block keys and prompt length (:meth:`parse_now`, then the
        backend's ``/tokenize`` when the mode asks for it)."""
        body, got = self.parse_now(raw, chat)
        if got is None:
            got = await self.remote_keys(body, chat)
        return body, *got

    def parse_now(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], Keyed | None]:
        """A body's JSON object and its keys and prompt length, or None for the keys when
        only the backend can tell them (``backend`` mode, text prompt). A completions body's
        token-id prompt is found by a scan of the raw bytes (``kvroute._core.prompt_ids``,
        ~9 ns per id) and only the rest of the body goes to the JSON parser, which would
        otherwise make a Python int of every id; bodies the scan cannot read unambiguously,
        and any error, take the full parse, so both accept and refuse the same bodies."""
        found = None if chat else prompt_ids(raw)
        if found is not None:
            ids, start, end = found
            try:
                body = parse_body(raw[:start] + b"[]" + raw[end:])
            except BadRequest:
                pass  # the full parse reports it, in its own words
            else:
                return body, self.token_keys(ids)
        body = parse_body(raw)
        if self.model is not None:
            return body, self.model_keys(raw, body, chat)
        return body, self.keys_now(body, chat)

    async def keys(self, body: dict[str, Any], chat: bool) -> Keyed:
        """The block keys and prompt length of a completions or chat body."""
        got = self.keys_now(body, chat)
        return got if got is not None else await self.remote_keys(body, chat)

    def keys_now(self, body: dict[str, Any], chat: bool) -> Keyed | None:
        """:meth:`keys` without the round-trip: None when it would take one."""
        if self.model is not None:
            return self.model_keys(json.dumps(body).encode(), body, chat)
        prompt: Prompt = request_prompt(body, chat)
        if isinstance(prompt, list):
            return self.token_keys(prompt)
        if self.mode == "backend" and self._remote is not None:
            return None
        return Keyed(*approx_keys(prompt, self.block_size))

    def model_keys(self, raw: bytes, body: dict[str, Any], chat: bool) -> Keyed:
        """Keys of a body (``raw``, parsed as ``body``) by the model: the ids vLLM computes
        (see the module doc)."""
        assert self.model is not None
        prompt: Prompt = request_prompt(body, chat)  # checks the body as every mode does
        if isinstance(prompt, list):
            return self.token_keys(prompt)
        try:
            ids = self.model.prompt_ids(raw, chat)
        except InvalidArgumentError:  # a chat the template cannot render
            ids = None
        if ids is None:  # that chat as ChatML, or a batch's first prompt
            ids = self.model.encode(prompt, not chat)
        return self.token_keys(np.asarray(ids, dtype=np.uint32))

    async def remote_keys(self, body: dict[str, Any], chat: bool) -> Keyed:
        """Keys of a text prompt from the backend's ``/tokenize`` (``approx`` when it fails)."""
        prompt = request_prompt(body, chat)
        assert isinstance(prompt, str) and self._remote is not None
        query: dict[str, Any] = (
            {"messages": chat_messages(body), "add_generation_prompt": True}
            if chat
            else {"prompt": prompt}
        )
        if "model" in body:
            query["model"] = body["model"]
        ids = await self._remote(query)
        if ids is not None:
            return self.token_keys(ids)
        return Keyed(*approx_keys(prompt, self.block_size))

    @property
    def exact(self) -> bool:
        """Whether text is keyed by the engine's own token ids (not ``approx``)."""
        return self.mode != "approx"

    def output_now(self, raw: bytes, stream: bool) -> tuple[Any, int] | TextOutput | None:
        """The token ids an answer generated and how many tokens it sampled, from the
        engine's ``token_ids`` when the client asked for them, else from its text by the
        local tokenizer; its :class:`TextOutput` when only the backend can tokenize it; None
        when nothing is known (``approx`` mode, or no generated text)."""
        if not self.exact and b'"token_ids"' not in raw:
            return None  # no ids in the answer, and its text cannot be tokenized exactly
        out = answer_output(raw, stream)
        if out is None:
            return None
        ids, text, generated = out
        if ids is not None:
            return ids, generated if generated is not None else len(ids)
        if not text or not self.exact:
            return None
        if self.model is None:
            return TextOutput(text, generated)
        got = np.asarray(self.model.encode(text, False), dtype=np.uint32)
        return got, generated if generated is not None else len(got)

    async def output(self, raw: bytes, stream: bool) -> tuple[Any, int] | None:
        """:meth:`output_now`, with the backend's ``/tokenize`` for text when it must."""
        got = self.output_now(raw, stream)
        return await self.tokenize_output(got) if isinstance(got, TextOutput) else got

    async def tokenize_output(self, out: TextOutput) -> tuple[Any, int] | None:
        """The ids of an answer's text from the backend's ``/tokenize`` (None: no answer)."""
        assert self._remote is not None
        ids = await self._remote({"prompt": out.text, "add_special_tokens": False})
        if ids is None:
            return None
        return ids, out.generated if out.generated is not None else len(ids)


class TextOutput(NamedTuple):
    """An answer's generated text, which only the backend can tokenize, and how many tokens
    the usage says it sampled (None: not said)."""

    text: str
    generated: int | None


def answer_output(raw: bytes, stream: bool) -> tuple[list[int] | None, str, int | None] | None:
    """The first choice's generated token ids (when the answer carries them), its text, and
    the usage's ``completion_tokens``, from a whole answer or an SSE stream; None when the
    answer cannot be read."""
    ids: list[int] | None = None
    parts: list[str] = []
    generated: int | None = None
    try:
        if stream:
            events = [
                json.loads(line[5:])
                for line in raw.split(b"\n")
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
            ]
        else:
            events = [json.loads(raw)]
        for event in events:
            for choice in event.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                got = choice.get("token_ids")
                if isinstance(got, list):
                    ids = (ids or []) + got
                message = choice.get("delta") or choice.get("message") or {}
                text = choice.get("text", message.get("content"))
                if isinstance(text, str):
                    parts.append(text)
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                generated = usage["completion_tokens"]
    except (ValueError, AttributeError, TypeError):
        return None
    return ids, "".join(parts), generated


def session_of(value: str | None, body: dict[str, Any], fld: str | None) -> Any:
    """The session id of a request (a string or an int), or None: the session header's
    ``value`` when there is one, else the body's field ``fld``. A string id longer than
    :data:`MAX_SESSION_ID_BYTES` bytes, a number that is not a 64-bit integer, is refused
    (:class:`BadRequest`); any other value (null, a boolean, an empty string, ...) is no
    session."""
    if value:
        if len(value) > MAX_SESSION_ID_BYTES:
            raise BadRequest(f"the session header is longer than {MAX_SESSION_ID_BYTES} bytes")
        return value
    if fld is not None:
        got = body.get(fld)
        if isinstance(got, str) and got:
            if len(got.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
                raise BadRequest(f"'{fld}' is longer than {MAX_SESSION_ID_BYTES} bytes", fld)
            return got
        if isinstance(got, float) or (
            isinstance(got, int) and not isinstance(got, bool) and not -(2**63) <= got < 2**63
        ):  # (a JSON parser may read an integer beyond 64 bits as a float)
            raise BadRequest(f"'{fld}' must be a string or a 64-bit integer, got {got}", fld)
        if isinstance(got, int) and not isinstance(got, bool):
            return got
    return None
