"""``kvroute ceilings TRACE``: the APC ceilings of a trace, as a table or one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvroute.ceilings import CapacityPoint, Ceilings, Variant
from kvroute.ceilings import ceilings as compute_ceilings
from kvroute.cli.common import Finite, executor_options, output_option
from kvroute.files import write_text


def _capacities(text: str | None) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError as exc:
            raise click.BadParameter(f"{part!r} is not a number", param_hint="--capacity") from exc
        if not value.is_integer() or value < 1:
            raise click.BadParameter(
                f"{part!r} is not a positive whole number of keys", param_hint="--capacity"
            )
        out.append(int(value))
    return out


def _table(result: Ceilings, name: str) -> Table:
    table = Table(title=f"APC ceilings of {name} (block {result.block_size} tokens)")
    for col in ("ceiling", "ratio", "hit tokens", "tokens", "hit reqs", "requests"):
        table.add_column(col, justify="left" if col == "ceiling" else "right", no_wrap=True)
    rows: list[tuple[str, Variant | CapacityPoint]] = [
        ("any-session", result.any),
        ("intra-session", result.intra),
        (f"shared (S>={result.min_sessions})", result.shared),
        *((f"LRU {c.capacity:,} keys", c) for c in result.capacity),
    ]
    for label, v in rows:
        table.add_row(
            label,
            f"{v.ratio:.4f}",
            f"{v.hit_tokens:,}",
            f"{v.total_tokens:,}",
            f"{v.hit_requests:,}",
            f"{v.total_requests:,}",
        )
    return table


@click.command("ceilings")
@click.argument("trace")
@click.option(
    "--min-sessions",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Sessions through a prefix for it to count as shared.",
)
@click.option(
    "--capacity",
    default=None,
    help="Comma-separated LRU cache sizes in keys for the capacity curve, e.g. 1e6,1e7.",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per key (default: the trace's metadata, else 512).",
)
@executor_options("Ray tasks over the Parquet files partitioned by first key")
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=None,
    help="Partitions of the trace with --executor ray [default: twice the files].",
)
@click.option(
    "--task-memory",
    type=Finite(min=0.001),
    default=None,
    help="GiB each task reserves with --executor ray (Ray schedules by it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@output_option("-o", "--output", default=None, help="Also write the JSON object to this file.")
def ceilings(
    trace: str,
    min_sessions: int,
    capacity: str | None,
    block_size: int | None,
    executor: str,
    ray_address: str | None,
    partitions: int | None,
    task_memory: float | None,
    as_json: bool,
    output: Path | None,
    force: bool,
) -> None:
    """APC ceilings of TRACE: any-session, intra-session, shared-prefix, LRU capacities.

    TRACE is a trace file, or a folder or glob of Parquet files (a sharded trace, read in
    name order)."""
    caps = _capacities(capacity)
    if executor != "ray" and (ray_address or partitions or task_memory):
        raise click.UsageError("--ray-address, --partitions and --task-memory need --executor ray")
    result = compute_ceilings(
        trace,
        block_size=block_size,
        min_sessions=min_sessions,
        capacities=caps,
        executor=executor,
        ray_address=ray_address,
        partitions=partitions,
        task_memory=None if task_memory is None else int(task_memory * 2**30),
    )
    if output is not None:
        write_text(output, json.dumps(result.to_dict(), indent=2) + "\n", force=force)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    console = Console()
    console.print(_table(result, Path(trace).name))
    r = result.reuse
    hits = max(r.intra + r.cross + r.shared, 1)
    console.print(
        "any-session hit tokens by reuse: "
        f"intra {r.intra:,} ({r.intra / hits:.1%}), cross {r.cross:,} ({r.cross / hits:.1%}), "
        f"shared {r.shared:,} ({r.shared / hits:.1%})",
        highlight=False,
    )
