"""Run metrics from per-request records (``docs/semantics.md`` §6).

TTFT = first_token - send; TPOT = (finish - first_token) / (output_length - 1), undefined
for one-token outputs; E2E = finish - send; percentiles are numpy's linear ones. APC =
Σ cached_tokens / Σ input_length. ``interference_index`` = TPOT p90 of requests whose decode
window overlapped another request's prefill on the same instance over TPOT p90 of the rest;
the overlap flag comes from the records (simulator) or, when null (replay), from the
intervals: another request's ``[send, first_token]`` on the same instance intersecting this
one's ``(first_token, finish)``. ``hotspot_index`` = max / median over instances of TTFT p90;
``req_bal`` = max / mean requests per instance. Failed requests (``error`` set) count in
``requests`` and ``errors`` only.

O(n log n) in the number of records; stateless.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from kvroute.records import conform_records, run_info

Array = npt.NDArray[np.float64]


def percentiles(values: Array) -> dict[str, float | None]:
    """p50/p90/p99 (None when there are no values)."""
    if len(values) == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _p90(values: Array) -> float | None:
    return float(np.percentile(values, 90)) if len(values) else None


def overlap_from_intervals(
    instance: npt.NDArray[np.int64], send: Array, first: Array, finish: Array
) -> npt.NDArray[np.bool_]:
    """Whether another request's prefill window ``[send, first)`` on the same instance
    intersects each request's decode window ``(first, finish)``."""
    out = np.zeros(len(send), dtype=bool)
    for inst in np.unique(instance):
        idx = np.flatnonzero(instance == inst)
        order = idx[np.argsort(send[idx], kind="stable")]
        starts = send[order]
        ends_prefix_max = np.maximum.accumulate(first[order])
        # Prefills that started before this decode ended; the latest-ending of them must end
        # after this decode began. A request's own prefill ends exactly at its first token,
        # so the strict comparison leaves it out.
        k = np.searchsorted(starts, finish[idx], side="left")
        has = k > 0
        latest = np.where(has, ends_prefix_max[np.maximum(k - 1, 0)], -np.inf)
        out[idx] = latest > first[idx]
    return out


def summarize(records: pa.Table, instances: int | None = None) -> dict[str, Any]:
    """The run summary: requests, errors, ttft/tpot/e2e percentiles (s), apc,
    interference_index, hotspot_index, req_bal and per_instance_requests."""
    r = conform_records(records)
    n_inst = (
        instances
        or run_info(r).get("instances")
        or (int(np.max(r.column("instance").to_numpy(), initial=-1)) + 1)
    )
    ok = r.column("error").is_null().to_numpy(zero_copy_only=False) & r.column(
        "first_token"
    ).is_valid().to_numpy(zero_copy_only=False)
    inst = r.column("instance").to_numpy()[ok].astype(np.int64)
    send = r.column("send").to_numpy()[ok]
    first = r.column("first_token").to_numpy(zero_copy_only=False)[ok].astype(np.float64)
    finish = r.column("finish").to_numpy()[ok]
    out_len = r.column("output_length").to_numpy()[ok]
    in_len = r.column("input_length").to_numpy()[ok]
    ttft, e2e = first - send, finish - send
    multi = out_len > 1
    tpot = np.where(multi, (finish - first) / np.maximum(out_len - 1, 1), np.nan)
    cached_col = r.column("cached_tokens")
    known = cached_col.is_valid().to_numpy(zero_copy_only=False)[ok]
    cached = cached_col.fill_null(0).to_numpy()[ok]
    flag_col = r.column("decode_overlaps_prefill")
    if flag_col.null_count == 0 and len(flag_col):
        overlap = flag_col.to_numpy(zero_copy_only=False)[ok].astype(bool)
    else:
        overlap = overlap_from_intervals(inst, send, first, finish)
    t_over, t_clean = tpot[multi & overlap], tpot[multi & ~overlap]
    p_over, p_clean = _p90(t_over), _p90(t_clean)
    per_inst = np.bincount(inst, minlength=n_inst)[:n_inst] if len(inst) else np.zeros(n_inst, int)
    # Per-instance p90 from one stable sort by instance (not one mask per instance); a radix
    # sort when the instance numbers fit 16 bits.
    narrow = inst.astype(np.int16) if n_inst <= np.iinfo(np.int16).max else inst
    order = np.argsort(narrow, kind="stable")
    bounds = np.searchsorted(inst[order], np.arange(n_inst + 1))
    inst_p90 = [_p90(ttft[order[bounds[i] : bounds[i + 1]]]) for i in range(n_inst)]
    inst_p90v = np.array([v for v in inst_p90 if v is not None])
    median_p90 = float(np.median(inst_p90v)) if len(inst_p90v) else 0.0
    return {
        "requests": r.num_rows,
        "errors": int(r.num_rows - ok.sum()),
        "ttft": percentiles(ttft),
        "tpot": percentiles(tpot[multi]),
        "e2e": percentiles(e2e),
        "apc": float(cached[known].sum() / in_len[known].sum()) if in_len[known].sum() else None,
        "interference_index": p_over / p_clean if p_over is not None and p_clean else None,
        "hotspot_index": float(inst_p90v.max() / median_p90) if median_p90 > 0 else None,
        "req_bal": float(per_inst.max() / per_inst.mean()) if per_inst.sum() else None,
        "per_instance_requests": [int(c) for c in per_inst],
        "per_instance_ttft_p90": inst_p90,
    }
