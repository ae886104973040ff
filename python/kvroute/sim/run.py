"""Plumbing of :mod:`kvroute.sim`: a trace as numpy columns for the native simulator, run
specifications, and a run's output as Arrow tables (the one record schema of
:mod:`kvroute.records`, and the per-instance time series).

The trace is converted once per call (sessions dictionary-encoded, ``hash_ids`` flattened;
one copy of the key buffer when the table has several chunks); runs then borrow it. O(rows +
keys); stateless and thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvroute import _core
from kvroute.errors import CorruptFileError, InvalidArgumentError
from kvroute.files import read_parquet, write_parquet, write_text
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

    @classmethod
    def read(cls, run_dir: str | Path) -> SimResult:
        """A result :meth:`write` wrote (``summary.json`` is written last: a folder without
        it is an interrupted write)."""
        folder = Path(run_dir)
        try:
            doc = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
            run = doc["run"]
            spec = RunSpec(run["policy"], run["mode"], run["rate"], run["seed"], run["params"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(f"{folder / 'summary.json'}: not a run summary ({exc})") from exc
        records = read_parquet(folder / "records.parquet")
        series = read_parquet(folder / "instances.parquet")
        return cls(spec, records, series, doc["summary"], doc["stats"], run)


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
        "router_wait": pa.array(raw["router_wait"], pa.float64(), from_pandas=True),
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


def run_meta(base: dict[str, Any], spec: RunSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``run`` metadata of a result: what a run was, as written in its summary."""
    return {
        **base,
        **asdict(spec),
        "source": "sim",
        "instances": cfg["instances"],
        "preset": cfg["preset"],
        "engine": cfg.get("engine") or {},
        "router_cache": cfg["router_cache"],
        "sample_interval": cfg["sample_interval"],
    }


def _result(
    table: pa.Table, spec: RunSpec, cfg: dict[str, Any], raw: dict[str, Any], run: dict[str, Any]
) -> SimResult:
    stats = dict(raw["stats"])
    records = records_table(table, raw, run)
    summary = summarize(records, cfg["instances"])
    series = series_table(raw, int(stats["kv_total_blocks"]))
    return SimResult(spec, records, series, summary, stats, run)


def _simulate_one(cols: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """One run, as a Ray task: the trace's columns come from the object store."""
    return dict(_core.simulate_runs([cols], [cfg])[0])


def execute(
    traces: list[pa.Table],
    jobs: list[tuple[int, RunSpec, dict[str, Any]]],
    base: dict[str, Any],
    *,
    executor: str = "local",
    ray_address: str | None = None,
    on_result: Callable[[SimResult], object] | None = None,
) -> list[SimResult]:
    """Run ``jobs`` (trace index, spec, native config); results in order. ``local``: one
    call into the core, which runs them on every core; ``ray``: each trace's columns go to
    the object store once and each job is a task, its result handed to ``on_result`` as it
    arrives (locally, all arrive at the end)."""
    if not jobs:
        return []
    cols = [trace_columns(t) for t in traces]
    if executor == "local":
        raws = _core.simulate_runs(cols, [cfg for _, _, cfg in jobs])
        results = []
        for (ti, spec, cfg), raw in zip(jobs, raws, strict=True):
            results.append(_result(traces[ti], spec, cfg, raw, run_meta(base, spec, cfg)))
            if on_result is not None:
                on_result(results[-1])
        return results
    from kvroute.distributed import completed, connected

    out: list[SimResult | None] = [None] * len(jobs)
    with connected(ray_address) as ray:
        task = ray.remote(num_cpus=1)(_simulate_one)
        refs = [ray.put(c) for c in cols]
        # Each task gets its own trace only, as trace 0.
        pending = [task.remote(refs[ti], {**cfg, "trace": 0}) for ti, _, cfg in jobs]
        for i, raw in completed(ray, pending):
            ti, spec, cfg = jobs[i]
            result = _result(traces[ti], spec, cfg, raw, run_meta(base, spec, cfg))
            out[i] = result
            if on_result is not None:
                on_result(result)
    return [r for r in out if r is not None]
