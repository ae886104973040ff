"""``kvroute calibrate``: measure running engines on a grid and write an engine profile that
``kvroute simulate --engine-profile`` and ``kvroute engine --engine-profile`` load
(:mod:`kvroute.sim.calibrate`; ``docs/simulator.md`` "Calibration")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvroute.cli.common import Finite, output_option
from kvroute.files import write_text

_GRIDS = ("standard", "short", "held-out")

#: How each fitted term is shown: (label, unit scale, unit).
_TERMS = {
    "step_overhead_s": ("step overhead", 1e3, "ms"),
    "prefill_s_per_token": ("prefill per token", 1e6, "µs"),
    "prefill_s_per_pair": ("prefill per (token, context token)", 1e9, "ns"),
    "decode_s_per_seq": ("decode per sequence", 1e3, "ms"),
    "decode_s_per_ctx_token": ("decode per context token", 1e6, "µs"),
    "admit_s_per_token": ("admission per prompt token", 1e6, "µs"),
    "admit_s_per_request": ("admission per request", 1e3, "ms"),
    "request_overhead_s": ("request overhead", 1e3, "ms"),
    "busy_handling_s": ("later start at a busy engine", 1e3, "ms"),
}


def _summary(doc: dict[str, Any]) -> Table:
    params = doc["params"]
    t = Table(
        title=f"engine profile: {doc['engine']['model']} ({len(doc['engine']['urls'])} engine(s))"
    )
    t.add_column("term")
    t.add_column("value", justify="right")
    for name, (label, scale, unit) in _TERMS.items():
        t.add_row(f"{label} ({name})", f"{params[name] * scale:.4g} {unit}")
    for name in ("kv_block_size", "kv_capacity_tokens", "max_num_batched_tokens", "max_num_seqs"):
        if name in params:
            t.add_row(name, f"{params[name]:.0f}")
    return t


def _errors(doc: dict[str, Any]) -> Table:
    t = Table(title="relative error of the fit (measured vs predicted)")
    for col in ("points", "kind", "n", "p50", "p90", "max"):
        t.add_column(col, justify="left" if col in ("points", "kind") else "right")
    for part in ("fit", "held_out"):
        if part not in doc:
            continue
        for kind, e in doc[part]["error"].items():
            t.add_row(
                part.replace("_", "-"),
                kind,
                str(e["points"]),
                *(f"{e[q]:.1%}" for q in ("p50", "p90", "max")),
            )
    return t


@click.command("calibrate")
@click.option(
    "--url", "urls", multiple=True, required=True, help="Engine base URL (repeat; alike engines)."
)
@output_option("-o", "--out", "out", required=True, help="Profile file to write (JSON).")
@click.option("--grid", default="standard", show_default=True, type=click.Choice(_GRIDS))
@click.option(
    "--held-out",
    default="held-out",
    show_default=True,
    type=click.Choice([*_GRIDS, "none"]),
    help="A grid measured but not fitted, to report the profile's error on.",
)
@click.option("--model", default=None, help="Model to calibrate (default: the engine's first).")
@click.option(
    "--max-num-batched-tokens",
    default=2048,
    show_default=True,
    type=click.IntRange(min=1),
    help="The engines' chunked-prefill token budget (vLLM's CPU default).",
)
@click.option(
    "--max-num-seqs",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="The engines' running-sequence cap (vLLM's CPU default).",
)
@click.option(
    "--vocab-size",
    default=32000,
    show_default=True,
    type=click.IntRange(min=1000),
    help="Token ids of the random prompts are drawn below this.",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--decode-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens each decoder of a decode or mixed point streams on its first try "
    "[default: the grid's, 24-32]; a point whose decoders did not stream long enough "
    "together is tried again with more.",
)
@click.option(
    "--clock",
    default="wall",
    show_default=True,
    type=click.Choice(["wall", "engine"]),
    help="Time chunks as they arrive (wall), or by the engine's own stamps (engine: "
    "`kvroute engine` only; a measurement the host's load cannot move).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the profile instead of tables.")
def calibrate(
    urls: tuple[str, ...],
    out: Path,
    force: bool,
    grid: str,
    held_out: str,
    model: str | None,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    vocab_size: int,
    seed: int,
    decode_tokens: int | None,
    clock: str,
    as_json: bool,
) -> None:
    """Measure running OpenAI-compatible engines and fit the simulator's engine model."""
    from kvroute.sim import calibrate as cal

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=as_json) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(f"{stage} grid", total=total)
            bar.update(tasks[stage], completed=done, total=total)

        doc = cal.calibrate(
            list(urls),
            grid=grid,
            held_out=None if held_out == "none" else held_out,
            model=model,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            vocab_size=vocab_size,
            seed=seed,
            decode_tokens=decode_tokens,
            clock="engine" if clock == "engine" else "wall",
            progress=progress,
        )
    text = json.dumps(doc, indent=2) + "\n"
    write_text(out, text)
    if as_json:
        sys.stdout.write(text)
        return
    console = Console(width=max(Console().width, 100))
    console.print(_summary(doc))
    console.print(_errors(doc))
    for why in doc["engine"]["skipped"]:
        console.print(f"skipped: {why}", style="dim", markup=False)
    for warning in doc["warnings"]:
        console.print(f"warning: {warning}", style="yellow", markup=False)
    console.print(f"[dim]wrote {out}[/dim]")


@click.command("side-by-side")
@click.argument("trace_path", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--url", "urls", multiple=True, required=True, help="Engine base URL (repeat), as calibrated."
)
@click.option(
    "--engine-profile",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The engines' profile from `kvroute calibrate`.",
)
@output_option(
    "-o", "--out", "out_dir", folder=True, required=True, help="Folder for records and report."
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policy name(s), comma list [default: unified, lmetric, load_only, sticky, leastwork].",
)
@click.option(
    "--mode", type=click.Choice(["tracets", "thinktime"]), default="tracets", show_default=True
)
@click.option(
    "--time-scale",
    default=1.0,
    show_default=True,
    type=Finite(min=0.0, min_open=True),
    help="Multiply the trace's times by this (both runs).",
)
@click.option("--max-requests", type=click.IntRange(min=1), default=None)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--tie-orders",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Also simulate the requests that arrive at the same instant in this many other "
    "orders, and report the range of APC they give (0: only the file's order).",
)
@click.option("--model", default=None, help="Model name (default: the engines' first).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def side_by_side(
    trace_path: Path,
    urls: tuple[str, ...],
    engine_profile: Path,
    out_dir: Path,
    force: bool,
    policies: tuple[str, ...],
    mode: str,
    time_scale: float,
    max_requests: int | None,
    seed: int,
    tie_orders: int,
    model: str | None,
    as_json: bool,
) -> None:
    """Replay TRACE's policies against running engines and simulate them with a profile."""
    from kvroute.sim import side_by_side as sbs
    from kvroute.sim.profile import load_profile
    from kvroute.sim.ties import tied_requests
    from kvroute.trace import read_trace

    engine = load_profile(engine_profile)
    table = read_trace(trace_path)
    if max_requests is not None:
        table = table.slice(0, max_requests)
    names = [p.strip() for item in policies for p in item.split(",") if p.strip()]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task: list[Any] = []

        def on_arm(policy: str) -> None:
            task.append(bar.add_task(f"{policy} (real)", total=table.num_rows))

        arms = sbs.side_by_side(
            table,
            list(urls),
            engine,
            policies=names or sbs.POLICIES,
            mode=mode,
            time_scale=time_scale,
            seed=seed,
            tie_orders=tie_orders,
            model=model,
            on_arm=on_arm,
            on_request=lambda: bar.advance(task[-1]),
        )
    meta = {
        "trace": str(trace_path),
        "requests": table.num_rows,
        "urls": list(urls),
        "engine_profile": str(engine_profile),
        "mode": mode,
        "time_scale": time_scale,
        "seed": seed,
        "tied_requests": tied_requests(table),
        "tie_orders": tie_orders,
    }
    doc = sbs.write(arms, out_dir, meta)
    if as_json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return
    Console(width=max(Console().width, 160)).print(sbs.markdown(doc), markup=False)
    Console().print(f"[dim]wrote {out_dir}/side_by_side.md, .json and each arm's records[/dim]")
