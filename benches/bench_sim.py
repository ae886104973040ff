"""The cluster simulator (``kvroute.sim``): simulated events per second, the w600 sweep of
every policy in both dispatch modes, a 100k-request agentic trace, and (opt-in) the full
2.11M-request synthetic trace.

Each timed round is one whole call of the Python API (trace conversion, the native runs,
records, summaries); ``extra_info`` carries the native loop's own counters and wall time.
Run with ``make bench`` or ``pytest benches/bench_sim.py --benchmark-only``. The full-scale
case runs only with ``KVROUTE_BENCH_FULL=1`` (it synthesizes the trace first, ~20 s, unless
``KVROUTE_FULL_TRACE`` names an existing one); see benches/README.md, "Simulator".
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import kvroute.sim as ks
from kvroute.synth import synthesize
from kvroute.trace import read_trace


@pytest.fixture(scope="module")
def w600(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    path = tmp_path_factory.mktemp("sim") / "w600.parquet"
    synthesize("w600", path, seed=42)
    return read_trace(path)


@pytest.fixture(scope="module")
def glm100k(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    path = tmp_path_factory.mktemp("sim") / "glm100k.parquet"
    synthesize("agentic-glm", path, requests=100_000, seed=42)
    return read_trace(path)


def _duration(t: pa.Table) -> float:
    ts = t.column("timestamp").to_numpy()
    return float(ts.max() - ts.min())


def _info(benchmark: Any, results: list[ks.SimResult], trace: pa.Table) -> None:
    events = sum(int(r.stats["events"]) for r in results)
    steps = sum(int(r.stats["engine_steps"]) for r in results)
    native = sum(float(r.stats["wall_s"]) for r in results)
    benchmark.extra_info.update(
        runs=len(results),
        requests=trace.num_rows,
        events=events,
        engine_steps=steps,
        native_wall_s=native,
        events_per_native_s=events / native,
        steps_per_native_s=steps / native,
        trace_duration_s=_duration(trace),
        max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )


def test_sim_events_per_second_w600(benchmark: Any, w600: pa.Table) -> None:
    benchmark.group = "sim"
    out: list[ks.SimResult] = []

    def once() -> None:
        out[:] = [ks.simulate(w600, instances=8, policy="unified", mode="thinktime")]

    benchmark.pedantic(once, rounds=5, warmup_rounds=1, iterations=1)
    _info(benchmark, out, w600)
    assert out[0].stats["finished"] == w600.num_rows


def test_sim_w600_every_policy_both_modes(benchmark: Any, w600: pa.Table) -> None:
    benchmark.group = "sim"
    out: list[ks.SimResult] = []
    policies = [*ks.resolve_policies("all"), "capped"]

    def once() -> None:
        out[:] = ks.sweep(w600, policies=policies, modes=["tracets", "thinktime"], instances=8)

    benchmark.pedantic(once, rounds=3, warmup_rounds=0, iterations=1)
    _info(benchmark, out, w600)
    assert len(out) == 22
    assert benchmark.stats.stats.max < 60.0


def _bench_agentic(benchmark: Any, trace: pa.Table, instances: int, rounds: int) -> None:
    """One unified tracets run of an agentic-glm trace on H200 engines, ``rounds`` times."""
    out: list[ks.SimResult] = []

    def once() -> None:
        out[:] = [
            ks.simulate(
                trace,
                instances=instances,
                policy="unified",
                mode="tracets",
                preset="h200-qwen3-coder-30b-a3b",
                sample_interval=10.0,
            )
        ]

    benchmark.pedantic(once, rounds=rounds, warmup_rounds=0, iterations=1)
    _info(benchmark, out, trace)
    benchmark.extra_info.update(speedup_vs_trace=_duration(trace) / benchmark.stats.stats.median)
    assert out[0].stats["finished"] == trace.num_rows


def test_sim_agentic_glm_100k(benchmark: Any, glm100k: pa.Table) -> None:
    benchmark.group = "sim"
    _bench_agentic(benchmark, glm100k, instances=32, rounds=3)


@pytest.mark.skipif(os.environ.get("KVROUTE_BENCH_FULL") != "1", reason="set KVROUTE_BENCH_FULL=1")
def test_sim_agentic_glm_full(benchmark: Any, tmp_path: Path) -> None:
    path = Path(os.environ.get("KVROUTE_FULL_TRACE", tmp_path / "glm.parquet"))
    if not path.exists():
        synthesize("agentic-glm", path, seed=42)
    benchmark.group = "sim full"
    _bench_agentic(benchmark, read_trace(path), instances=512, rounds=1)
