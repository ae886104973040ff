"""Pass 2's output: the requests in timestamp order, in chunks of about :data:`CHUNK_KEYS`
keys, each chunk's keys computed and appended to the Parquet file as one row group (the
keys are never all in memory), and the optional progress bar. A sharded trace is the same
rows cut into files of consecutive requests (no chunk crosses a cut).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvroute.schema import BLOCK_SIZE_KEY, trace_schema
from kvroute.synth.keys import chunk_keys, key_salt
from kvroute.synth.plan import Plan
from kvroute.synth.profiles import BLOCK_SIZE, KV_BYTES_PER_TOKEN

#: Target keys per Parquet row group (pass 2 chunk); bounds the generator's working set.
CHUNK_KEYS = 4_000_000
MAX_CHUNK_ROWS = 262_144
SYNTH_META_KEY = b"kvroute.synth"


def _chunks(plan: Plan, start: int, stop: int) -> list[tuple[int, int]]:
    """Row ranges of about :data:`CHUNK_KEYS` keys covering rows ``[start, stop)``."""
    nk = (plan.inp[plan.order] + BLOCK_SIZE - 1) // BLOCK_SIZE
    cum = np.cumsum(nk)
    bounds = [start]
    while bounds[-1] < stop:
        a = bounds[-1]
        base = int(cum[a - 1]) if a else 0
        b = int(np.searchsorted(cum, base + CHUNK_KEYS, side="right"))
        bounds.append(min(max(b, a + 1), a + MAX_CHUNK_ROWS, stop))
    return list(itertools.pairwise(bounds))


_TYPES = np.array(["text", "tool"])


def progress_bar(name: str) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"synth {name}: " + "{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def write_trace(plan: Plan, paths: list[Path], n_req_arg: int, bar: Any) -> None:
    """Write the trace into ``paths``: one file, or shards of consecutive requests (shard
    ``i`` holds rows ``[i n / N, (i+1) n / N)``; its metadata says which shard it is)."""
    p = plan.profile
    schema = trace_schema(ttp=True, type_column=True, block_size=BLOCK_SIZE)
    info = {
        "profile": p.name,
        "seed": plan.seed,
        "requests": n_req_arg,
        "sessions": len(plan.turns),
        "duration_s": p.duration_s,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    }
    assert (schema.metadata or {})[BLOCK_SIZE_KEY] == str(BLOCK_SIZE).encode()
    salt = key_salt(plan.seed)
    task = bar.add_task("keys + Parquet (requests)", total=len(plan.inp)) if bar else None
    n, shards = len(plan.inp), len(paths)
    for i, path in enumerate(paths):
        meta = dict(schema.metadata or {})
        shard = {"shard": i, "shards": shards} if shards > 1 else {}
        meta[SYNTH_META_KEY] = json.dumps({**info, **shard}, sort_keys=True).encode()
        shard_schema = schema.with_metadata(meta)
        with pq.ParquetWriter(
            path,
            shard_schema,
            compression="zstd",
            compression_level=3,
            # Keys are random 64-bit values, but a chunk repeats many of them (a session's
            # turns); large pages let zstd find the repeats (about -40% vs. dictionaries).
            use_dictionary=["session_id", "turn", "type"],
            data_page_size=8 << 20,
            write_statistics=["request_id", "timestamp", "session_id", "turn"],
            write_page_checksum=True,
        ) as writer:
            for a, b in _chunks(plan, i * n // shards, (i + 1) * n // shards):
                writer.write_table(_batch(plan, a, b, salt, shard_schema), row_group_size=b - a)
                if bar:
                    bar.update(task, advance=b - a)


def _batch(plan: Plan, a: int, b: int, salt: np.uint64, schema: pa.Schema) -> pa.Table:
    """Requests ``[a, b)`` (timestamp order) with their keys."""
    rows = plan.order[a:b]
    offsets, keys = chunk_keys(plan, rows, salt)
    turn = plan.turn[rows]
    return pa.Table.from_arrays(
        [
            pa.array(np.arange(a, b, dtype=np.int64)),
            pa.array(plan.ts[rows]),
            pa.array(plan.sid[plan.sess[rows]]),
            pa.array(turn.astype(np.int32)),
            pa.array(plan.inp[rows]),
            pa.array(plan.out[rows]),
            pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(keys)),
            pa.array(plan.ttp[rows], pa.float64(), mask=turn == 0),
            pa.array(_TYPES[plan.is_tool[rows].astype(np.int64)], pa.string()),
        ],
        schema=schema,
    )
