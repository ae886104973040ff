"""What every ``kvroute`` command shares: the error contract and the output options.

Every failure is one line on stderr and never a traceback (``kvroute --debug`` shows one):

* exit 2: usage errors and bad input (any :class:`~kvroute.errors.KvrouteError`: a bad
  argument, a damaged or malformed file, an output that exists without ``--force``);
* exit 1: the environment (a file that cannot be written, a full disk) and internal errors;
* exit 130 (SIGINT) or 143 (SIGTERM): interrupted; the line says which outputs were kept
  (outputs are atomic, :mod:`kvroute.files`, so none is left half-written).

Stateless apart from the SIGTERM handler a file-writing command installs.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvroute import files
from kvroute.errors import KvrouteError, OutputExistsError

F = TypeVar("F", bound=Callable[..., Any])

# Long-running servers keep their own signal handling (SIGTERM stops them cleanly).
SERVERS = frozenset({"proxy", "engine", "kv-events"})


class Finite(click.FloatRange):
    """A float option that must be finite, within the bounds given (click's ``FloatRange``
    lets ``nan`` and ``inf`` through)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        got = super().convert(value, param, ctx)
        if not math.isfinite(got):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return got


#: Any finite float, and a finite float above 0.
FINITE = Finite()
POSITIVE = Finite(min=0, min_open=True)


class BadInput(click.ClickException):
    """Bad input or arguments: one line, exit 2."""

    exit_code = 2


class Interrupted(click.ClickException):
    """SIGINT: one line saying what was kept, exit 130."""

    exit_code = 130
    signal_name = "SIGINT"

    def __init__(self) -> None:
        kept = files.written
        if kept:
            shown = ", ".join(str(p) for p in kept[:5]) + (", ..." if len(kept) > 5 else "")
            what = f"kept {len(kept)} complete output(s): {shown}; nothing else was written"
        else:
            what = "no output was written; files that were there before are unchanged"
        super().__init__(f"interrupted ({self.signal_name}): {what}")


class InterruptedByTerm(Interrupted):
    """SIGTERM: as :class:`Interrupted`, exit 143."""

    exit_code = 143
    signal_name = "SIGTERM"


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM, so that outputs are cleaned up."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


class Group(click.Group):
    """A click group that applies the error contract of the module doc."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        if name not in SERVERS and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)
        return name, cmd, rest

    def invoke(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug"))
        files.written.clear()
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Terminated as exc:
            raise InterruptedByTerm() from exc
        except KeyboardInterrupt as exc:
            raise Interrupted() from exc
        except KvrouteError as exc:
            if debug:
                raise
            raise BadInput(str(exc)) from exc
        except OSError as exc:
            if debug:
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            raise click.ClickException(f"{where}{exc.strerror or exc}") from exc
        except Exception as exc:
            if debug:
                raise
            raise click.ClickException(
                f"internal error: {type(exc).__name__}: {exc} "
                "(rerun with kvroute --debug for the traceback, and please report it)"
            ) from exc


# Eager, so that an output option's callback sees it whatever the order on the line.
force_option = click.option(
    "--force",
    is_flag=True,
    is_eager=True,
    help="Overwrite outputs that exist (default: refuse, exit 2).",
)


def output_option(*decls: str, folder: bool = False, **attrs: Any) -> Callable[[F], F]:
    """An output option (a file, or a ``folder``) and ``--force``: an existing file, or a
    non-empty folder, is refused before any input is read, unless ``--force`` (or an eager
    ``--resume`` of the command, which writes into its earlier output)."""

    def refuse(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
        force = bool(ctx.params.get("force")) or bool(ctx.params.get("resume"))
        (check_out_dir if folder else check_out_file)(value, force)
        return value

    kind = click.Path(file_okay=not folder, dir_okay=folder, path_type=Path)

    def decorate(f: F) -> F:
        return force_option(click.option(*decls, type=kind, callback=refuse, **attrs)(f))

    return decorate


def check_out_file(path: Path | None, force: bool) -> None:
    """Refuse an existing output file unless ``force``."""
    if path is not None:
        files.check_output(path, force=force)


def check_out_dir(path: Path | None, force: bool) -> None:
    """Refuse an existing, non-empty output folder unless ``force``."""
    if path is None or force or not path.exists():
        return
    if not path.is_dir():
        raise OutputExistsError(f"{path} exists and is not a folder")
    if any(path.iterdir()):
        raise OutputExistsError(f"{path} exists and is not empty; pass --force to write into it")


def executor_options(ray_help: str) -> Callable[[F], F]:
    """``--executor local|ray`` (``ray_help`` says what runs as Ray tasks) and
    ``--ray-address``; a command refuses the address without ``--executor ray``."""

    def decorate(f: F) -> F:
        f = click.option(
            "--ray-address",
            default=None,
            help="Ray cluster to join (e.g. auto, ray://HOST:10001; default: a local one).",
        )(f)
        return click.option(
            "--executor",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help=f"Where it runs: this machine, or {ray_help} (pip install 'kvroute[ray]').",
        )(f)

    return decorate


debug_option = click.option(
    "--debug", is_flag=True, help="Show the Python traceback of an error instead of one line."
)
