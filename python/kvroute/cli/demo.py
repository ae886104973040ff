"""``kvroute demo`` (the whole policy study, ``kvroute.demo``) and ``kvroute policies``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console

import kvroute
from kvroute.cli.common import output_option


@click.command("policies")
def list_policies() -> None:
    """List every routing policy."""
    for name in kvroute.policies():
        click.echo(name)


@click.command()
@output_option(
    "--out",
    folder=True,
    default=Path("kvroute-demo"),
    show_default=True,
    help="Where everything goes (a new or empty folder, unless --force).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="CI's short form: 300-request trace, six policies, 16 live requests.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Use this trace instead of synthesizing the w600 profile.",
)
@click.option("--instances", default=8, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--policy",
    "policy_names",
    multiple=True,
    type=click.Choice([*kvroute.policies(), "capped"]),
    help="Policies to simulate (default: all, plus capped).",
)
@click.option("--no-live", is_flag=True, help="Skip the live check (proxy + emulators).")
@click.option("--live-requests", default=48, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print report.json's object at the end.")
def demo(
    out: Path,
    force: bool,
    quick: bool,
    trace_path: Path | None,
    instances: int,
    policy_names: tuple[str, ...],
    no_live: bool,
    live_requests: int,
    as_json: bool,
) -> None:
    """The policy study in one command: synthesize the w600 trace, compute its ceilings,
    simulate every policy in both dispatch modes, check the live path through the proxy and
    emulators, and write the report with figures to OUT."""
    from kvroute.demo import DemoConfig, run_demo
    from kvroute.report.render import rich_deltas, rich_table

    cfg = DemoConfig(
        out=out,
        quick=quick,
        trace=trace_path,
        instances=instances,
        policies=policy_names,
        live=not no_live,
        live_requests=live_requests,
    )
    err = Console(stderr=True)
    started = time.perf_counter()
    rep = run_demo(cfg, lambda m: err.print(f"[dim]{m}[/dim]"))
    elapsed = time.perf_counter() - started
    if as_json:
        json.dump(
            {**rep.to_dict(), "timings": cfg.timings, "wall_s": elapsed}, sys.stdout, default=str
        )
        sys.stdout.write("\n")
        return
    console = Console(width=max(Console().width, 200))
    console.print(rich_table(rep, title="The study's B3 table, regenerated"))
    if rep.deltas:
        console.print(rich_deltas(rep))
    for note in rep.notes:
        console.print(f"[dim]{note}[/dim]")
    console.print(
        f"[dim]report: {out}/report.md, report.json, figures/ ({elapsed:.1f} s in all)[/dim]"
    )
