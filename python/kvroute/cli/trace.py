"""``kvroute trace ...``: convert, sample, cap, annotate-ttp, stats (and synth)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvroute.cli.common import FINITE, Finite, output_option
from kvroute.cli.synth import synth
from kvroute.files import read_parquet
from kvroute.trace import FORMATS, read_trace_with_report, write_trace
from kvroute.trace_ops import (
    MODELS,
    annotate_ttp,
    cap_sessions,
    plot_cdf,
    sample,
    shrink,
    trace_stats,
)

_err = Console(stderr=True)


def _input_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options every subcommand that reads a trace takes."""
    options = [
        click.argument("source", type=click.Path(exists=True, path_type=Path)),
        click.option(
            "--format",
            "fmt",
            type=click.Choice(FORMATS),
            default=None,
            help="Input format (default: detected).",
        ),
        click.option(
            "--block-size",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per key for agentic and text traces (default 512).",
        ),
        click.option(
            "--infer-sessions",
            is_flag=True,
            help="Group Mooncake requests into sessions by shared prefixes.",
        ),
        click.option(
            "--on-error",
            type=click.Choice(["raise", "skip"]),
            default="raise",
            show_default=True,
            help="Stop at the first bad line, or skip and count.",
        ),
        click.option(
            "--tokenizer",
            default=None,
            help="Text traces: a tokenizer.json path (default: built-in).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _load(
    source: Path,
    fmt: str | None,
    block_size: int | None,
    infer_sessions: bool,
    on_error: str,
    tokenizer: str | None,
) -> Any:
    table, report = read_trace_with_report(
        source,
        format=fmt,
        block_size=block_size,
        infer_sessions=infer_sessions,
        on_error="skip" if on_error == "skip" else "raise",
        tokenizer=tokenizer,
    )
    _err.print(f"[dim]{report.summary()}[/dim]", highlight=False)
    return table


def _output(table: Any, output: Path, force: bool) -> None:
    write_trace(table, output, force=force)
    _err.print(f"[dim]wrote {table.num_rows} requests to {output}[/dim]", highlight=False)


_output_option = output_option(
    "-o", "--output", required=True, help="Parquet file to write (refused if it exists)."
)


@click.group("trace")
def trace() -> None:
    """Read, convert, transform, describe and synthesize traces."""


trace.add_command(synth)


@trace.command()
@_input_options
@_output_option
def convert(output: Path, force: bool, **read: Any) -> None:
    """Convert a trace to the canonical Parquet format."""
    _output(_load(**read), output, force)


@trace.command("sample")
@_input_options
@_output_option
@click.option("--window-seconds", type=FINITE, default=None, help="Window length (default: all).")
@click.option("--window-start", type=FINITE, default=0.0, show_default=True)
@click.option(
    "--sample-ratio",
    type=Finite(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Fraction of the window's sessions to keep.",
)
@click.option(
    "--max-single-turn-ratio",
    type=Finite(0, 1, max_open=True),
    default=None,
    help="Cap on the share of single-turn sessions.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def sample_cmd(
    output: Path,
    force: bool,
    window_seconds: float | None,
    window_start: float,
    sample_ratio: float,
    max_single_turn_ratio: float | None,
    seed: int,
    **read: Any,
) -> None:
    """Sample sessions from a time window (deterministic for a seed)."""
    table = sample(
        _load(**read),
        window_seconds=window_seconds,
        window_start=window_start,
        sample_ratio=sample_ratio,
        max_single_turn_ratio=max_single_turn_ratio,
        seed=seed,
    )
    _output(table, output, force)


@trace.command("cap")
@_input_options
@_output_option
@click.option("--max-turns", type=click.IntRange(min=1), default=8, show_default=True)
def cap_cmd(output: Path, force: bool, max_turns: int, **read: Any) -> None:
    """Keep the first --max-turns requests of every session (the `capped` ablation)."""
    _output(cap_sessions(_load(**read), max_turns), output, force)


@trace.command("shrink")
@_input_options
@_output_option
@click.option(
    "--to-block-size",
    type=click.IntRange(min=1),
    required=True,
    help="Tokens per block after (input lengths scale by it over the trace's block size).",
)
@click.option("--max-output", type=click.IntRange(min=1), default=None, help="Cap outputs.")
def shrink_cmd(
    output: Path, force: bool, to_block_size: int, max_output: int | None, **read: Any
) -> None:
    """The same prefix sharing in smaller blocks: prompts that fit a small engine."""
    _output(shrink(_load(**read), to_block_size, max_output), output, force)


@trace.command("annotate-ttp")
@_input_options
@_output_option
@click.option(
    "--finish",
    "finish_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Parquet with request_id and finish (s) of each request.",
)
def annotate_ttp_cmd(output: Path, force: bool, finish_path: Path | None, **read: Any) -> None:
    """Fill time_to_parent_chat (from parent finish times when given, else parent starts)."""
    finish = read_parquet(finish_path) if finish_path else None
    table = annotate_ttp(_load(**read), finish)
    basis = (table.schema.metadata or {}).get(b"kvroute.ttp_basis", b"?").decode()
    _err.print(f"[dim]time_to_parent_chat measured from the parent's {basis}[/dim]")
    _output(table, output, force)


@trace.command()
@_input_options
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default="qwen3-coder-30b-a3b",
    show_default=True,
    help="Model whose KV bytes per token size the footprint.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@output_option("--plot", default=None, help="Write the length and KV-footprint CDFs to this PNG.")
def stats(model: str, as_json: bool, plot: Path | None, force: bool, **read: Any) -> None:
    """Requests, sessions, turns, lengths and KV footprint of a trace."""
    table = _load(**read)
    s = trace_stats(table, model=model)
    if plot is not None:
        plot_cdf(table, plot, kv_bytes_per_token=s["kv_bytes_per_token"], force=force)
    if as_json:
        json.dump(s, sys.stdout)
        sys.stdout.write("\n")
        return
    console = Console()
    console.print(
        f"{s['requests']} requests, {s['sessions']} sessions, {s['duration_s']:.1f} s, "
        f"{s['keys']} keys of {s['block_size']} tokens, {s['total_input_tokens']:,} input tokens"
    )
    table_out = Table(title=f"KV at {s['kv_bytes_per_token']} B/token ({model})")
    for col in ("", "p50", "p90", "p99", "max", "mean"):
        table_out.add_column(col, justify="right")
    for name, unit in (
        ("turns_per_session", ""),
        ("input_length", " tok"),
        ("output_length", " tok"),
        ("kv_per_request_gib", " GiB"),
    ):
        d = s[name]
        fmt = "{:.2f}" if unit == " GiB" or name == "turns_per_session" else "{:,.0f}"
        table_out.add_row(
            name + unit, *(fmt.format(d[k]) for k in ("p50", "p90", "p99", "max", "mean"))
        )
    console.print(table_out)
    if plot is not None:
        console.print(f"[dim]CDFs written to {plot}[/dim]")
