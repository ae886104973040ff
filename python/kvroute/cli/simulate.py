"""``kvroute simulate``: replay a trace through simulated engines (``docs/simulator.md``).

One policy, mode and seed prints the run's summary; several (``--policy all``, ``--mode
both``, ``--seeds 3``, ``--param overload_factor=1.3,2.0``) run a sweep in parallel and
print one row per run; ``--sustainable-rate`` bisects the highest Poisson session rate
that meets the SLOs. ``--json`` prints one JSON object instead of a table; ``--out DIR``
writes records, time series and summaries.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from kvroute import _core
from kvroute.cli.common import FINITE, POSITIVE, BadInput, Finite, executor_options, output_option
from kvroute.files import write_text

if TYPE_CHECKING:
    from kvroute import sim

# kvroute.sim (pyarrow, polars) is imported when the command runs, not when the CLI loads.
_PRESET = "h20-qwen3-coder-30b-a3b"
_MODES = {"both": ["tracets", "thinktime"], "all": ["tracets", "thinktime", "poisson"]}


def _split(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _numbers(pairs: tuple[str, ...], what: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for pair in pairs:
        name, sep, values = pair.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = [float(v) for v in values.split(",")]
        except ValueError:
            raise click.BadParameter(
                f"expected NAME=VALUE[,VALUE...], got {pair!r}", param_hint=what
            ) from None
    return out


def _row(r: sim.SimResult) -> dict[str, Any]:
    return {"label": r.spec.label, **r.run, "summary": r.summary, "stats": r.stats}


def _table(results: list[sim.SimResult], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "policy",
        "mode",
        "seed / params",
        "TTFT p50/p90/p99 s",
        "TPOT p50/p90/p99 ms",
        "E2E p90 s",
        "APC",
        "interf.",
        "hotspot",
        "req_bal",
    ):
        t.add_column(col, justify="left" if col in ("policy", "mode", "seed / params") else "right")

    def trip(d: dict[str, float | None], k: float = 1.0, nd: int = 2) -> str:
        vals = (d[q] for q in ("p50", "p90", "p99"))
        return "/".join("-" if v is None else f"{v * k:.{nd}f}" for v in vals)

    def num(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    for r in results:
        s, spec = r.summary, r.spec
        extra = (
            [f"seed {spec.seed}"]
            + ([f"rate {spec.rate:g}/s"] if spec.rate else [])
            + [f"{k}={v:g}" for k, v in spec.params.items()]
        )
        t.add_row(
            spec.policy,
            spec.mode,
            " ".join(extra),
            trip(s["ttft"]),
            trip(s["tpot"], 1e3, 1),
            num(s["e2e"]["p90"]),
            num(s["apc"], "{:.1%}"),
            num(s["interference_index"]),
            num(s["hotspot_index"], "{:.3f}"),
            num(s["req_bal"]),
        )
    return t


@click.command("simulate")
@click.argument("trace_path", type=click.Path(exists=True, path_type=Path))
@click.option("--instances", default=8, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--policy",
    "--policies",
    "policies",
    multiple=True,
    help="Policy name(s), comma list, 'all', 'study' or 'capped' [default: unified].",
)
@click.option(
    "--mode",
    "--modes",
    "modes",
    multiple=True,
    help="tracets, thinktime, poisson; 'both' = tracets,thinktime [default: thinktime].",
)
@click.option(
    "--rate", "rates", multiple=True, type=FINITE, help="Poisson session rate(s) per second."
)
@click.option(
    "--seed", "seed_list", multiple=True, type=click.IntRange(min=0), help="Seed(s) [default: 0]."
)
@click.option(
    "--seeds", "n_seeds", type=click.IntRange(min=1), default=None, help="Run seeds 0..N-1."
)
@click.option(
    "--param",
    "params",
    multiple=True,
    help="Policy parameter grid NAME=V[,V...], e.g. overload_factor=1.3,2.0.",
)
@click.option(
    "--preset", default=_PRESET, show_default=True, type=click.Choice(_core.engine_presets())
)
@click.option(
    "--engine",
    "engine",
    multiple=True,
    help="Engine parameter override NAME=VALUE (see docs/simulator.md).",
)
@click.option(
    "--engine-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Engine parameters from `kvroute calibrate` (--engine overrides win).",
)
@click.option(
    "--router-cache",
    default="engine",
    show_default=True,
    help="Router cache model size: 'engine', 'unbounded' or keys.",
)
@click.option(
    "--sample-interval",
    default=1.0,
    show_default=True,
    type=Finite(min=0),
    help="Seconds between time-series samples (0: none).",
)
@click.option(
    "--cap-turns",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Turns per session kept for 'capped'.",
)
@click.option("--infer-sessions", is_flag=True, help="Group Mooncake requests into sessions.")
@click.option(
    "--sustainable-rate",
    "sustainable",
    is_flag=True,
    help="Bisect each policy's highest Poisson rate within the SLOs.",
)
@click.option(
    "--slo-ttft-p90",
    default=10.0,
    show_default=True,
    type=POSITIVE,
    help="TTFT p90 SLO (s).",
)
@click.option(
    "--slo-tpot-p90",
    default=0.05,
    show_default=True,
    type=POSITIVE,
    help="TPOT p90 SLO (s).",
)
@click.option(
    "--rate-tol",
    default=0.05,
    show_default=True,
    type=POSITIVE,
    help="Relative width at which bisection stops.",
)
@output_option(
    "--out",
    "out_dir",
    folder=True,
    default=None,
    help="Write results here (a new or empty folder).",
)
@click.option(
    "--resume",
    is_flag=True,
    is_eager=True,
    help="Keep the runs an interrupted sweep already wrote into --out; run the rest.",
)
@executor_options("each run as a Ray task")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def simulate(
    trace_path: Path,
    instances: int,
    policies: tuple[str, ...],
    modes: tuple[str, ...],
    rates: tuple[float, ...],
    seed_list: tuple[int, ...],
    n_seeds: int | None,
    params: tuple[str, ...],
    preset: str,
    engine: tuple[str, ...],
    engine_profile: Path | None,
    router_cache: str,
    sample_interval: float,
    cap_turns: int,
    infer_sessions: bool,
    sustainable: bool,
    slo_ttft_p90: float,
    slo_tpot_p90: float,
    rate_tol: float,
    out_dir: Path | None,
    force: bool,
    resume: bool,
    executor: str,
    ray_address: str | None,
    as_json: bool,
) -> None:
    """Replay TRACE through simulated vLLM engines behind the kvroute Router."""
    if ray_address is not None and executor != "ray":
        raise click.UsageError("--ray-address needs --executor ray")
    from kvroute import sim
    from kvroute.sim.profile import load_profile

    grid = _numbers(params, "--param")
    overrides = load_profile(engine_profile) if engine_profile else {}
    overrides.update({k: v[0] for k, v in _numbers(engine, "--engine").items()})
    cache: str | int | None = int(router_cache) if router_cache.isdigit() else router_cache
    seeds = list(range(n_seeds)) if n_seeds else [int(s) for s in seed_list] or [0]
    mode_list = [m for name in _split(modes) for m in _MODES.get(name, [name])] or ["thinktime"]
    common: dict[str, Any] = dict(
        instances=instances,
        preset=preset,
        engine=overrides,
        router_cache=cache,
        cap_turns=cap_turns,
        infer_sessions=infer_sessions,
        executor=executor,
        ray_address=ray_address,
    )
    started = time.perf_counter()
    names = sim.resolve_policies(_split(policies) or ["unified"])
    if resume and (out_dir is None or sustainable):
        raise click.UsageError(
            "--resume needs --out (the folder of a sweep), not --sustainable-rate"
        )
    if sustainable:
        _sustainable(
            trace_path,
            names,
            seeds[0],
            grid,
            slo_ttft_p90,
            slo_tpot_p90,
            rate_tol,
            common,
            out_dir,
            as_json,
        )
        return
    if "poisson" in mode_list and not rates:
        raise click.UsageError("--mode poisson needs --rate")
    specs = sim.sweep_specs(names, mode_list, seeds, list(rates) or None, grid)
    single = len(specs) == 1
    with _progress(out_dir, specs, resume, enabled=not single and sys.stderr.isatty()) as bar:
        results = sim.sweep(
            trace_path,
            policies=names,
            modes=mode_list,
            seeds=seeds,
            rates=list(rates) or None,
            grid=grid,
            sample_interval=sample_interval,
            # A sweep writes each run as it arrives; a single run is written into --out itself.
            out=None if single else out_dir,
            resume=resume,
            on_result=bar,
            **common,
        )
    elapsed = time.perf_counter() - started
    if out_dir is not None:
        if single:
            results[0].write(out_dir)
        else:
            doc = {"trace": str(trace_path), "wall_s": elapsed, "runs": [_row(r) for r in results]}
            write_text(out_dir / "sweep.json", json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if as_json:
        doc = (
            results[0].summary
            if single
            else {"wall_s": elapsed, "runs": [_row(r) for r in results]}
        )
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return
    console = Console(width=max(Console().width, 140))
    n = results[0].records.num_rows
    console.print(_table(results, f"{trace_path.name}: {n} requests, {instances} x {preset}"))
    events = sum(int(r.stats["events"]) for r in results)
    console.print(f"[dim]{len(results)} run(s), {events} events, {elapsed:.2f} s[/dim]")
    _report_errors(results)


def _report_errors(results: list[Any]) -> None:
    """Requests a run could not simulate, said on stderr; an error when a run simulated none
    (its table row is only dashes)."""
    for r in results:
        errors = [e for e in r.records.column("error").to_pylist() if e is not None]
        if not errors:
            continue
        n = r.records.num_rows
        why = ", ".join(f"{c} {e}" for e, c in collections.Counter(errors).most_common())
        run = f"{r.spec.policy}/{r.spec.mode}"
        what = f"{run}: {len(errors)} of {n} request(s) not simulated ({why})"
        if len(errors) == n:
            raise BadInput(f"{what}: nothing to report")
        click.echo(f"kvroute simulate: {what}", err=True)


@contextlib.contextmanager
def _progress(
    out_dir: Path | None, specs: list[sim.RunSpec], resume: bool, *, enabled: bool
) -> Iterator[Callable[[object], None]]:
    """A callback that advances a progress bar of the sweep's runs on stderr (the runs
    ``--resume`` keeps count as done from the start)."""
    if not enabled:
        yield lambda _: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    kept = sum(
        resume and out_dir is not None and (out_dir / s.label / "summary.json").is_file()
        for s in specs
    )
    with Progress(
        "runs",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("runs", total=len(specs), completed=kept)
        yield lambda _: progress.advance(task)


def _sustainable(
    trace_path: Path,
    names: list[str],
    seed: int,
    grid: dict[str, list[float]],
    slo_ttft: float,
    slo_tpot: float,
    tol: float,
    common: dict[str, Any],
    out_dir: Path | None,
    as_json: bool,
) -> None:
    from kvroute import sim

    params = {k: v[0] for k, v in grid.items()}
    res = sim.sustainable_rate(
        trace_path,
        policies=names,
        slo_ttft_p90=slo_ttft,
        slo_tpot_p90=slo_tpot,
        rel_tol=tol,
        seed=seed,
        params=params,
        **common,
    )
    doc = {
        "trace": str(trace_path),
        "slo": {"ttft_p90": slo_ttft, "tpot_p90": slo_tpot},
        "policies": [
            {"policy": r.policy, "rate": r.rate, "upper": r.upper, "probes": r.probes} for r in res
        ],
    }
    if out_dir is not None:
        write_text(out_dir / "sustainable_rate.json", json.dumps(doc, indent=2) + "\n")
    if as_json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return
    t = Table(
        title=f"sustainable Poisson session rate: TTFT p90 <= {slo_ttft:g} s, "
        f"TPOT p90 <= {slo_tpot * 1e3:g} ms"
    )
    for col in ("policy", "rate (sessions/s)", "first failing rate", "probes"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in res:
        t.add_row(
            r.policy,
            f"{r.rate:.4g}",
            "-" if r.upper is None else f"{r.upper:.4g}",
            str(len(r.probes)),
        )
    Console(width=max(Console().width, 100)).print(t)
