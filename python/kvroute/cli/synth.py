"""``kvroute trace synth``: write a synthetic agentic trace and print what it achieved.

Defined here as a standalone click command; ``kvroute.cli.trace`` attaches it to the
``trace`` group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from kvroute.cli.common import force_option
from kvroute.synth import PROFILES, synthesize


@click.command("synth")
@click.option(
    "--profile",
    type=click.Choice(list(PROFILES)),
    default="agentic-glm",
    show_default=True,
    help="Trace shape: the study's full GLM-5.1 agentic trace, or its w600 sample.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=None,
    help="Scale the profile to N requests, sessions in proportion (default: its own size).",
)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=42, show_default=True)
@force_option
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Parquet file to write, or the folder for --shards (canonical format, zstd; an "
    "existing one is refused).",
)
@click.option(
    "--shards",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Write a folder of N Parquet files of consecutive requests instead of one file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the achieved statistics as JSON.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar on stderr (default: when stderr is a terminal).",
)
def synth(
    profile: str,
    requests: int | None,
    seed: int,
    output: Path,
    force: bool,
    shards: int | None,
    as_json: bool,
    progress: bool | None,
) -> None:
    """Write a synthetic agentic trace shaped like the study's and compare it with the study.

    \b
    kvroute trace synth --profile agentic-glm --seed 42 -o glm.parquet   # 2.11M requests
    kvroute trace synth --profile w600 -o w600.parquet                   # 1214 requests
    kvroute trace synth --requests 20000 -o small.parquet                # scaled down
    kvroute trace synth --requests 21100000 --shards 32 -o glm10x/        # 10x, sharded
    """
    show = sys.stderr.isatty() if progress is None else progress
    stats = synthesize(
        profile, output, requests=requests, seed=seed, progress=show, force=force, shards=shards
    )
    if as_json:
        click.echo(json.dumps(stats.to_dict(), sort_keys=True))
        return
    console = Console(width=max(Console().width, 100))
    console.print(stats.table())
    console.print(
        f"[dim]{output}: {stats.file_bytes / 2**20:,.1f} MiB, {stats.sessions:,} sessions, "
        f"{stats.input_tokens:,} input tokens; any/intra-session APC ceiling "
        f"{stats.any_ceiling:.1%} / {stats.intra_ceiling:.1%}; {stats.elapsed_s:.1f} s[/dim]"
    )
