"""The emulator's HTTP server: an OpenAI-compatible stand-in for one vLLM engine.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming or not;
``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stream_options.include_usage``,
``return_token_ids``; usage with ``prompt_tokens_details.cached_tokens``; a request with the
``X-Kvroute-Engine-Clock`` header is streamed a chunk per engine step, each with its engine
time, and told its arrival's in ``X-Kvroute-Engine-Arrived``: what a client needs to time the
engine model exactly, whatever the host's load), ``POST /tokenize``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (vLLM names, :mod:`kvroute.emulator.prom`), ``POST
/reset_prefix_cache`` (vLLM dev mode's) and ``GET /kv_event_sources`` (``{}`` unless
``kv_events``: then the engine model's stores, evictions and resets are published as vLLM's
KV-cache events, with a replay socket unless ``kv_events_replay`` is off; :mod:`.kv_feed`).

Prompts given as token ids are used as they are; text (and chat, rendered with
:func:`kvroute.proxy.prompts.render_chat`) goes through kvroute's built-in tokenizer, which
``/tokenize`` exposes. Block keys for the engine's prefix cache are
``kvroute.block_hashes(ids, block_size)``. Without ``ignore_eos`` a request "meets its end of
sequence" after a length drawn from its prompt (deterministic, up to twice ``max_tokens``), so
it may stop early with ``finish_reason = "stop"``, as a model does; with it, it generates
exactly ``max_tokens``. Default ``max_tokens``: 16 for completions (vLLM's), 256 for chat.

The engine model is the simulator's ``kvroute.EngineModel`` (:mod:`.sim_engine`) by default,
or the small :class:`~kvroute.emulator.engine.SimpleEngine`; both sit behind the
:class:`~kvroute.emulator.engine.Engine` protocol that :mod:`.driver` runs in real time.
A client that disconnects cancels its request in the engine. Faults: :mod:`.faults`.
One loop; per request O(prompt + output tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import kvroute
from kvroute.emulator.driver import Channel, Driver
from kvroute.emulator.engine import Engine, EngineEvent, SimpleEngine, preset
from kvroute.emulator.faults import FaultConfig
from kvroute.emulator.kv_feed import KvFeed
from kvroute.emulator.kv_publisher import KvEventPublisher
from kvroute.emulator.prom import EmulatorMetrics
from kvroute.emulator.responses import (
    DONE,
    ENGINE_ARRIVED_HEADER,
    ENGINE_CLOCK_HEADER,
    Reply,
    token_ids,
    token_text,
    usage,
)
from kvroute.emulator.sim_engine import SimEngine
from kvroute.errors import KvrouteError
from kvroute.proxy.prompts import (
    BadRequest,
    error_body,
    int_field,
    parse_body,
    request_prompt,
    wants_stream,
)
from kvroute.tokenize import BuiltinTokenizer

DEFAULT_MODEL = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
MAX_MODEL_LEN = 262_144
_MASK = (1 << 64) - 1
EMULATOR: web.AppKey[Emulator] = web.AppKey("kvroute.emulator")


@dataclass
class EmulatorConfig:
    """How to build one emulator server.

    ``engine``: ``"sim"`` (the simulator's ``kvroute.EngineModel``, presets
    ``kvroute._core.engine_presets()`` and ``fast``) or ``"simple"``
    (:class:`~kvroute.emulator.engine.SimpleEngine`, presets in ``engine.PRESETS``).
    ``overrides``: engine parameters of the preset to change, plus ``max_model_len``.
    ``reset_prefix_cache``: serve ``POST /reset_prefix_cache`` (vLLM does only in dev mode).
    ``kv_events``: publish KV-cache events on ZMQ sockets bound to ``kv_events_host`` (the
    ``sim`` engine only); ``kv_events_replay``: with vLLM's replay socket.
    """

    model: str = DEFAULT_MODEL
    preset: str = "h20-qwen3-coder-30b-a3b"
    overrides: dict[str, Any] = field(default_factory=dict)
    speedup: float = 1.0
    prompt_tokens_details: bool = True
    faults: FaultConfig = field(default_factory=FaultConfig)
    engine: str = "sim"
    reset_prefix_cache: bool = True
    kv_events: bool = False
    kv_events_replay: bool = True
    kv_events_host: str = "127.0.0.1"


def make_engine(config: EmulatorConfig) -> tuple[Engine, int, int]:
    """The engine model, its block size and the maximum model length."""
    overrides = dict(config.overrides)
    max_len = int(overrides.pop("max_model_len", MAX_MODEL_LEN))
    if config.engine == "simple":
        params = preset(config.preset, **overrides)
        return SimpleEngine(params), params.block_size, max_len
    if config.engine != "sim":
        raise ValueError(f"engine must be 'sim' or 'simple', got {config.engine!r}")
    sim = SimEngine(config.preset, **overrides)
    return sim, sim.block_size, max_len


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def output_plan(max_tokens: int, min_tokens: int, ignore_eos: bool, seed: int) -> tuple[int, str]:
    """Tokens to generate and the finish reason (see the module doc)."""
    if ignore_eos:
        return max_tokens, "length"
    natural = max(1 + _splitmix64(seed) % (2 * max_tokens), min_tokens)
    return (max_tokens, "length") if natural >= max_tokens else (natural, "stop")


class Emulator:
    """Handlers and state of one emulator server."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.faults = config.faults
        self.engine, self.block_size, self.max_model_len = make_engine(config)
        self.request_overhead_s = float(getattr(self.engine, "request_overhead_s", 0.0))
        self.tokenizer = BuiltinTokenizer()
        self.metrics = EmulatorMetrics(config.model, self.engine.stats, self.block_size)
        self._ids = itertools.count()
        self._driver: Driver | None = None
        if config.kv_events and not isinstance(self.engine, SimEngine):
            raise ValueError("kv_events needs the 'sim' engine")
        #: The KV-event feed, while the server runs with ``kv_events``.
        self.kv_feed: KvFeed | None = None

    @property
    def driver(self) -> Driver:
        """The engine's driver (exists once the server started)."""
        if self._driver is None:
            raise RuntimeError("the emulator's server has not started")
        return self._driver

    @property
    def active(self) -> int:
        """Requests in the engine now (any thread may ask)."""
        return 0 if self._driver is None else self._driver.active

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app[EMULATOR] = self
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        if self.config.reset_prefix_cache:
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        if self.config.kv_events:
            assert isinstance(self.engine, SimEngine)
            publisher = KvEventPublisher(
                replay=self.config.kv_events_replay, host=self.config.kv_events_host
            )
            self.kv_feed = KvFeed(publisher, self.block_size)
            self.engine.publish_kv_events(self.kv_feed.publish)
        self._driver = Driver(self.engine, speedup=self.config.speedup)

    async def _cleanup(self, _app: web.Application) -> None:
        if self._driver is not None:
            self._driver.close()
        if self.kv_feed is not None:
            self.kv_feed.publisher.close()

    def _ids_of(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return prompt

    @staticmethod
    def _error(status: int, message: str, param: str | None = None) -> web.Response:
        kind = "NotFoundError" if status == 404 else "BadRequestError"
        return web.json_response(error_body(message, kind, status, param), status=status)

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        """vLLM's dev-mode endpoint: forget the cached blocks no running request holds."""
        self.engine.reset_prefix_cache()
        return web.Response()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()
            arrived = self.driver.now()  # parsing and hashing it take no engine time
            body = parse_body(raw)
            model = body.get("model")
            if model is not None and model != self.config.model:
                return self._error(404, f"The model `{model}` does not exist.", "model")
            ids = self._ids_of(request_prompt(body, chat))
            keys = kvroute.block_hashes(ids, self.block_size).tolist()
            stream = wants_stream(body)
            limit = int_field(body, "max_completion_tokens", None, 1) if chat else None
            max_tokens = int_field(body, "max_tokens", limit or (256 if chat else 16), 1)
            min_tokens = int_field(body, "min_tokens", 0) or 0
            if int_field(body, "n", 1, 1) != 1:
                raise BadRequest("the emulator serves n = 1 only", "n")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise BadRequest("'stream_options' must be an object", "stream_options")
            want_ids = body.get("return_token_ids", False)
            if not isinstance(want_ids, bool):
                raise BadRequest("'return_token_ids' must be a boolean", "return_token_ids")
        except BadRequest as exc:
            return self._error(400, str(exc), exc.param)
        except KvrouteError as exc:
            return self._error(400, f"prompt: {exc}", "prompt")
        assert max_tokens is not None
        if len(ids) + max_tokens > self.max_model_len:
            return self._error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the request has {len(ids)} prompt and {max_tokens} output tokens.",
            )
        fault = self.faults.draw()
        if fault == "error":
            status = self.faults.error_status
            body_ = error_body("injected fault", "InternalServerError", status)
            return web.json_response(body_, status=status)
        if fault == "stall":
            await asyncio.sleep(self.faults.stall_s)
            arrived = self.driver.now()
        n_out, reason = output_plan(
            max_tokens, min_tokens, bool(body.get("ignore_eos", False)), keys[-1] if keys else 0
        )
        rid = next(self._ids)
        t0 = time.perf_counter()
        try:
            clock = stream and ENGINE_CLOCK_HEADER in request.headers
            channel = self.driver.submit(rid, keys, len(ids), n_out, arrived, stepwise=clock)
        except KvrouteError as exc:
            return self._error(400, f"the engine refused the request: {exc}")
        if self.kv_feed is not None:
            self.kv_feed.admit(rid, keys, ids)
        self.metrics.prompt_tokens.inc(len(ids))
        reply = Reply(self.config.model, chat)
        die_after = self.faults.die_after_tokens if fault == "die" else None
        try:
            if stream:
                include = bool(options.get("include_usage", False))
                return await self._stream(
                    request,
                    channel,
                    reply,
                    len(ids),
                    reason,
                    include,
                    die_after,
                    ids=want_ids,
                    clock=clock,
                )
            sent, cached = 0, 0
            while True:
                events = await self._next(channel)
                for ev in events:
                    sent += ev.tokens
                    if ev.kind == "first_token":
                        cached = ev.cached_tokens
                        self.metrics.ttft.observe(time.perf_counter() - t0)
                if events[-1].kind == "finish":
                    break
            if die_after is not None:
                return self._die(request, web.Response())
            self._done(sent, reason, t0)
            u = usage(len(ids), sent, cached, self.config.prompt_tokens_details)
            out_ids = token_ids(0, sent) if want_ids else None
            return web.json_response(reply.whole(token_text(0, sent), reason, u, out_ids))
        finally:
            self.driver.cancel(rid)
            if self.kv_feed is not None:
                self.kv_feed.release(rid)

    async def _next(self, channel: Channel) -> list[EngineEvent]:
        """The request's next events, held back by the engine's ``request_overhead_s``."""
        events = await channel.get()
        if self.request_overhead_s:
            await self.driver.hold_until(events[-1].time + self.request_overhead_s)
        return events

    @staticmethod
    def _die(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Close the connection without ending the response (the injected "die" fault)."""
        if request.transport is not None:
            request.transport.close()
        return resp

    def _done(self, tokens: int, reason: str, t0: float) -> None:
        self.metrics.generation_tokens.inc(tokens)
        self.metrics.success(reason)
        self.metrics.e2e.observe(time.perf_counter() - t0)

    async def _stream(
        self,
        request: web.Request,
        channel: Channel,
        reply: Reply,
        n_in: int,
        reason: str,
        include_usage: bool,
        die_after: int | None,
        *,
        ids: bool = False,
        clock: bool = False,
    ) -> web.StreamResponse:
        """Stream the request's tokens: one chunk per wake of the driver (tokens due
        together go out together), or per engine step with ``clock``, each chunk stamped
        with its ``engine_time``; the token ids in each with ``ids``."""
        t0 = time.perf_counter()
        headers = {"Content-Type": "text/event-stream"}
        if clock:
            headers[ENGINE_ARRIVED_HEADER] = repr(channel.arrived)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        overhead = self.request_overhead_s
        sent, cached, finished = 0, 0, False
        last: tuple[int, float] = (0, 0.0)  # the final chunk's tokens and their time
        while not finished:
            events = await self._next(channel)
            for ev in events:
                if ev.kind == "first_token":
                    cached = ev.cached_tokens
                    self.metrics.ttft.observe(time.perf_counter() - t0)
            finished = events[-1].kind == "finish"
            if clock:
                pieces = [(ev.tokens, ev.time + overhead) for ev in events if ev.tokens]
            else:
                pieces = [(sum(ev.tokens for ev in events), events[-1].time + overhead)]
            if finished:
                last = pieces.pop() if pieces else (0, events[-1].time + overhead)
                pieces.append(last)
            for k, (n, t) in enumerate(pieces):
                if die_after is not None and sent + n >= die_after:
                    if die_after > sent:
                        await resp.write(reply.text_chunk(token_text(sent, die_after - sent)))
                    return self._die(request, resp)
                if finished and k == len(pieces) - 1:
                    break  # the final chunk's tokens
                if n:
                    chunk = reply.text_chunk(
                        token_text(sent, n),
                        token_ids(sent, n) if ids else None,
                        t if clock else None,
                    )
                    if reply.chat and not sent:
                        chunk = reply.role_chunk() + chunk
                    await resp.write(chunk)
                sent += n
        n, t = last
        tail = reply.final_chunk(
            reason,
            token_text(sent, n) if n else "",
            token_ids(sent, n) if ids else None,
            t if clock else None,
        )
        sent += n
        if reply.chat and sent == n:
            tail = reply.role_chunk() + tail
        if include_usage:
            details = self.config.prompt_tokens_details
            tail += reply.usage_chunk(usage(n_in, sent, cached, details))
        await resp.write(tail + DONE)
        if self.faults.done_gap_s:
            await asyncio.sleep(self.faults.done_gap_s)
        await resp.write_eof()
        self._done(sent, reason, t0)
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse_body(await request.read())
            ids = self._ids_of(request_prompt(body, chat="messages" in body))
        except BadRequest as exc:
            return self._error(400, str(exc), exc.param)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        return web.json_response({**out, "token_strs": None})

    async def models(self, _request: web.Request) -> web.Response:
        card = {
            "id": self.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "kvroute-emulator",
            "root": self.config.model,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def kv_event_sources(self, _request: web.Request) -> web.Response:
        """vLLM's ``GET /kv_event_sources``: ``{rank: KVEventsConfig}`` (``{}`` without), the
        endpoints as ``tcp://*:<port>``, as vLLM reports the endpoints it binds (one with a host
        would be one it connects to), so a reader connects to the engine's own host."""
        feed = self.kv_feed
        answer = {} if feed is None else feed.publisher.kv_event_sources(wildcard=True)
        return web.json_response(answer)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def prometheus(self, _request: web.Request) -> web.Response:
        from prometheus_client import generate_latest

        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")


def emulator_app(config: EmulatorConfig | None = None) -> web.Application:
    """A ready aiohttp application of one emulator (see the module doc)."""
    return Emulator(config or EmulatorConfig()).app()


__all__ = ["EMULATOR", "Emulator", "EmulatorConfig", "emulator_app", "output_plan"]
