"""The ``kvroute`` command line (click). One module per command group; each is a thin
wrapper over the Python API. Errors follow :mod:`kvroute.cli.common`: one line, exit 2 for
bad input, 1 for the environment, never a traceback unless ``--debug``."""

from __future__ import annotations

import click

import kvroute
from kvroute.cli.calibrate import calibrate, side_by_side
from kvroute.cli.ceilings import ceilings
from kvroute.cli.common import Group, debug_option
from kvroute.cli.demo import demo, list_policies
from kvroute.cli.kv_events import kv_events
from kvroute.cli.live import engine, proxy, replay
from kvroute.cli.report import bench, report
from kvroute.cli.simulate import simulate
from kvroute.cli.srr import srr
from kvroute.cli.trace import trace


@click.group(cls=Group)
@click.version_option(kvroute.__version__, prog_name="kvroute")
@debug_option
def main(debug: bool) -> None:
    """KV-cache-aware routing of LLM requests: route, estimate, compare policies."""


main.add_command(list_policies)
main.add_command(demo)
main.add_command(ceilings)
main.add_command(trace)
main.add_command(proxy)
main.add_command(engine)
main.add_command(replay)
main.add_command(kv_events)
main.add_command(simulate)
main.add_command(calibrate)
main.add_command(side_by_side)
main.add_command(report)
bench.add_command(srr)
main.add_command(bench)

__all__ = ["main"]
