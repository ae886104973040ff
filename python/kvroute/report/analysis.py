"""The numbers of a report: per run the SEMANTICS §6 summary (:func:`kvroute.metrics.summarize`)
plus E2E mean, APC as a share of the trace's intra-session ceiling, slow requests and their
causes (:mod:`.slow`); per policy the ``tracets`` -> ``thinktime`` changes when both modes
ran; and the trace's ceilings when given.

O(records log records) per run; stateless, thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.ceilings import Ceilings
from kvroute.metrics import summarize
from kvroute.report.runs import Run
from kvroute.report.slow import SlowConfig, cause_counts, label_slow

#: The changes reported between dispatch modes: (name, summary path, kind).
DELTAS = (
    ("ttft_p90", ("ttft", "p90"), "rel"),
    ("e2e_mean", ("e2e_mean",), "rel"),
    ("e2e_p90", ("e2e", "p90"), "rel"),
    ("tpot_p90", ("tpot", "p90"), "rel"),
    ("apc", ("apc",), "abs"),
)


@dataclass
class Report:
    """Everything a report shows; :meth:`to_dict` is ``report.json``."""

    rows: list[dict[str, Any]]
    deltas: list[dict[str, Any]]
    config: SlowConfig
    ceilings: Ceilings | None = None
    trace: dict[str, Any] | None = None
    runs: list[Run] = field(default_factory=list, repr=False)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.rows,
            "mode_deltas": self.deltas,
            "slow_config": self.config.to_dict(),
            "ceilings": self.ceilings.to_dict() if self.ceilings is not None else None,
            "trace": self.trace,
            "notes": self.notes,
        }


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d


def run_row(run: Run, config: SlowConfig, ceilings: Ceilings | None = None) -> dict[str, Any]:
    """One run's numbers (the summary's keys plus label, policy, mode, source, e2e_mean,
    apc_share_intra, slow, slow_causes)."""
    s = summarize(run.records, run.info.get("instances"))
    r = run.records
    ok = np.asarray(r.column("error").is_null().to_numpy(zero_copy_only=False), dtype=bool)
    ok &= np.asarray(r.column("first_token").is_valid().to_numpy(zero_copy_only=False))
    e2e = (r.column("finish").to_numpy() - r.column("send").to_numpy())[ok]
    labels = label_slow(r, config)
    causes = cause_counts(labels)
    apc = s["apc"]
    intra = ceilings.intra.ratio if ceilings is not None else None
    return {
        "label": run.label,
        "policy": run.policy,
        "mode": run.mode,
        "source": run.source,
        "path": str(run.path.parent if run.path is not None else ""),
        **s,
        "e2e_mean": float(e2e.mean()) if len(e2e) else None,
        "apc_share_intra": apc / intra if apc is not None and intra else None,
        "slow": sum(causes.values()),
        "slow_causes": causes,
    }


def _change(before: Any, after: Any, kind: str) -> float | None:
    if before is None or after is None:
        return None
    if kind == "abs":
        return float(after - before)
    return float(after / before - 1.0) if before else None


def mode_deltas(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (policy, source) with both a ``tracets`` and a ``thinktime`` run: the relative
    change ``thinktime / tracets - 1`` of TTFT p90, E2E mean, E2E p90 and TPOT p90, and the
    absolute change of APC (negative latency changes: thinktime is faster)."""
    by: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in rows:
        by.setdefault((row["policy"], row["source"], row["mode"]), row)
    out = []
    for (policy, source, mode), before in by.items():
        after = by.get((policy, source, "thinktime"))
        if mode != "tracets" or after is None:
            continue
        d: dict[str, Any] = {"policy": policy, "source": source}
        for name, path, kind in DELTAS:
            d[name] = _change(_get(before, path), _get(after, path), kind)
        out.append(d)
    return out


def analyze(
    runs: list[Run],
    *,
    config: SlowConfig | None = None,
    ceilings: Ceilings | None = None,
    trace: dict[str, Any] | None = None,
) -> Report:
    """The report of ``runs`` (in the order given)."""
    cfg = config or SlowConfig()
    rows = [run_row(r, cfg, ceilings) for r in runs]
    return Report(rows, mode_deltas(rows), cfg, ceilings, trace, list(runs))
