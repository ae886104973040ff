"""Trace loading: every format on the shared real traces, round trips, errors with lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvroute
from kvroute.schema import block_size_of, trace_schema
from kvroute.trace import has_keys, read_trace, read_trace_with_report, write_trace
from kvroute.trace_formats import MIN_SESSION_PREFIX_BLOCKS

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"
MOONCAKE = SHARED / "mooncake" / "conversation_trace.jsonl"
BUNDLED = REPO / "traces" / "mooncake_conversation_head1000.jsonl"
needs_shared = pytest.mark.skipif(not SHARED.exists(), reason="shared traces not present")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_bundled_mooncake_reads_exactly() -> None:
    t = read_trace(BUNDLED)
    rows = _rows(BUNDLED)
    assert t.num_rows == len(rows) == 1000
    assert block_size_of(t) == 512
    assert t.column("hash_ids").to_pylist() == [r["hash_ids"] for r in rows]
    ts = t.column("timestamp").to_numpy()
    assert np.allclose(ts, [(r["timestamp"] - rows[0]["timestamp"]) / 1000 for r in rows])
    assert t.column("session_id").to_pylist() == list(range(1000))
    assert t.column("request_id").to_pylist() == list(range(1000))
    for r, n, k in zip(
        rows, t.column("input_length").to_pylist(), t.column("hash_ids").to_pylist(), strict=True
    ):
        assert n == r["input_length"] and len(k) == math.ceil(n / 512)


def _reference_sessions(rows: list[dict]) -> list[int]:
    """The documented rule, written plainly: join the earlier request whose keys minus the
    last block are the longest prefix (>= MIN blocks) of this request's keys."""
    out: list[int] = []
    for i, r in enumerate(rows):
        best, best_len = i, 0
        for j in range(i):
            p = rows[j]["hash_ids"][:-1]
            if (
                len(p) >= MIN_SESSION_PREFIX_BLOCKS
                and len(p) >= best_len
                and r["hash_ids"][: len(p)] == p
            ):
                best, best_len = out[j], len(p)
        out.append(best)
    return out


def test_infer_sessions_matches_plain_rule() -> None:
    rows = _rows(BUNDLED)[:400]
    path = BUNDLED.parent / "_head400.jsonl"
    try:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        t = read_trace(path, infer_sessions=True)
    finally:
        path.unlink()
    assert t.column("session_id").to_pylist() == _reference_sessions(rows)
    turns = t.column("turn").to_pylist()
    seen: dict[int, int] = {}
    for s, turn in zip(t.column("session_id").to_pylist(), turns, strict=True):
        assert turn == seen.get(s, 0)
        seen[s] = turn + 1


@needs_shared
def test_full_mooncake_sessions_match_the_published_count() -> None:
    t = read_trace(MOONCAKE, infer_sessions=True)
    assert t.num_rows == 12031
    # SOURCES.md: 3,562 requests extend an earlier request minus its last block (>= 3 blocks).
    assert len(set(t.column("session_id").to_pylist())) == 12031 - 3562


def test_parquet_round_trip_and_other_writers(tmp_path: Path) -> None:
    t = read_trace(BUNDLED)
    out = write_trace(t, tmp_path / "t.parquet")
    back = read_trace(out)
    assert back.equals(t)
    assert pq.read_metadata(out).row_group(0).column(0).compression == "ZSTD"
    # A Parquet file from another writer: int32 lengths, large_list<int64> keys, no request_id.
    other = pa.table(
        {
            "timestamp": pa.array([0.0, 1.5]),
            "session_id": pa.array(["a", "b"]),
            "turn": pa.array([0, 0], pa.int16()),
            "input_length": pa.array([3, 600], pa.int32()),
            "output_length": pa.array([1, 2], pa.int32()),
            "hash_ids": pa.array([[1], [1, 2]], pa.large_list(pa.int64())),
        }
    )
    pq.write_table(other, tmp_path / "o.parquet")
    got = read_trace(tmp_path / "o.parquet")
    assert got.column("request_id").to_pylist() == [0, 1]
    assert got.schema.field("input_length").type == pa.int64()
    assert got.column("hash_ids").to_pylist() == [[1], [1, 2]]


def test_polars_and_arrow_inputs_are_used_as_they_are() -> None:
    t = read_trace(BUNDLED)
    df = pl.from_arrow(t)
    assert isinstance(df, pl.DataFrame)
    from_polars = read_trace(df)
    assert pa.types.is_large_list(from_polars.schema.field("hash_ids").type)
    assert from_polars.column("hash_ids").to_pylist()[:5] == t.column("hash_ids").to_pylist()[:5]
    same = read_trace(t)
    assert (
        same.column("hash_ids").chunk(0).buffers()[-1].address
        == t.column("hash_ids").chunk(0).buffers()[-1].address
    )  # zero-copy


def test_bailian_sessions_and_rechained_keys(tmp_path: Path) -> None:
    rows = [
        {
            "chat_id": 10,
            "parent_chat_id": -1,
            "timestamp": 1.0,
            "input_length": 40,
            "output_length": 5,
            "type": "text",
            "turn": 1,
            "hash_ids": [7, 8, 9],
        },
        {
            "chat_id": 11,
            "parent_chat_id": 10,
            "timestamp": 3.0,
            "input_length": 50,
            "output_length": 5,
            "type": "text",
            "turn": 2,
            "hash_ids": [7, 8, 9, 4],
        },
        {
            "chat_id": 12,
            "parent_chat_id": -1,
            "timestamp": 2.0,
            "input_length": 20,
            "output_length": 5,
            "type": "image",
            "turn": 1,
            "hash_ids": [8, 9],
        },
        {
            "chat_id": 13,
            "parent_chat_id": 11,
            "timestamp": 4.0,
            "input_length": 70,
            "output_length": 5,
            "type": "text",
            "turn": 3,
            "hash_ids": [7, 8, 9, 4, 1],
        },
    ]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_trace(path)
    assert block_size_of(t) == 16
    assert t.column("request_id").to_pylist() == [10, 12, 11, 13]  # time order
    assert t.column("session_id").to_pylist() == [10, 12, 10, 10]
    keys = t.column("hash_ids").to_pylist()
    assert keys[0] == kvroute.chain_ids([7, 8, 9]).tolist()
    # Unchained ids 8, 9 at other positions are different prefixes after chaining.
    assert not set(keys[1]) & set(keys[0])
    assert keys[3][:4] == keys[2]
    assert t.column("type").to_pylist() == ["text", "image", "text", "text"]


def test_agentic_jsonl(tmp_path: Path) -> None:
    rows = [
        {
            "session_id": "s1",
            "turn_id": 0,
            "timestamp": 0.5,
            "input_length": 600,
            "output_length": 10,
            "hash_ids": [1, 2],
        },
        {
            "session_id": "s1",
            "turn_id": 1,
            "timestamp": 9.0,
            "input_length": 1100,
            "output_length": 10,
            "hash_ids": [1, 2, 3],
            "time_to_parent_chat": 2.5,
        },
        {
            "session_id": "s2",
            "turn_id": 0,
            "timestamp": 1.0,
            "input_length": 10,
            "output_length": 3,
            "hash_ids": [5],
        },
    ]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_trace(path, block_size=256)
    assert block_size_of(t) == 256
    assert t.column("session_id").to_pylist() == ["s1", "s2", "s1"]
    assert t.column("turn").to_pylist() == [0, 0, 1]
    assert t.column("time_to_parent_chat").to_pylist() == [None, None, 2.5]
    assert t.column("timestamp").to_pylist() == [0.0, 0.5, 8.5]


@needs_shared
def test_text_traces_tokenize_and_key_prefixes() -> None:
    t, report = read_trace_with_report(SHARED / "lmcache-agent-trace" / "miniswe")
    assert report.rows == t.num_rows == 402 and not report.skipped
    assert len(set(t.column("session_id").to_pylist())) == 20
    assert (t.schema.metadata or {})[b"kvroute.tokenizer"] == b"builtin"
    keys = t.column("hash_ids").to_pylist()
    lengths = t.column("input_length").to_pylist()
    assert all(len(k) == math.ceil(n / 512) for k, n in zip(keys, lengths, strict=True))
    # Append-only agent prompts: most consecutive turns of a session share their first block.
    sessions = t.column("session_id").to_pylist()
    last: dict[str, list[int]] = {}
    shared = pairs = 0
    for s, k in zip(sessions, keys, strict=True):
        if s in last and last[s] and k:
            pairs += 1
            shared += last[s][0] == k[0]
        last[s] = k
    assert pairs > 300 and shared / pairs > 0.6


@needs_shared
def test_azure_csv_is_lengths_only() -> None:
    t = read_trace(SHARED / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv")
    assert t.num_rows == 8819
    assert not has_keys(t)
    ts = t.column("timestamp").to_numpy()
    assert ts[0] == 0.0 and np.all(np.diff(ts) >= 0)
    assert t.column("input_length").to_numpy().min() >= 0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]',
            "not valid JSON",
        ),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "missing field hash_ids"),
        (
            '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}',
            "field input_length",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}',
            "field hash_ids: item 0",
        ),
        (
            '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "field timestamp",
        ),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(kvroute.InvalidArgumentError, match=rf"bad.jsonl:3: .*{expected}"):
        read_trace(path, format="mooncake")
    t, report = read_trace_with_report(path, format="mooncake", on_error="skip")
    assert t.num_rows == 3
    assert [n for n, _ in report.skipped] == [3]
    assert "1 bad line(s) skipped" in report.summary()


def test_csv_errors_and_skip(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("timestamp,input_length,output_length\n0,10,1\n1.5,abc,2\n2,5,3\n")
    with pytest.raises(kvroute.InvalidArgumentError, match=r"c.csv:3: field input_length"):
        read_trace(path)
    t, report = read_trace_with_report(path, on_error="skip")
    assert t.column("input_length").to_pylist() == [10, 5] and report.skipped[0][0] == 3


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(kvroute.InvalidArgumentError, match="not found"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(kvroute.InvalidArgumentError, match="unknown trace format"):
        read_trace(BUNDLED, format="xml")
    with pytest.raises(kvroute.KvrouteTypeError):
        read_trace(42)
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"foo": 1}\n')
    with pytest.raises(kvroute.InvalidArgumentError, match="cannot tell the trace format"):
        read_trace(odd)
    with pytest.raises(kvroute.InvalidArgumentError, match="missing column"):
        read_trace(pa.table({"timestamp": [0.0]}))
    bad_keys = (
        trace_schema().empty_table().set_column(6, "hash_ids", pa.array([], pa.list_(pa.string())))
    )
    with pytest.raises(kvroute.KvrouteTypeError, match="hash_ids"):
        read_trace(bad_keys)


def test_equal_timestamps_keep_file_order(tmp_path: Path) -> None:
    rows = [
        {"timestamp": ts, "input_length": i, "output_length": 1, "hash_ids": [i]}
        for i, ts in enumerate([5, 0, 5, 0, 5])
    ]
    path = tmp_path / "ties.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_trace(path).column("request_id").to_pylist() == [1, 3, 0, 2, 4]


def test_text_trace_with_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "fix": 1, "the": 2, "bug": 3, "now": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rows = [
        {"timestamp": 2_000_000, "input": "fix the bug", "output": "now", "session_id": "s"},
        {"timestamp": 1_000_000, "input": "fix the", "output": "bug now x", "session_id": "s"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_trace(path, format="text", tokenizer=tmp_path / "tokenizer.json", block_size=2)
    assert (t.schema.metadata or {})[b"kvroute.tokenizer"] == b"hf:tokenizer.json"
    assert t.column("input_length").to_pylist() == [2, 3]  # time order: "fix the" first
    assert t.column("output_length").to_pylist() == [3, 1]
    keys = t.column("hash_ids").to_pylist()
    assert keys[0] == kvroute.block_hashes([1, 2], 2).tolist()
    assert keys[1] == kvroute.block_hashes([1, 2, 3], 2).tolist()
    assert t.column("turn").to_pylist() == [0, 1]
    with pytest.raises(kvroute.InvalidArgumentError, match="tokenizer file not found"):
        read_trace(path, format="text", tokenizer=tmp_path / "missing.json")
