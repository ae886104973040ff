"""``kvroute bench srr``: each policy's sustainable request rate on running engines and the
causes of its slow requests around it (B4/B5; :mod:`kvroute.report.srr`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

import kvroute
from kvroute.cli.common import BadInput, Finite, output_option
from kvroute.cli.live import admission_options, token_cap
from kvroute.cli.report import cause_rule_options
from kvroute.errors import KvrouteError
from kvroute.files import write_text
from kvroute.report.slow import CAUSES, SlowConfig


@click.command("srr")
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--url", "urls", multiple=True, required=True, help="Engine base URL (repeat).")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(kvroute.policies()),
    help="Policy to measure (repeat) [default: unified_dynamo].",
)
@click.option("--slo-ttft-p90", required=True, type=Finite(min=0, min_open=True), help="Seconds.")
@click.option("--slo-tpot-p90", required=True, type=Finite(min=0, min_open=True), help="Seconds.")
@click.option(
    "--slo-e2e",
    default=30.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Seconds: with the TTFT target, what makes a request slow for the cause labels.",
)
@click.option(
    "--start",
    default=None,
    type=Finite(min=0, min_open=True),
    help="First rate probed, sessions/s [default: the trace's own].",
)
@click.option(
    "--think-scale",
    default=1.0,
    show_default=True,
    type=Finite(min=0),
    help="Multiply the trace's think times (time_to_parent_chat) by this.",
)
@click.option("--rel-tol", default=0.1, show_default=True, type=Finite(min=0, min_open=True))
@click.option("--max-rounds", default=8, show_default=True, type=click.IntRange(1, 100))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--seeds",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Runs per probe (arrival seeds SEED, SEED+1, ...), judged together.",
)
@click.option("--model", default=None, help="Model name [default: the engines' first].")
@click.option(
    "--engine-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Profile of these engines (kvroute calibrate): the ttft policy's costs, and the "
    "simulator's prediction of the same table beside the measured one.",
)
@cause_rule_options
@admission_options
@output_option("--out", folder=True, default=None, help="Write srr.json and srr.md here.")
def srr(
    trace_path: Path,
    urls: tuple[str, ...],
    policies: tuple[str, ...],
    slo_ttft_p90: float,
    slo_tpot_p90: float,
    slo_e2e: float,
    start: float | None,
    think_scale: float,
    rel_tol: float,
    max_rounds: int,
    seed: int,
    seeds: int,
    model: str | None,
    engine_profile: Path | None,
    max_in_flight: int | None,
    max_in_flight_tokens: str | None,
    queue_size: int | None,
    queue_patience: float,
    queue_hold: float,
    queue_hold_yield: float,
    overlap_min_tokens: int,
    hot_factor: float,
    queue_wait: float,
    miss_ratio: float,
    large_append: int,
    out: Path | None,
    force: bool,
) -> None:
    """B4/B5 on running engines: replay TRACE open-loop through a kvroute proxy per policy,
    find each policy's highest session rate within the SLOs, then label the slow requests
    at 0.9x, 1.0x and 1.1x of it (docs/report.md). The slow-cause thresholds are
    `kvroute report`'s; the runs at the factors are written under OUT/runs."""
    from kvroute.report import srr as srr_api
    from kvroute.sim.profile import load_profile
    from kvroute.trace import read_trace

    err = Console(stderr=True)
    try:
        engine = load_profile(engine_profile) if engine_profile else None
        proxy: dict[str, Any] = {
            "queue_patience_s": queue_patience,
            "queue_hold_s": queue_hold,
            "queue_hold_yield_s": queue_hold_yield,
        }
        if max_in_flight is not None:
            proxy["max_in_flight"] = max_in_flight
        tokens = token_cap(max_in_flight_tokens, list(urls), "bench srr")
        if tokens is not None:
            proxy["max_in_flight_tokens"] = tokens
        if queue_size is not None:
            proxy["queue_size"] = queue_size
        cfg = srr_api.SrrConfig(
            urls=tuple(urls),
            policies=tuple(policies) or ("unified_dynamo",),
            slo_ttft_p90=slo_ttft_p90,
            slo_tpot_p90=slo_tpot_p90,
            start=start,
            rel_tol=rel_tol,
            max_rounds=max_rounds,
            seed=seed,
            seeds=seeds,
            model=model,
            slo_e2e_s=slo_e2e,
            think_scale=think_scale,
            slow=SlowConfig(
                slo_ttft_p90,
                slo_e2e,
                overlap_min_tokens,
                hot_factor,
                queue_wait,
                miss_ratio,
                large_append,
            ),
            records_dir=None if out is None else out / "runs",
            proxy=proxy,
            policy_options={"ttft": {"engine_profile": engine}} if engine else {},
        )
        trace = read_trace(trace_path)
        probe = srr_api.live_probe(trace, cfg)
        found = srr_api.search(trace, cfg, probe, lambda m: err.print(f"[dim]{m}[/dim]"))
        rates = {p: float(v["rate"]) for p, v in found.items()}
        doc: dict[str, Any] = {
            "config": {k: v for k, v in cfg.__dict__.items() if k != "policy_options"}
            | {"slow": cfg.slow.to_dict()},
            "trace": str(trace_path),
            "real": {"rates": found, "causes": srr_api.causes(cfg, rates, probe)},
        }
        if engine is not None:
            doc["simulated"] = srr_api.simulated(trace, cfg, engine)
            doc["engine_profile"] = str(engine_profile)
    except KvrouteError as exc:
        raise BadInput(str(exc)) from exc
    text = markdown(doc)
    Console(width=max(Console().width, 110)).print(_table(doc))
    if out is not None:
        write_text(out / "srr.json", json.dumps(doc, indent=2, default=str) + "\n")
        write_text(out / "srr.md", text)
        Console().print(f"[dim]wrote {out}/srr.json, srr.md[/dim]")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f}"


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per policy, source and factor: rate, p90s, errors, slow requests by cause."""
    rows = []
    for source in ("real", "simulated"):
        part = doc.get(source)
        if part is None:
            continue
        for policy, runs in part["causes"].items():
            rate = part["rates"][policy]["rate"]
            if not runs:
                rows.append(
                    [policy, source, f"{rate:.4g}", "", "", "", "", "", *[""] * len(CAUSES)]
                )
            for r in runs:
                rows.append([
                    policy, source, f"{rate:.4g}", f"{r['factor']:g}x", _ms(r["ttft_p90"]),
                    _ms(r["tpot_p90"]), str(r["errors"]), f"{r['slow']}/{r['requests']}",
                    *(str(r[c]) for c in CAUSES),
                ])  # fmt: skip
    return rows


HEADER = ["policy", "source", "rate (sessions/s)", "at", "TTFT p90 ms", "TPOT p90 ms", "errors",
          "slow", *CAUSES]  # fmt: skip


def _table(doc: dict[str, Any]) -> Table:
    table = Table(title="sustainable rate and slow causes (B4/B5)", title_justify="left")
    for col in HEADER:
        table.add_column(col, justify="left" if col in ("policy", "source") else "right")
    for row in _rows(doc):
        table.add_row(*row)
    return table


def markdown(doc: dict[str, Any]) -> str:
    """The table as Markdown."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(doc)]
    return "\n".join(lines) + "\n"
