"""The study's trace transforms and statistics, on canonical trace tables.

* :func:`sample`: a time window, a seeded fraction of its sessions, and a cap on the share
  of single-turn sessions (the study's ``sample_trace.py``).
* :func:`cap_sessions`: the first ``max_turns`` requests of every session (the ``capped``
  ablation, ``docs/semantics.md`` §3).
* :func:`shrink`: the same prefix structure in smaller blocks (each block keeps its key and
  holds ``block_size`` tokens instead), outputs capped: a long-prompt trace that fits a small
  engine's context (``docs/simulator.md`` "Side by side").
* :func:`annotate_ttp`: fill ``time_to_parent_chat`` for ``thinktime`` dispatch.
* :func:`trace_stats`: sizes, turns per session, length percentiles and per-request KV
  footprint for a model; :func:`plot_cdf` draws the CDFs.

All are vectorized (polars/numpy), O(rows log rows), deterministic, and keep the schema
metadata. Stateless and thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from kvroute.errors import InvalidArgumentError
from kvroute.files import save_figure
from kvroute.schema import block_size_of, with_block_size

TTP_BASIS_KEY = b"kvroute.ttp_basis"


@dataclass(frozen=True)
class KvModel:
    """What sets a model's KV bytes per token: ``2 * layers * kv_heads * head_dim * dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


MODELS = {
    "qwen3-coder-30b-a3b": KvModel(48, 4, 128, 2),  # 98304 B/token, the study's model
    "qwen2.5-7b": KvModel(28, 4, 128, 2),
    "llama-3.1-8b": KvModel(32, 8, 128, 2),
    "llama-3.1-70b": KvModel(80, 8, 128, 2),
}


def _frame(table: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(table.drop_columns(["hash_ids"]))
    assert isinstance(df, pl.DataFrame)
    return df.with_row_index("_row")


def _take(table: pa.Table, rows: np.ndarray[Any, Any]) -> pa.Table:
    return table.take(pa.array(rows, pa.int64())).replace_schema_metadata(table.schema.metadata)


def sample(
    table: pa.Table,
    *,
    window_seconds: float | None = None,
    window_start: float = 0.0,
    sample_ratio: float = 1.0,
    max_single_turn_ratio: float | None = None,
    seed: int = 0,
) -> pa.Table:
    """Sessions that start inside ``[window_start, window_start + window_seconds)``, a
    ``sample_ratio`` fraction of them chosen with ``seed``, and at most
    ``max_single_turn_ratio`` of the kept sessions single-turn (extra single-turn sessions
    are dropped, the ones with the highest draws first). Kept: those sessions' requests
    inside the window, timestamps shifted so the window starts at 0."""
    if not 0.0 < sample_ratio <= 1.0:
        raise InvalidArgumentError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
    if max_single_turn_ratio is not None and not 0.0 <= max_single_turn_ratio < 1.0:
        raise InvalidArgumentError(
            f"max_single_turn_ratio must be in [0, 1), got {max_single_turn_ratio}"
        )
    if window_seconds is not None and window_seconds <= 0:
        raise InvalidArgumentError(f"window_seconds must be positive, got {window_seconds}")
    end = np.inf if window_seconds is None else window_start + window_seconds
    df = _frame(table).filter((pl.col("timestamp") >= window_start) & (pl.col("timestamp") < end))
    sessions = (
        df.group_by("session_id")
        .agg(pl.col("timestamp").min().alias("start"), pl.len().alias("n"))
        .sort("session_id")
    )
    draws = np.random.default_rng(seed).random(sessions.height)
    sessions = sessions.with_columns(pl.Series("u", draws)).filter(pl.col("u") < sample_ratio)
    if max_single_turn_ratio is not None:
        multi = sessions.filter(pl.col("n") > 1)
        single = sessions.filter(pl.col("n") == 1).sort("u")
        allowed = int(np.floor(max_single_turn_ratio * multi.height / (1 - max_single_turn_ratio)))
        sessions = pl.concat([multi, single.head(allowed)])
    kept = df.join(sessions.select("session_id"), on="session_id", how="semi").sort("_row")
    out = _take(table, kept["_row"].to_numpy())
    ts = out.column("timestamp").to_numpy() - window_start
    return out.set_column(out.schema.get_field_index("timestamp"), "timestamp", pa.array(ts))


def cap_sessions(table: pa.Table, max_turns: int = 8) -> pa.Table:
    """Per session, the first ``max_turns`` requests by ``(turn, timestamp)``; global
    timestamp order restored, stable (``docs/semantics.md`` §3)."""
    if max_turns < 1:
        raise InvalidArgumentError(f"max_turns must be >= 1, got {max_turns}")
    df = _frame(table).sort(["session_id", "turn", "timestamp", "_row"])
    df = df.with_columns(pl.int_range(pl.len()).over("session_id").alias("_k"))
    kept = df.filter(pl.col("_k") < max_turns).sort(["timestamp", "_row"])
    return _take(table, kept["_row"].to_numpy())


def shrink(table: pa.Table, block_size: int, max_output: int | None = None) -> pa.Table:
    """Every block of the trace as ``block_size`` tokens: input lengths scale by
    ``block_size / trace block size`` (rounded up, so a request keeps all its blocks), the
    ``hash_ids`` stay, so requests share exactly the blocks they shared; outputs capped at
    ``max_output`` tokens. Rows, order and other columns are unchanged."""
    old = block_size_of(table)
    if block_size < 1 or block_size > old:
        raise InvalidArgumentError(
            f"block_size must be between 1 and the trace's block size {old}, got {block_size}"
        )
    if max_output is not None and max_output < 1:
        raise InvalidArgumentError(f"max_output must be >= 1, got {max_output}")
    i = table.schema.get_field_index("input_length")
    lengths = table.column(i).to_numpy()
    scaled = -(-lengths.astype(np.int64) * block_size // old)
    out = table.set_column(i, "input_length", pa.array(scaled, table.schema.field(i).type))
    if max_output is not None:
        j = out.schema.get_field_index("output_length")
        capped = pc.min_element_wise(out.column(j), pa.scalar(max_output, out.schema.field(j).type))
        out = out.set_column(j, "output_length", capped)
    return with_block_size(out, block_size)


def annotate_ttp(table: pa.Table, finish: pa.Table | None = None) -> pa.Table:
    """Fill ``time_to_parent_chat``: a request's timestamp minus its parent's (the previous
    turn of its session) finish time when ``finish`` (columns ``request_id``, ``finish`` in
    trace seconds) knows it, else minus the parent's timestamp. First turns get null;
    negative gaps become 0. The basis (``finish``, ``start`` or ``mixed``) is recorded in the
    schema metadata under ``kvroute.ttp_basis``."""
    df = _frame(table).sort(["session_id", "turn", "timestamp", "_row"])
    if finish is not None:
        missing = {"request_id", "finish"} - set(finish.column_names)
        if missing:
            raise InvalidArgumentError(f"finish table lacks column(s) {', '.join(sorted(missing))}")
        fin = pl.from_arrow(finish.select(["request_id", "finish"]))
        assert isinstance(fin, pl.DataFrame)
        df = df.join(
            fin.with_columns(pl.col("finish").cast(pl.Float64)), on="request_id", how="left"
        )
    else:
        df = df.with_columns(pl.lit(None, pl.Float64).alias("finish"))
    prev_ts = pl.col("timestamp").shift(1).over("session_id")
    prev_fin = pl.col("finish").shift(1).over("session_id")
    df = df.with_columns(
        pl.coalesce(prev_fin, prev_ts).alias("_parent_end"),
        prev_fin.is_not_null().alias("_by_finish"),
        prev_ts.is_not_null().alias("_has_parent"),
    )
    df = df.with_columns(
        (pl.col("timestamp") - pl.col("_parent_end")).clip(lower_bound=0.0).alias("_ttp")
    ).sort("_row")
    by_finish = df.filter(pl.col("_has_parent"))["_by_finish"]
    basis = "start" if not by_finish.any() else ("finish" if by_finish.all() else "mixed")
    ttp = pa.array(df["_ttp"].to_numpy(), pa.float64(), mask=~df["_has_parent"].to_numpy())
    if "time_to_parent_chat" in table.column_names:
        out = table.set_column(
            table.schema.get_field_index("time_to_parent_chat"), "time_to_parent_chat", ttp
        )
    else:
        out = table.append_column(pa.field("time_to_parent_chat", pa.float64()), ttp)
    meta = dict(table.schema.metadata or {})
    meta[TTP_BASIS_KEY] = basis.encode()
    return out.replace_schema_metadata(meta)


def _percentiles(
    values: np.ndarray[Any, Any], qs: tuple[int, ...] = (50, 90, 99)
) -> dict[str, float]:
    if len(values) == 0:
        return {**{f"p{q}": 0.0 for q in qs}, "max": 0.0, "mean": 0.0}
    pct = np.percentile(values, qs)
    out = {f"p{q}": float(v) for q, v in zip(qs, pct, strict=True)}
    out["max"] = float(values.max())
    out["mean"] = float(values.mean())
    return out


def trace_stats(
    table: pa.Table, *, model: str = "qwen3-coder-30b-a3b", kv_bytes_per_token: int | None = None
) -> dict[str, Any]:
    """Statistics of a trace as one JSON-ready dict (percentiles are numpy's linear ones)."""
    if kv_bytes_per_token is None:
        if model not in MODELS:
            raise InvalidArgumentError(f"unknown model {model!r}; presets: {', '.join(MODELS)}")
        kv_bytes_per_token = MODELS[model].kv_bytes_per_token
    df = _frame(table)
    turns = df.group_by("session_id").len()["len"].to_numpy()
    inp = df["input_length"].to_numpy()
    out = df["output_length"].to_numpy()
    ts = df["timestamp"].to_numpy()
    kv_gib = (inp + out) * kv_bytes_per_token / 2**30
    return {
        "requests": int(df.height),
        "sessions": len(turns),
        "duration_s": float(ts.max() - ts.min()) if len(ts) else 0.0,
        "block_size": block_size_of(table),
        "keys": int(pc.sum(pc.list_value_length(table.column("hash_ids"))).as_py() or 0),
        "total_input_tokens": int(inp.sum()),
        "total_output_tokens": int(out.sum()),
        "turns_per_session": _percentiles(turns),
        "input_length": _percentiles(inp),
        "output_length": _percentiles(out),
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_per_request_gib": _percentiles(kv_gib, (50, 90, 95, 99)),
    }


def plot_cdf(
    table: pa.Table, path: str | Path, *, kv_bytes_per_token: int = 98304, force: bool = True
) -> Path:
    """Two CDF panels: input length per request and KV footprint per request (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inp = np.sort(table.column("input_length").to_numpy())
    kv = np.sort(inp + table.column("output_length").to_numpy()) * kv_bytes_per_token / 2**30
    y = np.arange(1, len(inp) + 1) / max(len(inp), 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    axes[0].plot(inp / 1000, y)
    axes[0].set_xlabel("input length (thousand tokens)")
    axes[1].plot(kv, y, color="tab:orange")
    axes[1].set_xlabel(f"KV footprint per request (GiB at {kv_bytes_per_token} B/token)")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(inp)} requests")
    try:
        return save_figure(fig, path, dpi=120, force=force)
    finally:
        plt.close(fig)
