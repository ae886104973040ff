"""``kvroute bench interference`` against emulators (short cells)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.report.interference import BenchConfig, run_interference
from livekit import Stack


def test_interference_cells() -> None:
    with Stack(2, speedup=20.0) as s:
        a, b = s.engine_urls
        cfg = BenchConfig(
            a,
            b,
            sizes=(2048, 16384),
            duration_s=1.5,
            decode_rate=20.0,
            decode_tokens=16,
            injections=2,
        )
        cells = run_interference(cfg)
    assert [(c.variant, c.size) for c in cells] == [
        ("same", 2048),
        ("same", 16384),
        ("different", 2048),
        ("different", 16384),
    ]
    for c in cells:
        assert c.errors == 0 and c.n_overlap + c.n_clean == 30 and len(c.injection_s) == 2
    # How much a prefill slows the decodes beside it is a ratio of wall-clock times, which
    # a busy host moves: the real engines' B2 (tests/test_real_calibration.py) holds it.


def test_a_repeated_run_sends_new_prompts() -> None:
    """Run twice against one engine, the injections still prefill: the second run's prompts
    are not the first's, which the engine's prefix cache would serve without prefill."""
    with Stack(1, speedup=20.0) as s:
        cfg = BenchConfig(
            s.engine_urls[0], sizes=(16384,), variants=("same",), duration_s=1.0,
            decode_rate=10.0, decode_tokens=8, injections=1,
        )  # fmt: skip
        stats = s.emulators[0].engine.stats
        first = run_interference(cfg)[0]
        queried, hits = stats()["prefix_queries_tokens"], stats()["prefix_hits_tokens"]
        again = run_interference(cfg)[0]
        assert stats()["prefix_queries_tokens"] - queried >= 16384
        assert stats()["prefix_hits_tokens"] == hits  # nothing the first run sent was reused
    assert first.errors == again.errors == 0


def test_interference_cli(tmp_path: Path) -> None:
    with Stack(1, speedup=20.0) as s:
        res = CliRunner().invoke(
            main,
            [
                "bench",
                "interference",
                "--decode-endpoint",
                s.engine_urls[0] + "/v1",
                "--sizes",
                "4096",
                "--duration",
                "1",
                "--decode-rate",
                "10",
                "--decode-tokens",
                "8",
                "--injections",
                "1",
                "--out",
                str(tmp_path),
            ],
        )
    assert res.exit_code == 0, res.output
    assert "same" in res.output and "different" not in res.output
    doc = json.loads((tmp_path / "interference.json").read_text())
    assert len(doc["cells"]) == 1 and doc["cells"][0]["size"] == 4096
    assert (tmp_path / "interference.png").read_bytes()[:4] == b"\x89PNG"


def test_interference_real_and_simulated_on_the_emulator(tmp_path: Path) -> None:
    """With ``--engine-profile`` the bench also simulates the same schedule and reports both:
    the simulated cells show a prefill stalling the decodes of its own engine only."""
    from livekit import spawn
    from test_side_by_side import profile

    prof = profile(tmp_path / "profile.json")
    procs = [spawn("engine", "--model", "m", "--engine-profile", str(prof)) for _ in range(2)]
    out = tmp_path / "out"
    args = ["bench", "interference", "--sizes", "6000", "--duration", "6", "--decode-rate", "8"]
    args += ["--decode-prompt", "128", "--decode-tokens", "64", "--injections", "3"]
    args += ["--engine-profile", str(prof), "--out", str(out)]
    try:
        urls = ["--decode-endpoint", procs[0].url, "--prefill-endpoint", procs[1].url]
        res = CliRunner().invoke(main, [*args, *urls])
    finally:
        for p in procs:
            p.stop()
    assert res.exit_code == 0, res.output
    assert "real / sim" in res.output
    doc = json.loads((out / "interference.json").read_text())
    real, sim = doc["cells"], doc["simulated"]
    assert [(c["variant"], c["size"]) for c in sim] == [(c["variant"], c["size"]) for c in real]
    same, other = sim
    assert same["tpot_index"] > 1.2 and same["ttft_index"] > 2  # a 6k prefill stalls decodes
    assert other["tpot_index"] == pytest.approx(1.0, abs=0.02)  # another engine's does not
    # The measured indices are ratios of wall-clock times, which a busy host moves: how close
    # they come to the simulated ones is held on real engines (tests/test_real_calibration.py).
    assert all(c["errors"] == 0 and c["tpot_index"] is not None for c in real), real
