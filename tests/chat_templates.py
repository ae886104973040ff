"""Chat templates for the text model's tests, written for them (not any model's), that use what
real models' templates use: a system message taken out of the loop, tools through ``tojson``,
``namespace``, loop controls and ``loop`` attributes, Python's string methods, ``is string``
and ``is defined`` tests, slicing, ``raise_exception``, and a switch from
``chat_template_kwargs``; and the reference renderer: Jinja2 as transformers sets it up for
``apply_chat_template`` (which vLLM calls).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- set content = m.content if m.content is string else '' %}
    {{- '<|im_start|>' + m.role + '\\n' + content.strip() }}
    {%- if m.tool_calls is defined and m.tool_calls %}
        {%- for call in m.tool_calls %}
            {{- '\\n<tool_call>' + (call.function | tojson) + '</tool_call>' }}
        {%- endfor %}
    {%- endif %}
    {%- if loop.index0 == ns.last_user %}{{ ' [last user]' }}{% endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

ALTERNATING = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'].split() | join(' ') + ' [/INST]' }}
    {% else %}
        {{ message['content'].upper() + eos_token }}
    {% endif %}
    {% if loop.last and messages | length > 2 %}({{ messages[1:] | length }} more){% endif %}
{% endfor %}"""

TEMPLATES = {"chatml": CHATML, "tools": TOOLS, "alternating": ALTERNATING}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def write_model(
    folder: Path, tokenizer_json: Path, template: str, config: dict[str, Any] | None = None
) -> Path:
    """A model folder: ``tokenizer_json`` copied in, and ``template`` as the chat template of
    its ``tokenizer_config.json`` (``config``'s, by default :data:`SPECIAL`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {**(SPECIAL if config is None else config), "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def jinja2_render(template: str, body: dict[str, Any]) -> str:
    """``body``'s chat through ``template`` as transformers renders it: Jinja2's immutable
    sandbox with ``trim_blocks``, ``lstrip_blocks`` and loop controls, its ``tojson`` and
    ``raise_exception``; messages as vLLM passes them (text parts joined by newlines)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    messages = []
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": "\n".join(p["text"] for p in content)}
        messages.append(m)
    context = {
        **SPECIAL,
        **body.get("chat_template_kwargs", {}),
        "messages": messages,
        "tools": body.get("tools"),
        "add_generation_prompt": body.get("add_generation_prompt", True),
    }
    return env.from_string(template).render(**context)
