"""Plumbing of :mod:`kvroute.sim`: a trace as numpy columns for the native simulator, run
specifications, and a run's output as Arrow tables (the one record schema of
:mod:`kvroute.records`, and the per-instance time series).

The trace is converted once per call (sessions dictionary-encoded, ``hash_ids`` flattened;
one copy of the key buffer when the table has several chunks); runs then borrow it. O(rows +
keys); stateless and thread-safe.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvroute import _core
from kvroute.errors import InvalidArgumentError
from kvroute.files import write_parquet, write_text
from kvroute.metrics import summarize
from kvroute.records import record_schema, write_records
from kvroute.schema import block_size_of

ERRORS = {0: None, 1: "exceeds the engine's KV capacity", 2: "not sent"}
SERIES_SCHEMA = pa.schema(
    [
        ("time", pa.float64()),
        ("instance", pa.int32()),
        ("running", pa.int32()),
        ("waiting", pa.int32()),
        ("kv_used_blocks", pa.int64()),
        ("kv_cached_blocks", pa.int64()),
        ("kv_usage", pa.float64()),
    ]
)


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: policy (``capped`` = ``lmetric`` on the turn-capped trace),
    dispatch mode, Poisson rate, seed and policy parameters."""

    policy: str = "unified"
    mode: str = "thinktime"
    rate: float | None = None
    seed: int = 0
    params: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A directory-safe name, e.g. ``unified-thinktime-seed0-overload_factor=1.3``."""
        parts = [self.policy, self.mode]
        if self.rate is not None:
            parts.append(f"rate={self.rate:.6g}")
        parts.append(f"seed{self.seed}")
        parts += [f"{k}={v:g}" for k, v in sorted(self.params.items())]
        return "-".join(parts)


@dataclass
class SimResult:
    """One run: per-request ``records``, per-instance time series ``instances``, the
    ``summary`` of semantics §6, engine/loop ``stats`` and the ``run`` metadata."""

    spec: RunSpec
    records: pa.Table
    instances: pa.Table
    summary: dict[str, Any]
    stats: dict[str, Any]
    run: dict[str, Any]

    def write(self, out_dir: str | Path) -> Path:
        """Write ``records.parquet``, ``instances.parquet`` and ``summary.json``."""
        out = Path(out_dir)
        write_records(self.records, out / "records.parquet")
        write_parquet(self.instances, out / "instances.parquet")
        doc = {"run": self.run, "summary": self.summary, "stats": self.stats}
        write_text(out / "summary.json", json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return out


def trace_columns(table: pa.Table) -> dict[str, Any]:
    """The numpy columns ``_core.simulate_runs`` reads."""
    n = table.num_rows
    if n == 0:
        raise InvalidArgumentError("the trace has no requests")
    sess = table.column("session_id").combine_chunks().dictionary_encode()
    # The keys stay in Arrow's chunks (no 1-GB concatenation at full scale); the offsets are
    # rebased so that they index the chunks laid end to end.
    chunks, offsets, base = [], [np.zeros(1, np.int64)], 0
    for chunk in table.column("hash_ids").chunks:
        off = np.asarray(chunk.offsets, dtype=np.int64)
        values = np.asarray(chunk.flatten().to_numpy(zero_copy_only=False))
        if values.dtype == np.int64:
            values = values.view(np.uint64)
        chunks.append(np.ascontiguousarray(values, dtype=np.uint64))
        offsets.append(off[1:] - off[0] + base)
        base += len(values)
    ttp = None
    if "time_to_parent_chat" in table.column_names:
        col = table.column("time_to_parent_chat").combine_chunks()
        ttp = np.ascontiguousarray(col.fill_null(np.nan).to_numpy(), dtype=np.float64)
    return {
        "timestamp": np.ascontiguousarray(table.column("timestamp").to_numpy(), dtype=np.float64),
        "session": np.ascontiguousarray(sess.indices.to_numpy(), dtype=np.uint32),
        "turn": np.ascontiguousarray(table.column("turn").to_numpy(), dtype=np.int32),
        "input_length": np.ascontiguousarray(table.column("input_length").to_numpy(), np.int64),
        "output_length": np.ascontiguousarray(table.column("output_length").to_numpy(), np.int64),
        "offsets": np.concatenate(offsets),
        "keys": chunks,
        "ttp": ttp,
        "block_size": block_size_of(table),
    }


def records_table(table: pa.Table, raw: dict[str, Any], run: dict[str, Any]) -> pa.Table:
    """The run's records in the schema of :mod:`kvroute.records`, in trace row order."""
    err = raw["error"]
    ok = err == 0
    sess = table.column("session_id").combine_chunks()
    stype = (
        pa.string()
        if pa.types.is_string(sess.type) or pa.types.is_large_string(sess.type)
        else None
    )
    out_len = np.where(ok, raw["output_length"], table.column("output_length").to_numpy())
    cols = {
        "request_id": table.column("request_id").combine_chunks(),
        "session_id": sess.cast(pa.string()) if stype else sess,
        "turn": table.column("turn").combine_chunks(),
        "instance": pa.array(raw["instance"], pa.int32()),
        "send": pa.array(np.nan_to_num(raw["send"], nan=0.0), pa.float64()),
        "first_token": pa.array(raw["first_token"], pa.float64(), from_pandas=True),
        "finish": pa.array(np.nan_to_num(raw["finish"], nan=0.0), pa.float64()),
        "input_length": table.column("input_length").combine_chunks(),
        "output_length": pa.array(out_len, pa.int64()),
        "cached_tokens": pa.array(raw["cached_tokens"], pa.int64(), mask=~ok),
        "estimated_hit_tokens": pa.array(raw["estimated_hit_tokens"], pa.int64(), mask=err == 2),
        "queue_wait": pa.array(raw["queue_wait"], pa.float64(), from_pandas=True),
        "preemptions": pa.array(raw["preemptions"], pa.int32(), mask=~ok),
        "decode_overlaps_prefill": pa.array(raw["decode_overlaps_prefill"], pa.bool_(), mask=~ok),
        "error": pa.array(
            [ERRORS[int(e)] for e in err] if not ok.all() else [None] * len(err), pa.string()
        ),
    }
    schema = record_schema(stype, run)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def series_table(raw: dict[str, Any], total_blocks: int) -> pa.Table:
    """The per-instance time series."""
    s = raw["series"]
    used = s["kv_used_blocks"]
    usage = used / max(total_blocks, 1)
    arrays = [
        s["time"],
        s["instance"],
        s["running"],
        s["waiting"],
        used,
        s["kv_cached_blocks"],
        usage,
    ]
    return pa.Table.from_arrays(
        [pa.array(a, f.type) for a, f in zip(arrays, SERIES_SCHEMA, strict=True)],
        schema=SERIES_SCHEMA.with_metadata(
            {b"kvroute.kv_total_blocks": str(total_blocks).encode()}
        ),
    )


def execute(
    traces: list[pa.Table], jobs: list[tuple[int, RunSpec, dict[str, Any]]], base: dict[str, Any]
) -> list[SimResult]:
    """Run ``jobs`` (trace index, spec, native config) in parallel; results in order."""
    cols = [trace_columns(t) for t in traces]
    raws = _core.simulate_runs(cols, [cfg for _, _, cfg in jobs])
    results = []
    for (ti, spec, cfg), raw in zip(jobs, raws, strict=True):
        run = {
            **base,
            **asdict(spec),
            "source": "sim",
            "instances": cfg["instances"],
            "preset": cfg["preset"],
            "engine": cfg.get("engine") or {},
            "router_cache": cfg["router_cache"],
            "sample_interval": cfg["sample_interval"],
        }
        stats = dict(raw["stats"])
        records = records_table(traces[ti], raw, run)
        summary = summarize(records, cfg["instances"])
        results.append(
            SimResult(
                spec, records, series_table(raw, int(stats["kv_total_blocks"])), summary, stats, run
            )
        )
    return results
