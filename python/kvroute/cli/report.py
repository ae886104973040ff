"""``kvroute report`` (tables and figures from run records) and ``kvroute bench interference``
(the study's B2 microbenchmark against OpenAI-compatible endpoints)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from kvroute.cli.common import output_option
from kvroute.files import write_text

F = TypeVar("F", bound=Callable[..., Any])


def cause_rule_options(f: F) -> F:
    """The thresholds of the slow-cause rules (``kvroute.report.slow.SlowConfig``)."""
    options = [
        click.option(
            "--overlap-min-tokens",
            default=8192,
            show_default=True,
            help="Smallest other prefill (new tokens) that counts as an overlap.",
        ),
        click.option(
            "--hot-factor",
            default=1.5,
            show_default=True,
            help="Hot instance: TTFT p90 over this x the median instance's.",
        ),
        click.option(
            "--queue-wait",
            default=5.0,
            show_default=True,
            help="Hot-instance queue also when the request's queue wait is this long (s).",
        ),
        click.option(
            "--miss-ratio",
            default=0.5,
            show_default=True,
            help="Cache miss: prefix hit below this share of the prompt ...",
        ),
        click.option(
            "--large-append",
            default=8192,
            show_default=True,
            help="... and at least this many new tokens.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--ceilings",
    "trace",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The trace the runs replayed: APC against its ceilings, KV footprint CDF.",
)
@output_option(
    "--out", folder=True, default=None, help="Write report.md, report.json and figures/*.png here."
)
@click.option("--slo-ttft", default=5.0, show_default=True, help="Slow: TTFT over this (s).")
@click.option("--slo-e2e", default=30.0, show_default=True, help="Slow: E2E over this (s).")
@cause_rule_options
@click.option("--no-figures", is_flag=True, help="Skip the PNG figures.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json's object.")
def report(
    runs: tuple[Path, ...],
    trace: Path | None,
    out: Path | None,
    force: bool,
    slo_ttft: float,
    slo_e2e: float,
    overlap_min_tokens: int,
    hot_factor: float,
    queue_wait: float,
    miss_ratio: float,
    large_append: int,
    no_figures: bool,
    as_json: bool,
) -> None:
    """Report on runs (run directories, records files or sweep directories): latency
    percentiles, APC against the trace's ceilings, interference and hotspot indices, slow
    requests by cause, tracets->thinktime changes; terminal, Markdown, JSON and PNG."""
    from kvroute.report import SlowConfig
    from kvroute.report import report as make_report
    from kvroute.report.render import rich_deltas, rich_table

    cfg = SlowConfig(
        slo_ttft, slo_e2e, overlap_min_tokens, hot_factor, queue_wait, miss_ratio, large_append
    )
    rep = make_report(list(runs), ceilings=trace, out=out, config=cfg, figures=not no_figures)
    if as_json:
        json.dump(rep.to_dict(), sys.stdout, default=str)
        sys.stdout.write("\n")
        return
    console = Console(width=max(Console().width, 200))
    console.print(rich_table(rep))
    if rep.deltas:
        console.print(rich_deltas(rep))
    if out is not None:
        console.print(f"[dim]wrote {out}/report.md, report.json, figures/[/dim]")


@click.group("bench")
def bench() -> None:
    """Microbenchmarks against OpenAI-compatible endpoints."""


@bench.command("interference")
@click.option("--decode-endpoint", required=True, help="Endpoint that gets the decode load.")
@click.option(
    "--prefill-endpoint",
    default=None,
    help="Second endpoint, for the 'different' variant (omit: 'same' only).",
)
@click.option("--model", default=None, help="Model name (default: the endpoint's first).")
@click.option(
    "--sizes",
    default="2048,8192,16384,32768,65536",
    show_default=True,
    help="Injected prefill sizes in tokens, comma separated.",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["same", "different"]),
    help="Variants to run (default: both).",
)
@click.option("--duration", default=60.0, show_default=True, help="Seconds per cell.")
@click.option("--decode-rate", default=4.0, show_default=True, help="Decode requests/s.")
@click.option("--decode-prompt", default=256, show_default=True)
@click.option("--decode-tokens", default=64, show_default=True)
@click.option("--injections", default=4, show_default=True, help="Prefills per cell.")
@click.option(
    "--engine-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Also simulate every cell with this profile (from `kvroute calibrate`), side by side.",
)
@output_option(
    "--out", folder=True, default=None, help="Write interference.json and interference.png here."
)
def interference(
    decode_endpoint: str,
    prefill_endpoint: str | None,
    model: str | None,
    sizes: str,
    variants: tuple[str, ...],
    duration: float,
    decode_rate: float,
    decode_prompt: int,
    decode_tokens: int,
    injections: int,
    engine_profile: Path | None,
    out: Path | None,
    force: bool,
) -> None:
    """B2: a steady short-prompt decode load plus large one-token prefills on the same or
    another endpoint; TPOT and TTFT p90 indices (overlapping / clean decodes) per cell."""
    from kvroute.report.interference import (
        BenchConfig,
        plot,
        run_interference,
        simulate_interference,
        to_dict,
    )
    from kvroute.sim.profile import load_profile

    try:
        size_list = tuple(int(s) for s in sizes.split(",") if s.strip())
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {sizes}", param_hint="--sizes") from exc
    cfg = BenchConfig(
        decode_endpoint,
        prefill_endpoint,
        model,
        size_list,
        variants or ("same", "different"),
        duration,
        decode_rate,
        decode_prompt,
        decode_tokens,
        injections,
    )
    params = load_profile(engine_profile) if engine_profile else None
    err = Console(stderr=True)
    cells = run_interference(
        cfg, lambda c: err.print(f"[dim]{c.variant} {c.size}: tpot idx {c.tpot_index}[/dim]")
    )
    simulated = simulate_interference(cfg, params) if params is not None else None

    def idx(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    table = Table(title="interference microbenchmark (B2)", title_justify="left")
    cols = ["variant", "prefill", "n_overlap", "n_clean", "TPOT idx", "TTFT idx", "errors"]
    if simulated is not None:
        cols[4:6] = ["TPOT idx real / sim", "TTFT idx real / sim"]
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for i, c in enumerate(cells):
        tpot, ttft = idx(c.tpot_index), idx(c.ttft_index)
        if simulated is not None:
            tpot += f" / {idx(simulated[i].tpot_index)}"
            ttft += f" / {idx(simulated[i].ttft_index)}"
        table.add_row(
            c.variant, str(c.size), str(c.n_overlap), str(c.n_clean), tpot, ttft, str(c.errors)
        )
    Console(width=max(Console().width, 110)).print(table)
    if out is not None:
        doc = to_dict(cfg, cells)
        if simulated is not None:
            doc["simulated"] = to_dict(cfg, simulated)["cells"]
            doc["engine_profile"] = str(engine_profile)
        write_text(out / "interference.json", json.dumps(doc, indent=2) + "\n")
        plot(cells, out / "interference.png")
        Console().print(f"[dim]wrote {out}/interference.json, interference.png[/dim]")
