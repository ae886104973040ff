"""Slow requests and their causes, one label per slow request (``docs/report.md``).

A request is *slow* when it succeeded and its TTFT exceeds ``slo_ttft_s`` or its E2E exceeds
``slo_e2e_s``. Each slow request gets the first of these labels that applies:

0. ``router_queue``: it waited in the router's admission queue (``router_wait``) for at
   least half its TTFT.
1. ``prefill_overlap``: the prefill window of another request on the same instance with at
   least ``overlap_min_tokens`` new (uncached) prompt tokens intersects this request's
   lifetime ``(send, finish)``, i.e. its TTFT window or its decode window. A prefill window
   is ``[send + router_wait + queue_wait, first_token)`` (each 0 when unknown).
2. ``hot_queue``: the request's instance is hot (its TTFT p90 exceeds ``hot_factor`` x the
   median over instances of TTFT p90), or its own ``queue_wait`` is at least
   ``queue_wait_s``.
3. ``cache_miss``: its prefix hit (``cached_tokens``, else ``estimated_hit_tokens``) covers
   less than ``miss_hit_ratio`` of its prompt and the new tokens are at least
   ``large_append_tokens``. A request with neither hit known is never labelled so.
4. ``unknown``: none of the above.

Time O(n log n) in the number of records (sorted interval counts per instance); stateless.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from kvroute.records import conform_records

CAUSES = ("router_queue", "prefill_overlap", "hot_queue", "cache_miss", "unknown")
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class SlowConfig:
    """SLOs and the thresholds of the cause rules (see the module doc)."""

    slo_ttft_s: float = 5.0
    slo_e2e_s: float = 30.0
    overlap_min_tokens: int = 8192
    hot_factor: float = 1.5
    queue_wait_s: float = 5.0
    miss_hit_ratio: float = 0.5
    large_append_tokens: int = 8192

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Columns:
    """The record columns the rules read, as numpy arrays over all rows."""

    ok: Bools
    instance: I64
    send: F64
    first: F64
    finish: F64
    input_length: I64
    hit: F64  # NaN: unknown
    queue_wait: F64  # NaN: unknown
    router_wait: F64  # NaN: unknown

    @staticmethod
    def of(records: pa.Table) -> Columns:
        r = conform_records(records)

        def f64(name: str) -> F64:
            col = r.column(name).cast(pa.float64()).fill_null(np.nan)
            return np.asarray(col.to_numpy(), dtype=np.float64)

        cached, est = f64("cached_tokens"), f64("estimated_hit_tokens")
        first = f64("first_token")
        ok = r.column("error").is_null().to_numpy(zero_copy_only=False) & ~np.isnan(first)
        return Columns(
            ok=np.asarray(ok, dtype=bool),
            instance=np.asarray(r.column("instance").to_numpy(), dtype=np.int64),
            send=f64("send"),
            first=first,
            finish=f64("finish"),
            input_length=np.asarray(r.column("input_length").to_numpy(), dtype=np.int64),
            hit=np.where(np.isnan(cached), est, cached),
            queue_wait=f64("queue_wait"),
            router_wait=f64("router_wait"),
        )


def overlapping_prefill(c: Columns, min_tokens: int) -> Bools:
    """Per row: another successful request's prefill window of ``min_tokens`` or more new
    tokens on the same instance intersects this row's ``(send, finish)``."""
    out = np.zeros(len(c.send), dtype=bool)
    new = c.input_length - np.nan_to_num(c.hit, nan=0.0)
    start = c.send + np.nan_to_num(c.router_wait, nan=0.0) + np.nan_to_num(c.queue_wait, nan=0.0)
    big = c.ok & (new >= min_tokens) & (c.first > start)
    for inst in np.unique(c.instance[c.ok]):
        rows = np.flatnonzero(c.ok & (c.instance == inst))
        win = np.flatnonzero(big & (c.instance == inst))
        starts, ends = np.sort(start[win]), np.sort(c.first[win])
        # Windows intersecting (s, f): those starting before f, less those ending by s
        # (a window ending by s started before it, hence before f).
        n = np.searchsorted(starts, c.finish[rows], "left") - np.searchsorted(
            ends, c.send[rows], "right"
        )
        own = big[rows] & (start[rows] < c.finish[rows]) & (c.first[rows] > c.send[rows])
        out[rows] = (n - own.astype(np.int64)) > 0
    return out


def hot_instances(c: Columns, factor: float) -> set[int]:
    """Instances whose TTFT p90 exceeds ``factor`` x the median instance TTFT p90."""
    ttft = c.first - c.send
    p90 = {
        int(i): float(np.percentile(ttft[c.ok & (c.instance == i)], 90))
        for i in np.unique(c.instance[c.ok])
    }
    if not p90:
        return set()
    median = float(np.median(list(p90.values())))
    return {i for i, v in p90.items() if v > factor * median}


def label_slow(records: pa.Table, config: SlowConfig | None = None) -> list[str | None]:
    """Per record, its cause label if it is slow, else None (see the module doc)."""
    cfg = config or SlowConfig()
    c = Columns.of(records)
    ttft, e2e = c.first - c.send, c.finish - c.send
    slow = c.ok & ((ttft > cfg.slo_ttft_s) | (e2e > cfg.slo_e2e_s))
    overlap = overlapping_prefill(c, cfg.overlap_min_tokens)
    hot = np.isin(c.instance, list(hot_instances(c, cfg.hot_factor)))
    queued = np.nan_to_num(c.queue_wait, nan=-np.inf) >= cfg.queue_wait_s
    waited = np.nan_to_num(c.router_wait, nan=0.0)
    admitted_late = (waited > 0) & (waited >= 0.5 * ttft)
    known = ~np.isnan(c.hit)
    hit = np.nan_to_num(c.hit, nan=0.0)
    miss = (
        known
        & (hit < cfg.miss_hit_ratio * c.input_length)
        & (c.input_length - hit >= cfg.large_append_tokens)
    )
    labels: list[str | None] = []
    for i in range(len(slow)):
        if not slow[i]:
            labels.append(None)
        elif admitted_late[i]:
            labels.append("router_queue")
        elif overlap[i]:
            labels.append("prefill_overlap")
        elif hot[i] or queued[i]:
            labels.append("hot_queue")
        elif miss[i]:
            labels.append("cache_miss")
        else:
            labels.append("unknown")
    return labels


def cause_counts(labels: list[str | None]) -> dict[str, int]:
    """Slow requests per cause, every cause present (0 when none)."""
    counts = dict.fromkeys(CAUSES, 0)
    for label in labels:
        if label is not None:
            counts[label] += 1
    return counts
