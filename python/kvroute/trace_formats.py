"""Per-format converters into the canonical trace table (see ``docs/trace-format.md``).

Each ``from_*`` function reads one file format with Arrow (JSONL via :mod:`kvroute.jsonl`,
CSV via polars), then builds the canonical columns with vectorized numpy/Arrow code:
O(rows + keys), except Mooncake session inference (a Python loop over requests and their
keys, opt-in) and text tokenization (O(text)). Stateless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from kvroute._core import block_hashes, chain_ids_lists
from kvroute.errors import InvalidArgumentError
from kvroute.jsonl import (
    LoadReport,
    OnError,
    is_count,
    is_id,
    is_int,
    is_key_list,
    is_number,
    is_str,
    read_jsonl,
)
from kvroute.schema import BLOCK_SIZE_KEY
from kvroute.tokenize import load_tokenizer

FORMATS = ("parquet", "mooncake", "bailian", "agentic", "text", "csv")
MIN_SESSION_PREFIX_BLOCKS = 3
KEYS_I64 = pa.list_(pa.int64())


def detect_jsonl_format(first: dict[str, Any], path: Path) -> str:
    """The JSONL dialect of a file from the fields of its first object."""
    fields = set(first)
    if {"input", "output"} <= fields:
        return "text"
    if "chat_id" in fields or "parent_chat_id" in fields:
        return "bailian"
    if "session_id" in fields and "hash_ids" in fields:
        return "agentic"
    if {"timestamp", "input_length", "hash_ids"} <= fields:
        return "mooncake"
    raise InvalidArgumentError(
        f"{path}: cannot tell the trace format from its first line (fields: "
        f"{', '.join(sorted(fields))}); pass format= / --format"
    )


def _negative_row(table: pa.Table, *names: str) -> tuple[int, str, str] | None:
    for name in names:
        col = table.column(name)
        if col.null_count:
            row = int(pc.index(pc.is_null(col), True).as_py())
            return row, name, "missing (null)"
        bad = pc.less(col, 0)
        if pc.any(bad).as_py():
            row = int(pc.index(bad, True).as_py())
            return row, name, f"expected a non-negative integer, got {col[row].as_py()}"
    return None


def _keys_u64(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A list<int64> column reinterpreted as list<uint64> (same bits, no copy of values)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.offset or arr.null_count:
        arr = pa.concat_arrays([arr.fill_null([])]) if arr.null_count else arr
    values = arr.flatten().to_numpy(zero_copy_only=False).view(np.uint64)
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint64()))


def _flat(col: pa.Array) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    values = col.flatten().to_numpy(zero_copy_only=False)
    offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    return values.view(np.uint64) if values.dtype == np.int64 else values, offsets - offsets[0]


def _turns_by_time(session: pa.Array, timestamp: npt.NDArray[np.float64]) -> npt.NDArray[np.int32]:
    """0-based rank of each request in its session by (timestamp, row)."""
    df = pl.DataFrame({"s": pl.from_arrow(session), "t": timestamp, "i": np.arange(len(timestamp))})
    ranked = df.sort(["s", "t", "i"]).with_columns(
        pl.col("i").cum_count().over("s").alias("turn") - 1
    )
    return ranked.sort("i")["turn"].to_numpy().astype(np.int32)


def canonical(
    *,
    request_id: Any,
    timestamp: npt.NDArray[np.float64],
    session_id: Any,
    turn: Any,
    input_length: Any,
    output_length: Any,
    hash_ids: pa.Array,
    block_size: int,
    ttp: Any = None,
    types: Any = None,
    extra_meta: dict[bytes, bytes] | None = None,
) -> pa.Table:
    """Assemble the canonical table: timestamps from 0, rows in stable timestamp order."""
    ts = np.asarray(timestamp, dtype=np.float64)
    ts = ts - ts.min() if len(ts) else ts
    cols: dict[str, Any] = {
        "request_id": pa.array(request_id, pa.int64()),
        "timestamp": pa.array(ts, pa.float64()),
        "session_id": session_id,
        "turn": pa.array(turn, pa.int32()),
        "input_length": pa.array(input_length, pa.int64()),
        "output_length": pa.array(output_length, pa.int64()),
        "hash_ids": hash_ids,
    }
    if ttp is not None:
        cols["time_to_parent_chat"] = pa.array(ttp, pa.float64())
    if types is not None:
        cols["type"] = types
    meta = {BLOCK_SIZE_KEY: str(block_size).encode(), **(extra_meta or {})}
    table = pa.table(cols).replace_schema_metadata(meta)
    order = np.argsort(ts, kind="stable")
    return table if np.all(np.diff(order) > 0) else table.take(pa.array(order))


def from_mooncake(
    path: Path, block_size: int, infer_sessions: bool, *, on_error: OnError
) -> tuple[pa.Table, LoadReport]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    schema = pa.schema(
        [
            ("timestamp", pa.float64()),
            ("input_length", pa.int64()),
            ("output_length", pa.int64()),
            ("hash_ids", KEYS_I64),
        ]
    )
    required = {
        "timestamp": is_number,
        "input_length": is_count,
        "output_length": is_count,
        "hash_ids": is_key_list,
    }
    raw, report = read_jsonl(
        path,
        "mooncake",
        required,
        {},
        schema,
        on_error=on_error,
        row_check=lambda t: _negative_row(t, "input_length", "output_length"),
    )
    n = raw.num_rows
    keys = _keys_u64(raw.column("hash_ids"))
    ts = raw.column("timestamp").to_numpy() / 1000.0
    rid = np.arange(n, dtype=np.int64)
    if infer_sessions:
        order = np.argsort(ts, kind="stable")
        session = np.empty(n, dtype=np.int64)
        session[order] = infer_prefix_sessions(keys.take(pa.array(order)), rid[order])
        turn = _turns_by_time(pa.array(session), ts)
    else:
        session, turn = rid, np.zeros(n, dtype=np.int32)
    table = canonical(
        request_id=rid,
        timestamp=ts,
        session_id=pa.array(session, pa.int64()),
        turn=turn,
        input_length=raw.column("input_length"),
        output_length=raw.column("output_length"),
        hash_ids=keys,
        block_size=block_size,
    )
    return table, report


def infer_prefix_sessions(
    keys: pa.Array, request_ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Sessions of requests given in time order: a request joins the session of the earlier
    request whose keys minus its last block are the longest prefix of its own keys, if that
    prefix has at least ``MIN_SESSION_PREFIX_BLOCKS`` blocks (shorter shared prefixes are
    system prompts); otherwise it starts a session named by its own request id."""
    values, offsets = _flat(keys)
    out = np.empty(len(request_ids), dtype=np.int64)
    prefix_end: dict[tuple[int, int], int] = {}
    lo = MIN_SESSION_PREFIX_BLOCKS - 1
    for i in range(len(request_ids)):
        ks = values[offsets[i] : offsets[i + 1]].tolist()
        session = int(request_ids[i])
        for j in range(len(ks) - 1, lo - 1, -1):
            found = prefix_end.get((j, ks[j]))
            if found is not None:
                session = found
                break
        if len(ks) > MIN_SESSION_PREFIX_BLOCKS:
            prefix_end[(len(ks) - 2, ks[-2])] = session
        out[i] = session
    return out


def _root_index(parent_idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Root of every node of a forest by pointer jumping (``-1`` = no parent). O(n log depth).
    A cycle of parents is an error."""
    n = len(parent_idx)
    root = np.where(parent_idx >= 0, parent_idx, np.arange(n))
    for _ in range(64):
        nxt = root[root]
        if np.array_equal(nxt, root):
            return root
        root = nxt
    raise InvalidArgumentError("parent_chat_id links form a cycle")


def from_bailian(path: Path, *, on_error: OnError) -> tuple[pa.Table, LoadReport]:
    """Bailian-style JSONL: ``chat_id``, ``parent_chat_id`` (-1 for a first turn), float-second
    ``timestamp``, ``turn``, ``type``, and unchained 16-token block ids, re-chained here.
    A request's session is the chat at the root of its parent chain; a parent missing from the
    trace (e.g. sampled away) makes the request a root."""
    schema = pa.schema(
        [
            ("chat_id", pa.int64()),
            ("parent_chat_id", pa.int64()),
            ("timestamp", pa.float64()),
            ("input_length", pa.int64()),
            ("output_length", pa.int64()),
            ("turn", pa.int32()),
            ("type", pa.string()),
            ("hash_ids", KEYS_I64),
        ]
    )
    required = {
        "chat_id": is_int,
        "timestamp": is_number,
        "input_length": is_count,
        "output_length": is_count,
        "hash_ids": is_key_list,
    }
    optional = {"parent_chat_id": is_int, "turn": is_int, "type": is_str}
    raw, report = read_jsonl(
        path,
        "bailian",
        required,
        optional,
        schema,
        on_error=on_error,
        row_check=lambda t: _negative_row(t, "input_length", "output_length"),
    )
    chat = raw.column("chat_id").to_numpy()
    if len(np.unique(chat)) != len(chat):
        dup = int(chat[np.argmax(np.unique(chat, return_counts=True)[1] > 1)])
        raise InvalidArgumentError(f"{path}: chat_id {dup} appears more than once")
    parent = raw.column("parent_chat_id").fill_null(-1).to_numpy()
    sorter = np.argsort(chat)
    pos = np.clip(np.searchsorted(chat, parent, sorter=sorter), 0, max(len(chat) - 1, 0))
    parent_idx = (
        np.where((len(chat) > 0) & (chat[sorter[pos]] == parent), sorter[pos], -1)
        if len(chat)
        else parent
    )
    session = chat[_root_index(np.asarray(parent_idx, dtype=np.int64))]
    ts = raw.column("timestamp").to_numpy()
    turns = raw.column("turn")
    turn = turns.to_numpy() if turns.null_count == 0 else _turns_by_time(pa.array(session), ts)
    keys = _keys_u64(raw.column("hash_ids"))
    values, offsets = _flat(keys)
    chained = chain_ids_lists(values, offsets)
    keys = pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(chained, pa.uint64())
    )
    table = canonical(
        request_id=chat,
        timestamp=ts,
        session_id=pa.array(session, pa.int64()),
        turn=turn,
        input_length=raw.column("input_length"),
        output_length=raw.column("output_length"),
        hash_ids=keys,
        block_size=16,
        types=raw.column("type"),
    )
    return table, report


def from_agentic(path: Path, block_size: int, *, on_error: OnError) -> tuple[pa.Table, LoadReport]:
    """Agentic JSONL: ``session_id`` (int or str), ``turn`` or ``turn_id``, optional
    ``time_to_parent_chat`` (s), float-second ``timestamp``, chained ``hash_ids``."""
    from kvroute.jsonl import first_json_object

    first = first_json_object(path)
    sess_type = pa.string() if isinstance(first.get("session_id"), str) else pa.int64()
    schema = pa.schema(
        [
            ("request_id", pa.int64()),
            ("session_id", sess_type),
            ("turn", pa.int32()),
            ("turn_id", pa.int32()),
            ("time_to_parent_chat", pa.float64()),
            ("timestamp", pa.float64()),
            ("input_length", pa.int64()),
            ("output_length", pa.int64()),
            ("type", pa.string()),
            ("hash_ids", KEYS_I64),
        ]
    )
    required = {
        "session_id": is_id,
        "timestamp": is_number,
        "input_length": is_count,
        "output_length": is_count,
        "hash_ids": is_key_list,
    }
    optional = {
        "request_id": is_int,
        "turn": is_int,
        "turn_id": is_int,
        "time_to_parent_chat": is_number,
        "type": is_str,
    }
    raw, report = read_jsonl(
        path,
        "agentic",
        required,
        optional,
        schema,
        on_error=on_error,
        row_check=lambda t: _negative_row(t, "input_length", "output_length"),
    )
    ts = raw.column("timestamp").to_numpy()
    session = raw.column("session_id").combine_chunks()
    turn_col = raw.column("turn") if raw.column("turn").null_count == 0 else raw.column("turn_id")
    turn = turn_col.to_numpy() if turn_col.null_count == 0 else _turns_by_time(session, ts)
    rid_col = raw.column("request_id")
    rid = rid_col.to_numpy() if rid_col.null_count == 0 else np.arange(raw.num_rows)
    has_ttp = raw.column("time_to_parent_chat").null_count < raw.num_rows
    has_type = raw.column("type").null_count < raw.num_rows
    table = canonical(
        request_id=rid,
        timestamp=ts,
        session_id=session,
        turn=turn,
        input_length=raw.column("input_length"),
        output_length=raw.column("output_length"),
        hash_ids=_keys_u64(raw.column("hash_ids")),
        block_size=block_size,
        ttp=raw.column("time_to_parent_chat") if has_ttp else None,
        types=raw.column("type") if has_type else None,
    )
    return table, report


def from_text(
    path: Path, tokenizer: Any, block_size: int, *, on_error: OnError
) -> tuple[pa.Table, LoadReport]:
    """Text traces (one JSONL file, or a directory of them): ``timestamp`` (µs), ``input``
    and ``output`` text, ``session_id``. Prompts are tokenized and keyed here."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise InvalidArgumentError(f"{path}: no .jsonl files in the directory")
    schema = pa.schema(
        [
            ("timestamp", pa.int64()),
            ("input", pa.string()),
            ("output", pa.string()),
            ("session_id", pa.string()),
        ]
    )
    required = {"timestamp": is_int, "input": is_str, "output": is_str, "session_id": is_id}
    tables, report = [], LoadReport(str(path), "text")
    for f in files:
        t, r = read_jsonl(f, "text", required, {}, schema, on_error=on_error)
        tables.append(t)
        report.skipped.extend((line, f"{f.name}: {why}") for line, why in r.skipped)
    raw = pa.concat_tables(tables)
    report.rows = raw.num_rows
    tok = load_tokenizer(tokenizer)
    in_len, out_len, key_parts = [], [], []
    for text, out in zip(
        raw.column("input").to_pylist(), raw.column("output").to_pylist(), strict=True
    ):
        ids = tok.encode(text)
        in_len.append(len(ids))
        out_len.append(len(tok.encode(out)))
        key_parts.append(block_hashes(ids, block_size))
    offsets = np.zeros(len(key_parts) + 1, dtype=np.int32)
    np.cumsum([len(k) for k in key_parts], out=offsets[1:])
    flat = np.concatenate(key_parts) if key_parts else np.empty(0, np.uint64)
    keys = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.uint64()))
    ts = raw.column("timestamp").to_numpy() / 1e6
    session = raw.column("session_id").combine_chunks()
    table = canonical(
        request_id=np.arange(raw.num_rows),
        timestamp=ts,
        session_id=session,
        turn=_turns_by_time(session, ts),
        input_length=in_len,
        output_length=out_len,
        hash_ids=keys,
        block_size=block_size,
        extra_meta={b"kvroute.tokenizer": tok.name.encode()},
    )
    return table, report


CSV_COLUMNS = {
    "timestamp": ("TIMESTAMP", "timestamp"),
    "input_length": ("ContextTokens", "input_length"),
    "output_length": ("GeneratedTokens", "output_length"),
}


def from_csv(path: Path, *, on_error: OnError) -> tuple[pa.Table, LoadReport]:
    """Lengths-only CSV (Azure LLM inference traces: ``TIMESTAMP``, ``ContextTokens``,
    ``GeneratedTokens``; or ``timestamp``, ``input_length``, ``output_length`` with seconds).
    There are no keys: the table says so in its metadata and ceilings refuse it."""
    try:
        df = pl.read_csv(path, infer_schema=False)
    except pl.exceptions.PolarsError as exc:
        raise InvalidArgumentError(f"{path}: not a readable CSV file: {exc}") from exc
    names: dict[str, str] = {}
    for canon, options in CSV_COLUMNS.items():
        found = next((c for c in options if c in df.columns), None)
        if found is None:
            raise InvalidArgumentError(
                f"{path}: missing column {canon} (accepted names: {', '.join(options)})"
            )
        names[canon] = found
    ts_raw = df[names["timestamp"]]
    ts = ts_raw.cast(pl.Float64, strict=False)
    if ts.null_count() > ts_raw.null_count():
        dt = ts_raw.str.to_datetime(strict=False, time_unit="us")
        ts = (dt.dt.epoch("us").cast(pl.Float64) / 1e6).alias("ts")
    checks = {
        "timestamp": ts,
        "input_length": df[names["input_length"]].cast(pl.Int64, strict=False),
        "output_length": df[names["output_length"]].cast(pl.Int64, strict=False),
    }
    bad = np.zeros(df.height, dtype=bool)
    report = LoadReport(str(path), "csv")
    for canon, series in checks.items():
        invalid = series.is_null().to_numpy() | (series < 0).fill_null(True).to_numpy()
        for row in np.flatnonzero(invalid & ~bad):
            problem = f"field {names[canon]}: cannot read {df[names[canon]][int(row)]!r} as {canon}"
            if on_error == "raise":
                raise InvalidArgumentError(f"{path}:{int(row) + 2}: {problem}")
            report.skipped.append((int(row) + 2, problem))
        bad |= invalid
    keep = ~bad
    n = int(keep.sum())
    report.rows = n
    empty_keys = pa.ListArray.from_arrays(
        pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.uint64())
    )
    table = canonical(
        request_id=np.flatnonzero(keep),
        timestamp=checks["timestamp"].to_numpy()[keep],
        session_id=pa.array(np.flatnonzero(keep), pa.int64()),
        turn=np.zeros(n, np.int32),
        input_length=checks["input_length"].to_numpy()[keep],
        output_length=checks["output_length"].to_numpy()[keep],
        hash_ids=empty_keys,
        block_size=512,
        extra_meta={b"kvroute.keys": b"none"},
    )
    return table, report
