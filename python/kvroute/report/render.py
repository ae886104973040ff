"""A report as text: the headline table (the study's B3 table) for a terminal (rich) and as
Markdown, with the slow-cause breakdown, the ``tracets`` -> ``thinktime`` changes and the
trace's ceilings. O(runs); stateless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from kvroute.report.analysis import Report
from kvroute.report.slow import CAUSES

HEADLINE = (
    "run",
    "TTFT p50/p90/p99 s",
    "TPOT p50/p90/p99 ms",
    "E2E p50/p90/p99 s",
    "APC",
    "APC/intra",
    "interf.",
    "hotspot",
    "req_bal",
    "n_slow",
)
CAUSE_NAMES = {
    "router_queue": "router queue (admission)",
    "prefill_overlap": "same-instance prefill overlap",
    "hot_queue": "hot-instance queue",
    "cache_miss": "cache miss, large append",
    "unknown": "unknown",
}


def _num(v: Any, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "n/a" if v is None else fmt.format(v * scale)


def _triple(p: dict[str, Any], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return " / ".join(_num(p.get(k), fmt, scale) for k in ("p50", "p90", "p99"))


def headline_cells(row: dict[str, Any]) -> list[str]:
    """One row of the headline table."""
    return [
        row["label"],
        _triple(row["ttft"]),
        _triple(row["tpot"], 1000.0, "{:.1f}"),
        _triple(row["e2e"]),
        _num(row["apc"], "{:.1%}"),
        _num(row["apc_share_intra"], "{:.0%}"),
        _num(row["interference_index"]),
        _num(row["hotspot_index"], "{:.3f}"),
        _num(row["req_bal"]),
        str(row["slow"]),
    ]


def cause_cells(row: dict[str, Any]) -> list[str]:
    n = row["slow"]
    cells = [row["label"], str(n)]
    for c in CAUSES:
        k = row["slow_causes"][c]
        cells.append(f"{k} ({k / n:.0%})" if n else "0")
    return cells


def delta_cells(d: dict[str, Any]) -> list[str]:
    pct = [_num(d[k], "{:+.0%}") for k in ("ttft_p90", "e2e_mean", "e2e_p90", "tpot_p90")]
    label = d["policy"] + (" (live)" if d["source"] == "replay" else "")
    return [label, *pct, _num(d["apc"], "{:+.1%}", 1.0).replace("%", " pp")]


DELTA_HEAD = ("policy", "ΔTTFT p90", "ΔE2E mean", "ΔE2E p90", "ΔTPOT p90", "ΔAPC")


def rich_table(report: Report, title: str | None = None) -> Table:
    """The headline table for a terminal."""
    table = Table(title=title, title_justify="left")
    for col in HEADLINE:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for row in report.rows:
        table.add_row(*headline_cells(row))
    return table


def rich_deltas(report: Report) -> Table:
    table = Table(title="tracets -> thinktime (negative: thinktime faster)", title_justify="left")
    for col in DELTA_HEAD:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for d in report.deltas:
        table.add_row(*delta_cells(d))
    return table


def md_table(head: Sequence[str], rows: list[list[str]]) -> str:
    """A Markdown table, first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(head) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(report: Report, figures: Sequence[str] = (), title: str = "kvroute report") -> str:
    """The whole report as Markdown; ``figures`` are relative PNG paths to embed."""
    cfg = report.config
    out = [f"# {title}", ""]
    out += [f"> {n}" for n in report.notes] + ([""] if report.notes else [])
    out += ["## Runs", "", md_table(HEADLINE, [headline_cells(r) for r in report.rows]), ""]
    out.append(
        "TTFT/TPOT/E2E percentiles, APC = Σ cached / Σ input, APC/intra = APC over the "
        "trace's intra-session ceiling, interference and hotspot indices and req_bal as in "
        "SEMANTICS §6; n_slow = requests with TTFT > "
        f"{cfg.slo_ttft_s:g} s or E2E > {cfg.slo_e2e_s:g} s."
    )
    out += ["", "## Slow requests by cause", ""]
    head = ["run", "n_slow", *(CAUSE_NAMES[c] for c in CAUSES)]
    out += [md_table(head, [cause_cells(r) for r in report.rows]), ""]
    out.append(
        "One label per slow request, first rule that applies (docs/report.md): another "
        f"prefill of ≥ {cfg.overlap_min_tokens} new tokens on the same instance during its "
        f"lifetime; its instance's TTFT p90 > {cfg.hot_factor:g} x the median instance's, "
        f"or queue wait ≥ {cfg.queue_wait_s:g} s; prefix hit < {cfg.miss_hit_ratio:.0%} "
        f"of the prompt with ≥ {cfg.large_append_tokens} new tokens; else unknown."
    )
    if report.deltas:
        out += ["", "## tracets → thinktime", ""]
        out.append(md_table(DELTA_HEAD, [delta_cells(d) for d in report.deltas]))
        out += ["", "Relative change thinktime / tracets - 1 (negative: thinktime faster)."]
    if report.ceilings is not None:
        c = report.ceilings
        out += ["", "## APC ceilings of the trace", ""]
        rows = [
            [name, f"{v.ratio:.1%}", f"{v.hit_requests} / {v.total_requests}"]
            for name, v in (("any-session", c.any), ("intra-session", c.intra))
        ]
        rows.append([f"shared-prefix (≥ {c.min_sessions} sessions)", f"{c.shared.ratio:.2%}", ""])
        rows[-1][2] = f"{c.shared.hit_requests} / {c.shared.total_requests}"
        out.append(md_table(["variant", "upper bound", "hit requests"], rows))
        total = c.reuse.intra + c.reuse.cross + c.reuse.shared
        if total:
            out += [
                "",
                "Reuse of the any-session ceiling's hits: "
                + ", ".join(
                    f"{k} {v / total:.1%}"
                    for k, v in (
                        ("intra", c.reuse.intra),
                        ("cross", c.reuse.cross),
                        ("shared", c.reuse.shared),
                    )
                )
                + ".",
            ]
    if figures:
        out += ["", "## Figures", ""]
        out += [f"![{f}]({f})" for f in figures]
    return "\n".join(out) + "\n"
