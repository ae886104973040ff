"""``kvroute bench interference`` against emulators (short cells)."""

from __future__ import annotations

import json
from pathlib import Path

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
    same_big = cells[1]
    # Decodes that arrive during a same-engine 16k prefill wait for it.
    assert same_big.ttft_index is not None and same_big.ttft_index > 3


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
