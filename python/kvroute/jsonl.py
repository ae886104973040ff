"""Reading JSON Lines into Arrow with errors that name the file, line and field.

The fast path is Arrow's own JSON reader (C++, no Python object per value). Only when it
fails, or when a column check fails, does :func:`read_jsonl` walk the file line by line in
Python to find the first bad line (``on_error="raise"``) or every bad line
(``on_error="skip"``, which then re-reads the good lines with Arrow). O(file size);
stateless, thread-safe.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.json as pajson

from kvroute.errors import InvalidArgumentError

OnError = Literal["raise", "skip"]
Check = Callable[[Any], str | None]


@dataclass
class LoadReport:
    """What a load read and what it skipped."""

    path: str
    format: str
    rows: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line for humans."""
        text = f"{self.path}: {self.rows} rows as {self.format}"
        if self.skipped:
            first = "; ".join(f"line {n}: {why}" for n, why in self.skipped[:3])
            more = "; ..." if len(self.skipped) > 3 else ""
            text += f", {len(self.skipped)} bad line(s) skipped ({first}{more})"
        return text


def is_int(v: Any) -> str | None:
    return (
        None
        if isinstance(v, int) and not isinstance(v, bool)
        else f"expected an integer, got {v!r:.40}"
    )


def is_count(v: Any) -> str | None:
    return is_int(v) or (None if v >= 0 else f"expected a non-negative integer, got {v}")


def is_number(v: Any) -> str | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return None if ok else f"expected a finite number, got {v!r:.40}"


def is_str(v: Any) -> str | None:
    return None if isinstance(v, str) else f"expected a string, got {type(v).__name__}"


def is_id(v: Any) -> str | None:
    return (
        None
        if isinstance(v, str) or is_int(v) is None
        else f"expected an int or a string, got {v!r:.40}"
    )


def is_key_list(v: Any) -> str | None:
    if not isinstance(v, list):
        return f"expected a list of integers, got {type(v).__name__}"
    for i, k in enumerate(v):
        if isinstance(k, bool) or not isinstance(k, int) or not -(2**63) <= k < 2**64:
            return f"item {i} is {k!r:.40}, expected a 64-bit integer"
    return None


def read_jsonl(
    path: Path,
    fmt: str,
    required: Mapping[str, Check],
    optional: Mapping[str, Check],
    schema: pa.Schema,
    *,
    on_error: OnError = "raise",
    row_check: Callable[[pa.Table], tuple[int, str, str] | None] | None = None,
) -> tuple[pa.Table, LoadReport]:
    """Read ``path`` with the columns of ``schema`` (others ignored). ``required`` and
    ``optional`` give the per-field checks used to explain a failure. ``row_check`` runs
    vectorized checks on the parsed table and returns ``(row, field, problem)`` for the first
    bad row."""
    report = LoadReport(str(path), fmt)
    if on_error not in ("raise", "skip"):
        raise InvalidArgumentError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    table: pa.Table | None = None
    try:
        with path.open("rb") as f:
            table = _arrow_read(f, schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        table = None
    if table is not None:
        has_nulls = any(table.column(n).null_count for n in required if n in schema.names)
        bad = None if row_check is None else row_check(table)
        if bad is None and not has_nulls:
            report.rows = table.num_rows
            return table, report
    # Slow path: find the offending lines.
    good = io.BytesIO()
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            problem = _check_line(raw, required, optional)
            if problem is None and row_check is not None:
                one = _arrow_read(io.BytesIO(raw), schema, lenient=True)
                if one is not None:
                    hit = row_check(one)
                    problem = None if hit is None else f"field {hit[1]}: {hit[2]}"
                else:
                    problem = _typed_problem(raw, schema)
            if problem is not None:
                if on_error == "raise":
                    raise InvalidArgumentError(f"{path}:{lineno}: {problem}")
                report.skipped.append((lineno, problem))
                continue
            good.write(raw if raw.endswith(b"\n") else raw + b"\n")
    good.seek(0)
    table = _arrow_read(good, schema, lenient=True) if good.getbuffer().nbytes else None
    if table is None:
        table = schema.empty_table()
    report.rows = table.num_rows
    return table, report


def _arrow_read(source: Any, schema: pa.Schema, lenient: bool = False) -> pa.Table | None:
    try:
        return pajson.read_json(
            source,
            read_options=pajson.ReadOptions(block_size=1 << 24),
            parse_options=pajson.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        if lenient:
            return None
        raise


def _check_line(
    raw: bytes, required: Mapping[str, Check], optional: Mapping[str, Check]
) -> str | None:
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start})"
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for name, check in required.items():
        if name not in row:
            return f"missing field {name}"
        problem = check(row[name])
        if problem:
            return f"field {name}: {problem}"
    for name, check in optional.items():
        if row.get(name) is not None and (problem := check(row[name])):
            return f"field {name}: {problem}"
    return None


def _typed_problem(raw: bytes, schema: pa.Schema) -> str:
    """Which field of a line Arrow could not read with ``schema``'s types, and why."""
    row = json.loads(raw)
    for f in schema:
        if row.get(f.name) is None:
            continue
        try:
            pa.array([row[f.name]], type=f.type)
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            return f"field {f.name}: {row[f.name]!r:.40} cannot be read as {f.type} ({exc})"
    return "cannot be read with the expected types"


def first_json_object(path: Path) -> dict[str, Any]:
    """The first non-blank line of a JSONL file, parsed (for format detection)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                    raise InvalidArgumentError(f"{path}:{lineno}: not valid JSON ({why})") from exc
                if not isinstance(obj, dict):
                    raise InvalidArgumentError(f"{path}:{lineno}: expected a JSON object")
                return obj
    raise InvalidArgumentError(f"{path}: the file has no JSON lines")
