"""Reports of runs, simulated or real (``docs/report.md``).

>>> from kvroute.report import report
>>> r = report(["sweep/"], ceilings="w600.parquet", out="report/")   # doctest: +SKIP

:func:`report` reads per-request records (:mod:`.runs`), computes per run the SEMANTICS §6
metrics, APC against the trace's ceilings, slow requests and their causes and the dispatch
mode deltas (:mod:`.analysis`, :mod:`.slow`), and writes ``report.md``, ``report.json`` and
``figures/*.png`` (:mod:`.render`, :mod:`.figures`). O(records log records) plus figure
drawing; not for concurrent use from several threads (matplotlib's global state).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvroute import args
from kvroute.errors import KvrouteTypeError
from kvroute.files import write_text
from kvroute.report.analysis import Report, analyze
from kvroute.report.runs import Run, load_runs, make_run
from kvroute.report.slow import CAUSES, SlowConfig, label_slow

CEILING_CAPACITIES = (256, 1024, 4096, 16384, 65536)


def trace_ceilings(trace: Any, capacities: Sequence[int] = CEILING_CAPACITIES) -> Any:
    """The ceilings of ``trace`` (a path or table) with a capacity curve."""
    from kvroute.ceilings import ceilings

    return ceilings(trace, capacities=list(capacities), progress=False)


def write_report(
    rep: Report,
    out: str | Path,
    *,
    trace: pa.Table | None = None,
    figures: bool = True,
    title: str = "kvroute report",
) -> dict[str, Any]:
    """Write ``report.md``, ``report.json`` and (``figures``) ``figures/*.png`` under
    ``out``; returns their paths."""
    from kvroute.report.render import markdown

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if figures:
        from kvroute.report.figures import write_figures

        pngs = write_figures(rep, out_dir / "figures", trace)
    rel = [str(p.relative_to(out_dir)) for p in pngs]
    md = write_text(out_dir / "report.md", markdown(rep, rel, title))
    js = write_text(
        out_dir / "report.json",
        json.dumps(rep.to_dict(), indent=2, sort_keys=True, default=str) + "\n",
    )
    return {"markdown": md, "json": js, "figures": pngs}


def report(
    runs: Sequence[str | Path | Run],
    *,
    ceilings: str | Path | pa.Table | None = None,
    out: str | Path | None = None,
    config: SlowConfig | None = None,
    figures: bool = True,
    title: str = "kvroute report",
) -> Report:
    """Analyse ``runs`` (paths as :func:`load_runs` takes them, or :class:`Run` objects);
    ``ceilings``: the trace they replayed, for APC against its ceilings and the KV CDF;
    ``out``: where to write the report (nothing written when None)."""
    args.sequence(runs, "runs")
    args.flag(figures, "figures")
    args.text(title, "title")
    if config is not None and not isinstance(config, SlowConfig):
        raise KvrouteTypeError(f"config must be a SlowConfig or None, got {type(config).__name__}")
    loaded: list[Run] = [r for r in runs if isinstance(r, Run)]
    paths = [args.path(p, "runs") for p in runs if not isinstance(p, Run)]
    if paths:
        loaded += load_runs(paths)
    table = None
    ceil = None
    trace_doc = None
    if ceilings is not None:
        from kvroute.trace import read_trace
        from kvroute.trace_ops import trace_stats

        table = ceilings if isinstance(ceilings, pa.Table) else read_trace(ceilings)
        ceil = trace_ceilings(table)
        trace_doc = trace_stats(table)
        if not isinstance(ceilings, pa.Table):
            trace_doc["path"] = str(ceilings)
    rep = analyze(loaded, config=config, ceilings=ceil, trace=trace_doc)
    if out is not None:
        write_report(rep, out, trace=table, figures=figures, title=title)
    return rep


__all__ = [
    "CAUSES",
    "Report",
    "Run",
    "SlowConfig",
    "analyze",
    "label_slow",
    "load_runs",
    "make_run",
    "report",
    "write_report",
]
