"""``kvroute calibrate``: measure running OpenAI-compatible engines (real vLLM, or ``kvroute
engine``) on a documented grid and fit the simulator's engine model to them
(:mod:`kvroute.sim.profile`; ``docs/simulator.md`` "Calibration").

Every prompt is made of random token ids drawn for that request alone, so nothing a point
sends was cached before it unless the point caches it on purpose (its ``cached_tokens``
prefix, sent once first); engines that serve ``POST /reset_prefix_cache`` are also reset
before each point. Requests go to ``/v1/completions`` with ``ignore_eos`` and
``return_token_ids`` (so a chunk that carries several tokens counts as several), streamed,
timed on the monotonic clock when each chunk arrives, or with ``clock="engine"`` on the
engine's own clock (``kvroute engine`` stamps its chunks: a measurement that the host's load
cannot move). What a point measures:

* ``prefill``: the first-token time of one request, the median of ``repeats`` tries;
* ``decode``: ``batch`` prompts prefilled once, then sent again together (so only their last
  blocks are computed and they start decoding at once); once all have their first token,
  the time per token of each (its chunks' span over the tokens in it) up to the first
  finish; the median;
* ``mixed``: ``batch`` decoding requests, started as for ``decode``; when each has streamed
  ``MIXED_WARMUP`` tokens, one prefill is sent; the longest gap of each decoder while it is
  prefilled; the median;
* ``arrival``: ``batch`` decoding requests, started as for ``mixed``; then ``ARRIVALS``
  requests of ``new`` tokens after ``cached`` ones (their prefixes sent before), one after
  another with one output token each, each at its own point of a decode step (request k of
  n, ``(k + u) / n`` of a step after a decoder's chunk, u uniform in [0, 1)); for each,
  what the decoders' gaps from its sending to just after its answer took beyond their
  neighbouring gaps (the median over the decoders); the median. It sees what a request
  costs the running ones wherever its handling takes the engine's time, which a lone
  prefill cannot tell from the request's own latency. The same requests make a ``busy``
  point: their mean first-token time (spread over the step in progress, they wait half of
  it on average) and, per request, the starts of the step that made its first token and of
  the step before, read off the decoders' chunks: when a request that arrives while the
  engine is stepping can start.

A decode, mixed or arrival point whose decoders did not stream long enough together (a fast
engine, or requests that reached it far apart) is tried again with as many more tokens per
decoder as the try showed it needs (:data:`GROWTHS` times at most, while the context and the
KV pool allow); a point that still fails, or fails otherwise :data:`POINT_TRIES` times, is
skipped and listed, and an engine that fails :data:`MAX_FAILED_IN_ROW` points in a row is
given up. The grid's points are spread over the engines (each engine runs one point at a
time; the fit assumes the engines are alike). A held-out grid is measured in the same pass,
its points interleaved with the fitted grid's, so that the machine's drift during a run
reaches both.
The profile lists warnings where its errors say it cannot be trusted (:func:`warnings_of`).
O(grid tokens) of prompts; one asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import aiohttp
import numpy as np

from kvroute.emulator.responses import ENGINE_ARRIVED_HEADER, ENGINE_CLOCK_HEADER
from kvroute.errors import InvalidArgumentError, KvrouteError
from kvroute.proxy.caches import kv_capacity
from kvroute.replay import FIRST_ID, KEEPALIVE_S, sse_payloads
from kvroute.sim.profile import KINDS, Point, make_profile

#: Tokens each decoder streams before a mixed point's prefill is sent.
MIXED_WARMUP = 8
#: Requests of a grid point fail when an answer takes longer than this.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300.0, sock_connect=5.0)
#: The headers of a request whose body is JSON encoded beforehand.
JSON_HEADERS = {"Content-Type": "application/json"}
#: Seconds of quiet before each measured prefill, so that the request before it (the
#: cached prefix, or the previous repeat) does not run into its clock (its blocks cached,
#: its last output sent), and every prefill point starts from the same idle engine and
#: client: with the quiet before the cached points only, a request after it took 0.05-0.1
#: ms longer from client to handler on the emulator, which the fit counted as admission
#: cost (3-6% of it).
SETTLE_S = 0.02
#: A decoder's time per token is read from at least this many tokens, in at least
#: ``MIN_WINDOW_CHUNKS`` chunks, streamed while the whole batch decodes.
MIN_WINDOW_TOKENS = 8
MIN_WINDOW_CHUNKS = 3
#: Requests an arrival point sends, one after another, beside one decoding batch; seconds
#: after each answer before the next is sent (so that the engine is done with it); seconds
#: after an answer that its cost is still looked for in the decoders' gaps.
ARRIVALS = 6
ARRIVAL_PAUSE_S = 0.05
ARRIVAL_TAIL_S = 0.01
#: The least time ahead an arrival is aimed at a point of a step (it comes whole steps later
#: than one already too close).
ARRIVAL_MARGIN_S = 0.001
#: Gaps on each side of an arrival's that give the decoders' usual gap beside it.
EXCESS_BASE_GAPS = 4
#: How many times a decode or mixed point may be tried again with more tokens per decoder.
GROWTHS = 4
#: How many times a point that fails otherwise (an error answer, a lost connection) is tried.
POINT_TRIES = 3
#: Seconds between two tries of a failed point.
RETRY_PAUSE_S = 1.0
#: An engine whose points fail this many times in a row is given up.
MAX_FAILED_IN_ROW = 3
#: A profile whose error on a kind's points (fitted or held out) has a median above this
#: warns that it cannot be trusted for that kind of step.
TRUST_P50 = 0.25

Clock = Literal["wall", "engine"]
_T = TypeVar("_T")


class CalibrationError(KvrouteError, RuntimeError):
    """An engine cannot be calibrated: it does not answer, or lacks what the fit needs."""


class PointError(CalibrationError):
    """One point could not be measured as it is (``tokens_needed``: how many tokens per
    decoder the try suggests would do, or None)."""

    def __init__(self, message: str, tokens_needed: int | None = None) -> None:
        super().__init__(message)
        self.tokens_needed = tokens_needed


@dataclass(frozen=True)
class Grid:
    """The points measured (``docs/simulator.md`` lists the named grids)."""

    #: Prompt lengths of cold prefills.
    prefill: tuple[int, ...]
    #: (cached tokens, new tokens) of warm prefills.
    cached: tuple[tuple[int, int], ...]
    #: Batch sizes x contexts of the decode points.
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    #: (batch, context, prefill tokens) of the mixed points.
    mixed: tuple[tuple[int, int, int], ...]
    #: (batch, context, new tokens, cached tokens) of the arrival points.
    arrivals: tuple[tuple[int, int, int, int], ...] = ()
    decode_tokens: int = 32
    repeats: int = 3

    def points(self) -> list[Point]:
        """The grid's points, unmeasured (seconds 0)."""
        out = [Point("prefill", 0.0, prefill_tokens=n) for n in self.prefill]
        out += [Point("prefill", 0.0, prefill_tokens=n, cached_tokens=c) for c, n in self.cached]
        out += [
            Point("decode", 0.0, batch=b, context=float(c))
            for b in self.batches
            for c in self.contexts
        ]
        out += [
            Point("mixed", 0.0, prefill_tokens=n, batch=b, context=float(c))
            for b, c, n in self.mixed
        ]
        out += [
            Point("arrival", 0.0, prefill_tokens=n, cached_tokens=k, batch=b, context=float(c))
            for b, c, n, k in self.arrivals
        ]
        return out


GRIDS: dict[str, Grid] = {
    "standard": Grid(
        prefill=(64, 256, 512, 1024, 1536, 2048, 3072, 4096),
        cached=(
            (1024, 512),
            (2048, 512),
            (2048, 1024),
            (3072, 1024),
            (1024, 32),
            (2048, 32),
            (3072, 32),
            (4096, 32),
            (6144, 32),
            (4096, 256),
        ),
        batches=(1, 4, 16, 32),
        contexts=(64, 1024, 2048),
        mixed=((4, 512, 512), (4, 1024, 1536), (16, 512, 1024), (16, 1024, 512)),
        arrivals=((4, 512, 64, 0), (16, 1024, 64, 0), (8, 512, 64, 2048), (8, 512, 16, 4096)),
    ),
    "short": Grid(
        prefill=(128, 512, 1024, 2048, 3072),
        cached=((1024, 512), (2048, 1024), (1024, 32), (4096, 32)),
        batches=(1, 8, 24),
        contexts=(128, 1536),
        mixed=((8, 512, 1024),),
        arrivals=((8, 512, 64, 0), (8, 512, 64, 2048), (8, 512, 16, 4096)),
        decode_tokens=24,
        repeats=2,
    ),
    # Sizes none of the others measures, to check a profile on points it was not fitted to.
    "held-out": Grid(
        prefill=(384, 1280, 2560),
        cached=((1536, 768), (3072, 128)),
        batches=(2, 12),
        contexts=(512, 1792),
        mixed=((6, 768, 768),),
        arrivals=((6, 768, 128, 1024),),
        decode_tokens=24,
        repeats=2,
    ),
}


@dataclass
class EngineInfo:
    """What an engine says about itself before the grid runs."""

    url: str
    model: str
    max_model_len: int | None
    kv_block_size: int | None = None
    num_gpu_blocks: int | None = None
    resets: bool = False


@dataclass
class _Stream:
    """One streamed request: when it was sent, when each chunk with tokens came and how many
    tokens it carried, the cached tokens its usage reported, and when each chunk reached the
    client (its clock, whatever clock ``chunks`` are on)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    received: list[float] = field(default_factory=list)

    def window(self, start: float, end: float) -> tuple[float, int] | None:
        """The seconds per token of this stream's chunks within ``[start, end]``, and the
        tokens that reading spans; None with fewer than ``MIN_WINDOW_CHUNKS`` chunks there."""
        inside = [i for i, t in enumerate(self.chunks) if start <= t <= end]
        if len(inside) < MIN_WINDOW_CHUNKS:
            return None
        tokens = sum(self.tokens[i] for i in inside[1:])
        return (self.chunks[inside[-1]] - self.chunks[inside[0]]) / tokens, tokens

    def excess(self, start: float, end: float) -> float:
        """How much longer than this stream's usual gap between chunks its gaps that overlap
        ``[start, end]`` took, together (seconds). The usual gap is the median of the
        ``EXCESS_BASE_GAPS`` gaps before and after them (their neighbours, not the whole
        stream's, whose steps grow as the contexts do)."""
        gaps = [(a, b - a) for a, b in zip(self.chunks, self.chunks[1:], strict=False)]
        inside = [i for i, (a, g) in enumerate(gaps) if a < end and a + g > start]
        if not inside:
            return 0.0
        lo, hi = inside[0], inside[-1] + 1
        around = gaps[max(0, lo - EXCESS_BASE_GAPS) : lo] + gaps[hi : hi + EXCESS_BASE_GAPS]
        base = statistics.median(g for _, g in around or gaps)
        return sum(gaps[i][1] - base for i in inside)


class _Client:
    """Requests of one calibration run to one engine."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        info: EngineInfo,
        vocab: int,
        seed: int,
        clock: Clock = "wall",
    ):
        self.http, self.info = http, info
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.clock = clock
        self.headers = dict(JSON_HEADERS)
        if clock == "engine":
            self.headers[ENGINE_CLOCK_HEADER] = "1"

    def prompt(self, n: int) -> list[int]:
        """``n`` token ids no other request gets (with overwhelming probability)."""
        return [int(t) for t in self.rng.integers(FIRST_ID, self.vocab, n)]

    async def stream(
        self, prompt: list[int], max_tokens: int, out: _Stream | None = None
    ) -> _Stream:
        body = {
            "model": self.info.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        data = json.dumps(body).encode()  # before the clock starts: not the engine's time
        s = out or _Stream(time.perf_counter())
        url = self.info.url + "/v1/completions"
        engine_clock = self.clock == "engine"
        try:
            async with self.http.post(url, data=data, headers=self.headers) as resp:
                if resp.status != 200:
                    text = (await resp.text()).strip()[:300]
                    raise CalibrationError(f"{url} answered {resp.status}: {text}")
                if engine_clock:
                    s.sent = _engine_arrival(resp.headers.get(ENGINE_ARRIVED_HEADER), url)
                async for payload in sse_payloads(resp):
                    obj = _json(payload, url)
                    if obj.get("choices"):
                        wall = time.perf_counter()
                        now = _engine_time(obj, url) if engine_clock else wall
                        n = _chunk_tokens(obj["choices"][0])
                        if n:
                            s.chunks.append(now)
                            s.tokens.append(n)
                            s.received.append(wall)
                    usage = obj.get("usage")
                    if usage:
                        details = usage.get("prompt_tokens_details")
                        if not isinstance(details, dict) or details.get("cached_tokens") is None:
                            raise CalibrationError(
                                f"{url}: the usage has no prompt_tokens_details.cached_tokens, "
                                "which the fit needs (start vLLM with "
                                "--enable-prompt-tokens-details)"
                            )
                        s.cached = int(details["cached_tokens"])
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise CalibrationError(f"{url}: {type(exc).__name__}: {exc}") from exc
        if not s.chunks:
            raise CalibrationError(f"{url}: the stream ended without a token")
        return s

    async def reset(self) -> None:
        if self.info.resets:
            async with self.http.post(self.info.url + "/reset_prefix_cache") as resp:
                await resp.read()

    async def prefill(self, new: int, cached: int) -> tuple[float, int]:
        """First-token seconds of ``cached + new`` tokens, ``cached`` sent before; the
        cached tokens the engine reports."""
        prompt = self.prompt(cached + new)
        if cached:
            await self.stream(prompt[:cached], 1)
        await asyncio.sleep(SETTLE_S)
        s = await self.stream(prompt, 1)
        return s.chunks[0] - s.sent, s.cached

    async def cached_prompts(self, batch: int, context: int) -> list[list[int]]:
        """``batch`` prompts of ``context`` tokens, prefilled once first, so that a batch of
        them starts decoding together (only each prompt's last block is computed again)."""
        prompts = [self.prompt(context) for _ in range(batch)]
        await _all(self.stream(p, 1) for p in prompts)
        return prompts

    async def decode(self, batch: int, context: int, tokens: int) -> float:
        prompts = await self.cached_prompts(batch, context)
        streams = await _all(self.stream(p, tokens) for p in prompts)
        start = max(s.chunks[0] for s in streams)
        end = min(s.chunks[-1] for s in streams)
        windows = [w for s in streams if (w := s.window(start, end)) is not None]
        per_token = [t for t, n in windows if n >= MIN_WINDOW_TOKENS]
        if len(per_token) * 2 < batch:  # the median must be one of the batch's readings
            common = min((n for _, n in windows), default=0)
            raise PointError(
                f"{self.info.url}: decode point batch {batch}: the requests did not decode "
                f"together long enough ({common} of {tokens} tokens in common, "
                f"{MIN_WINDOW_TOKENS} needed)",
                _tokens_needed(streams),
            )
        return statistics.median(per_token)

    async def beside_batch(
        self,
        batch: int,
        context: int,
        tokens: int,
        requests: Sequence[list[int]],
        spread: bool = False,
    ) -> tuple[list[_Stream], list[_Stream]]:
        """``batch`` decoders of ``context`` tokens and ``tokens`` each, started as for
        ``decode``; when each has streamed ``MIXED_WARMUP`` tokens, ``requests`` are sent one
        after another (one output token each, ``ARRIVAL_PAUSE_S`` after each answer; with
        ``spread``, request k of n then waits for a decoder's chunk and ``(k + u) / n`` of its
        step, u uniform in [0, 1), so the requests arrive spread over the step in progress).
        The decoders' streams and the requests'."""
        prompts = await self.cached_prompts(batch, context)
        now = time.perf_counter()
        decoders = [_Stream(now) for _ in range(batch)]
        tasks = [
            asyncio.ensure_future(self.stream(p, tokens, s))
            for p, s in zip(prompts, decoders, strict=True)
        ]
        answers = []
        try:
            while any(len(s.chunks) < MIXED_WARMUP for s in decoders):
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.0005)
            for k, prompt in enumerate(requests):
                if spread:
                    phase = (k + self.rng.random()) / len(requests)
                    await _into_step(decoders[0], tasks[0], phase)
                answers.append(await self.stream(prompt, 1))
                await asyncio.sleep(ARRIVAL_PAUSE_S)
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return decoders, answers

    async def mixed(self, batch: int, context: int, prefill: int, tokens: int) -> float:
        decoders, (p,) = await self.beside_batch(batch, context, tokens, [self.prompt(prefill)])
        gaps = []
        for s in decoders:
            during = [
                b - a
                for a, b in zip(s.chunks, s.chunks[1:], strict=False)
                if b > p.sent and a < p.chunks[0]
            ]
            if during:
                gaps.append(max(during))
        if not gaps:
            raise PointError(
                f"{self.info.url}: mixed point batch {batch}: the decoders ended before the "
                f"prefill ran ({tokens} tokens each)",
                _tokens_needed(decoders, p.chunks[0] - p.sent),
            )
        return statistics.median(gaps)

    async def arrival(
        self, batch: int, context: int, new: int, cached: int, tokens: int
    ) -> tuple[float, list[float], list[tuple[float, float]], list[int]]:
        """``ARRIVALS`` requests of ``cached + new`` tokens (``cached`` sent before) beside a
        decoding batch: for each, the median over the decoders of their gaps' excess
        (:meth:`_Stream.excess`) from its sending until ``ARRIVAL_TAIL_S`` after its answer;
        the median of those, the requests' own first-token times, their joins
        (:func:`_join`) and the cached tokens the engine reported for each."""
        prompts = [self.prompt(cached + new) for _ in range(ARRIVALS)]
        if cached:
            await _all(self.stream(p[:cached], 1) for p in prompts)
        decoders, answers = await self.beside_batch(batch, context, tokens, prompts, spread=True)
        last = answers[-1].chunks[-1] + ARRIVAL_TAIL_S
        if any(s.chunks[-1] < last for s in decoders):
            raise PointError(
                f"{self.info.url}: arrival point batch {batch}: the decoders ended before the "
                f"last arrival was answered ({tokens} tokens each)",
                _tokens_needed(decoders, last - answers[0].sent),
            )
        excess = statistics.median(
            statistics.median(s.excess(a.sent, a.chunks[-1] + ARRIVAL_TAIL_S) for s in decoders)
            for a in answers
        )
        joins = [j for a in answers if (j := _join(decoders[0], a)) is not None]
        return excess, [a.chunks[0] - a.sent for a in answers], joins, [a.cached for a in answers]


def _join(decoder: _Stream, request: _Stream) -> tuple[float, float] | None:
    """Seconds from ``request``'s sending to the decoder's chunk that came a step before its
    first token (the start of the step that made it), and to the chunk before that; None
    when the decoder has no such chunks."""
    gaps = [b - a for a, b in zip(decoder.chunks, decoder.chunks[1:], strict=False)]
    if not gaps:
        return None
    first = request.chunks[0]
    half = statistics.median(gaps) / 2
    before = [t for t in decoder.chunks if t <= first - half]
    if len(before) < 2:
        return None
    return before[-1] - request.sent, before[-2] - request.sent


async def _into_step(decoder: _Stream, task: asyncio.Future[Any], fraction: float) -> None:
    """Wait until ``fraction`` of a step after one of ``decoder``'s chunks reached the
    client, a step being the span of its next two chunks, and whole steps later where that
    time has passed; at once when the decoder has ended."""
    seen = len(decoder.received)
    while len(decoder.received) < seen + 2 and not task.done():
        await asyncio.sleep(0.0002)
    if len(decoder.received) < seen + 2:
        return
    last, step = decoder.received[-1], decoder.received[-1] - decoder.received[-2]
    wait = last + fraction * step - time.perf_counter()
    if step > 0 and wait < ARRIVAL_MARGIN_S:
        wait += math.ceil((ARRIVAL_MARGIN_S - wait) / step) * step
    await asyncio.sleep(max(wait, 0.0))


async def _all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Every coroutine's result; when one fails, the others are cancelled (a failed try
    leaves no request running into the next)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def _tokens_needed(streams: Sequence[_Stream], extra_s: float = 0.0) -> int | None:
    """Tokens per decoder that would make ``streams`` decode together for
    ``MIN_WINDOW_TOKENS`` tokens and ``extra_s`` seconds more, with a margin: from the spread
    of their first tokens and their time per token; None when they show no rate."""
    rates = [
        (s.chunks[-1] - s.chunks[0]) / sum(s.tokens[1:])
        for s in streams
        if len(s.chunks) >= 2 and s.chunks[-1] > s.chunks[0]
    ]
    if not rates:
        return None
    rate = statistics.median(rates)
    spread = max(s.chunks[0] for s in streams) - min(s.chunks[0] for s in streams)
    return math.ceil(1.5 * ((spread + extra_s) / rate + MIN_WINDOW_TOKENS + MIXED_WARMUP))


def _chunk_tokens(choice: Any) -> int:
    """The tokens a stream chunk's choice carries: its ``token_ids`` when the engine sends
    them, else 1 for a chunk with text (an engine that sends one chunk per step)."""
    if not isinstance(choice, dict):
        return 0
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    text = choice.get("text", (choice.get("delta") or {}).get("content"))
    return 1 if text else 0


def _engine_arrival(value: str | None, url: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CalibrationError(
            f"{url} does not report its engine clock ({ENGINE_ARRIVED_HEADER} is "
            f"{value!r}): the engine clock is the emulator's, `kvroute engine`"
        ) from None


def _engine_time(obj: dict[str, Any], url: str) -> float:
    t = obj.get("engine_time")
    if not isinstance(t, int | float) or isinstance(t, bool):
        raise CalibrationError(f"{url}: a stream chunk has no engine_time (got {t!r})")
    return float(t)


def _json(payload: bytes, url: str) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except ValueError as exc:
        raise CalibrationError(f"{url}: a stream chunk is not JSON: {payload[:100]!r}") from exc
    if not isinstance(obj, dict):
        raise CalibrationError(f"{url}: a stream chunk is not an object: {payload[:100]!r}")
    if obj.get("error"):
        raise CalibrationError(f"{url}: stream error: {obj['error']}")
    return obj


async def probe(http: aiohttp.ClientSession, url: str, model: str | None) -> EngineInfo:
    """The engine's model, context limit, KV blocks and whether it resets its cache."""
    try:
        async with http.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                raise CalibrationError(f"{url}/v1/models answered {r.status}")
            cards = (await r.json()).get("data") or []
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            metrics = await r.text() if r.status == 200 else ""
        async with http.post(url + "/reset_prefix_cache") as r:
            resets = r.status < 300
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise CalibrationError(f"{url} does not answer: {type(exc).__name__}: {exc}") from exc
    card = next((c for c in cards if model is None or c.get("id") == model), None)
    if card is None:
        served = ", ".join(str(c.get("id")) for c in cards) or "none"
        raise CalibrationError(f"{url} does not serve model {model!r} (it serves {served})")
    info = EngineInfo(url, str(card["id"]), card.get("max_model_len"), resets=resets)
    found = kv_capacity(metrics)
    if found is not None:
        info.num_gpu_blocks, info.kv_block_size = found
    return info


def feasible(
    point: Point, info: EngineInfo, grid: Grid, max_num_seqs: int, tokens: int | None = None
) -> str | None:
    """Why ``point`` cannot run on the engine (context, KV pool, batch) with ``tokens`` per
    decoder (default: a first try's, :func:`first_tokens`), or None."""
    out = (tokens or first_tokens(point, grid)) + MIXED_WARMUP
    longest = max(point.prefill_tokens + point.cached_tokens, int(point.context)) + out
    if info.max_model_len and longest > info.max_model_len:
        return f"{longest} tokens exceed max_model_len {info.max_model_len}"
    # An arrival point's requests each have a prefix of their own, cached before they go.
    prompts = ARRIVALS if point.kind == "arrival" else 1
    held = point.batch * (point.context + out) + prompts * (
        point.prefill_tokens + point.cached_tokens
    )
    if info.num_gpu_blocks and info.kv_block_size:
        capacity = info.num_gpu_blocks * info.kv_block_size
        if held > 0.8 * capacity:
            return f"{held:.0f} tokens held exceed 80% of the KV pool ({capacity} tokens)"
    if point.batch + 1 > max_num_seqs:
        return f"batch {point.batch} exceeds max_num_seqs {max_num_seqs}"
    return None


def first_tokens(point: Point, grid: Grid) -> int:
    """Tokens per decoder of a decode, mixed or arrival point's first try: the grid's, times
    ``ARRIVALS`` for an arrival point (its decoders wait for each request in turn)."""
    return grid.decode_tokens * (ARRIVALS if point.kind == "arrival" else 1)


def _as_reported(point: Point, cached: Sequence[int]) -> Point:
    """``point`` with the cached tokens the engine reported for its requests (the median),
    not those it meant: a prefix evicted before its request came counts as new tokens."""
    hit = int(statistics.median(cached))
    return replace(
        point, prefill_tokens=point.prefill_tokens + point.cached_tokens - hit, cached_tokens=hit
    )


async def _decoding(
    c: _Client, point: Point, repeats: int, tokens: int
) -> tuple[list[float], Point, Point | None]:
    """``repeats`` tries of a decode, mixed or arrival point with ``tokens`` per decoder:
    each try's reading; the point as measured (an arrival point's cached tokens those the
    engine reported, as a prefill point's); and an arrival point's busy point (its requests'
    mean first-token time and their joins; the other fields as the arrival point's)."""
    batch, context = point.batch, int(point.context)
    if point.kind == "decode":
        return [await c.decode(batch, context, tokens) for _ in range(repeats)], point, None
    new, cached, out = point.prefill_tokens, point.cached_tokens, tokens + MIXED_WARMUP
    if point.kind == "arrival":
        tries = [await c.arrival(batch, context, new, cached, out) for _ in range(repeats)]
        firsts = [f for _, fs, _, _ in tries for f in fs]
        point = _as_reported(point, [k for _, _, _, ks in tries for k in ks])
        busy = replace(
            point,
            kind="busy",
            seconds=statistics.fmean(firsts),
            samples=len(firsts),
            joins=tuple(j for _, _, js, _ in tries for j in js),
        )
        return [t for t, _, _, _ in tries], point, busy
    return [await c.mixed(batch, context, new, out) for _ in range(repeats)], point, None


async def _measure_one(c: _Client, point: Point, grid: Grid, max_num_seqs: int) -> list[Point]:
    """Measure ``point`` (an arrival point gives its busy point too); a decode, mixed or
    arrival point that its decoders did not stream long enough for is tried again with more
    tokens each (see the module doc)."""
    await c.reset()
    if point.kind == "prefill":
        warm = [
            await c.prefill(point.prefill_tokens, point.cached_tokens) for _ in range(grid.repeats)
        ]
        seconds = statistics.median(t for t, _ in warm)
        measured = _as_reported(point, [k for _, k in warm])
        return [replace(measured, seconds=seconds, samples=len(warm))]
    tokens = first_tokens(point, grid)
    for growth in range(GROWTHS + 1):
        try:
            tries, measured, busy = await _decoding(c, point, grid.repeats, tokens)
            break
        except PointError as exc:
            more = max(2 * tokens, exc.tokens_needed or 0)
            why = feasible(point, c.info, grid, max_num_seqs, more)
            if why is not None or growth == GROWTHS:
                said = f"{more} tokens each would not fit: {why}" if why else "tried"
                raise PointError(
                    f"{exc}; {said} after {growth + 1} tries up to {tokens} tokens per "
                    "decoder (--decode-tokens sets the first try's)"
                ) from None
            tokens = more
            await c.reset()
    # The decoders read their prompt and, on average, half of what they generate.
    context = point.context + tokens / 2
    out = [replace(measured, seconds=statistics.median(tries), context=context, samples=len(tries))]
    if busy is not None:
        out.append(replace(busy, context=context))
    return out


async def _measure_point(c: _Client, point: Point, grid: Grid, max_num_seqs: int) -> list[Point]:
    """:func:`_measure_one`, tried up to ``POINT_TRIES`` times when it fails otherwise than
    by the point itself (an error answer, a lost connection)."""
    for attempt in range(1, POINT_TRIES + 1):
        try:
            return await _measure_one(c, point, grid, max_num_seqs)
        except PointError:
            raise
        except CalibrationError as exc:
            if attempt == POINT_TRIES:
                raise CalibrationError(f"{exc} ({POINT_TRIES} tries)") from exc
            await asyncio.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def label(point: Point) -> str:
    """A grid point in words, as the skipped list names it."""
    cached = f" after {point.cached_tokens} cached" if point.cached_tokens else ""
    if point.kind == "prefill":
        return f"prefill of {point.prefill_tokens} tokens{cached}"
    at = f"batch {point.batch} at context {point.context:.0f}"
    if point.kind == "decode":
        return f"decode {at}"
    if point.kind == "mixed":
        return f"mixed {at} + prefill of {point.prefill_tokens}"
    return f"arrival beside {at}: {point.prefill_tokens} tokens{cached}"


def _interleave(lists: Sequence[Sequence[Point]]) -> list[tuple[int, int, Point]]:
    """The points of every list as (list, index, point), each list spread evenly over the
    whole order, so slow drift of the machine reaches every list alike."""
    tagged = [(j / len(ps), k, j, p) for k, ps in enumerate(lists) for j, p in enumerate(ps)]
    return [(k, j, p) for _, k, j, p in sorted(tagged, key=lambda t: t[:3])]


async def measure_grids(
    urls: Sequence[str],
    grids: Sequence[Grid],
    *,
    model: str | None = None,
    max_num_seqs: int = 128,
    vocab_size: int = 32000,
    seed: int = 0,
    clock: Clock = "wall",
    progress: Callable[[int, int, int], None] | None = None,
) -> tuple[list[list[Point]], list[EngineInfo], list[str]]:
    """Measure the points of all ``grids`` in one pass, interleaved: per grid its points (in
    grid order), what each engine said, and the points skipped with why (those that could
    not run, those that failed, and engines given up). ``clock``: ``"wall"`` (the client's)
    or ``"engine"`` (the emulator's stamps). ``progress(grid, done, total)`` is called per
    grid before the first point and after each of its points, measured or skipped."""
    if clock not in ("wall", "engine"):
        raise CalibrationError(f"clock must be 'wall' or 'engine', got {clock!r}")
    conn = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT, connector=conn) as http:
        infos = [await probe(http, u.rstrip("/"), model) for u in urls]
        clients = [_Client(http, info, vocab_size, seed + i, clock) for i, info in enumerate(infos)]
        # One warm-up request of each prefill size (first shapes cost extra on some backends)
        # that also checks the usage reports cached tokens.
        for c in clients:
            for n in sorted({16, *(n for g in grids for n in g.prefill)}):
                point = Point("prefill", 0.0, prefill_tokens=n)
                if any(feasible(point, c.info, g, max_num_seqs) is None for g in grids):
                    await c.stream(c.prompt(n), 2)
        todo: list[list[Point]] = []
        skipped: list[str] = []
        for g in grids:
            todo.append([])
            for p in g.points():
                why = next(
                    filter(None, (feasible(p, c.info, g, max_num_seqs) for c in clients)), None
                )
                if why:
                    skipped.append(f"{label(p)}: {why}")
                else:
                    todo[-1].append(p)
        queue: asyncio.Queue[tuple[int, int, Point]] = asyncio.Queue()
        for item in _interleave(todo):
            queue.put_nowait(item)
        done: list[dict[int, list[Point]]] = [{} for _ in grids]
        finished = [0 for _ in grids]
        if progress is not None:
            for k, ps in enumerate(todo):
                progress(k, 0, len(ps))
        given_up: list[str] = []

        async def work(c: _Client) -> None:
            in_row = 0
            while not queue.empty():
                k, j, p = queue.get_nowait()
                try:
                    done[k][j] = await _measure_point(c, p, grids[k], max_num_seqs)
                    in_row = 0
                except CalibrationError as exc:
                    skipped.append(f"{label(p)}: {exc}")
                    in_row += 1
                finished[k] += 1
                if progress is not None:
                    progress(k, finished[k], len(todo[k]))
                if in_row >= MAX_FAILED_IN_ROW:
                    given_up.append(f"{c.info.url}: given up after {in_row} failed points in a row")
                    return

        await asyncio.gather(*(work(c) for c in clients))
    if len(given_up) == len(clients):
        last = skipped[-1] if skipped else ""
        raise CalibrationError(f"every engine was given up ({'; '.join(given_up)}); last: {last}")
    return [[p for j in sorted(d) for p in d[j]] for d in done], infos, skipped + given_up


async def measure(
    urls: Sequence[str],
    grid: Grid,
    *,
    model: str | None = None,
    max_num_seqs: int = 128,
    vocab_size: int = 32000,
    seed: int = 0,
    clock: Clock = "wall",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Point], list[EngineInfo], list[str]]:
    """Measure one ``grid`` on the engines (:func:`measure_grids`); ``progress(done,
    total)``."""
    per_grid = None if progress is None else (lambda _k, done, total: progress(done, total))
    (points,), infos, skipped = await measure_grids(
        urls,
        [grid],
        model=model,
        max_num_seqs=max_num_seqs,
        vocab_size=vocab_size,
        seed=seed,
        clock=clock,
        progress=per_grid,
    )
    return points, infos, skipped


def _grid(grid: str | Grid) -> Grid:
    if isinstance(grid, Grid):
        return grid
    if grid not in GRIDS:
        raise CalibrationError(f"unknown grid {grid!r}; the grids are {', '.join(GRIDS)}")
    return GRIDS[grid]


def warnings_of(doc: dict[str, Any], grids: Sequence[Grid]) -> list[str]:
    """What a profile document's own numbers say it cannot be trusted for: a kind of step
    whose fitted or held-out points it predicts more than ``TRUST_P50`` off at the median,
    and a kind the grids have that no point of was measured."""
    out = []
    fitted = doc["fit"]["error"]
    for kind in KINDS:
        if kind not in fitted and any(p.kind == kind for p in grids[0].points()):
            out.append(f"no {kind} point was measured: the profile's {kind} terms are not fitted")
    for part, label in (("fit", "fitted"), ("held_out", "held-out")):
        errors = doc.get(part, {}).get("error", {})
        for kind in KINDS:
            e = errors.get(kind)
            if e is not None and e["p50"] > TRUST_P50:
                out.append(
                    f"the profile is not to be trusted for {kind} steps: it predicts its "
                    f"{e['points']} "
                    f"{label} {kind} points {e['p50']:.0%} off at the median (max "
                    f"{e['max']:.0%})"
                )
    return out


def calibrate(
    urls: Sequence[str],
    *,
    grid: str | Grid = "standard",
    held_out: str | Grid | None = None,
    model: str | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    vocab_size: int = 32000,
    seed: int = 0,
    decode_tokens: int | None = None,
    clock: Clock = "wall",
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Measure ``grid`` (and ``held_out``, not fitted, its points interleaved with the
    fit's so that drift of the machine reaches both alike) on the engines and return the
    profile document (:func:`kvroute.sim.profile.make_profile`, with ``warnings``:
    :func:`warnings_of`). ``max_num_batched_tokens`` and ``max_num_seqs`` are the engines'
    scheduler settings (vLLM's CPU defaults here); ``decode_tokens`` replaces the grids'
    tokens per decoder of a first try; ``clock`` as in :func:`measure_grids`.
    ``progress(stage, done, total)`` follows the points of each stage, ``"fit"`` and
    ``"held-out"``."""
    if not urls:
        raise CalibrationError("calibrate needs at least one engine URL")
    grids = [_grid(grid)] + ([] if held_out is None else [_grid(held_out)])
    if decode_tokens is not None:
        if decode_tokens < 1:
            raise CalibrationError(f"decode_tokens must be >= 1, got {decode_tokens}")
        grids = [replace(g, decode_tokens=decode_tokens) for g in grids]
    stages = ("fit", "held-out")
    (points, *rest), infos, skipped = asyncio.run(
        measure_grids(
            urls,
            grids,
            model=model,
            max_num_seqs=max_num_seqs,
            vocab_size=vocab_size,
            seed=seed,
            clock=clock,
            progress=None if progress is None else lambda k, d, t: progress(stages[k], d, t),
        )
    )
    held: list[Point] = rest[0] if rest else []
    scheduler: dict[str, int] = {
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
    }
    first = infos[0]
    if first.kv_block_size and first.num_gpu_blocks:
        scheduler["kv_block_size"] = first.kv_block_size
        scheduler["kv_capacity_tokens"] = first.kv_block_size * first.num_gpu_blocks
    engine = {
        "urls": [i.url for i in infos],
        "model": first.model,
        "max_model_len": first.max_model_len,
        "num_gpu_blocks": first.num_gpu_blocks,
        "grid": grid if isinstance(grid, str) else "custom",
        "clock": clock,
        "skipped": skipped,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        doc = make_profile(points, engine=engine, scheduler=scheduler, held_out=held)
    except InvalidArgumentError as exc:
        raise CalibrationError(
            f"cannot fit the profile: {exc} ({len(skipped)} skipped: {'; '.join(skipped)})"
        ) from exc
    doc["warnings"] = warnings_of(doc, grids)
    return doc


__all__ = [
    "GRIDS",
    "CalibrationError",
    "EngineInfo",
    "Grid",
    "PointError",
    "calibrate",
    "feasible",
    "label",
    "measure",
    "measure_grids",
    "probe",
    "warnings_of",
]
