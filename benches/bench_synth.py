"""Synthetic trace generation: ``kvroute.synth.synthesize`` at 100k requests of agentic-glm.

Each timed round is one whole call: pass 1 (every per-request scalar, sorted by time), pass
2 (~6.6M keys, in chunks) and the zstd Parquet write, to a fresh file. The full scale
(2.11M requests, ~139M keys) is run once by hand, not here:

    /usr/bin/time -v kvroute trace synth --profile agentic-glm -o glm.parquet

(numbers in docs/synth.md). Runs with ``make bench`` (pytest collects ``bench_*.py``), or
alone: ``pytest benches/bench_synth.py --benchmark-only``. The generator does not use the
native extension, so its timings do not depend on the build profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute.synth import synthesize

REQUESTS = 100_000


def test_synth_agentic_glm_100k(benchmark: Any, tmp_path: Path) -> None:
    path = tmp_path / "synth.parquet"
    benchmark.group = "synth"
    benchmark.extra_info.update(kind="synth", profile="agentic-glm", requests=REQUESTS)
    stats = benchmark.pedantic(
        synthesize,
        args=("agentic-glm", path),
        kwargs={"requests": REQUESTS, "seed": 42},
        rounds=5,
        warmup_rounds=1,
        iterations=1,
    )
    benchmark.extra_info.update(keys=stats.keys, file_bytes=stats.file_bytes)
    assert stats.requests == REQUESTS
    assert stats.turns_p90 == 1
