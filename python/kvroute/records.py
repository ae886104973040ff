"""Per-request records: the one schema that the simulator and the HTTP replayer both write,
and that metrics and reports read. Arrow, stored as zstd Parquet.

=============================  =====================================================
``request_id``                 int64, the trace's request id
``session_id``                 int64 or string, as in the trace
``turn``                       int32
``instance``                   int32, the engine the router chose (-1: none, failed)
``send``                       float64 s since the run started: request sent
``first_token``                float64 s: first token arrived (null: never)
``finish``                     float64 s: last token arrived, or the failure
``input_length``               int64 prompt tokens
``output_length``              int64 tokens generated
``cached_tokens``              int64 prefix-cache hit the engine reported (null: unknown)
``estimated_hit_tokens``       int64 the router's estimate at routing time
``queue_wait``                 float64 s from arrival at the engine to first scheduling
                               (null: unknown, e.g. a real engine)
``router_wait``                float64 s in the router's admission queue before routing
                               (0: routed on arrival; null: unknown, no kvroute proxy)
``preemptions``                int32 times the engine preempted it (null: unknown)
``decode_overlaps_prefill``    bool: another request's prefill ran on the same instance
                               during this one's decode (null: derive from intervals)
``error``                      string, null when the request succeeded
=============================  =====================================================

Run-level facts (policy, mode, instances, trace, seed, source) are JSON in the schema
metadata under ``kvroute.run``. Stateless helpers, thread-safe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvroute.errors import InvalidArgumentError
from kvroute.files import read_parquet, write_parquet

RUN_KEY = b"kvroute.run"

_FIELDS: list[tuple[str, pa.DataType, bool]] = [
    ("request_id", pa.int64(), False),
    ("turn", pa.int32(), False),
    ("instance", pa.int32(), False),
    ("send", pa.float64(), False),
    ("first_token", pa.float64(), True),
    ("finish", pa.float64(), False),
    ("input_length", pa.int64(), False),
    ("output_length", pa.int64(), False),
    ("cached_tokens", pa.int64(), True),
    ("estimated_hit_tokens", pa.int64(), True),
    ("queue_wait", pa.float64(), True),
    ("router_wait", pa.float64(), True),
    ("preemptions", pa.int32(), True),
    ("decode_overlaps_prefill", pa.bool_(), True),
    ("error", pa.string(), True),
]
COLUMNS = ["request_id", "session_id", *(name for name, _, _ in _FIELDS[1:])]


def record_schema(
    session_type: pa.DataType | None = None, run: dict[str, Any] | None = None
) -> pa.Schema:
    """The record schema; ``run`` goes into the metadata."""
    fields = [pa.field(n, t, nullable=nullable) for n, t, nullable in _FIELDS]
    fields.insert(1, pa.field("session_id", session_type or pa.int64(), nullable=False))
    meta = {RUN_KEY: json.dumps(run or {}, sort_keys=True).encode()}
    return pa.schema(fields, metadata=meta)


def run_info(records: pa.Table) -> dict[str, Any]:
    """The run-level facts stored with the records."""
    raw = (records.schema.metadata or {}).get(RUN_KEY)
    return dict(json.loads(raw)) if raw else {}


def conform_records(table: pa.Table, *, source: str = "records") -> pa.Table:
    """Check a records table: required columns present, castable to the schema's types;
    optional columns absent are added as nulls."""
    names = set(table.column_names)
    missing = [
        c
        for c in (
            "request_id",
            "session_id",
            "instance",
            "send",
            "finish",
            "input_length",
            "output_length",
        )
        if c not in names
    ]
    if missing:
        raise InvalidArgumentError(f"{source}: missing record column(s) {', '.join(missing)}")
    sess = table.schema.field("session_id").type
    schema = record_schema(sess if pa.types.is_string(sess) else pa.int64())
    cols = []
    for f in schema:
        if f.name in names:
            col = table.column(f.name)
            try:
                cols.append(col if col.type == f.type else col.cast(f.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise InvalidArgumentError(
                    f"{source}: record column {f.name} of type {col.type} is not {f.type}"
                ) from exc
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(
        cols, schema=schema.with_metadata(table.schema.metadata or schema.metadata)
    )


def write_records(records: pa.Table, path: str | Path, *, force: bool = True) -> Path:
    """Write records as zstd Parquet, atomically (:mod:`kvroute.files`)."""
    return write_parquet(conform_records(records), path, force=force)


def read_records(path: str | Path) -> pa.Table:
    """Read and check a records Parquet file."""
    return conform_records(read_parquet(path), source=str(path))
