"""``kvroute.EngineModel``, the one-engine real-time API: prefix hits, eviction order,
preemption, chunked prefill, the token budget, event order, cancel and errors."""

from __future__ import annotations

import pytest

import kvroute
from kvroute import EngineModel

# Round numbers: 10 ms per step + 0.1 ms per prefill token, nothing else.
SIMPLE = {
    "step_overhead_s": 0.01,
    "prefill_s_per_token": 1e-4,
    "prefill_s_per_pair": 0.0,
    "decode_s_per_seq": 0.0,
    "decode_s_per_ctx_token": 0.0,
}


def engine(**over: float) -> EngineModel:
    return EngineModel("h20-qwen3-coder-30b-a3b", **{**SIMPLE, **over})


def drain(e: EngineModel) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    while (t := e.next_event_time()) is not None:
        out += e.advance(t)
    return out


def first_token(events: list[tuple[object, ...]], rid: object) -> tuple[object, ...]:
    return next(ev for ev in events if ev[0] == "first_token" and ev[1] == rid)


def test_prefix_hit_is_the_longest_resident_prefix() -> None:
    e = engine()
    e.submit("a", [1, 2, 3, 4], 2048, 2, 0.0)
    assert first_token(drain(e), "a")[3] == 0
    e.submit("b", [1, 2, 9, 9], 2048, 2, 5.0)
    assert first_token(drain(e), "b")[3] == 1024
    e.submit("c", [1, 2, 3, 4], 2048, 2, 10.0)  # all resident: the last key is recomputed
    assert first_token(drain(e), "c")[3] == 1536
    s = e.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (3 * 2048, 1024 + 1536)
    assert s["kv_used_blocks"] == 0 and s["kv_cached_blocks"] > 0


def test_eviction_takes_the_tail_of_a_prefix_first() -> None:
    e = engine(kv_capacity_tokens=1040)  # 65 blocks: two 512-token keys and one block
    e.submit(0, [10, 11], 1024, 1, 0.0)
    drain(e)
    e.submit(1, [50], 512, 1, 1.0)  # needs 32 blocks: evicts key 11, keeps key 10
    drain(e)
    e.submit(2, [10, 11], 1024, 1, 2.0)
    assert first_token(drain(e), 2)[3] == 512


def test_preemption_recomputes_and_everything_finishes() -> None:
    e = engine(kv_capacity_tokens=320)
    e.submit("x", [1], 100, 150, 0.0)
    e.submit("y", [2], 100, 150, 0.0)
    events = drain(e)
    finished = [ev[1] for ev in events if ev[0] == "finish"]
    assert sorted(finished) == ["x", "y"]  # type: ignore[type-var]
    assert e.stats()["preemptions"] >= 1
    last = {ev[1]: ev[3] for ev in events if ev[0] == "tokens"}
    assert last == {"x": 150, "y": 150}


def test_chunked_prefill_and_token_budget() -> None:
    e = engine()
    e.submit("p", list(range(40)), 20_000, 1, 0.0)  # 8192 + 8192 + 3616: three steps
    ev = first_token(drain(e), "p")
    assert ev[2] == pytest.approx(3 * 0.01 + 20_000 * 1e-4)
    assert e.stats()["steps"] == 3
    small = engine(max_num_batched_tokens=1000)
    small.submit("p", list(range(40)), 20_000, 1, 0.0)
    ev = first_token(drain(small), "p")
    assert small.stats()["steps"] == 20
    assert ev[2] == pytest.approx(20 * 0.01 + 20_000 * 1e-4)


def test_decodes_run_beside_a_chunk_and_slow_down() -> None:
    e = engine()
    e.submit("d", [1], 100, 200, 0.0)
    drain(e)  # alone: 1 prefill step + 199 decode steps of 10 ms
    alone = e.stats()["now"]
    e2 = engine()
    e2.submit("d", [1], 100, 200, 0.0)
    e2.submit("big", list(range(100, 164)), 32_768, 1, 0.5)
    events = drain(e2)
    fin = {ev[1]: ev[2] for ev in events if ev[0] == "finish"}
    assert fin["d"] > alone + 1.0  # its decode steps carried 8k-token chunks


def test_events_are_cumulative_ordered_and_stream_inside_runs() -> None:
    e = engine()
    e.submit(7, [1, 2], 1000, 50, 0.0)
    seen: list[tuple[object, ...]] = []
    t = 0.0
    while e.next_event_time() is not None:
        t += 0.05
        seen += e.advance(t)
    kinds = [ev[0] for ev in seen]
    assert kinds[0] == "first_token" and kinds[-1] == "finish"
    counts = [ev[3] for ev in seen if ev[0] == "tokens"]
    assert counts == sorted(counts) and counts[-1] == 50 and len(counts) > 3
    times = [ev[2] for ev in seen]
    assert times == sorted(times)
    assert e.active == 0


def test_next_event_time_is_each_token() -> None:
    e = engine()
    e.submit("r", [1], 100, 4, 0.0)
    times = []
    while (t := e.next_event_time()) is not None:
        times.append(t)
        e.advance(t)
    assert times == pytest.approx([0.02, 0.03, 0.04, 0.05])


def test_cancel_and_errors() -> None:
    e = engine()
    e.submit("a", [1, 2, 3], 1500, 100, 0.0)
    e.advance(0.5)
    assert e.cancel("a") and not e.cancel("a")
    assert e.stats()["kv_used_blocks"] == 0 and e.active == 0
    e.submit("a", [1], 10, 1, 1.0)  # the id is free again
    with pytest.raises(kvroute.DuplicateRequestError):
        e.submit("a", [1], 10, 1, 1.0)
    with pytest.raises(kvroute.InvalidArgumentError, match="KV blocks"):
        engine(kv_capacity_tokens=1600).submit("huge", [1], 1600, 100, 1.0)
    with pytest.raises(kvroute.KvrouteTypeError):
        e.submit(1.5, [1], 10, 1, 1.0)  # type: ignore[arg-type]
    with pytest.raises(kvroute.InvalidArgumentError, match="warp"):
        EngineModel(warp=1.0)
    with pytest.raises(kvroute.KvrouteTypeError, match="bool"):
        EngineModel(max_num_seqs=True)
    with pytest.raises(kvroute.InvalidArgumentError, match="a100"):
        EngineModel("a100")
    e.advance(0.0)  # an earlier time is the latest time seen
    assert e.stats()["now"] >= 1.0


def test_params_and_repr() -> None:
    e = EngineModel("h200-qwen3-coder-30b-a3b", max_num_seqs=16)
    assert e.preset == "h200-qwen3-coder-30b-a3b"
    assert e.params["max_num_seqs"] == 16
    assert e.params["kv_capacity_tokens"] > 600_000
    assert "h200" in repr(e)
    s = e.stats()
    assert s["kv_total_blocks"] * 16 <= e.params["kv_capacity_tokens"]
    assert s["running"] == s["waiting"] == 0 and e.next_event_time() is None
