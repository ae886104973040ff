"""Reading and writing traces in the canonical format (:mod:`kvroute.schema`).

:func:`read_trace` takes a path (Parquet, JSONL in one of four dialects, CSV, or a directory
of text-trace JSONL files), a pyarrow Table or a polars DataFrame, and returns a pyarrow
Table in the canonical format. Parquet and tables are used as they are (zero-copy); JSONL is
parsed by Arrow's reader (see :mod:`kvroute.jsonl` for errors), then converted with
vectorized Arrow/numpy code. :func:`write_trace` writes zstd Parquet.

Format rules (``docs/trace-format.md``): ``mooncake`` (ms timestamps, 512-token chained keys,
no sessions), ``bailian`` (``chat_id``/``parent_chat_id``, float seconds, 16-token unchained
ids), ``agentic`` (``session_id``, ``turn``/``turn_id``, ``time_to_parent_chat``), ``text``
(prompt text, µs timestamps, tokenized here) and ``csv`` (lengths only). Stateless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvroute import args, jsonl
from kvroute.errors import InvalidArgumentError, KvrouteTypeError
from kvroute.files import read_parquet, write_parquet
from kvroute.jsonl import LoadReport, OnError
from kvroute.schema import BLOCK_SIZE_KEY, block_size_of, conform, with_block_size
from kvroute.trace_formats import (
    FORMATS,
    detect_jsonl_format,
    from_agentic,
    from_bailian,
    from_csv,
    from_mooncake,
    from_text,
)

KEYS_KEY = b"kvroute.keys"


def read_trace(
    source: Any,
    *,
    format: str | None = None,
    block_size: int | None = None,
    infer_sessions: bool = False,
    on_error: OnError = "raise",
    tokenizer: Any = None,
) -> pa.Table:
    """Read a trace into the canonical format. See :func:`read_trace_with_report`."""
    return read_trace_with_report(
        source,
        format=format,
        block_size=block_size,
        infer_sessions=infer_sessions,
        on_error=on_error,
        tokenizer=tokenizer,
    )[0]


def read_trace_with_report(
    source: Any,
    *,
    format: str | None = None,
    block_size: int | None = None,
    infer_sessions: bool = False,
    on_error: OnError = "raise",
    tokenizer: Any = None,
) -> tuple[pa.Table, LoadReport]:
    """Read a trace and say what was read and skipped.

    ``format``: one of ``FORMATS`` (detected from the suffix and the first line when None).
    ``block_size``: tokens per key for formats that do not fix it (agentic, text; 512).
    ``infer_sessions``: group Mooncake requests into sessions (see ``docs/trace-format.md``).
    ``on_error``: ``"raise"`` stops at the first bad line with file, line and field;
    ``"skip"`` skips bad lines and counts them in the report.
    ``tokenizer``: for text traces: ``"builtin"`` (default), a ``tokenizer.json`` path, or an
    object with ``encode(text) -> uint32 array``.
    """
    if format is not None and args.text(format, "format") not in FORMATS:
        raise InvalidArgumentError(f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    if block_size is not None:
        block_size = args.integer(block_size, "block_size", 1, 2**32)
    args.flag(infer_sessions, "infer_sessions")
    args.text(on_error, "on_error", ("raise", "skip"))
    if not (tokenizer is None or isinstance(tokenizer, str | Path) or hasattr(tokenizer, "encode")):
        raise KvrouteTypeError(
            "tokenizer must be None, 'builtin', a tokenizer.json path or an object with "
            f"encode(text), got {type(tokenizer).__name__}"
        )
    if isinstance(source, pa.Table):
        return conform(source), LoadReport("<table>", "arrow", source.num_rows)
    if type(source).__module__.startswith("polars"):
        table = source.to_arrow()
        return conform(table, source="<polars DataFrame>"), LoadReport(
            "<polars>", "arrow", table.num_rows
        )
    if not isinstance(source, str | Path):
        raise KvrouteTypeError(
            "trace must be a path, a pyarrow Table or a polars DataFrame, "
            f"got {type(source).__name__}"
        )
    path = args.path(source, "trace")
    if not path.exists():
        raise InvalidArgumentError(f"trace not found: {path}")
    fmt = format or _detect(path)
    if fmt == "parquet":
        table = conform(read_parquet(path), source=str(path))
        return table, LoadReport(str(path), fmt, table.num_rows)
    if fmt == "csv":
        table, report = from_csv(path, on_error=on_error)
    elif fmt == "text":
        table, report = from_text(path, tokenizer, block_size or 512, on_error=on_error)
    elif fmt == "bailian":
        table, report = from_bailian(path, on_error=on_error)
    elif fmt == "agentic":
        table, report = from_agentic(path, block_size or 512, on_error=on_error)
    else:
        table, report = from_mooncake(path, block_size or 512, infer_sessions, on_error=on_error)
    return conform(table, source=str(path)), report


def write_trace(
    table: Any, path: str | Path, *, block_size: int | None = None, force: bool = True
) -> Path:
    """Write a trace (any :func:`read_trace` source) as zstd Parquet with page checksums,
    atomically (:mod:`kvroute.files`); returns the path. ``force=False`` refuses an existing
    file (:class:`~kvroute.errors.OutputExistsError`)."""
    args.path(path, "path")
    force = args.flag(force, "force")
    if block_size is not None:
        block_size = args.integer(block_size, "block_size", 1, 2**32)
    t = read_trace(table) if not isinstance(table, pa.Table) else conform(table)
    if block_size is not None:
        t = with_block_size(t, block_size)
    return write_parquet(t, path, force=force)


def has_keys(table: pa.Table) -> bool:
    """Whether the trace carries block keys (a lengths-only CSV does not)."""
    return (table.schema.metadata or {}).get(KEYS_KEY) != b"none"


def _detect(path: Path) -> str:
    if path.is_dir():
        return "text"
    suffix = "".join(path.suffixes[-2:]).lower()
    if suffix.endswith((".parquet", ".pq")):
        return "parquet"
    if suffix.endswith(".csv"):
        return "csv"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        return "parquet"
    return detect_jsonl_format(jsonl.first_json_object(path), path)


def sort_by_time(table: pa.Table) -> pa.Table:
    """Stable sort by timestamp (ties keep their order)."""
    ts = table.column("timestamp").to_numpy()
    order = np.argsort(ts, kind="stable")
    if np.all(order[:-1] < order[1:]):
        return table
    return table.take(pa.array(order))


__all__ = [
    "BLOCK_SIZE_KEY",
    "FORMATS",
    "LoadReport",
    "block_size_of",
    "has_keys",
    "read_trace",
    "read_trace_with_report",
    "sort_by_time",
    "write_trace",
]
