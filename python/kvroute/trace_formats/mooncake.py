"""Mooncake JSONL traces (``timestamp`` in ms, lengths, chained ``hash_ids``) and the
opt-in session inference from shared key prefixes. Loading is O(rows + keys) vectorized;
inference is a Python loop over the requests, at most one dict lookup per key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from kvroute.jsonl import LoadReport, OnError, is_count, is_key_list, is_number, read_jsonl
from kvroute.trace_formats.common import (
    KEYS_I64,
    canonical,
    flat_keys,
    keys_u64,
    negative_row,
    turns_by_time,
)

MIN_SESSION_PREFIX_BLOCKS = 3


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
        row_check=lambda t: negative_row(t, "input_length", "output_length"),
    )
    n = raw.num_rows
    keys = keys_u64(raw.column("hash_ids"))
    ts = raw.column("timestamp").to_numpy() / 1000.0
    rid = np.arange(n, dtype=np.int64)
    if infer_sessions:
        order = np.argsort(ts, kind="stable")
        session = np.empty(n, dtype=np.int64)
        session[order] = infer_prefix_sessions(keys.take(pa.array(order)), rid[order])
        turn = turns_by_time(pa.array(session), ts)
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
    values, offsets = flat_keys(keys)
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
