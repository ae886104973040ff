"""The model's own tokenization in Rust (``kvroute._core.TextModel``): its ids are the Python
``tokenizers`` package's, its chat renders are Jinja2's under transformers' settings, and the
relay's keying of text and chat bodies with it agrees with the Python keyer's (``make
test-vllm`` holds it to a real engine's ``/tokenize``: ``tests/test_real_text_model.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvroute
from chat_templates import TEMPLATES, jinja2_render, write_model
from kvroute._core import TextModel, relay_text_prompt
from kvroute.errors import InvalidArgumentError
from kvroute.proxy.keys import Keyer, session_of
from kvroute.proxy.prompts import BadRequest, wants_stream

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)
WORDS = st.sampled_from(["hello", "world", " ", "  ", "\n", "é", "日本", "🙂", "<s>", "a.b"])
MESSAGE_TEXT = st.lists(WORDS, max_size=8).map("".join)


@pytest.fixture(scope="module")
def models(tokenizer_json: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: TextModel(write_model(root / name, tokenizer_json, t))
        for name, t in TEMPLATES.items()
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, special=st.booleans())
def test_ids_are_the_tokenizers_package_ids(
    tokenizer_json: Path, models: dict[str, Any], text: str, special: bool
) -> None:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    want = reference.encode(text, add_special_tokens=special).ids
    assert models["chatml"].encode(text, special) == want


MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool"]),
            "content": st.one_of(
                MESSAGE_TEXT,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": MESSAGE_TEXT}),
                    min_size=1,
                    max_size=3,
                ),
            ),
        }
    ),
    min_size=1,
    max_size=5,
)
TOOL_LIST = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["get", "set_é"]),
                    "parameters": st.dictionaries(
                        st.sampled_from(["b", "a", "ü"]),
                        st.one_of(st.integers(-5, 5), MESSAGE_TEXT, st.booleans(), st.none()),
                        max_size=3,
                    ),
                }
            ),
        }
    ),
    max_size=2,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(TEMPLATES)),
    messages=MESSAGES,
    tools=st.one_of(st.none(), TOOL_LIST),
    generation=st.booleans(),
    thinking=st.sampled_from([None, True, False]),
)
def test_chat_renders_are_jinja2s(
    models: dict[str, Any],
    name: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation: bool,
    thinking: bool | None,
) -> None:
    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation}
    if tools is not None:
        body["tools"] = tools
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    raw = json.dumps(body).encode()
    try:
        want: str | None = jinja2_render(TEMPLATES[name], body)
    except Exception:  # the template raised (a role out of turn)
        want = None
    if want is None:
        with pytest.raises(InvalidArgumentError, match="roles must alternate"):
            models[name].render_chat(raw)
    else:
        assert models[name].render_chat(raw) == want
        ids = models[name].prompt_ids(raw, True)
        assert ids == models[name].encode(want, False)


def test_errors_name_what_is_wrong(
    tmp_path: Path, tokenizer_json: Path, models: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgumentError, match=r"tokenizer\.json.*cannot load"):
        TextModel(tmp_path)
    broken = write_model(tmp_path / "broken", tokenizer_json, "{% for %}")
    model = TextModel(broken)
    assert model.template_error is not None and "does not compile" in model.template_error
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    with pytest.raises(InvalidArgumentError, match="does not compile"):
        model.prompt_ids(chat, True)
    assert model.prompt_ids(b'{"prompt": "hi"}', False) == model.encode("hi", True)
    assert model.prompt_ids(b'{"prompt": [1, 2]}', False) is None
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        model.prompt_ids(b"{", False)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(InvalidArgumentError, match="not text"):
        models["chatml"].prompt_ids(json.dumps(image).encode(), True)


SESSION_VALUES = st.one_of(
    st.none(), st.text(max_size=6), st.integers(-(2**70), 2**70), st.floats(), st.booleans()
)
CHAT_BODIES = st.fixed_dictionaries(
    {"messages": st.one_of(MESSAGES, st.just([]), st.just([{"content": "x"}]), st.just("x"))}
)
TEXT_BODIES = st.fixed_dictionaries(
    {"prompt": st.one_of(MESSAGE_TEXT, st.lists(MESSAGE_TEXT, min_size=1, max_size=2))}
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chat=st.booleans(),
    data=st.data(),
    extra=st.dictionaries(
        st.sampled_from(["stream", "session_id", "model", "tools"]),
        st.one_of(SESSION_VALUES, st.booleans(), st.just([])),
        max_size=3,
    ),
    header=st.sampled_from([None, "", "hdr"]),
    junk=st.sampled_from([b"", b"x", b"NaN"]),
)
def test_relay_text_keying_agrees_with_the_python_keyer(
    tokenizer_json: Path,
    models: dict[str, Any],
    chat: bool,
    data: st.DataObject,
    extra: dict[str, Any],
    header: str | None,
    junk: bytes,
) -> None:
    """When the relay keys a text or chat body itself (``relay_text_prompt``), it reads the
    keys, length, stream flag and session the Python keyer reads with the same model; every
    body it leaves to the hooks is one the Python keyer is asked about instead."""
    body = data.draw(CHAT_BODIES if chat else TEXT_BODIES)
    raw = json.dumps({**body, **extra}).encode()
    if junk:
        raw = raw.replace(b"}", b', "j": ' + junk + b"}", 1)
    model = models["tools"]
    got = relay_text_prompt(model, raw, chat, 4, "session_id", header)
    if got is None:
        return
    keyer = Keyer(str(model.dir), 4)
    try:
        parsed, keyed = keyer.parse_now(raw, chat)
        session = session_of(header, parsed, "session_id")
        python = (keyed[0].tolist(), keyed[1], wants_stream(parsed), session)  # type: ignore[index]
    except BadRequest as exc:
        pytest.fail(f"the relay keyed a body the Python keyer refuses: {exc}")
    assert (got[0].tolist(), got[1], got[2], got[3]) == python
    assert got[1] > 0 and len(got[0]) == -(-got[1] // 4)


def test_the_keyer_falls_back_to_chatml_where_the_template_cannot_render(
    models: dict[str, Any],
) -> None:
    """A chat the model's template refuses (roles out of turn) is keyed as ChatML by the same
    tokenizer: the relay leaves it to the hook, which does so."""
    model = models["alternating"]
    body = {"messages": [{"role": "assistant", "content": "first"}]}
    raw = json.dumps(body).encode()
    assert relay_text_prompt(model, raw, True, 4) is None
    keyer = Keyer(str(model.dir), 4)
    _, keyed = keyer.parse_now(raw, True)
    chatml = "<|im_start|>assistant\nfirst<|im_end|>\n<|im_start|>assistant\n"
    assert keyed is not None and keyed[1] == len(model.encode(chatml, False))
    assert list(keyed[0]) == list(kvroute.block_hashes(model.encode(chatml, False), 4))


LINES = st.lists(
    st.text(st.sampled_from("ab é日🙂.,(){}_=\t"), max_size=30).map(lambda s: s + "\n"),
    min_size=1,
    max_size=6,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.lists(LINES, min_size=30, max_size=60).map("".join),
    cut=st.integers(0, 2000),
    tails=st.lists(LINES, min_size=1, max_size=3),
    special=st.booleans(),
)
def test_the_prefix_cache_splices_exactly(
    tokenizer_json: Path, base: str, cut: int, tails: list[str], special: bool
) -> None:
    """A prompt that extends or shares the start of earlier ones (an agent's next turn) gets
    the ids the whole prompt would get: the cache splices only where that holds."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    model = TextModel(tokenizer_json.parent)  # a cache of its own
    prompt = base
    for tail in tails:
        prompt = prompt[: max(len(prompt) - cut, 0)] + tail if cut % 3 == 0 else prompt + tail
        for text, sp in ((prompt, special), (prompt + tail, special), (prompt, not special)):
            want = reference.encode(text, add_special_tokens=sp).ids
            assert model.encode(text, sp) == want


def test_an_agents_next_turn_is_spliced(tokenizer_json: Path) -> None:
    """A session's next prompt (the last one, its answer, a new message) is tokenized from
    near the end of what it shares with the last one, and its ids are the whole prompt's."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    model = TextModel(tokenizer_json.parent)
    prompt = "".join(f"line {i}: the cache keeps every prefix warm, déjà vu\n" for i in range(60))
    for turn in range(4):
        prompt += f"turn {turn} answer (tools) 日本語 🙂\nnext message\n"
        assert model.encode(prompt, True) == reference.encode(prompt).ids
    assert model.cache_counts == (3, 1)
    # The same prompt again (a retry): its ids at once, counted with the spliced ones.
    assert model.encode(prompt, True) == reference.encode(prompt).ids
    assert model.cache_counts == (4, 1)


WORDS = st.lists(st.text(st.sampled_from("ab é日🙂.,(){}_=\t'0"), max_size=12), min_size=1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.lists(WORDS.map(" ".join), min_size=150, max_size=300).map(" ".join),
    tails=st.lists(WORDS.map(" ".join), min_size=1, max_size=3),
)
def test_the_prefix_cache_splices_text_without_lines_exactly(
    tokenizer_json: Path, base: str, tails: list[str]
) -> None:
    """Prompts with no line breaks (random tokens decoded to text, as vLLM's
    prefix_repetition makes them) are cut at word starts, with the same ids as whole."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    model = TextModel(tokenizer_json.parent)
    for tail in tails:
        text = base + tail
        assert model.encode(text, False) == reference.encode(text, add_special_tokens=False).ids


def test_prompts_that_share_a_prefix_without_lines_are_spliced(tokenizer_json: Path) -> None:
    """A shared prefix of words (no line break) with different suffixes: tokenized once."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    model = TextModel(tokenizer_json.parent)
    prefix = " ".join(f"word{i % 97} déjà-vu {i}" for i in range(400))
    for suffix in range(4):
        text = f"{prefix} and then suffix number {suffix} "
        assert model.encode(text, True) == reference.encode(text).ids
    assert model.cache_counts == (3, 1)
