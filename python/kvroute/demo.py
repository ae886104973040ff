"""The main job's first form: route a bundled trace under every policy and compare.

Each request is routed at its trace time with the real :class:`kvroute.Router`. Its
first token and finish come from a deliberately small load model, so that counters, cache
state and policy decisions evolve as they would in front of real engines:

* each instance runs prefills one at a time at ``prefill_tokens_per_s`` (a 32k prefill takes
  about 5 s, as on the study's H20 engines), so a request's first token arrives when the
  prefills queued before it and its own *new* prefill (input minus estimated cache hit) are done;
* decoding then takes ``output_length * tpot_s``.

This is not the cluster simulator (continuous batching, KV pool, preemption); it only gives
the router realistic request lifetimes. Per policy it reports the estimated prefix-cache hit
rate, the request balance (``req_bal``), and the model's TTFT percentiles.

Complexity: O(requests x (keys + instances)) routing plus O(requests log requests) events.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from kvroute import Router, policies

if TYPE_CHECKING:
    from kvroute._core import RouteInfo

SEED_POLICIES = ("lmetric", "load_only", "sticky", "unified", "leastwork")


@dataclass(frozen=True)
class Request:
    """One trace request."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session_id: int | str


@dataclass(frozen=True)
class PolicyResult:
    """What one policy achieved on the trace under the load model."""

    policy: str
    requests: int
    hit_rate: float
    req_bal: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    per_instance: list[int]


def requests_of(trace: pa.Table) -> list[Request]:
    """The rows of a canonical trace table as :class:`Request` objects, in time order."""
    cols = trace.select(
        ["timestamp", "input_length", "output_length", "hash_ids", "session_id"]
    ).to_pydict()
    return [Request(*row) for row in zip(*cols.values(), strict=True)]


def _events(
    requests: list[Request], router: Router, prefill_tps: float, tpot_s: float
) -> Iterator[tuple[RouteInfo, float]]:
    """Route every request; yield (decision, ttft) and drive first_token/finish in time order."""
    pending: list[tuple[float, int, int, str]] = []  # (time, seq, request index, event)
    prefill_free_at = [0.0] * router.num_instances
    seq = 0
    for idx, req in enumerate(requests):
        while pending and pending[0][0] <= req.timestamp:
            _, _, rid, kind = heapq.heappop(pending)
            (router.first_token if kind == "first" else router.finish)(rid)
        info = router.route_info(idx, req.hash_ids, req.input_length, req.session_id)
        inst = info["instance"]
        start = max(req.timestamp, prefill_free_at[inst])
        first = start + info["new_prefill"] / prefill_tps
        prefill_free_at[inst] = first
        finish = first + max(req.output_length - 1, 0) * tpot_s
        heapq.heappush(pending, (first, seq, idx, "first"))
        heapq.heappush(pending, (finish, seq + 1, idx, "finish"))
        seq += 2
        yield info, first - req.timestamp
    while pending:
        _, _, rid, kind = heapq.heappop(pending)
        (router.first_token if kind == "first" else router.finish)(rid)


def run_policy(
    requests: list[Request],
    policy: str,
    *,
    instances: int = 8,
    prefill_tps: float = 6500.0,
    tpot_s: float = 0.009,
    **router_kwargs: float,
) -> PolicyResult:
    """Route ``requests`` under ``policy`` with the load model; returns the summary."""
    router = Router(instances, policy, **router_kwargs)  # type: ignore[arg-type]
    hits = total = 0
    counts = [0] * instances
    ttfts: list[float] = []
    for req, (info, ttft) in zip(
        requests, _events(requests, router, prefill_tps, tpot_s), strict=True
    ):
        counts[info["instance"]] += 1
        hits += info["hit_tokens"]
        total += req.input_length
        ttfts.append(ttft)
    if router.in_flight or any(s["num_requests"] for s in router.state()):
        raise RuntimeError("router counters did not return to zero")  # an internal bug
    p50, p90, p99 = np.percentile(np.array(ttfts), [50, 90, 99]) if ttfts else (0.0, 0.0, 0.0)
    mean = sum(counts) / instances
    return PolicyResult(
        policy=policy,
        requests=len(requests),
        hit_rate=hits / total if total else 0.0,
        req_bal=max(counts) / mean if mean else 0.0,
        ttft_p50=float(p50),
        ttft_p90=float(p90),
        ttft_p99=float(p99),
        per_instance=counts,
    )


def run_all(
    requests: list[Request], names: list[str] | None = None, instances: int = 8
) -> list[PolicyResult]:
    """``run_policy`` for each name (default: every policy)."""
    return [run_policy(requests, name, instances=instances) for name in names or policies()]
