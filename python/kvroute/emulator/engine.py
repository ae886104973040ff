"""The engine behind the emulator: a small protocol, and a simple vLLM-like timing model.

:class:`Engine` is what :class:`kvroute.emulator.driver.Driver` needs from an engine model;
the simulator's ``kvroute.EngineModel`` satisfies it through the adapter
:class:`kvroute.emulator.sim_engine.SimEngine` (the emulator's default). Times are engine
seconds (the driver maps them to wall time with the speedup).

:class:`SimpleEngine` is a small pure-Python stand-in (``kvroute engine --engine simple``):
continuous batching in steps. At the start of a step it plans one decode token for every
running request whose prefill is done, then prefill chunks (running requests first, then
waiting ones admitted FIFO while ``max_num_seqs`` and the KV pool allow) up to
``max_num_batched_tokens`` tokens; the step lasts
``step_base_s + prefill_tokens * prefill_s_per_token + decodes * decode_s_per_seq`` and its
events (first tokens, tokens, finishes) happen at its end. A request's prefix-cache hit is
taken at admission from an LRU of block keys (``kv_capacity_blocks``), touched last to first
as vLLM's free-block queue does; like vLLM it recomputes at least the last prompt token, so a
full hit reports ``input_length - 1`` rounded down to vLLM's 16-token block. No preemption.

Cost: O(running requests) per step, O(keys) per admission. Not thread-safe: one driver owns it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

RequestId = int | str
EventKind = Literal["first_token", "tokens", "finish"]
VLLM_BLOCK = 16


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """``first_token`` (``tokens`` = 1, ``cached_tokens`` set), ``tokens`` (more tokens) or
    ``finish`` (the request is done; no token of its own)."""

    kind: EventKind
    request_id: RequestId
    time: float
    tokens: int = 0
    cached_tokens: int = 0


class Engine(Protocol):
    """What the emulator drives in real time."""

    def submit(
        self,
        request_id: RequestId,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        now: float,
    ) -> None: ...

    def next_event_time(self) -> float | None: ...

    def advance(self, now: float) -> list[EngineEvent]: ...

    def cancel(self, request_id: RequestId) -> None: ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no running request holds; the blocks forgotten."""
        ...

    def stats(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class TimingParams:
    """Parameters of :class:`SimpleEngine`."""

    block_size: int = 512
    step_base_s: float = 0.007
    prefill_s_per_token: float = 1.0 / 10_000
    decode_s_per_seq: float = 0.00003
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_capacity_blocks: int = 500


PRESETS: dict[str, TimingParams] = {
    # One H20 with Qwen3-Coder-30B-A3B (TP1): ~10k prefill tokens/s (a 32k prefill takes
    # about 3-5 s with decodes beside it), ~7 ms decode steps, ~250k tokens of KV.
    "h20-qwen3-coder-30b-a3b": TimingParams(),
    # Near-instant engine for tests and proxy benchmarks.
    "fast": TimingParams(step_base_s=0.0005, prefill_s_per_token=1e-7, decode_s_per_seq=1e-6),
}


def preset(name: str, **overrides: Any) -> TimingParams:
    """A preset's parameters with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown engine preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


@dataclass(slots=True)
class _Req:
    rid: RequestId
    keys: Sequence[int]
    input_length: int
    output_length: int
    blocks: int
    prefill_left: int = 0
    generated: int = 0
    cached: int = 0
    done: bool = False


@dataclass
class _Step:
    end: float
    decodes: list[_Req] = field(default_factory=list)
    chunks: list[tuple[_Req, int]] = field(default_factory=list)


class SimpleEngine:
    """The stand-in timing model (see the module doc)."""

    def __init__(self, params: TimingParams | None = None) -> None:
        self.p = params or TimingParams()
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_id: dict[RequestId, _Req] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._used_blocks = 0
        self._step: _Step | None = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    def submit(
        self,
        request_id: RequestId,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        now: float,
    ) -> None:
        if request_id in self._by_id:
            raise ValueError(f"request {request_id!r} is already in the engine")
        n_in = max(int(input_length), 1)
        req = _Req(
            request_id,
            hash_ids,
            n_in,
            max(int(output_length), 1),
            -(-(n_in + int(output_length)) // self.p.block_size),
        )
        self._by_id[request_id] = req
        self._waiting.append(req)
        if self._step is None:
            self._plan(now)

    def next_event_time(self) -> float | None:
        return None if self._step is None else self._step.end

    def advance(self, now: float) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        while self._step is not None and self._step.end <= now:
            step = self._step
            self._complete(step, events)
            self._step = None
            self._plan(step.end)
        return events

    def cancel(self, request_id: RequestId) -> None:
        req = self._by_id.pop(request_id, None)
        if req is None:
            return
        req.done = True
        if req in self._running:
            self._running.remove(req)
            self._used_blocks -= req.blocks
        else:
            self._waiting.remove(req)

    def reset_prefix_cache(self) -> int:
        # The model caches every block in the LRU (running ones too): all are forgotten.
        n = len(self._lru)
        self._lru.clear()
        return n

    def stats(self) -> dict[str, float]:
        cap = self.p.kv_capacity_blocks
        return {
            "running": float(len(self._running)),
            "waiting": float(len(self._waiting)),
            "kv_usage": min(self._used_blocks / cap, 1.0) if cap else 0.0,
            "prefix_queries_tokens": float(self.prefix_queries),
            "prefix_hits_tokens": float(self.prefix_hits),
            "cached_blocks": float(len(self._lru)),
            "num_gpu_blocks": float(cap),
        }

    # -- internals -------------------------------------------------------------------------

    def _admit(self, req: _Req) -> None:
        k = 0
        for key in req.keys:
            if key not in self._lru:
                break
            k += 1
        hit = min(k * self.p.block_size, req.input_length)
        if hit >= req.input_length:  # vLLM recomputes the last prompt token
            hit = (req.input_length - 1) // VLLM_BLOCK * VLLM_BLOCK
        req.cached = hit
        req.prefill_left = req.input_length - hit
        self.prefix_queries += req.input_length
        self.prefix_hits += hit
        lru = self._lru
        for key in reversed(req.keys):
            lru[key] = None
            lru.move_to_end(key, last=False)
        while len(lru) > self.p.kv_capacity_blocks:
            lru.popitem(last=True)
        self._running.append(req)
        self._used_blocks += req.blocks

    def _plan(self, start: float) -> None:
        p = self.p
        decodes = [r for r in self._running if r.prefill_left == 0]
        budget = p.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[_Req, int]] = []
        for r in self._running:
            if budget <= 0:
                break
            if r.prefill_left > 0:
                n = min(budget, r.prefill_left)
                chunks.append((r, n))
                budget -= n
        while budget > 0 and self._waiting and len(self._running) < p.max_num_seqs:
            nxt = self._waiting[0]
            if self._running and self._used_blocks + nxt.blocks > p.kv_capacity_blocks:
                break
            self._admit(self._waiting.popleft())
            n = min(budget, nxt.prefill_left)
            chunks.append((nxt, n))
            budget -= n
        if not decodes and not chunks:
            return
        prefill = sum(n for _, n in chunks)
        end = start + p.step_base_s + prefill * p.prefill_s_per_token
        self._step = _Step(end + len(decodes) * p.decode_s_per_seq, decodes, chunks)

    def _complete(self, step: _Step, events: list[EngineEvent]) -> None:
        t = step.end
        for r in step.decodes:
            if r.done:
                continue
            r.generated += 1
            events.append(EngineEvent("tokens", r.rid, t, tokens=1))
            if r.generated >= r.output_length:
                self._finish(r, t, events)
        for r, n in step.chunks:
            if r.done:
                continue
            r.prefill_left -= n
            if r.prefill_left == 0:
                r.generated = 1
                events.append(EngineEvent("first_token", r.rid, t, 1, r.cached))
                if r.output_length <= 1:
                    self._finish(r, t, events)

    def _finish(self, r: _Req, t: float, events: list[EngineEvent]) -> None:
        r.done = True
        self._running.remove(r)
        self._used_blocks -= r.blocks
        del self._by_id[r.rid]
        events.append(EngineEvent("finish", r.rid, t))
