"""The simulator's vLLM engine model (``kvroute.EngineModel``, ``docs/simulator.md``) behind
the emulator's :class:`~kvroute.emulator.engine.Engine` protocol.

The model reports cumulative token counts (``("tokens", id, t, generated)``); this adapter
turns them into increments and its tuples into :class:`EngineEvent`. Presets are the
simulator's (``kvroute.engine_presets()``) plus ``fast``: the H20 preset with near-zero step
costs, for tests and proxy benchmarks.

O(events) per call on top of the model's own cost; not thread-safe (one driver owns it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import kvroute
from kvroute._core import engine_presets
from kvroute.emulator.engine import EngineEvent, RequestId

DEFAULT_PRESET = "h20-qwen3-coder-30b-a3b"
FAST: dict[str, float] = {
    "step_overhead_s": 0.0005,
    "prefill_s_per_token": 1e-7,
    "decode_s_per_seq": 1e-6,
    "decode_s_per_ctx_token": 0.0,
}


def presets() -> list[str]:
    """Presets the simulator's engine model takes, and ``fast``."""
    return [*engine_presets(), "fast"]


class SimEngine:
    """``kvroute.EngineModel`` as an emulator engine."""

    def __init__(self, preset: str = DEFAULT_PRESET, **overrides: Any) -> None:
        name, base = (DEFAULT_PRESET, FAST) if preset == "fast" else (preset, {})
        params = {k: float(v) for k, v in {**base, **overrides}.items()}
        self.model = kvroute.EngineModel(name, **params)
        self.block_size = int(self.model.params["block_size"])
        self.kv_block_size = float(self.model.params["kv_block_size"])
        #: What the client sees comes this long after the model makes it (the profile's
        #: ``request_overhead_s``; the server holds each event back until then).
        self.request_overhead_s = float(self.model.params["request_overhead_s"])
        self._generated: dict[RequestId, int] = {}
        self._kv_sink: Callable[[list[tuple[str, int | None]]], None] | None = None

    def publish_kv_events(self, sink: Callable[[list[tuple[str, int | None]]], None]) -> None:
        """Hand the KV pool's changes (``EngineModel.take_kv_events``) to ``sink`` after each
        advance and reset that made some."""
        self.model.record_kv_events(True)
        self._kv_sink = sink

    def _drain_kv_events(self) -> None:
        if self._kv_sink is not None and (changes := self.model.take_kv_events()):
            self._kv_sink(changes)

    def submit(
        self,
        request_id: RequestId,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        now: float,
    ) -> None:
        self.model.submit(request_id, hash_ids, input_length, output_length, now)
        self._generated[request_id] = 0

    def next_event_time(self) -> float | None:
        return self.model.next_event_time()

    def advance(self, now: float) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        seen = self._generated
        for ev in self.model.advance(now):
            kind, rid, t = ev[0], ev[1], ev[2]
            if kind == "tokens":
                total = int(ev[3])  # type: ignore[misc]
                step = total - seen.get(rid, 0)
                seen[rid] = total
                if step > 0:
                    out.append(EngineEvent("tokens", rid, t, tokens=step))
            elif kind == "first_token":
                seen[rid] = 1
                out.append(EngineEvent("first_token", rid, t, 1, int(ev[3])))  # type: ignore[misc]
            else:
                seen.pop(rid, None)
                out.append(EngineEvent("finish", rid, t))
        self._drain_kv_events()
        return out

    def reset_prefix_cache(self) -> int:
        blocks = self.model.reset_prefix_cache()
        self._drain_kv_events()
        return blocks

    def cancel(self, request_id: RequestId) -> None:
        self.model.cancel(request_id)
        self._generated.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        s = self.model.stats()
        return {
            "running": float(s["running"]),
            "waiting": float(s["waiting"]),
            "kv_usage": float(s["kv_usage"]),
            "prefix_queries_tokens": float(s["prefix_cache_queries"]),
            "prefix_hits_tokens": float(s["prefix_cache_hits"]),
            "cached_blocks": float(s["kv_cached_blocks"]),
            "num_gpu_blocks": float(s["kv_total_blocks"]),
            "kv_block_size": self.kv_block_size,
        }
