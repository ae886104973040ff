"""``kvroute demo --quick`` end to end (CI's short form of ``make demo``) and ``policies``."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import kvroute
from kvroute.cli import main


def test_demo_quick(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = CliRunner().invoke(main, ["demo", "--quick", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "B3 table" in res.output and "unified/thinktime live" in res.output
    doc = json.loads((out / "report.json").read_text())
    labels = [r["label"] for r in doc["runs"]]
    assert len(labels) == 13 and labels[-1] == "unified/thinktime live"
    live = doc["runs"][-1]
    assert live["errors"] == 0 and live["requests"] == 16 and live["source"] == "replay"
    assert doc["ceilings"]["intra"]["ratio"] > 0.5 and len(doc["mode_deltas"]) == 6
    assert (out / "report.md").read_text().startswith("# kvroute demo")
    pngs = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert len(pngs) == 6
    for p in (out / "figures").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out / "figures" / "latency.png").shape[2] in (3, 4)
    assert (out / "trace" / "w600.parquet").exists()
    assert (out / "runs" / "unified-thinktime-seed0" / "records.parquet").exists()


def test_demo_given_trace_no_live(tmp_path: Path) -> None:
    trace = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_head1000.jsonl"
    res = CliRunner().invoke(
        main,
        [
            "demo",
            "--trace",
            str(trace),
            "--no-live",
            "--policy",
            "unified",
            "--policy",
            "lmetric",
            "--instances",
            "4",
            "--out",
            str(tmp_path),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert [r["label"] for r in doc["runs"]] == ["lmetric/tracets", "unified/tracets"]
    assert doc["timings"] and doc["wall_s"] > 0


def test_policies_lists_every_policy() -> None:
    res = CliRunner().invoke(main, ["policies"])
    assert res.exit_code == 0 and res.output.split() == kvroute.policies()
