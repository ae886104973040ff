"""The trace replayer: prompts from keys, the dispatch modes, records, and the command."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.errors import InvalidArgumentError
from kvroute.metrics import summarize
from kvroute.records import read_records, record_schema, run_info
from kvroute.replay import FIRST_ID, ReplayConfig, ReplayError, prompt_tokens, replay
from kvroute.trace import read_trace, write_trace
from livekit import Stack, small_trace

# -- prompts from keys ----------------------------------------------------------------------


def test_equal_keys_give_equal_tokens() -> None:
    a = prompt_tokens([11, 22, 33], 1500, 512, salt=1)
    b = prompt_tokens([11, 22, 44], 1400, 512, salt=2)
    assert a.dtype == np.uint32 and len(a) == 1500 and len(b) == 1400
    assert np.array_equal(a[:1024], b[:1024]) and not np.array_equal(a[1024:1400], b[1024:])
    assert np.array_equal(a, prompt_tokens([11, 22, 33], 1500, 512, salt=9))
    assert a.min() >= FIRST_ID and a.max() < 32000
    # Within a block, tokens depend on the position too.
    assert len(set(a[:512].tolist())) > 400


def test_missing_keys_are_unique_per_request() -> None:
    a = prompt_tokens([5], 1200, 512, salt=1)
    b = prompt_tokens([5], 1200, 512, salt=2)
    assert np.array_equal(a[:512], b[:512]) and not np.array_equal(a[512:], b[512:])
    assert len(prompt_tokens([], 10, 512, salt=3)) == 10
    with pytest.raises(InvalidArgumentError):
        prompt_tokens([1], 10, 512, vocab_size=100)


def test_config_checks() -> None:
    with pytest.raises(InvalidArgumentError, match="mode"):
        ReplayConfig(url="http://x", mode="fast")
    with pytest.raises(InvalidArgumentError, match="rate"):
        ReplayConfig(url="http://x", mode="poisson")
    assert ReplayConfig(url="http://h:1/v1/").url == "http://h:1"


# -- against the emulator -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(2, speedup=50, proxy={"policy": "unified"}) as s:
        yield s


def by_session(records: pa.Table) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in records.to_pylist():
        out[row["session_id"]].append(row)
    for rows in out.values():
        rows.sort(key=lambda r: r["turn"])
    return out


@pytest.mark.parametrize("mode", ["tracets", "thinktime", "poisson"])
def test_dispatch_modes(stack: Stack, mode: str) -> None:
    trace = small_trace(sessions=4, turns=3, gap=0.1, ttp=0.15)
    config = ReplayConfig(url=stack.engine_urls[0], mode=mode, rate=20.0, time_scale=1.0)
    records = replay(trace, config)
    assert records.schema.equals(record_schema(), check_metadata=False)
    assert records.num_rows == 12 and records.column("error").null_count == 12
    ts = {r["request_id"]: r["timestamp"] for r in trace.to_pylist()}
    for rows in by_session(records).values():
        for prev, row in itertools.pairwise(rows):
            assert row["send"] >= prev["finish"]  # one turn at a time
            if mode == "tracets":
                assert row["send"] >= ts[row["request_id"]] - 0.01
            else:
                assert row["send"] >= prev["finish"] + 0.15 * 0.95
        for row in rows:
            assert row["send"] <= row["first_token"] <= row["finish"]
            assert row["output_length"] == 8 and row["instance"] == 0
    if mode == "tracets":
        firsts = sorted(rows[0]["send"] for rows in by_session(records).values())
        assert firsts[-1] >= 0.3 - 0.01
    info = run_info(records)
    assert info["source"] == "replay" and info["mode"] == mode
    summary = summarize(records)
    assert summary["requests"] == 12 and summary["errors"] == 0


def test_the_engine_sees_the_trace_reuse(stack: Stack) -> None:
    trace = small_trace(sessions=3, turns=3, string_sessions=True, key_offset=10**12)
    records = replay(trace, ReplayConfig(url=stack.url, mode="thinktime", time_scale=0.1))
    assert pa.types.is_string(records.schema.field("session_id").type)
    for rows in by_session(records).values():
        for prev, row in itertools.pairwise(rows):
            # Turn n+1 extends turn n's keys: its cached prefix is turn n's prompt.
            assert row["cached_tokens"] == prev["input_length"]
            assert row["estimated_hit_tokens"] == prev["input_length"]
            assert row["estimated_hit_tokens"] is not None
            # unified keeps the session (hit ratio above the gate) via X-Session-Id
            assert row["instance"] == prev["instance"]
    assert summarize(records)["apc"] > 0.3
    stack.assert_counters_zero()


def test_max_requests_and_time_scale(stack: Stack) -> None:
    # The first five requests are sent 100 s apart in trace time: 0.1 s apart once scaled.
    trace = small_trace(sessions=3, turns=4, gap=100.0)
    config = ReplayConfig(url=stack.url, mode="tracets", time_scale=0.001, max_requests=5)
    records = replay(trace, config)
    assert records.num_rows == 5
    sends = sorted(records.column("send").to_pylist())
    assert sends[-1] >= 0.4 * (1 - 1e-6)  # scaled, not dropped: the last at 400 s x 0.001
    assert max(records.column("finish").to_pylist()) < 30  # unscaled, the last is sent at 400 s


def test_failures_are_recorded(stack: Stack) -> None:
    trace = small_trace(sessions=1, turns=2)
    records = replay(trace, ReplayConfig(url=stack.url, model="no-such-model", time_scale=0))
    errors = records.column("error").to_pylist()
    assert all(e and e.startswith("HTTP 404") for e in errors)
    assert records.column("first_token").null_count == 2
    assert summarize(records)["errors"] == 2


def test_a_refused_cache_reset_stops_the_run(tmp_path: Path) -> None:
    """Emulators that answer ``/reset_prefix_cache`` with 404, as vLLM does outside its dev
    mode: the proxy says which backend refused, and the replay stops before any request."""
    trace = small_trace(sessions=1, turns=1)
    with Stack(2, speedup=50, emulator={"reset_prefix_cache": False}) as stack:
        with pytest.raises(ReplayError, match=r"backend 0.*VLLM_SERVER_DEV_MODE"):
            replay(trace, ReplayConfig(url=stack.url, time_scale=0, reset_cache=True))
        path = write_trace(trace, tmp_path / "t.parquet")
        args = ["replay", str(path), "--url", stack.url, "--reset-cache", "--no-progress"]
        result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "r.parquet")])
    assert result.exit_code != 0 and "reset_prefix_cache" in result.output
    assert not (tmp_path / "r.parquet").exists()


def test_a_cache_reset_makes_the_run_start_cold(stack: Stack) -> None:
    """The emulators serve ``/reset_prefix_cache`` (vLLM's dev mode): a second run of the
    same trace finds its prefixes cached, unless the caches are reset first."""
    trace = small_trace(sessions=1, turns=1)
    config = ReplayConfig(url=stack.url, time_scale=0)
    replay(trace, config)
    warm = replay(trace, config)
    cold = replay(trace, ReplayConfig(url=stack.url, time_scale=0, reset_cache=True))
    assert warm["cached_tokens"].to_pylist()[0] > 0
    assert cold["cached_tokens"].to_pylist() == [0]


def test_replay_command(stack: Stack, tmp_path: Path) -> None:
    path = write_trace(small_trace(sessions=2, turns=2), tmp_path / "t.parquet")
    out = tmp_path / "records.parquet"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(path),
            "--url",
            stack.url,
            "--mode",
            "thinktime",
            "--time-scale",
            "0.1",
            "-o",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "requests: 4" in result.output and "ttft (s)" in result.output
    assert read_records(out).num_rows == 4
    result = CliRunner().invoke(
        main, ["replay", str(path), "--url", stack.url, "--mode", "poisson"]
    )
    assert result.exit_code != 0 and "rate" in result.output


def test_a_real_trace(stack: Stack) -> None:
    bundled = (
        Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_head1000.jsonl"
    )
    trace = read_trace(bundled, infer_sessions=True)
    config = ReplayConfig(url=stack.url, mode="tracets", time_scale=0.002, max_requests=40)
    records = replay(trace, config)
    assert records.num_rows == 40 and summarize(records)["errors"] == 0
    assert (
        records.column("input_length").to_pylist() == trace.column("input_length").to_pylist()[:40]
    )
    stack.assert_counters_zero()
