"""Replaying a trace over HTTP against an OpenAI-compatible endpoint: ``kvroute proxy``, one
vLLM engine, or the emulator. See ``docs/replay.md``.

**Prompts from keys.** Each request is sent to ``/v1/completions`` as token ids made from its
block keys: block ``i`` with key ``k`` becomes ``block_size`` tokens, token ``j`` being
``FIRST_ID + splitmix64(k + (j + 1) * 0x9E3779B97F4A7C15) % (vocab_size - FIRST_ID)``; the
blocks are concatenated and cut to ``input_length``. Equal keys give equal tokens, so a real
engine's prefix cache sees exactly the reuse the trace implies (ids avoid the first 256, where
special tokens live). Blocks beyond the trace's keys get keys unique to the request.
``max_tokens = output_length`` with ``ignore_eos``, streamed with usage.

**Dispatch** (``docs/semantics.md`` §5): a session's turns go one at a time; ``tracets`` sends
turn n+1 at ``max(timestamp, finish_n)``, ``thinktime`` at ``finish_n + time_to_parent_chat``
(0 when absent), ``poisson`` starts sessions as a seeded Poisson process of ``rate`` sessions
per second with turns as in ``thinktime``. Trace times (timestamps, think times) are
multiplied by ``time_scale``; a failed turn ends at its failure and the session goes on.

**Cold start**: ``reset_cache`` sends ``POST /reset_prefix_cache`` first (``kvroute proxy``
sends it on to every backend and clears its router's cache model), so that each arm of an
experiment starts with empty prefix caches; a refusal stops the run with a
:class:`ReplayError` that says what the endpoint answered.

**Measurement**: send, first streamed token and last token on the monotonic clock (seconds
since the run began), usage's ``completion_tokens`` and ``prompt_tokens_details.cached_tokens``,
and the proxy's ``X-Kvroute-Instance`` / ``X-Kvroute-Hit-Tokens`` / ``X-Kvroute-Queue-Wait``
headers when present. The records have the schema of :mod:`kvroute.records`, shared with
the simulator.

Cost: O(input tokens) per request to build prompts; one asyncio task per session.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from kvroute.errors import InvalidArgumentError, KvrouteError
from kvroute.records import conform_records, record_schema
from kvroute.schema import block_size_of

MODES = ("tracets", "thinktime", "poisson")
#: Idle client connections (the replayer's, calibration's, B2's) are closed after this many
#: seconds, before an engine's server closes them (vLLM's uvicorn keeps an idle connection
#: 5 s): a request sent on a connection the server is closing at that moment fails with
#: "Server disconnected".
KEEPALIVE_S = 3.0
FIRST_ID = 256
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
U64 = npt.NDArray[np.uint64]


async def sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a streamed completion, up to ``[DONE]``."""
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield payload


def _mix(x: U64) -> U64:
    z = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def prompt_tokens(
    hash_ids: Any, input_length: int, block_size: int, salt: int = 0, vocab_size: int = 32000
) -> npt.NDArray[np.uint32]:
    """The token ids of a request (see the module doc); ``salt`` (the request id) makes the
    keys of blocks that the trace has no key for."""
    if vocab_size <= FIRST_ID:
        raise InvalidArgumentError(f"vocab_size must exceed {FIRST_ID}, got {vocab_size}")
    need = -(-int(input_length) // block_size)
    keys = np.asarray(hash_ids, dtype=np.uint64)[:need]
    if len(keys) < need:
        extra = np.arange(len(keys), need, dtype=np.uint64) + np.uint64(salt & ((1 << 63) - 1))
        keys = np.concatenate([keys, _mix(extra ^ np.uint64(0xA5A5A5A5A5A5A5A5))])
    j = np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN
    z = _mix(keys[:, None] + j[None, :]).ravel()[:input_length]
    return (np.uint64(FIRST_ID) + z % np.uint64(vocab_size - FIRST_ID)).astype(np.uint32)


class ReplayError(KvrouteError, RuntimeError):
    """The endpoint refused a step of the replay itself (not one of its requests)."""


@dataclass
class ReplayConfig:
    """How to replay (see the module doc and ``docs/replay.md``)."""

    url: str
    mode: str = "thinktime"
    model: str | None = None
    time_scale: float = 1.0
    max_requests: int | None = None
    rate: float | None = None
    seed: int = 0
    vocab_size: int = 32000
    request_timeout_s: float = 3600.0
    session_header: str = "X-Session-Id"
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = False
    reset_cache: bool = False

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "poisson" and not (self.rate and self.rate > 0):
            raise InvalidArgumentError("poisson dispatch needs a positive rate (sessions/s)")
        if self.time_scale < 0:
            raise InvalidArgumentError("time_scale must be non-negative")


@dataclass(slots=True)
class _Turn:
    row: int
    timestamp: float
    ttp: float


@dataclass(slots=True)
class _Result:
    send: float
    first: float | None = None
    finish: float = 0.0
    output: int = 0
    cached: int | None = None
    instance: int = -1
    estimated: int | None = None
    router_wait: float | None = None
    error: str | None = None


class Replayer:
    """One replay run of a trace (see the module doc)."""

    def __init__(self, trace: pa.Table, config: ReplayConfig) -> None:
        if config.max_requests is not None:
            trace = trace.slice(0, config.max_requests)
        self.trace, self.config = trace, config
        self.block_size = block_size_of(trace)
        self._cols = {
            c: trace.column(c).to_pylist()
            for c in ("request_id", "session_id", "turn", "input_length", "output_length")
        }
        self._keys = trace.column("hash_ids")
        ts = trace.column("timestamp").to_numpy()
        self._t0 = float(ts.min()) if len(ts) else 0.0
        ttp = (
            trace.column("time_to_parent_chat").to_pylist()
            if "time_to_parent_chat" in trace.column_names
            else [None] * trace.num_rows
        )
        sessions: dict[Any, list[_Turn]] = defaultdict(list)
        for i, sid in enumerate(self._cols["session_id"]):
            sessions[sid].append(_Turn(i, float(ts[i]) - self._t0, float(ttp[i] or 0.0)))
        order = {i: (self._cols["turn"][i], ts[i], i) for i in range(trace.num_rows)}
        self.sessions = [sorted(v, key=lambda t: order[t.row]) for v in sessions.values()]
        self.sessions.sort(key=lambda s: s[0].timestamp)
        self.results: list[_Result | None] = [None] * trace.num_rows
        self.on_done: Any = None

    def _starts(self) -> list[float]:
        c = self.config
        if c.mode != "poisson":
            return [s[0].timestamp * c.time_scale for s in self.sessions]
        assert c.rate is not None
        gaps = np.random.default_rng(c.seed).exponential(1.0 / c.rate, len(self.sessions))
        return list(np.cumsum(gaps) - gaps[0]) if len(gaps) else []

    async def run(self) -> pa.Table:
        """Replay every session; the records."""
        c = self.config
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=c.request_timeout_s)
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as http:
            if c.reset_cache:
                await self._reset_cache(http)
            model = c.model or await self._model(http)
            self._start = time.perf_counter()
            tasks = []
            for sess, start in zip(self.sessions, self._starts(), strict=True):
                await self._sleep_until(start)
                tasks.append(asyncio.create_task(self._session(http, model, sess, start)))
            await asyncio.gather(*tasks)
        return self.records(model)

    def _now(self) -> float:
        return time.perf_counter() - self._start

    async def _sleep_until(self, t: float) -> None:
        delay = t - self._now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _reset_cache(self, http: aiohttp.ClientSession) -> None:
        """``POST /reset_prefix_cache`` (a proxy sends it on to every backend), so the run
        starts with cold caches."""
        url = self.config.url + "/reset_prefix_cache"
        try:
            async with http.post(url) as resp:
                if resp.status < 300:
                    return
                text = (await resp.text()).strip()[:300]
        except (aiohttp.ClientError, OSError) as exc:
            raise ReplayError(f"{url}: {exc}") from exc
        hint = " (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)" if resp.status == 404 else ""
        raise ReplayError(f"{url} answered {resp.status}{hint}: {text}")

    async def _model(self, http: aiohttp.ClientSession) -> str:
        async with http.get(self.config.url + "/v1/models") as resp:
            if resp.status != 200:
                raise InvalidArgumentError(
                    f"{self.config.url}/v1/models answered {resp.status}; pass the model name"
                )
            data = await resp.json()
        return str(data["data"][0]["id"])

    async def _session(
        self, http: aiohttp.ClientSession, model: str, turns: list[_Turn], start: float
    ) -> None:
        c = self.config
        finish = start
        for n, turn in enumerate(turns):
            if n:
                if c.mode == "tracets":
                    at = max(turn.timestamp * c.time_scale, finish)
                else:
                    at = finish + turn.ttp * c.time_scale
                await self._sleep_until(at)
            res = await self._send(http, model, turn.row)
            self.results[turn.row] = res
            finish = res.finish
            if self.on_done is not None:
                self.on_done()

    def _body(self, model: str, row: int) -> bytes:
        cols = self._cols
        keys = self._keys[row].values.to_numpy(zero_copy_only=False)
        toks = prompt_tokens(
            keys,
            cols["input_length"][row],
            self.block_size,
            cols["request_id"][row],
            self.config.vocab_size,
        )
        body = {
            "model": model,
            "max_tokens": max(int(cols["output_length"][row]), 1),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.config.extra_body,
        }
        head = json.dumps(body)[:-1].encode()
        return head + b', "prompt": [' + ",".join(map(str, toks.tolist())).encode() + b"]}"

    async def _send(self, http: aiohttp.ClientSession, model: str, row: int) -> _Result:
        data = self._body(model, row)
        headers = {
            "Content-Type": "application/json",
            self.config.session_header: str(self._cols["session_id"][row]),
        }
        res = _Result(send=self._now())
        try:
            async with http.post(
                self.config.url + "/v1/completions", data=data, headers=headers
            ) as resp:
                inst = resp.headers.get("X-Kvroute-Instance")
                res.instance = int(inst) if inst is not None else 0
                hit = resp.headers.get("X-Kvroute-Hit-Tokens")
                res.estimated = int(hit) if hit is not None else None
                waited = resp.headers.get("X-Kvroute-Queue-Wait")
                res.router_wait = float(waited) if waited is not None else None
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    res.error = f"HTTP {resp.status}: {text}"
                else:
                    await self._read_stream(resp, res)
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: bad JSON
            res.error = f"{type(exc).__name__}: {exc}"
        res.finish = self._now()
        return res

    async def _read_stream(self, resp: aiohttp.ClientResponse, res: _Result) -> None:
        chunks = 0
        async for payload in sse_payloads(resp):
            obj = json.loads(payload)
            if obj.get("error"):
                res.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                return
            if obj.get("choices"):
                if res.first is None:
                    res.first = self._now()
                chunks += 1
            usage = obj.get("usage")
            if usage:
                res.output = int(usage.get("completion_tokens", chunks))
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    res.cached = int(details["cached_tokens"])
        if not res.output:
            res.output = chunks

    def records(self, model: str = "") -> pa.Table:
        """The per-request records of the requests sent so far."""
        done = [(i, r) for i, r in enumerate(self.results) if r is not None]
        cols = self._cols

        def pick(name: str) -> list[Any]:
            return [cols[name][i] for i, _ in done]

        sess_type = self.trace.schema.field("session_id").type
        c = self.config
        run = {
            "source": "replay",
            "mode": c.mode,
            "url": c.url,
            "model": model,
            "time_scale": c.time_scale,
            "rate": c.rate,
            "seed": c.seed,
            "block_size": self.block_size,
        }
        schema = record_schema(sess_type if pa.types.is_string(sess_type) else None, run)
        arrays = {
            "request_id": pick("request_id"),
            "session_id": pick("session_id"),
            "turn": pick("turn"),
            "instance": [r.instance for _, r in done],
            "send": [r.send for _, r in done],
            "first_token": [r.first for _, r in done],
            "finish": [r.finish for _, r in done],
            "input_length": pick("input_length"),
            "output_length": [r.output for _, r in done],
            "cached_tokens": [r.cached for _, r in done],
            "estimated_hit_tokens": [r.estimated for _, r in done],
            "queue_wait": [None] * len(done),
            "router_wait": [r.router_wait for _, r in done],
            "preemptions": [None] * len(done),
            "decode_overlaps_prefill": [None] * len(done),
            "error": [r.error for _, r in done],
        }
        table = pa.table({f.name: pa.array(arrays[f.name], f.type) for f in schema}, schema=schema)
        return conform_records(table)


def replay(
    trace: pa.Table, config: ReplayConfig, on_done: Callable[[], None] | None = None
) -> pa.Table:
    """Replay ``trace`` (canonical format) as ``config`` says; blocks until done.
    ``on_done()`` is called as each request ends (instead of the progress bar)."""
    from kvroute.proxy.serving import new_event_loop

    replayer = Replayer(trace, config)
    progress = None
    if on_done is not None:
        replayer.on_done = on_done
    elif config.progress:
        from rich.console import Console
        from rich.progress import Progress

        progress = Progress(console=Console(stderr=True), transient=True)
        task = progress.add_task("replay", total=replayer.trace.num_rows)
        replayer.on_done = lambda: progress.advance(task)
        progress.start()
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(replayer.run())
    finally:
        if progress is not None:
            progress.stop()


__all__ = ["MODES", "ReplayConfig", "ReplayError", "Replayer", "prompt_tokens", "replay"]
