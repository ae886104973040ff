"""PNG figures of a report (matplotlib, Agg backend, no display needed): latency bars per
policy, APC against the ceilings, APC against hotspot, per-instance TTFT p90, slow-cause
breakdown, and the trace's KV footprint CDF. O(runs x instances) drawing; matplotlib's
pyplot state is global, so call from one thread at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.figure import Figure

from kvroute.files import save_figure
from kvroute.report.analysis import Report
from kvroute.report.render import CAUSE_NAMES
from kvroute.report.slow import CAUSES

DPI = 110
CAUSE_COLORS = ("tab:purple", "tab:red", "tab:orange", "tab:blue", "tab:gray")


def _save(fig: Figure, path: Path) -> Path:
    try:
        return save_figure(fig, path, dpi=DPI)
    finally:
        plt.close(fig)


def _groups(report: Report) -> tuple[list[str], list[str]]:
    policies: list[str] = []
    series: list[str] = []
    for run, row in zip(report.runs, report.rows, strict=True):
        if row["policy"] not in policies:
            policies.append(row["policy"])
        if run.series not in series:
            series.append(run.series)
    return policies, series


def latency_bars(report: Report, path: Path) -> Path:
    """TTFT, TPOT and E2E per policy, one bar per mode: bar p90, whisker p50 to p99."""
    policies, series = _groups(report)
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.9 * len(policies) + 3), 9.5), sharex=True)
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(policies))
    metrics = (("ttft", "TTFT (s)", 1.0), ("tpot", "TPOT (ms)", 1000.0), ("e2e", "E2E (s)", 1.0))
    for ax, (key, ylabel, scale) in zip(axes, metrics, strict=True):
        for k, s in enumerate(series):
            for run, row in zip(report.runs, report.rows, strict=True):
                p = row[key]
                if run.series != s or p["p90"] is None:
                    continue
                xi = policies.index(row["policy"]) + (k - (len(series) - 1) / 2) * width
                ax.bar(xi, p["p90"] * scale, width, color=f"C{k}", label=s)
                ax.plot([xi, xi], [p["p50"] * scale, p["p99"] * scale], color="black", lw=1)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    axes[0].legend(uniq.values(), uniq.keys(), title="dispatch mode", fontsize=8)
    axes[0].set_title("Latency per policy (bar: p90; line: p50 to p99)")
    axes[-1].set_xticks(x, policies, rotation=30, ha="right")
    fig.tight_layout()
    return _save(fig, path)


def apc_vs_ceilings(report: Report, path: Path) -> Path:
    """Measured APC per run against the trace's any/intra/shared ceilings, and the
    capacity curve of the any-session ceiling when it was computed."""
    c = report.ceilings
    curve = bool(c is not None and c.capacity)
    fig, axes = plt.subplots(
        1,
        2 if curve else 1,
        figsize=(12 if curve else 8, 0.32 * len(report.rows) + 2.2),
        squeeze=False,
    )
    ax = axes[0][0]
    labels = [r["label"] for r in report.rows]
    apc = [100 * (r["apc"] or 0.0) for r in report.rows]
    y = np.arange(len(labels))
    ax.barh(y, apc, color="tab:blue", label="measured APC")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    if c is not None:
        for name, v, style in (
            ("any-session", c.any, "-"),
            ("intra-session", c.intra, "--"),
            ("shared-prefix", c.shared, ":"),
        ):
            ax.axvline(
                100 * v.ratio, color="black", ls=style, label=f"{name} ceiling ({v.ratio:.1%})"
            )
    ax.set_xlabel("APC (% of prompt tokens served from prefix cache)")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    ax.set_title("APC against the trace's ceilings")
    ax.grid(axis="x", alpha=0.3)
    if curve and c is not None:
        ax2 = axes[0][1]
        caps = [p.capacity for p in c.capacity]
        ax2.plot(caps, [100 * p.ratio for p in c.capacity], marker="o")
        ax2.axhline(100 * c.any.ratio, color="black", ls="-", label="unbounded cache")
        ax2.set_xscale("log")
        ax2.set_xlabel(f"global LRU cache size (keys of {c.block_size} tokens)")
        ax2.set_ylabel("any-session ceiling (%)")
        ax2.set_ylim(0, 100)
        ax2.legend(fontsize=8)
        ax2.set_title("Ceiling against cache capacity")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def apc_vs_hotspot(report: Report, path: Path) -> Path:
    """One point per run: APC against hotspot index, marker per mode."""
    _, series = _groups(report)
    fig, ax = plt.subplots(figsize=(8, 6))
    markers = "osD^v<>"
    for k, s in enumerate(series):
        pts = [
            (100 * row["apc"], row["hotspot_index"], row["policy"])
            for run, row in zip(report.runs, report.rows, strict=True)
            if run.series == s and row["apc"] is not None and row["hotspot_index"] is not None
        ]
        if not pts:
            continue
        ax.scatter(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=markers[k % len(markers)],
            s=50,
            color=f"C{k}",
            label=s,
        )
        for n, (xv, yv, name) in enumerate(sorted(pts)):
            off = ((5, 4), (5, -10), (-5, 6))[n % 3]
            ax.annotate(
                name,
                (xv, yv),
                textcoords="offset points",
                xytext=off,
                fontsize=7,
                ha="right" if off[0] < 0 else "left",
            )
    hs = [r["hotspot_index"] for r in report.rows if r["hotspot_index"]]
    if hs and max(hs) / min(hs) > 4:  # one far-off policy would squash the rest
        ax.set_yscale("log")
        ticks = [
            t for t in (1, 1.25, 1.5, 2, 3, 5, 10, 20, 50) if min(hs) / 1.2 <= t <= max(hs) * 1.2
        ]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("APC (%)")
    ax.set_ylabel("hotspot index (max / median instance TTFT p90)")
    ax.set_title("Locality against hot spots")
    ax.legend(title="dispatch mode", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def instance_ttft(report: Report, path: Path) -> Path:
    """Heat map of TTFT p90 per run and instance (s); blank: no request."""
    n = max((len(r["per_instance_ttft_p90"]) for r in report.rows), default=1)
    grid = np.full((len(report.rows), n), np.nan)
    for i, r in enumerate(report.rows):
        for j, v in enumerate(r["per_instance_ttft_p90"]):
            grid[i, j] = np.nan if v is None else v
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * n + 4), 0.32 * len(report.rows) + 2))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(np.arange(len(report.rows)), [r["label"] for r in report.rows], fontsize=8)
    ax.set_xticks(np.arange(n), [str(j) for j in range(n)])
    ax.set_xlabel("instance")
    top = np.nanmax(grid) if np.isfinite(grid).any() else 0.0
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(
                j,
                i,
                f"{v:.1f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if v < 0.6 * top else "black",
            )
    fig.colorbar(im, ax=ax, label="TTFT p90 (s)")
    ax.set_title("TTFT p90 per instance")
    fig.tight_layout()
    return _save(fig, path)


def slow_causes(report: Report, path: Path) -> Path:
    """Stacked bars: slow requests per run by cause."""
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(report.rows) + 2.2))
    y = np.arange(len(report.rows))
    left = np.zeros(len(report.rows))
    for cause, color in zip(CAUSES, CAUSE_COLORS, strict=True):
        vals = np.array([r["slow_causes"][cause] for r in report.rows], dtype=float)
        ax.barh(y, vals, left=left, color=color, label=CAUSE_NAMES[cause])
        left += vals
    ax.set_yticks(y, [r["label"] for r in report.rows], fontsize=8)
    ax.invert_yaxis()
    cfg = report.config
    ax.set_xlabel(f"slow requests (TTFT > {cfg.slo_ttft_s:g} s or E2E > {cfg.slo_e2e_s:g} s)")
    ax.set_title("Slow requests by cause")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def kv_cdf(trace: pa.Table, path: Path, kv_bytes_per_token: int = 98304) -> Path:
    """The trace's input length and KV footprint per request, as CDFs."""
    from kvroute.trace_ops import plot_cdf

    return plot_cdf(trace, path, kv_bytes_per_token=kv_bytes_per_token)


def write_figures(report: Report, out_dir: Path, trace: pa.Table | None = None) -> list[Path]:
    """Every figure that the report's data allows, under ``out_dir``."""
    if not report.rows:
        return []
    out: list[Any] = [
        latency_bars(report, out_dir / "latency.png"),
        apc_vs_ceilings(report, out_dir / "apc_vs_ceilings.png"),
        apc_vs_hotspot(report, out_dir / "apc_vs_hotspot.png"),
        instance_ttft(report, out_dir / "instance_ttft_p90.png"),
        slow_causes(report, out_dir / "slow_causes.png"),
    ]
    if trace is not None:
        out.append(kv_cdf(trace, out_dir / "kv_footprint_cdf.png"))
    return out
