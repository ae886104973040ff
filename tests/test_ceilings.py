"""``kvroute.ceilings`` against the plain reading of SEMANTICS §4 in ``reference_ceilings``:
every integer field equal, on real Mooncake traces and on hypothesis-made traces (chained and
unchained ids, equal timestamps, empty key lists, single requests); input kinds; errors;
progress and Ctrl-C; the CLI."""

from __future__ import annotations

import _thread
import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvroute
from kvroute.cli import main
from kvroute.schema import trace_schema
from reference_ceilings import Row, reference_ceilings

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "traces" / "mooncake_conversation_head1000.jsonl"
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def table_of(rows: list[Row], *, large: bool = False, block_size: int = 512) -> pa.Table:
    sessions = [r.session for r in rows]
    stype = pa.string() if any(isinstance(s, str) for s in sessions) else pa.int64()
    if stype == pa.string():
        sessions = [str(s) for s in sessions]
    schema = trace_schema(session_type=stype, large_list=large, block_size=block_size)
    return pa.table(
        {
            "request_id": pa.array(range(len(rows)), pa.int64()),
            "timestamp": pa.array([float(r.timestamp) for r in rows], pa.float64()),
            "session_id": pa.array(sessions, stype),
            "turn": pa.array([0] * len(rows), pa.int32()),
            "input_length": pa.array([r.input_length for r in rows], pa.int64()),
            "output_length": pa.array([1] * len(rows), pa.int64()),
            "hash_ids": pa.array([list(r.keys) for r in rows], schema.field("hash_ids").type),
        },
        schema=schema,
    )


def mooncake_rows(path: Path, group: str) -> list[Row]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            d = json.loads(line)
            keys = d["hash_ids"]
            session: Any = {
                "own": i,
                "mod": f"s{i % 97}",
                "root": keys[0] if keys else -1,
            }[group]
            rows.append(Row(d["timestamp"] / 1000, session, d["input_length"], keys))
    return rows


def check(rows: list[Row], *, block_size: int, min_sessions: int, caps: list[int]) -> None:
    want = reference_ceilings(
        rows, block_size=block_size, min_sessions=min_sessions, capacities=caps
    )
    got = kvroute.ceilings(
        table_of(rows, block_size=block_size),
        min_sessions=min_sessions,
        capacities=caps,
        per_request=True,
        progress=False,
    )
    assert got.to_dict() == want.summary
    assert got.block_size == block_size
    per = got.per_request
    assert per is not None
    assert per.column("any").to_pylist() == want.any
    assert per.column("intra").to_pylist() == want.intra
    assert per.column("shared").to_pylist() == want.shared
    for cap in sorted(set(caps)):
        assert per.column(f"capacity_{cap}").to_pylist() == want.capacity[cap]
    r = got.reuse
    assert r.intra + r.cross + r.shared == got.any.hit_tokens


@pytest.mark.parametrize("group", ["own", "mod", "root"])
@pytest.mark.parametrize("min_sessions", [1, 2, 8])
def test_bundled_mooncake_matches_reference(group: str, min_sessions: int) -> None:
    rows = mooncake_rows(BUNDLED, group)
    check(rows, block_size=512, min_sessions=min_sessions, caps=[1, 16, 500, 5000, 10**6])


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
@pytest.mark.parametrize("group", ["own", "mod"])
def test_full_mooncake_conversation_matches_reference(group: str) -> None:
    rows = mooncake_rows(MOONCAKE, group)
    check(rows, block_size=512, min_sessions=8, caps=[100, 10_000, 100_000])


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[Row], int]:
    block = draw(st.sampled_from([1, 4, 16]))
    unchained = draw(st.booleans())
    alphabet = st.integers(0, 3) if unchained else st.integers(0, 2**64 - 1)
    prefixes = draw(st.lists(st.lists(alphabet, max_size=4), min_size=1, max_size=3))
    sessions = draw(
        st.lists(
            st.one_of(st.integers(-5, 5), st.text("ab", max_size=2)),
            min_size=1,
            max_size=6,
            unique=True,
        )
    )
    contexts: dict[Any, list[int]] = {}
    rows = []
    for _ in range(draw(st.integers(0, 30))):
        s = draw(st.sampled_from(sessions))
        ctx = contexts.setdefault(s, list(draw(st.sampled_from(prefixes))))
        action = draw(st.sampled_from(["grow", "grow", "cut", "restart"]))
        if action == "cut":
            del ctx[draw(st.integers(0, len(ctx))) :]
        elif action == "restart":
            ctx[:] = draw(st.sampled_from(prefixes))
        ctx.extend(draw(st.lists(alphabet, max_size=3)))
        blocks = len(ctx)
        length = draw(st.integers(max(0, (blocks - 1) * block), blocks * block + 2 * block))
        ts = draw(st.integers(0, 5))
        rows.append(Row(float(ts), s, length, list(ctx)))
    return rows, block


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(1, 4), st.lists(st.integers(1, 12), max_size=4))
def test_hypothesis_traces_match_reference(
    trace: tuple[list[Row], int], min_sessions: int, caps: list[int]
) -> None:
    rows, block = trace
    check(rows, block_size=block, min_sessions=min_sessions, caps=caps)


def test_empty_and_single_request() -> None:
    check([], block_size=512, min_sessions=8, caps=[4])
    check([Row(0.0, 1, 1300, [7, 8, 9])], block_size=512, min_sessions=1, caps=[1])
    check([Row(0.0, 1, 0, [])], block_size=512, min_sessions=1, caps=[1])
    empty = kvroute.ceilings(table_of([]), progress=False)
    assert empty.any.ratio == 0.0 and empty.any.total_requests == 0


def test_input_kinds_agree(tmp_path: Path) -> None:
    rows = mooncake_rows(BUNDLED, "mod")
    base = table_of(rows)
    want = kvroute.ceilings(base, capacities=[100], progress=False).to_dict()
    large = table_of(rows, large=True)
    signed = base.set_column(6, "hash_ids", base.column("hash_ids").cast(pa.list_(pa.int64())))
    chunked = pa.concat_tables([base.slice(0, 300), base.slice(300, 1), base.slice(301)])
    frame = pl.from_arrow(base)
    assert isinstance(frame, pl.DataFrame)
    path = tmp_path / "t.parquet"
    pq.write_table(base, path)
    reader = pa.RecordBatchReader.from_batches(base.schema, base.to_batches())
    for kind in (large, signed, chunked, frame, path, str(path), reader):
        got = kvroute.ceilings(kind, capacities=[100], progress=False)
        assert got.to_dict() == want, type(kind)
    # A JSONL path goes through kvroute.trace (Mooncake: every request its own session).
    jsonl = kvroute.ceilings(BUNDLED, min_sessions=1, capacities=[100], progress=False)
    ref = reference_ceilings(mooncake_rows(BUNDLED, "own"), min_sessions=1, capacities=[100])
    assert jsonl.to_dict() == ref.summary


def test_block_size_from_metadata_and_override() -> None:
    rows = [Row(0.0, 1, 100, [1, 2, 3]), Row(1.0, 2, 100, [1, 2, 3])]
    t = table_of(rows, block_size=16)
    assert kvroute.ceilings(t, progress=False).any.hit_tokens == 48
    assert kvroute.ceilings(t, block_size=10, progress=False).any.hit_tokens == 30
    assert kvroute.ceilings(t, block_size=10, progress=False).block_size == 10


def test_errors() -> None:
    t = table_of([Row(0.0, 1, 10, [1, 2])])
    with pytest.raises(kvroute.InvalidArgumentError, match="hash_ids"):
        kvroute.ceilings(t.drop_columns(["hash_ids"]), progress=False)
    strings = t.set_column(6, "hash_ids", pa.array([["a"]], pa.list_(pa.string())))
    with pytest.raises(kvroute.KvrouteTypeError, match="hash_ids"):
        kvroute.ceilings(strings, progress=False)
    floats = t.set_column(2, "session_id", pa.array([1.5]))
    with pytest.raises(kvroute.KvrouteTypeError, match="session_id"):
        kvroute.ceilings(floats, progress=False)
    negative = t.set_column(4, "input_length", pa.array([-3], pa.int64()))
    with pytest.raises(kvroute.InvalidArgumentError, match="input_length"):
        kvroute.ceilings(negative, progress=False)
    nulls = t.set_column(6, "hash_ids", pa.array([None], pa.list_(pa.uint64())))
    with pytest.raises(kvroute.InvalidArgumentError, match="null"):
        kvroute.ceilings(nulls, progress=False)
    for bad in ({"block_size": 0}, {"min_sessions": 0}, {"capacities": [0]}):
        with pytest.raises(kvroute.InvalidArgumentError):
            kvroute.ceilings(t, progress=False, **bad)  # type: ignore[arg-type]
    with pytest.raises(kvroute.KvrouteTypeError):
        kvroute.ceilings(42)


def test_lengths_only_trace_is_refused(tmp_path: Path) -> None:
    csv = tmp_path / "lengths.csv"
    csv.write_text("timestamp,input_length,output_length\n0,100,10\n1,200,20\n")
    with pytest.raises(kvroute.InvalidArgumentError, match="hash_ids"):
        kvroute.ceilings(csv, progress=False)


def big_table(rows: int = 200_000, keys: int = 20) -> pa.Table:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**63, rows * keys, dtype=np.int64).astype(np.uint64)
    offsets = pa.array(np.arange(0, rows * keys + 1, keys, dtype=np.int32))
    return pa.table(
        {
            "timestamp": pa.array(np.arange(rows, dtype=np.float64)),
            "session_id": pa.array(np.arange(rows, dtype=np.int64) % 1000),
            "input_length": pa.array(np.full(rows, keys * 512, dtype=np.int64)),
            "hash_ids": pa.ListArray.from_arrays(offsets, pa.array(values)),
        }
    )


def test_progress_callback_and_its_errors() -> None:
    t = big_table()
    seen: list[tuple[int, int]] = []
    kvroute.ceilings(t, capacities=[10, 100, 1000], progress=lambda d, n: seen.append((d, n)))
    assert all(0 <= d <= n for d, n in seen)

    def fail(done: int, total: int) -> None:
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        kvroute.ceilings(t, capacities=[10, 100, 1000, 10_000], progress=fail)


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_stops_cleanly() -> None:
    t = big_table()

    def interrupt(done: int, total: int) -> None:
        _thread.interrupt_main()

    with pytest.raises(KeyboardInterrupt):
        kvroute.ceilings(t, capacities=[10, 100, 1000, 10_000], progress=interrupt)
    small = table_of([Row(0.0, 1, 10, [1])])
    assert kvroute.ceilings(small, progress=False).any.total_requests == 1


def test_cli_json_and_table(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table_of(mooncake_rows(BUNDLED, "mod")), path)
    runner = CliRunner()
    res = runner.invoke(main, ["ceilings", str(path), "--json", "--capacity", "1e2,1000"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"any", "intra", "shared", "capacity", "reuse"}
    assert set(out["any"]) == {
        "ratio",
        "hit_tokens",
        "total_tokens",
        "hit_requests",
        "total_requests",
    }
    assert [c["capacity"] for c in out["capacity"]] == [100, 1000]
    assert set(out["reuse"]) == {"intra", "cross", "shared"}
    want = kvroute.ceilings(path, capacities=[100, 1000], progress=False).to_dict()
    assert out == want
    res = runner.invoke(main, ["ceilings", str(path), "--min-sessions", "2"])
    assert res.exit_code == 0, res.output
    assert "any-session" in res.stdout and "intra" in res.stdout
    bad = runner.invoke(main, ["ceilings", str(path), "--capacity", "1.5"])
    assert bad.exit_code != 0
    csv = tmp_path / "lengths.csv"
    csv.write_text("timestamp,input_length,output_length\n0,100,10\n")
    res = runner.invoke(main, ["ceilings", str(csv), "--json"])
    assert res.exit_code == 2 and "hash_ids" in res.output
