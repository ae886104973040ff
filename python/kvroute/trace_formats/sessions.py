"""JSONL traces that name their sessions: Bailian-style (a ``parent_chat_id`` chain per
chat, unchained 16-token block ids, re-chained here) and agentic (``session_id`` and turn
per request). O(rows + keys) vectorized; the parent chains are resolved by pointer
jumping, O(rows log depth).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from kvroute._core import chain_ids_lists
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
from kvroute.trace_formats.common import (
    KEYS_I64,
    canonical,
    flat_keys,
    keys_u64,
    negative_row,
    turns_by_time,
)


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
        row_check=lambda t: negative_row(t, "input_length", "output_length"),
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
    turn = turns.to_numpy() if turns.null_count == 0 else turns_by_time(pa.array(session), ts)
    keys = keys_u64(raw.column("hash_ids"))
    values, offsets = flat_keys(keys)
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
        row_check=lambda t: negative_row(t, "input_length", "output_length"),
    )
    ts = raw.column("timestamp").to_numpy()
    session = raw.column("session_id").combine_chunks()
    turn_col = raw.column("turn") if raw.column("turn").null_count == 0 else raw.column("turn_id")
    turn = turn_col.to_numpy() if turn_col.null_count == 0 else turns_by_time(session, ts)
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
        hash_ids=keys_u64(raw.column("hash_ids")),
        block_size=block_size,
        ttp=raw.column("time_to_parent_chat") if has_ttp else None,
        types=raw.column("type") if has_type else None,
    )
    return table, report
