"""The ``kvroute`` command line (click). One module per command group; each is a thin
wrapper over the Python API, and turns kvroute errors into one-line messages (exit 1)."""

from __future__ import annotations

import click

import kvroute
from kvroute.cli.demo import demo, list_policies
from kvroute.cli.trace import trace


@click.group()
@click.version_option(kvroute.__version__, prog_name="kvroute")
def main() -> None:
    """KV-cache-aware routing of LLM requests: route, estimate, compare policies."""


main.add_command(list_policies)
main.add_command(demo)
main.add_command(trace)

__all__ = ["main"]
