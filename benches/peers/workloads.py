"""The peers benchmark's workloads: sessions of requests, each request an OpenAI body ready
to send, with the token ids the engines will see (for the trace's APC ceiling).

* ``agentic-text`` / ``agentic-chat``: the LMCache agent traces (``miniswe`` and
  ``taubench``, real multi-turn agent sessions with their prompt text), each prompt as a
  text completion, or as a chat of one user message; a session stops at its first prompt
  over ``MAX_PROMPT_CHARS`` (the engines' context and KV pool are small).
* ``prefix-repetition``: vLLM's ``prefix_repetition`` dataset as its benchmark makes it
  (random token ids decoded to text): ``PREFIXES`` prefixes of ``PREFIX_TOKENS`` tokens,
  each followed by ``SUFFIX_TOKENS`` random tokens, ``PROMPTS`` prompts in a seeded shuffle,
  no sessions.
* ``mooncake-ids``: the bundled Mooncake-derived trace (``traces/mooncake_sessions_32tok
  .parquet``, 32-token blocks) as token-id prompts made from its block keys, as ``kvroute
  replay`` makes them.

Every request generates ``OUTPUT_TOKENS`` tokens (``ignore_eos``), streamed with usage.
Building a workload tokenizes its text through an engine's ``/tokenize`` (chat rendered by
the engine's own template): O(requests) HTTP calls, once per run.
"""

from __future__ import annotations

import itertools
import json
import random
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
AGENT_TRACES = REPO.parent / "shared" / "traces" / "lmcache-agent-trace"
MOONCAKE = REPO / "traces" / "mooncake_sessions_32tok.parquet"
MAX_PROMPT_CHARS = 20_000
OUTPUT_TOKENS = 16
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, PROMPTS = 12, 2048, 128, 120


@dataclass
class Request:
    """One request: its path, body (``model`` filled in when sent) and prompt token ids."""

    path: str
    body: dict[str, Any]
    tokens: list[int] = field(default_factory=list)


@dataclass
class Workload:
    """Sessions of requests, in order; ``session_ids[i]`` None: sent without a session."""

    name: str
    sessions: list[list[Request]]
    session_ids: list[str | None]

    @property
    def requests(self) -> int:
        return sum(len(s) for s in self.sessions)


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    """POST ``body`` as JSON to ``url``; the JSON answer."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def random_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids of the model's vocabulary: a prompt no cache holds."""
    return [rng.randrange(100, 30000) for _ in range(n)]


def _generation(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **extra,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _agent_sessions(max_sessions: int | None, max_turns: int | None) -> list[tuple[str, list[str]]]:
    """(session id, its prompts in time order) of the agent traces, a miniswe session and a
    taubench one in turn, each cut at its first prompt over ``MAX_PROMPT_CHARS`` and after
    ``max_turns``."""
    by_folder: list[list[tuple[str, list[str]]]] = []
    for folder in ("miniswe", "taubench"):
        out: list[tuple[str, list[str]]] = []
        by_folder.append(out)
        files = sorted((AGENT_TRACES / folder).glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"no agent sessions (*.jsonl) in {AGENT_TRACES / folder}")
        for path in files[:max_sessions]:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            rows.sort(key=lambda r: r["timestamp"])
            prompts = []
            for r in rows[:max_turns]:
                if len(r["input"]) > MAX_PROMPT_CHARS:
                    break
                prompts.append(r["input"])
            if prompts:
                out.append((f"{folder}-{rows[0]['session_id']}", prompts))
    mixed = [s for pair in itertools.zip_longest(*by_folder) for s in pair if s is not None]
    return mixed


def agentic(
    engine_url: str,
    model: str,
    chat: bool,
    max_sessions: int | None = None,
    max_turns: int | None = None,
) -> Workload:
    """``agentic-text`` or ``agentic-chat`` (see the module doc); ``max_sessions`` per
    trace folder and ``max_turns`` per session (None: all)."""
    sessions, ids = [], []
    for sid, prompts in _agent_sessions(max_sessions, max_turns):
        turns = []
        for text in prompts:
            if chat:
                msg = {"messages": [{"role": "user", "content": text}]}
                tokens = post(engine_url + "/tokenize", {"model": model, **msg})["tokens"]
                turns.append(Request("/v1/chat/completions", _generation(msg), tokens))
            else:
                query = {"model": model, "prompt": text}
                tokens = post(engine_url + "/tokenize", query)["tokens"]
                turns.append(Request("/v1/completions", _generation({"prompt": text}), tokens))
        sessions.append(turns)
        ids.append(sid)
    return Workload("agentic-chat" if chat else "agentic-text", sessions, ids)


def prefix_repetition(
    engine_url: str, model: str, detokenize: Callable[[list[int]], str], seed: int = 0
) -> Workload:
    """vLLM's ``prefix_repetition`` (see the module doc): every prompt its own session-less
    request; ``detokenize`` turns ids into text (the model's tokenizer)."""
    rng = np.random.default_rng(seed)
    vocab = 32000

    def text(n: int) -> str:
        return detokenize([int(t) for t in rng.integers(1000, vocab - 1000, n)])

    prefixes = [text(PREFIX_TOKENS) for _ in range(PREFIXES)]
    prompts = [p + text(SUFFIX_TOKENS) for p in prefixes for _ in range(PROMPTS // PREFIXES)]
    order = rng.permutation(len(prompts))
    requests = []
    for i in order:
        query = {"model": model, "prompt": prompts[i]}
        tokens = post(engine_url + "/tokenize", query)["tokens"]
        requests.append(Request("/v1/completions", _generation({"prompt": prompts[i]}), tokens))
    return Workload("prefix-repetition", [[r] for r in requests], [None] * len(requests))


def mooncake_ids(max_requests: int | None = None) -> Workload:
    """``mooncake-ids`` (see the module doc)."""
    import pyarrow.parquet as pq

    from kvroute.replay import prompt_tokens

    table = pq.read_table(MOONCAKE).sort_by([("timestamp", "ascending")])
    if max_requests is not None:
        table = table.slice(0, max_requests)
    rows = table.to_pylist()
    by_session: dict[str, list[Request]] = {}
    for r in rows:
        ids = prompt_tokens(r["hash_ids"], r["input_length"], 32, r["request_id"]).tolist()
        req = Request("/v1/completions", _generation({"prompt": ids}), ids)
        by_session.setdefault(str(r["session_id"]), []).append(req)
    names = list(by_session)
    return Workload("mooncake-ids", [by_session[n] for n in names], [f"mc-{n}" for n in names])


WORKLOADS = ("agentic-text", "agentic-chat", "prefix-repetition", "mooncake-ids")


def ceiling(workload: Workload, block_size: int) -> dict[str, float]:
    """The workload's APC ceilings on its own tokens (``kvroute ceilings``): any-session and
    intra-session hit ratios, in prompt tokens, with an unbounded cache."""
    import pyarrow as pa

    import kvroute

    rows: dict[str, list[Any]] = {
        k: [] for k in ("timestamp", "session_id", "input_length", "output_length", "hash_ids")
    }
    t = 0.0
    for s, session in enumerate(workload.sessions):
        for req in session:
            rows["timestamp"].append(t)
            rows["session_id"].append(s)
            rows["input_length"].append(len(req.tokens))
            rows["output_length"].append(OUTPUT_TOKENS)
            rows["hash_ids"].append(kvroute.block_hashes(req.tokens, block_size).tolist())
            t += 1.0
    table = pa.table(
        {
            "request_id": pa.array(range(len(rows["timestamp"])), pa.int64()),
            "timestamp": pa.array(rows["timestamp"], pa.float64()),
            "session_id": pa.array(rows["session_id"], pa.int64()),
            "input_length": pa.array(rows["input_length"], pa.int64()),
            "output_length": pa.array(rows["output_length"], pa.int64()),
            "hash_ids": pa.array(rows["hash_ids"], pa.list_(pa.uint64())),
        }
    )
    result = kvroute.ceilings(table, block_size=block_size, progress=False)
    return {"any_session": result.any.ratio, "intra_session": result.intra.ratio}
