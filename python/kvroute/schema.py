"""The canonical trace format: one Arrow schema, stored as Parquet (zstd).

Columns (see ``docs/trace-format.md``):

========================  ==========================================================
``request_id``            int64; the row number when the input has none
``timestamp``             float64 seconds from the start of the trace
``session_id``            int64 or string
``turn``                  int32, 0-based position of the request in its session
``input_length``          int64 tokens
``output_length``         int64 tokens
``hash_ids``              prefix-chained block keys: list or large_list of uint64/int64
``time_to_parent_chat``   optional float64 seconds (idle gap before this turn)
``type``                  optional string (e.g. "text", "image", "file", "search")
========================  ==========================================================

The block size lives in the schema metadata under ``kvroute.block_size`` (512 when absent).
A table with these columns is used as it is, zero-copy, whoever wrote it: :func:`conform`
only casts a column when its type differs from the canonical one.
O(1) for checks, O(rows) for a cast; stateless and thread-safe.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from kvroute.errors import InvalidArgumentError, KvrouteTypeError

BLOCK_SIZE_KEY = b"kvroute.block_size"
DEFAULT_BLOCK_SIZE = 512

REQUIRED = ("timestamp", "session_id", "turn", "input_length", "output_length", "hash_ids")
OPTIONAL = ("time_to_parent_chat", "type")
COLUMN_TYPES: dict[str, pa.DataType] = {
    "request_id": pa.int64(),
    "timestamp": pa.float64(),
    "turn": pa.int32(),
    "input_length": pa.int64(),
    "output_length": pa.int64(),
    "time_to_parent_chat": pa.float64(),
    "type": pa.string(),
}


def trace_schema(
    *,
    session_type: pa.DataType | None = None,
    large_list: bool = False,
    ttp: bool = False,
    type_column: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> pa.Schema:
    """The canonical schema with the chosen variants."""
    keys = pa.large_list(pa.uint64()) if large_list else pa.list_(pa.uint64())
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("timestamp", pa.float64(), nullable=False),
        pa.field("session_id", session_type or pa.int64(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("input_length", pa.int64(), nullable=False),
        pa.field("output_length", pa.int64(), nullable=False),
        pa.field("hash_ids", keys, nullable=False),
    ]
    if ttp:
        fields.append(pa.field("time_to_parent_chat", pa.float64()))
    if type_column:
        fields.append(pa.field("type", pa.string()))
    return pa.schema(fields, metadata={BLOCK_SIZE_KEY: str(block_size).encode()})


def block_size_of(table: pa.Table | pa.Schema) -> int:
    """The block size recorded in the metadata (512 when absent)."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    raw = (schema.metadata or {}).get(BLOCK_SIZE_KEY)
    if raw is None:
        return DEFAULT_BLOCK_SIZE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidArgumentError(
            f"schema metadata {BLOCK_SIZE_KEY.decode()} = {raw!r} is not a positive int"
        )
    return value


def with_block_size(table: pa.Table, block_size: int) -> pa.Table:
    """``table`` with ``block_size`` recorded in its schema metadata."""
    if block_size <= 0:
        raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
    meta = dict(table.schema.metadata or {})
    meta[BLOCK_SIZE_KEY] = str(block_size).encode()
    return table.replace_schema_metadata(meta)


def _is_key_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type in (
        pa.uint64(),
        pa.int64(),
    )


def conform(table: pa.Table, *, source: str = "table") -> pa.Table:
    """Check ``table`` against the canonical format; add ``request_id`` (row numbers) when
    absent and cast columns whose type differs. Errors name ``source`` and the column."""
    names = set(table.column_names)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise InvalidArgumentError(
            f"{source}: missing column(s) {', '.join(missing)}; a kvroute trace needs "
            f"{', '.join(REQUIRED)} (see docs/trace-format.md)"
        )
    block_size_of(table)
    if "request_id" not in names:
        table = table.add_column(0, "request_id", pa.array(range(table.num_rows), pa.int64()))
    for name, want in COLUMN_TYPES.items():
        if name in names or name == "request_id":
            table = _cast_column(table, name, want, source)
    sess = table.schema.field("session_id").type
    if not (
        pa.types.is_integer(sess) or pa.types.is_string(sess) or pa.types.is_large_string(sess)
    ):
        raise KvrouteTypeError(f"{source}: column session_id must be int64 or string, got {sess}")
    if pa.types.is_integer(sess) and sess != pa.int64():
        table = _cast_column(table, "session_id", pa.int64(), source)
    keys = table.schema.field("hash_ids").type
    if not _is_key_list(keys):
        if (pa.types.is_list(keys) or pa.types.is_large_list(keys)) and pa.types.is_integer(
            keys.value_type
        ):
            table = _cast_column(
                table,
                "hash_ids",
                pa.large_list(pa.uint64())
                if pa.types.is_large_list(keys)
                else pa.list_(pa.uint64()),
                source,
            )
        else:
            raise KvrouteTypeError(
                f"{source}: column hash_ids must be a list of uint64/int64, got {keys}"
            )
    check_values(table, source)
    return table


def check_values(table: pa.Table, source: str = "table") -> None:
    """Check the values of a table with canonical column types: no nulls in required
    columns or in keys, finite times, non-negative lengths, turns and think times. The first
    problem is an :class:`InvalidArgumentError` ``SOURCE: row N: field F: problem`` (N
    counts from 0). O(rows), vectorized."""
    for name in ("request_id", *REQUIRED):
        col = table.column(name)
        if col.null_count:
            _fail(source, col, col.is_null(), name, "null where a value is required")
    keys = pc.list_flatten(table.column("hash_ids"))
    if keys.null_count:
        rows = pc.list_parent_indices(table.column("hash_ids"))
        first = rows[pc.index(keys.is_null(), True).as_py()].as_py()
        raise InvalidArgumentError(f"{source}: row {first}: field hash_ids: a null key")
    rules: list[tuple[str, bool, bool]] = [  # column, must be finite, must be >= 0
        ("timestamp", True, False),
        ("time_to_parent_chat", True, True),
        ("turn", False, True),
        ("input_length", False, True),
        ("output_length", False, True),
    ]
    for name, finite, non_negative in rules:
        if name not in table.column_names:
            continue
        col = table.column(name)
        if finite:
            bad = pc.invert(pc.is_finite(col))
            if pc.any(bad).as_py():
                _fail(source, col, bad, name, "not a finite number")
        if non_negative:
            bad = pc.less(col, 0)
            if pc.any(bad).as_py():
                _fail(source, col, bad, name, "negative")


def _fail(source: str, col: pa.ChunkedArray, bad: pa.ChunkedArray, name: str, problem: str) -> None:
    row = pc.index(pc.fill_null(bad, False), True).as_py()
    raise InvalidArgumentError(
        f"{source}: row {row}: field {name}: {problem}, got {col[row].as_py()!r:.40}"
    )


def _cast_column(table: pa.Table, name: str, want: pa.DataType, source: str) -> pa.Table:
    col = table.column(name)
    if col.type == want:
        return table
    try:
        cast = col.cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise KvrouteTypeError(
            f"{source}: column {name} of type {col.type} cannot be read as {want}: {exc}"
        ) from exc
    return table.set_column(table.schema.get_field_index(name), pa.field(name, want), cast)
