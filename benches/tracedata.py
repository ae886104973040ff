"""Bench data sets shared by the bench modules: the full-scale synthetic trace.

The 2.11M-request agentic-glm trace (seed 42) is generated once by ``kvroute.synth`` into
``$KVROUTE_BENCH_DATA`` (default ``~/.cache/kvroute``) and reused; generating it takes
under a minute and about 1 GiB of memory.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path(os.environ.get("KVROUTE_BENCH_DATA", Path.home() / ".cache" / "kvroute"))
FULL_REQUESTS = 2_110_000


def full_scale_trace() -> Path:
    """The full-scale agentic-glm synthetic trace, generated on first use."""
    from kvroute.synth import synthesize

    path = DATA / f"agentic-glm-{FULL_REQUESTS}-seed42.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.parquet")
        synthesize("agentic-glm", tmp, requests=FULL_REQUESTS, seed=42)
        tmp.rename(path)
    return path
