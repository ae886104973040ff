"""``kvroute bench srr`` (``kvroute.report.srr``): the rate search on a probe of known
capacity, the cause labels at the factors, and the command end to end on emulators."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvroute import sim
from kvroute.cli import main
from kvroute.errors import InvalidArgumentError
from kvroute.records import conform_records
from kvroute.report import srr
from kvroute.trace import write_trace
from livekit import Stack, small_trace
from test_ttft import profile


def records(ttft: float, n: int = 20, error: str | None = None) -> pa.Table:
    """``n`` one-token requests on two instances, each ``ttft`` to its first token."""
    table = pa.table(
        {
            "request_id": list(range(n)),
            "session_id": list(range(n)),
            "instance": [i % 2 for i in range(n)],
            "send": [float(i) for i in range(n)],
            "first_token": [i + ttft for i in range(n)],
            "finish": [i + ttft for i in range(n)],
            "input_length": [100] * n,
            "output_length": [1] * n,
            "error": [error] + [None] * (n - 1),
        }
    )
    return conform_records(table)


def config(**kw: object) -> srr.SrrConfig:
    base: dict[str, object] = {
        "urls": ("http://a", "http://b"),
        "policies": ("leastwork", "unified"),
        "slo_ttft_p90": 1.0,
        "slo_tpot_p90": 1.0,
        "start": 1.0,
    }
    return srr.SrrConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_the_search_finds_a_known_capacity() -> None:
    # TTFT grows with the rate: 0.25 s per session/s, so the SLO of 1 s holds up to 4.
    # leastwork's capacity is twice unified's.
    capacity = {"leastwork": 4.0, "unified": 2.0}
    probed: list[tuple[str, float]] = []

    def probe(policy: str, rate: float, seed: int) -> pa.Table:
        probed.append((policy, rate))
        return records(rate / capacity[policy])

    found = srr.search(pa.table({"timestamp": [0.0], "session_id": [0]}), config(), probe)
    doubling = {"leastwork": [1, 2, 4, 8], "unified": [1, 2, 4]}  # then bisection
    for policy, cap in capacity.items():
        got = found[policy]
        assert got["rate"] == cap and cap < got["upper"] <= cap * 1.1
        first = got["probes"][: len(doubling[policy])]
        assert [(p["rate"], p["ok"]) for p in first] == [(r, r <= cap) for r in doubling[policy]]
    assert [p for p, _ in probed] == sorted(p for p, _ in probed), "one policy after the other"


def test_a_run_with_an_error_fails_and_causes_are_counted() -> None:
    cfg = config(policies=("leastwork",))
    assert not srr.passes(records(0.1, error="HTTP 503"), cfg)[0]
    assert srr.passes(records(0.1), cfg)[0]
    rows = srr.causes(cfg, {"leastwork": 2.0}, lambda p, r, s: records(r))
    assert [r["factor"] for r in rows["leastwork"]] == [0.9, 1.0, 1.1]
    # At 1.1x every request takes 2.2 s > 1 s: all slow, none with a known cause here.
    last = rows["leastwork"][-1]
    assert last["slow"] == 20 and last["unknown"] == 20 and last["rate"] == pytest.approx(2.2)
    assert srr.causes(cfg, {"leastwork": 0.0}, lambda p, r, s: records(r)) == {"leastwork": []}
    with pytest.raises(InvalidArgumentError, match="slo_ttft_p90"):
        config(slo_ttft_p90=0.0)


def test_a_probe_runs_every_seed_and_judges_their_requests_together() -> None:
    cfg = config(policies=("leastwork",), seed=5, seeds=3)
    seen: list[int] = []

    def probe(policy: str, rate: float, seed: int) -> pa.Table:
        seen.append(seed)
        return records(2.0 if seed == 6 else 0.1)  # one draw of three is slow

    ok, fig = srr.passes(srr.runs(probe, cfg, "leastwork", 1.0), cfg)
    assert seen == [5, 6, 7] and fig["requests"] == 60
    assert not ok and fig["ttft_p90"] == pytest.approx(2.0), "a third of the requests are slow"
    rows = srr.causes(cfg, {"leastwork": 1.0}, probe, factors=(1.0,))["leastwork"]
    assert rows[0]["requests"] == 60 and rows[0]["slow"] == 20
    with pytest.raises(InvalidArgumentError, match="seeds"):
        config(seeds=0)


def test_the_simulator_routes_with_the_proxys_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    grids: dict[str, dict[str, list[float]]] = {}

    def sweep(trace: pa.Table, **kw: Any) -> list[SimpleNamespace]:
        grids[kw["policies"][0]] = kw["grid"]
        return [SimpleNamespace(records=records(0.1))]

    monkeypatch.setattr(sim, "sweep", sweep)
    admission = {"max_in_flight": 4, "queue_size": 8, "queue_patience_s": 0.5, "queue_hold_s": 1}
    cfg = config(policies=("unified_dynamo", "leastwork"), proxy=admission)
    trace = pa.table({"timestamp": [0.0], "session_id": [0]})
    got = srr.simulated(trace, cfg, engine={}, factors=(1.0,))
    queue = {"max_in_flight": [4.0], "queue_patience_s": [0.5], "queue_hold_s": [1.0]}
    assert grids == {"unified_dynamo": {"overlap_weight": [8.0], **queue}, "leastwork": queue}
    assert got["rates"]["leastwork"]["upper"] is None, "every fake probe passed"
    # A token cap alone turns the simulated queue on too.
    tokens = {"max_in_flight_tokens": 12288, "queue_size": 8}
    srr.simulated(trace, config(policies=("leastwork",), proxy=tokens), engine={}, factors=(1.0,))
    assert grids["leastwork"] == {"max_in_flight_tokens": [12288.0]}


def test_think_times_are_scaled() -> None:
    trace = small_trace(sessions=2, turns=3, ttp=0.4)
    half = srr.scaled(trace, config(think_scale=0.5)).column("time_to_parent_chat").to_pylist()
    assert half == [
        None if t is None else 0.2 for t in trace.column("time_to_parent_chat").to_pylist()
    ]
    assert srr.scaled(trace, config()) is trace


def test_the_command_on_emulators(tmp_path: Path) -> None:
    trace = tmp_path / "t.parquet"
    write_trace(small_trace(sessions=4, turns=2, block_size=64), trace)
    out = tmp_path / "out"
    with Stack(2, speedup=50.0) as s:
        args = ["bench", "srr", str(trace), *(a for u in s.engine_urls for a in ("--url", u))]
        args += ["--policy", "leastwork", "--policy", "ttft", "--slo-ttft-p90", "30"]
        args += [
            "--slo-tpot-p90",
            "30",
            "--max-rounds",
            "2",
            "--start",
            "4",
            "--think-scale",
            "0.5",
            "--seeds",
            "2",
        ]
        args += ["--engine-profile", str(profile(tmp_path / "p.json")), "--out", str(out)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    doc = json.loads((out / "srr.json").read_text())
    for source in ("real", "simulated"):
        for policy in ("leastwork", "ttft"):
            rows = doc[source]["causes"][policy]
            assert [r["factor"] for r in rows] == [0.9, 1.0, 1.1]
            for r in rows:
                assert r["slow"] == sum(
                    r[c]
                    for c in (
                        "router_queue",
                        "prefill_overlap",
                        "hot_queue",
                        "cache_miss",
                        "unknown",
                    )
                )
    probes = doc["real"]["rates"]["leastwork"]["probes"]
    assert len(probes) == 2 and all(p["ok"] and p["requests"] == 16 for p in probes), "2 seeds"
    assert doc["real"]["rates"]["leastwork"]["rate"] == 8.0, "4 then 8 passed; no failure yet"
    assert "| leastwork | real |" in (out / "srr.md").read_text()
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert (
        len(runs) == 24
        and "real-ttft-1.1x-seed1.parquet" in runs
        and "simulated-leastwork-0.9x-seed0.parquet" in runs
    )
    assert doc["config"]["slow"]["overlap_min_tokens"] == 8192
