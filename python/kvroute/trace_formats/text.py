"""Text traces (JSONL with prompt and reply text): the prompts are tokenized and keyed
here, so loading is O(text) and dominated by the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvroute._core import block_hashes
from kvroute.errors import InvalidArgumentError
from kvroute.jsonl import LoadReport, OnError, is_id, is_int, is_str, read_jsonl
from kvroute.tokenize import load_tokenizer
from kvroute.trace_formats.common import canonical, turns_by_time


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
        turn=turns_by_time(session, ts),
        input_length=in_len,
        output_length=out_len,
        hash_ids=keys,
        block_size=block_size,
        extra_meta={b"kvroute.tokenizer": tok.name.encode()},
    )
    return table, report
