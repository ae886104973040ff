"""Lengths-only CSV traces (the Azure LLM inference traces, or the canonical column names):
timestamps and token counts without keys. O(rows) with polars.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from kvroute.errors import InvalidArgumentError
from kvroute.jsonl import LoadReport, OnError
from kvroute.trace_formats.common import canonical

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
        try:
            dt = ts_raw.str.to_datetime(strict=False, time_unit="us")
            ts = (dt.dt.epoch("us").cast(pl.Float64) / 1e6).alias("ts")
        except pl.exceptions.PolarsError:
            pass  # no date format fits: the rows that are not numbers are reported below
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
