"""What the format loaders share: the format names, JSONL dialect detection, Arrow/numpy
helpers for key columns (int64 -> uint64 lists, flattening), null/negative row checks,
turn numbering by time, and :func:`canonical`, which assembles the canonical table.
O(rows + keys) vectorized, plus the sorts by timestamp (O(rows log rows)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from kvroute.errors import InvalidArgumentError
from kvroute.schema import BLOCK_SIZE_KEY

FORMATS = ("parquet", "mooncake", "bailian", "agentic", "text", "csv")
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


def negative_row(table: pa.Table, *names: str) -> tuple[int, str, str] | None:
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


def keys_u64(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A list<int64> column reinterpreted as list<uint64> (same bits, no copy of values)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.offset or arr.null_count:
        arr = pa.concat_arrays([arr.fill_null([])]) if arr.null_count else arr
    values = arr.flatten().to_numpy(zero_copy_only=False).view(np.uint64)
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint64()))


def flat_keys(col: pa.Array) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    values = col.flatten().to_numpy(zero_copy_only=False)
    offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    return values.view(np.uint64) if values.dtype == np.int64 else values, offsets - offsets[0]


def turns_by_time(session: pa.Array, timestamp: npt.NDArray[np.float64]) -> npt.NDArray[np.int32]:
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
