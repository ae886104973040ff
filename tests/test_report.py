"""Reports: slow-cause labels, report numbers and mode deltas against hand-computed values on
small record sets, figures and files from a simulated run, and the ``kvroute report`` CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvroute.ceilings import Ceilings, Reuse, Variant
from kvroute.cli import main
from kvroute.records import conform_records, record_schema, write_records
from kvroute.report import SlowConfig, analyze, label_slow, make_run, report
from kvroute.report.analysis import mode_deltas
from kvroute.report.slow import Columns, cause_counts, overlapping_prefill

PNG = b"\x89PNG\r\n\x1a\n"


def records(rows: list[dict[str, Any]], **run: Any) -> pa.Table:
    """Records from partial rows (defaults for the rest)."""
    full = []
    for i, r in enumerate(rows):
        d = {
            "request_id": i,
            "session_id": i,
            "turn": 0,
            "output_length": 11,
            "cached_tokens": 0,
            "error": None,
            **r,
        }
        full.append(d)
    cols = {f.name: [d.get(f.name) for d in full] for f in record_schema()}
    return conform_records(pa.table(cols, schema=record_schema(run=run)))


# Four requests on instance 0, two on instance 1 (times in s, lengths in tokens).
CASE = [
    # 0: slow TTFT (6 s); request 1's big prefill [1, 3) overlaps its lifetime -> overlap
    {"instance": 0, "send": 0.0, "first_token": 6.0, "finish": 7.0, "input_length": 1000},
    # 1: not slow (TTFT 2 s, E2E 2.5 s); a 10k-token prefill
    {"instance": 0, "send": 1.0, "first_token": 3.0, "finish": 3.5, "input_length": 10000},
    # 2: slow E2E (40 s), no big prefill after t=8 on instance 0; queue wait 6 s -> hot_queue
    {
        "instance": 0,
        "send": 8.0,
        "first_token": 8.5,
        "finish": 48.0,
        "input_length": 100,
        "queue_wait": 6.0,
    },
    # 3: slow TTFT (5.5 s), only small prefills around; 20k prompt, hit 1k -> cache_miss
    {
        "instance": 1,
        "send": 0.0,
        "first_token": 5.5,
        "finish": 6.0,
        "input_length": 20000,
        "cached_tokens": 1000,
    },
    # 4: slow TTFT (9 s), hit 90% -> unknown
    {
        "instance": 1,
        "send": 10.0,
        "first_token": 19.0,
        "finish": 20.0,
        "input_length": 20000,
        "cached_tokens": 18000,
    },
    # 5: failed: never slow, never a prefill window
    {
        "instance": 1,
        "send": 10.0,
        "first_token": None,
        "finish": 11.0,
        "input_length": 50000,
        "error": "boom",
    },
    # 6: slow TTFT (6 s) after 4 s in the router's admission queue -> router_queue
    {
        "instance": 2,
        "send": 30.0,
        "first_token": 36.0,
        "finish": 37.0,
        "input_length": 100,
        "router_wait": 4.0,
    },
]


def test_slow_labels_hand_computed() -> None:
    cfg = SlowConfig(hot_factor=100.0)  # no hot instance: only the queue-wait rule
    labels = label_slow(records(CASE), cfg)
    assert labels == [
        "prefill_overlap", None, "hot_queue", "cache_miss", "unknown", None, "router_queue"
    ]  # fmt: skip
    assert cause_counts(labels) == {
        "router_queue": 1,
        "prefill_overlap": 1,
        "hot_queue": 1,
        "cache_miss": 1,
        "unknown": 1,
    }


def test_slow_thresholds_and_hot_instance() -> None:
    # TTFT p90 per instance: 0 -> p90 of (6, 2, 0.5) = 5.2; 1 -> p90 of (5.5, 9) = 8.65;
    # 2 -> 6. Median 6; factor 1.2 -> instance 1 hot (8.65 > 7.2): 3 and 4 become hot_queue.
    labels = label_slow(records(CASE), SlowConfig(hot_factor=1.2))
    assert labels == [
        "prefill_overlap", None, "hot_queue", "hot_queue", "hot_queue", None, "router_queue"
    ]  # fmt: skip
    # Raising the SLOs leaves only request 2 (E2E 40 s > 39 s) slow.
    labels = label_slow(records(CASE), SlowConfig(slo_ttft_s=10, slo_e2e_s=39, hot_factor=9))
    assert labels == [None, None, "hot_queue", None, None, None, None]
    # A 10k prefill is no overlap when the minimum is above it.
    labels = label_slow(records(CASE), SlowConfig(overlap_min_tokens=10001, hot_factor=9))
    assert labels[0] == "unknown"


def test_overlap_matches_brute_force() -> None:
    rng = np.random.default_rng(7)
    n = 300
    send = rng.uniform(0, 50, n)
    first = send + rng.uniform(0, 5, n)
    rows = [
        {
            "instance": int(rng.integers(0, 3)),
            "send": float(s),
            "first_token": float(f),
            "finish": float(f + rng.uniform(0, 5)),
            "input_length": int(rng.integers(1, 20000)),
            "cached_tokens": int(rng.integers(0, 5000)),
            "queue_wait": float(rng.uniform(0, 1)),
        }
        for s, f in zip(send, first, strict=True)
    ]
    c = Columns.of(records(rows))
    got = overlapping_prefill(c, 8192)
    start = c.send + c.queue_wait
    big = (c.input_length - c.hit >= 8192) & (c.first > start)
    for i in range(n):
        want = any(
            j != i
            and big[j]
            and c.instance[j] == c.instance[i]
            and start[j] < c.finish[i]
            and c.first[j] > c.send[i]
            for j in range(n)
        )
        assert got[i] == want, i


def _ceilings(intra: float) -> Ceilings:
    v = Variant(intra, int(intra * 1000), 1000, 1, 2)
    return Ceilings(v, v, Variant(0.0, 0, 1000, 0, 2), (), Reuse(1, 0, 0), 512, 8)


def test_report_numbers_hand_computed() -> None:
    rows = [
        {
            "instance": 0,
            "send": 0.0,
            "first_token": 1.0,
            "finish": 2.0,
            "input_length": 1000,
            "cached_tokens": 500,
        },
        {
            "instance": 1,
            "send": 0.0,
            "first_token": 3.0,
            "finish": 8.0,
            "input_length": 1000,
            "cached_tokens": 100,
        },
    ]
    run = make_run(records(rows, policy="sticky", mode="tracets", source="sim", instances=2))
    rep = analyze([run], ceilings=_ceilings(0.8), config=SlowConfig(slo_ttft_s=2.0))
    (row,) = rep.rows
    assert row["label"] == "sticky/tracets" and row["source"] == "sim"
    assert row["apc"] == pytest.approx(600 / 2000)
    assert row["apc_share_intra"] == pytest.approx(0.3 / 0.8)
    assert row["e2e_mean"] == pytest.approx(5.0)
    assert row["ttft"]["p50"] == pytest.approx(2.0)
    assert row["tpot"]["p90"] == pytest.approx(0.1 + 0.9 * 0.4)  # (0.1, 0.5) linear p90
    assert row["hotspot_index"] == pytest.approx(3.0 / 2.0)  # p90s 1 and 3, median 2
    assert row["req_bal"] == pytest.approx(1.0)
    assert row["slow"] == 1 and row["slow_causes"]["cache_miss"] == 0  # 900 new < 8192
    json.dumps(rep.to_dict())


def test_mode_deltas_hand_computed() -> None:
    def row(mode: str, ttft: float, apc: float) -> dict[str, Any]:
        return {
            "policy": "unified",
            "source": "sim",
            "mode": mode,
            "ttft": {"p90": ttft},
            "e2e": {"p90": 2 * ttft},
            "tpot": {"p90": None},
            "e2e_mean": ttft,
            "apc": apc,
        }

    (d,) = mode_deltas([row("tracets", 10.0, 0.5), row("thinktime", 6.0, 0.55), row("x", 1, 1)])
    assert d["ttft_p90"] == pytest.approx(-0.4) and d["e2e_p90"] == pytest.approx(-0.4)
    assert d["apc"] == pytest.approx(0.05) and d["tpot_p90"] is None
    assert mode_deltas([row("tracets", 1.0, 0.5)]) == []


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import kvroute.sim as ks
    from kvroute.synth import synthesize

    root = tmp_path_factory.mktemp("runs")
    trace = root / "w600.parquet"
    synthesize("w600", trace, seed=1, requests=150)
    for r in ks.sweep(
        trace, policies=["lmetric", "unified"], modes=["tracets", "thinktime"], instances=4
    ):
        r.write(root / "sweep" / r.spec.label)
    return root / "sweep", trace


def test_report_writes_files_and_figures(sim_runs: tuple[Path, Path], tmp_path: Path) -> None:
    sweep, trace = sim_runs
    rep = report([sweep], ceilings=trace, out=tmp_path)
    assert [r["label"] for r in rep.rows] == [
        "lmetric/tracets",
        "lmetric/thinktime",
        "unified/tracets",
        "unified/thinktime",
    ]
    assert {d["policy"] for d in rep.deltas} == {"lmetric", "unified"}
    assert all(0 < r["apc_share_intra"] <= 1.05 for r in rep.rows)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert len(doc["runs"]) == 4 and doc["ceilings"]["intra"]["ratio"] > 0
    md = (tmp_path / "report.md").read_text()
    assert "| unified/thinktime |" in md and "figures/latency.png" in md
    names = {p.name for p in (tmp_path / "figures").glob("*.png")}
    assert names == {
        "latency.png",
        "apc_vs_ceilings.png",
        "apc_vs_hotspot.png",
        "instance_ttft_p90.png",
        "slow_causes.png",
        "kv_footprint_cdf.png",
    }
    for p in (tmp_path / "figures").glob("*.png"):
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000


def test_report_cli(sim_runs: tuple[Path, Path], tmp_path: Path) -> None:
    sweep, trace = sim_runs
    runner = CliRunner()
    res = runner.invoke(
        main, ["report", str(sweep / "unified-thinktime-seed0"), "--slo-ttft", "1", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert doc["slow_config"]["slo_ttft_s"] == 1.0 and doc["runs"][0]["slow"] > 0
    res = runner.invoke(
        main,
        ["report", str(sweep), "--ceilings", str(trace), "--out", str(tmp_path), "--no-figures"],
    )
    assert res.exit_code == 0, res.output
    assert "unified/thinktime" in res.output and "thinktime" in res.output
    assert (tmp_path / "report.md").exists() and not (tmp_path / "figures").exists()
    res = runner.invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "not a run" in res.output


def test_records_file_path_and_duplicate_labels(sim_runs: tuple[Path, Path]) -> None:
    sweep, _ = sim_runs
    f = sweep / "unified-thinktime-seed0" / "records.parquet"
    rep = report([f, f])
    assert [r["label"] for r in rep.rows] == ["unified/thinktime [unified-thinktime-seed0]"] * 2


def test_replay_records_without_flags(tmp_path: Path) -> None:
    rows = [dict(r, decode_overlaps_prefill=None) for r in CASE]
    path = write_records(records(rows, mode="thinktime", source="replay"), tmp_path / "r.parquet")
    rep = report([path])
    assert rep.rows[0]["label"] == "r/thinktime live" and rep.rows[0]["errors"] == 1
