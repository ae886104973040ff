"""Transforms and statistics: exact semantics against plain Python, determinism, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.schema import trace_schema
from kvroute.trace import read_trace
from kvroute.trace_ops import annotate_ttp, cap_sessions, sample, shrink, trace_stats

BUNDLED = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_head1000.jsonl"


def _table(rows: list[tuple[float, object, int, int]]) -> pa.Table:
    """rows of (timestamp, session, turn, input_length); keys one per 4 tokens."""
    schema = trace_schema(
        session_type=pa.string() if isinstance(rows[0][1], str) else pa.int64(), block_size=4
    )
    return pa.table(
        {
            "request_id": list(range(len(rows))),
            "timestamp": [r[0] for r in rows],
            "session_id": [r[1] for r in rows],
            "turn": [r[2] for r in rows],
            "input_length": [r[3] for r in rows],
            "output_length": [2] * len(rows),
            "hash_ids": [list(range(1, -(-r[3] // 4) + 1)) for r in rows],
        },
        schema=schema,
    )


def _cap_reference(table: pa.Table, max_turns: int) -> list[int]:
    rows = table.to_pylist()
    by_session: dict[object, list[tuple[int, dict]]] = {}
    for i, r in enumerate(rows):
        by_session.setdefault(r["session_id"], []).append((i, r))
    kept = []
    for items in by_session.values():
        items.sort(key=lambda x: (x[1]["turn"], x[1]["timestamp"]))
        kept.extend(items[:max_turns])
    kept.sort(key=lambda x: (x[1]["timestamp"], x[0]))
    return [r["request_id"] for _, r in kept]


def test_cap_matches_the_semantics() -> None:
    t = read_trace(BUNDLED, infer_sessions=True)
    for k in (1, 2, 8):
        assert cap_sessions(t, k).column("request_id").to_pylist() == _cap_reference(t, k)
    # Turn numbers out of time order and equal timestamps.
    odd = _table([(0.0, 1, 2, 8), (0.0, 1, 0, 8), (1.0, 2, 0, 8), (0.0, 1, 1, 8), (2.0, 1, 3, 4)])
    assert cap_sessions(odd, 2).column("request_id").to_pylist() == _cap_reference(odd, 2)
    assert cap_sessions(odd, 2).schema.metadata == odd.schema.metadata
    with pytest.raises(kvroute.InvalidArgumentError):
        cap_sessions(odd, 0)


def test_sample_is_deterministic_and_respects_its_limits() -> None:
    t = read_trace(BUNDLED, infer_sessions=True)
    a = sample(t, window_seconds=200, sample_ratio=0.5, max_single_turn_ratio=0.3, seed=7)
    b = sample(t, window_seconds=200, sample_ratio=0.5, max_single_turn_ratio=0.3, seed=7)
    c = sample(t, window_seconds=200, sample_ratio=0.5, max_single_turn_ratio=0.3, seed=8)
    assert a.equals(b) and not a.equals(c)
    ts = a.column("timestamp").to_numpy()
    assert ts.min() >= 0 and ts.max() < 200
    sessions, counts = np.unique(a.column("session_id").to_numpy(), return_counts=True)
    assert (counts == 1).sum() <= 0.3 * len(sessions) + 1e-9
    everything = sample(t, window_seconds=200)
    in_window = t.column("timestamp").to_numpy() < 200
    assert everything.num_rows == in_window.sum()
    shifted = sample(t, window_seconds=100, window_start=100)
    assert shifted.column("timestamp").to_numpy().min() >= 0
    with pytest.raises(kvroute.InvalidArgumentError):
        sample(t, sample_ratio=0)


def test_annotate_ttp_from_starts_and_finishes() -> None:
    t = _table([(0.0, "a", 0, 8), (1.0, "b", 0, 8), (5.0, "a", 1, 12), (9.0, "a", 2, 16)])
    by_start = annotate_ttp(t)
    assert by_start.column("time_to_parent_chat").to_pylist() == [None, None, 5.0, 4.0]
    assert by_start.schema.metadata[b"kvroute.ttp_basis"] == b"start"
    finish = pa.table({"request_id": [0, 2], "finish": [3.0, 9.5]})
    by_finish = annotate_ttp(t, finish)
    # Request 3's parent finished after it started: the gap is clipped to 0.
    assert by_finish.column("time_to_parent_chat").to_pylist() == [None, None, 2.0, 0.0]
    assert by_finish.schema.metadata[b"kvroute.ttp_basis"] == b"finish"
    with pytest.raises(kvroute.InvalidArgumentError, match="finish"):
        annotate_ttp(t, pa.table({"request_id": [0]}))


def test_stats_by_hand() -> None:
    t = _table([(0.0, 1, 0, 10), (1.0, 2, 0, 20), (3.0, 1, 1, 30), (4.0, 1, 2, 40)])
    s = trace_stats(t, kv_bytes_per_token=1024)
    assert s["requests"] == 4 and s["sessions"] == 2 and s["duration_s"] == 4.0
    assert s["turns_per_session"]["max"] == 3 and s["turns_per_session"]["p50"] == 2.0
    assert s["input_length"]["p50"] == 25.0 and s["total_input_tokens"] == 100
    assert s["keys"] == 3 + 5 + 8 + 10
    assert s["kv_per_request_gib"]["max"] == pytest.approx(42 * 1024 / 2**30)
    assert trace_stats(t)["kv_bytes_per_token"] == 98304  # Qwen3-Coder-30B-A3B
    with pytest.raises(kvroute.InvalidArgumentError, match="unknown model"):
        trace_stats(t, model="gpt-9")


def test_cli_convert_cap_stats_plot(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "t.parquet"
    res = runner.invoke(
        main, ["trace", "convert", str(BUNDLED), "--infer-sessions", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    capped = tmp_path / "c.parquet"
    res = runner.invoke(main, ["trace", "cap", str(out), "--max-turns", "2", "-o", str(capped)])
    assert res.exit_code == 0, res.output
    png = tmp_path / "cdf.png"
    res = runner.invoke(main, ["trace", "stats", str(capped), "--json", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats["requests"] == read_trace(capped).num_rows
    assert stats["turns_per_session"]["max"] <= 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{\n')
    res = runner.invoke(main, ["trace", "stats", str(bad)])
    assert res.exit_code == 2 and "bad.jsonl:2" in res.output


def test_shrink_keeps_the_keys_and_scales_the_lengths(tmp_path: Path) -> None:
    table = _table([(0.0, "a", 0, 10), (1.0, "a", 1, 16), (2.0, "b", 0, 3)])
    out = shrink(table, 2, max_output=1)
    assert out["input_length"].to_pylist() == [5, 8, 2]  # 10 * 2/4, 16 * 2/4, ceil(3 * 2/4)
    assert out["output_length"].to_pylist() == [1, 1, 1]
    assert out["hash_ids"].equals(table["hash_ids"])
    assert out.schema.metadata[b"kvroute.block_size"] == b"2"
    # Each request keeps all its keys: ceil(new length / new block size) = the keys it had.
    assert [-(-n // 2) for n in out["input_length"].to_pylist()] == [3, 4, 1]
    assert shrink(table, 4)["output_length"].to_pylist() == [2, 2, 2]
    for bad in (0, 5):
        with pytest.raises(kvroute.InvalidArgumentError, match="block_size"):
            shrink(table, bad)
    with pytest.raises(kvroute.InvalidArgumentError, match="max_output"):
        shrink(table, 2, max_output=0)
    path = tmp_path / "small.parquet"
    args = ["trace", "shrink", str(BUNDLED), "--to-block-size", "32", "--max-output", "8"]
    result = CliRunner().invoke(main, [*args, "-o", str(path)])
    assert result.exit_code == 0, result.output
    small, full = read_trace(path), read_trace(BUNDLED)
    assert small["hash_ids"].equals(full["hash_ids"])
    assert max(small["input_length"].to_pylist()) <= 8192
    assert set(small["output_length"].to_pylist()) <= set(range(1, 9))
