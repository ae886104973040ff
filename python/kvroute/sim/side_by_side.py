"""The simulator against real engines, side by side: each policy's arm replayed through the
kvroute proxy in front of running engines, and simulated with a calibrated engine profile,
on the same trace (``docs/simulator.md`` "Side by side").

Per arm: the proxy starts with the policy (estimate view only, as the simulator's router),
in a process of its own, as it is deployed (in the replayer's process the two took turns at
one interpreter lock: over alternating runs of a sticky arm, TTFT p50 35.3 ms against 32.9
ms in its own process, runs spreading by ±3 ms), the engines' prefix caches are reset, the
replayer drives the trace and its records are summarized; the simulator then runs every arm
on the same trace with the profile's engine parameters (one parallel sweep). :func:`compare`
sets the two summaries against each other and checks the targets: APC within 2 points, the
policies' APC order the same (pairs whose real APCs are within those 2 points count as
tied), TTFT p50 within 25% and p90 within 40%; beside them, each policy's simulated APC over
other orders of the requests that arrive at the same instant (:mod:`kvroute.sim.ties`), which
a real run takes in whatever order they win their race. Before each real arm, it waits until the
engines hold no request (vLLM answers a reset with 200 even when blocks in use made it
fail).

Cost: the real arms take the trace's wall time each; the simulated ones milliseconds.
Blocking; runs its own replay loop and one proxy process per arm; not thread-safe.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.parser import text_string_to_metric_families

from kvroute.errors import InvalidArgumentError
from kvroute.files import write_text
from kvroute.launch import LaunchError, launch
from kvroute.metrics import summarize
from kvroute.records import write_records
from kvroute.replay import ReplayError
from kvroute.schema import block_size_of
from kvroute.sim.ties import shuffle_ties, tied_requests
from kvroute.trace import read_trace

#: The default arms: the study's four and LPWL.
POLICIES = ("unified", "lmetric", "load_only", "sticky", "leastwork")
#: (metric, quantile) pairs set side by side.
LATENCIES: tuple[tuple[str, str], ...] = tuple(
    (metric, q) for metric in ("ttft", "tpot", "e2e") for q in ("p50", "p90")
)
#: The targets: APC points, TTFT p50 and p90 relative differences.
TARGETS = {"apc_points": 2.0, "ttft_p50": 0.25, "ttft_p90": 0.40}


@dataclass
class Arm:
    """One policy: the real run's and the simulated run's records and summaries."""

    policy: str
    real_records: pa.Table
    sim_records: pa.Table
    real: dict[str, Any]
    sim: dict[str, Any]
    #: The simulated APC with the trace's simultaneous arrivals in other orders.
    sim_tie_apcs: list[float] = field(default_factory=list)


def scale_time(trace: pa.Table, factor: float) -> pa.Table:
    """The trace with timestamps and think times multiplied by ``factor``."""
    for name in ("timestamp", "time_to_parent_chat"):
        if name in trace.column_names:
            i = trace.schema.get_field_index(name)
            col = trace.column(i)
            trace = trace.set_column(i, name, pc.multiply(col, factor).cast(col.type))
    return trace


def requests_in(url: str) -> float:
    """Requests an engine is running or holding (its ``vllm:num_requests_*`` gauges)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(
        s.value for f in text_string_to_metric_families(text) if f.name in names for s in f.samples
    )


def wait_idle(urls: Sequence[str], timeout_s: float = 120.0) -> None:
    """Wait until no engine holds a request: vLLM answers ``/reset_prefix_cache`` with 200
    even when it could not reset because blocks were still in use."""
    deadline = time.monotonic() + timeout_s
    while busy := [u for u in urls if requests_in(u) > 0]:
        if time.monotonic() > deadline:
            raise ReplayError(f"engines still busy after {timeout_s:g} s: {', '.join(busy)}")
        time.sleep(0.2)


@contextmanager
def proxy_process(args: Sequence[str], timeout_s: float = 60.0) -> Iterator[str]:
    """``kvroute proxy ARGS`` on a free port, in a process of its own; yields its URL and
    stops it after. A proxy that does not start is an error quoting the end of its log."""
    try:
        proxy = launch("proxy", *args, timeout_s=timeout_s)
    except LaunchError as exc:
        raise ReplayError(str(exc)) from exc
    with proxy:
        yield proxy.url


def run_real(
    trace: pa.Table,
    urls: Sequence[str],
    policy: str,
    *,
    mode: str = "tracets",
    seed: int = 0,
    model: str | None = None,
    request_timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
) -> pa.Table:
    """One arm against the engines: a proxy with ``policy`` in front of ``urls`` (its own
    process), caches reset, the trace replayed; the records."""
    from kvroute.replay import ReplayConfig, replay

    args = [f"--backend={u}" for u in urls] + [f"--policy={policy}", "--kv-events=off"]
    args += [f"--block-size={block_size_of(trace)}", "--health-interval=0.5"]
    args += [f"--request-timeout={request_timeout_s}"]
    wait_idle(urls)
    with proxy_process(args) as url:
        replay_config = ReplayConfig(
            url=url,
            mode=mode,
            model=model,
            seed=seed,
            reset_cache=True,
            request_timeout_s=request_timeout_s,
        )
        return replay(trace, replay_config, on_done)


def side_by_side(
    trace: Any,
    urls: Sequence[str],
    engine: Mapping[str, float],
    *,
    policies: Sequence[str] = POLICIES,
    mode: str = "tracets",
    time_scale: float = 1.0,
    seed: int = 0,
    tie_orders: int = 20,
    model: str | None = None,
    on_arm: Callable[[str], None] | None = None,
    on_request: Callable[[], None] | None = None,
) -> list[Arm]:
    """Every policy replayed against ``urls`` and simulated with ``engine`` (the parameters
    of a profile, :func:`kvroute.sim.profile.load_profile`) on the same trace; where requests
    arrive at the same instant, also simulated with them in ``tie_orders`` other orders
    (:mod:`kvroute.sim.ties`)."""
    from kvroute import sim

    if not urls:
        raise InvalidArgumentError("side_by_side needs at least one engine URL")
    if mode not in ("tracets", "thinktime"):
        raise InvalidArgumentError(f"mode must be tracets or thinktime, got {mode!r}")
    table = read_trace(trace)
    if time_scale != 1.0:
        table = scale_time(table, time_scale)
    if tie_orders < 0:
        raise InvalidArgumentError(f"tie_orders must be >= 0, got {tie_orders}")
    names = sim.resolve_policies(list(policies))

    def simulate(trace: pa.Table) -> list[sim.SimResult]:
        return sim.sweep(
            trace,
            policies=names,
            modes=[mode],
            seeds=[seed],
            instances=len(urls),
            engine=dict(engine),
            sample_interval=0.0,
        )

    simulated = simulate(table)
    orders = tie_orders if tied_requests(table) else 0
    tie_apcs = [[s.summary["apc"] for s in simulate(shuffle_ties(table, k))] for k in range(orders)]
    arms = []
    for i, (name, s) in enumerate(zip(names, simulated, strict=True)):
        if on_arm is not None:
            on_arm(name)
        real = run_real(table, urls, name, mode=mode, seed=seed, model=model, on_done=on_request)
        ties = [apcs[i] for apcs in tie_apcs]
        arms.append(Arm(name, real, s.records, summarize(real, len(urls)), s.summary, ties))
    return arms


def _rel(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else sim / real - 1.0


def compare(arms: Sequence[Arm]) -> dict[str, Any]:
    """Per arm, each metric real, simulated and their difference (APC in points, latencies
    relative), and which targets hold."""
    rows = []
    for a in arms:
        row: dict[str, Any] = {"policy": a.policy, "errors": {"real": a.real["errors"]}}
        apc_r, apc_s = a.real["apc"], a.sim["apc"]
        row["apc"] = {
            "real": apc_r,
            "sim": apc_s,
            "points": None if apc_r is None or apc_s is None else 100 * (apc_s - apc_r),
        }
        if a.sim_tie_apcs and apc_s is not None and apc_r is not None:
            every = [apc_s, *a.sim_tie_apcs]
            lo, hi = min(every), max(every)
            row["apc"]["sim_tie_orders"] = {
                "orders": len(every),
                "min": lo,
                "p50": statistics.median(every),
                "max": hi,
                # How far the real APC lies outside [min, max], in points (0: inside).
                "real_outside_points": 100 * max(lo - apc_r, apc_r - hi, 0.0),
            }
        for metric, q in LATENCIES:
            r, s = a.real[metric][q], a.sim[metric][q]
            row[f"{metric}_{q}"] = {"real": r, "sim": s, "rel": _rel(s, r)}
        for key in ("hotspot_index", "req_bal"):
            row[key] = {"real": a.real[key], "sim": a.sim[key]}
        rows.append(row)

    def order(side: str) -> list[str]:
        return [r["policy"] for r in sorted(rows, key=lambda r: -(r["apc"][side] or 0.0))]

    def apc(r: dict[str, Any], side: str) -> float:
        return 100 * (r["apc"][side] or 0.0)

    # Policies whose real APCs are within the APC tolerance of each other are tied: their
    # order is noise. Every other pair must be ordered alike.
    tol = TARGETS["apc_points"]
    flipped = [
        [a["policy"], b["policy"]]
        for i, a in enumerate(rows)
        for b in rows[i + 1 :]
        if abs(apc(a, "real") - apc(b, "real")) > tol
        and (apc(a, "real") > apc(b, "real")) != (apc(a, "sim") > apc(b, "sim"))
    ]

    def within(key: str, field: str, bound: float) -> bool:
        return all(r[key][field] is not None and abs(r[key][field]) <= bound for r in rows)

    targets = {
        "apc_within_2_points": within("apc", "points", TARGETS["apc_points"]),
        "apc_order_same": not flipped,
        "ttft_p50_within_25pct": within("ttft_p50", "rel", TARGETS["ttft_p50"]),
        "ttft_p90_within_40pct": within("ttft_p90", "rel", TARGETS["ttft_p90"]),
    }
    return {
        "arms": rows,
        "apc_order": {"real": order("real"), "sim": order("sim"), "flipped": flipped},
        "targets": targets,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _s(x: float | None, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.3g}"


def markdown(doc: Mapping[str, Any]) -> str:
    """The comparison as a Markdown table (real / simulated, difference)."""
    head = ["policy", "APC real / sim (pts)"]
    head += [f"{m.upper()} {q} {'ms' if m == 'tpot' else 's'}" for m, q in LATENCIES]
    head += ["hotspot real / sim"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in doc["arms"]:
        apc = r["apc"]
        cells = [
            r["policy"],
            f"{_s(apc['real'], 100)}% / {_s(apc['sim'], 100)}% "
            f"({'-' if apc['points'] is None else format(apc['points'], '+.1f')})",
        ]
        if "sim_tie_orders" in apc:
            ties = apc["sim_tie_orders"]
            cells[1] += f" [{100 * ties['min']:.1f}-{100 * ties['max']:.1f}%]"
        for m, q in LATENCIES:
            c, k = r[f"{m}_{q}"], 1e3 if m == "tpot" else 1.0
            cells.append(f"{_s(c['real'], k)} / {_s(c['sim'], k)} ({_pct(c['rel'])})")
        h = r["hotspot_index"]
        cells.append(f"{_s(h['real'])} / {_s(h['sim'])}")
        lines.append("| " + " | ".join(cells) + " |")
    t = doc["targets"]
    lines.append("")
    lines.append("Targets: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t.items()))
    lines.append(
        f"APC order real: {', '.join(doc['apc_order']['real'])}; "
        f"simulated: {', '.join(doc['apc_order']['sim'])} (pairs more than "
        f"{TARGETS['apc_points']:g} points apart in the real run and ordered otherwise in the "
        f"simulation: {doc['apc_order']['flipped'] or 'none'})"
    )
    ranges = {
        r["policy"]: r["apc"]["sim_tie_orders"] for r in doc["arms"] if "sim_tie_orders" in r["apc"]
    }
    if ranges:
        outside = [
            f"{policy} by {t['real_outside_points']:.2f} points"
            for policy, t in ranges.items()
            if t["real_outside_points"] > 0
        ]
        orders = next(iter(ranges.values()))["orders"]
        lines.append(
            f"[min-max]: the simulated APC with the requests that arrive at the same instant "
            f"in {orders} orders (the file's and others drawn at random); the real APC is "
            f"inside that range for {len(ranges) - len(outside)} of {len(ranges)} policies"
            f"{' (outside: ' + ', '.join(outside) + ')' if outside else ''}."
        )
    return "\n".join(lines) + "\n"


def write(arms: Sequence[Arm], out_dir: str | Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """Write each arm's records (``<policy>/real.parquet``, ``sim.parquet``),
    ``side_by_side.json`` and ``side_by_side.md``; the comparison document."""
    out = Path(out_dir)
    for a in arms:
        write_records(a.real_records, out / a.policy / "real.parquet")
        write_records(a.sim_records, out / a.policy / "sim.parquet")
    doc = {**dict(meta), **compare(arms)}
    write_text(out / "side_by_side.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / "side_by_side.md", markdown(doc))
    return doc


__all__ = [
    "POLICIES",
    "TARGETS",
    "Arm",
    "compare",
    "markdown",
    "run_real",
    "scale_time",
    "side_by_side",
    "write",
]
