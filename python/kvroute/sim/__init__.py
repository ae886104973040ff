"""The cluster simulator: replay a trace through simulated vLLM engines behind the very
Router that runs live, under any policy, dispatch mode and seed (``docs/simulator.md``).

>>> import kvroute.sim as ks
>>> r = ks.simulate("trace.parquet", instances=8, policy="unified", mode="thinktime")
>>> r.summary["ttft"]["p90"], r.summary["apc"]          # doctest: +SKIP
>>> r.write("out/")                                      # records, instances, summary

:func:`simulate` runs one configuration, :func:`sweep` many (policies x modes x seeds x
parameter grids x rates, in parallel on every core or as Ray tasks, written as they arrive
and resumable), :func:`sustainable_rate` bisects the
highest Poisson session rate that meets TTFT/TPOT p90 SLOs. ``capped`` is accepted as a
policy: ``lmetric`` on the trace capped at ``cap_turns`` turns per session (semantics §3).
The engine model runs in Rust without the GIL; Ctrl-C stops a run cleanly
(``KeyboardInterrupt``). Stateless; safe to call from several threads.

The package: this module (the entry points), :mod:`kvroute.sim.run` (one run's spec and
result, and the parallel executor), :mod:`kvroute.sim.fidelity` (the simulator against the
study's published tables), :mod:`kvroute.sim.profile` and :mod:`kvroute.sim.calibrate` (an
engine model fitted to a running engine), :mod:`kvroute.sim.side_by_side` (simulated against
replayed on real engines) and :mod:`kvroute.sim.ties` (simultaneous arrivals in other orders).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvroute import _core, args
from kvroute.distributed import check_executor, connected
from kvroute.errors import InvalidArgumentError, UnknownPolicyError
from kvroute.sim.run import RunSpec, SimResult, execute, run_meta
from kvroute.trace import read_trace
from kvroute.trace_ops import cap_sessions

DEFAULT_PRESET = "h20-qwen3-coder-30b-a3b"
MODES = ("tracets", "thinktime", "poisson")
#: The study's five arms (``capped`` = lmetric on the turn-capped trace).
STUDY_POLICIES = ("lmetric", "load_only", "sticky", "unified", "capped")
#: Which policies read each parameter (grids only multiply those).
PARAM_POLICIES = {
    "overload_factor": ("unified", "unified_dynamo"),
    "hit_ratio_gate": ("unified", "unified_dynamo"),
    "cache_threshold": ("sglang_cache_aware",),
    "balance_abs": ("sglang_cache_aware",),
    "balance_rel": ("sglang_cache_aware",),
    "overlap_weight": ("dynamo_cost", "unified_dynamo"),
    "queued_weight": ("dynamo_cost", "unified_dynamo"),
    "dedup_weight": ("dynamo_cost", "unified_dynamo"),
    "temperature": ("dynamo_cost", "unified_dynamo"),
    "ttft_slo_s": ("ttft",),
    "delay_weight": ("ttft",),
    # Admission at the router (``docs/simulator.md``): every policy reads them.
    "max_in_flight": (*_core.policies(), "capped"),
    "max_in_flight_tokens": (*_core.policies(), "capped"),
    "queue_patience_s": (*_core.policies(), "capped"),
    "queue_hold_s": (*_core.policies(), "capped"),
    "queue_hold_yield_s": (*_core.policies(), "capped"),
}

__all__ = [
    "DEFAULT_PRESET",
    "MODES",
    "STUDY_POLICIES",
    "RateResult",
    "RunSpec",
    "SimResult",
    "engine_params",
    "next_probe",
    "presets",
    "resolve_policies",
    "session_rate",
    "simulate",
    "sustainable_rate",
    "sweep",
]


def presets() -> list[str]:
    """Names of the engine presets."""
    return list(_core.engine_presets())


def engine_params(preset: str = DEFAULT_PRESET, **overrides: float) -> dict[str, float]:
    """Every engine parameter of ``preset`` with ``overrides`` (KV capacity derived)."""
    return dict(_core.engine_params(preset, overrides))


def resolve_policies(policies: str | Iterable[str]) -> list[str]:
    """``"all"`` (every core policy), ``"study"`` (the study's five), a comma list or names."""
    names = args.names(policies, "policies")
    out: list[str] = []
    for name in (n.strip() for item in names for n in item.split(",")):
        expanded = {"all": _core.policies(), "study": list(STUDY_POLICIES)}.get(name, [name])
        for p in expanded:
            if p != "capped" and p not in _core.policies():
                known = ", ".join([*_core.policies(), "capped", "all", "study"])
                raise UnknownPolicyError(f"unknown policy {p!r}; known: {known}")
            if p not in out:
                out.append(p)
    return out


@dataclass
class _Setup:
    table: pa.Table
    capped: pa.Table | None
    base: dict[str, Any]
    cfg: dict[str, Any]


def _setup(
    trace: Any,
    *,
    instances: int,
    preset: str,
    engine: Mapping[str, float] | None,
    router_cache: str | int | None,
    sample_interval: float,
    closed_form: bool,
    cap_turns: int,
    infer_sessions: bool,
    need_capped: bool,
) -> _Setup:
    instances = args.integer(instances, "instances", 1, _core.MAX_INSTANCES)
    args.text(preset, "preset")
    engine = {
        k: args.number(v, f"engine[{k!r}]") for k, v in args.mapping(engine, "engine").items()
    }
    if isinstance(router_cache, str) and router_cache != "engine":
        raise InvalidArgumentError(
            f"router_cache must be 'engine', None or a number of keys, got {router_cache!r}"
        )
    if router_cache is not None and not isinstance(router_cache, str):
        router_cache = args.integer(router_cache, "router_cache", 1)
    sample_interval = args.number(sample_interval, "sample_interval", 0.0)
    closed_form = args.flag(closed_form, "closed_form")
    cap_turns = args.integer(cap_turns, "cap_turns", 1)
    infer_sessions = args.flag(infer_sessions, "infer_sessions")
    table = (
        read_trace(trace, infer_sessions=infer_sessions)
        if not isinstance(trace, pa.Table)
        else read_trace(trace)
    )
    name = str(trace) if isinstance(trace, str | Path) else "<table>"
    base = {"trace": name, "cap_turns": cap_turns}
    cfg = {
        "instances": instances,
        "preset": preset,
        "engine": dict(engine or {}),
        "router_cache": router_cache,
        "sample_interval": sample_interval,
        "closed_form": closed_form,
    }
    _core.engine_params(preset, dict(engine or {}))  # fail early, naming the parameter
    return _Setup(table, cap_sessions(table, cap_turns) if need_capped else None, base, cfg)


def _job(s: _Setup, spec: RunSpec) -> tuple[int, RunSpec, dict[str, Any]]:
    if spec.mode not in MODES:
        raise InvalidArgumentError(
            f"unknown dispatch mode {spec.mode!r}; known: {', '.join(MODES)}"
        )
    policy = "lmetric" if spec.policy == "capped" else spec.policy
    cfg = {**s.cfg, "policy": policy, "mode": spec.mode, "rate": spec.rate, "seed": spec.seed}
    cfg["params"] = dict(spec.params)
    cfg["trace"] = 1 if spec.policy == "capped" else 0
    return cfg["trace"], spec, cfg


def _traces(s: _Setup) -> list[pa.Table]:
    return [s.table] if s.capped is None else [s.table, s.capped]


def simulate(
    trace: Any,
    *,
    instances: int = 8,
    policy: str = "unified",
    mode: str = "thinktime",
    rate: float | None = None,
    seed: int = 0,
    preset: str = DEFAULT_PRESET,
    engine: Mapping[str, float] | None = None,
    router_cache: str | int | None = "engine",
    sample_interval: float = 1.0,
    closed_form: bool = True,
    cap_turns: int = 8,
    infer_sessions: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
    **params: float,
) -> SimResult:
    """One run. ``trace``: any :func:`kvroute.trace.read_trace` source. ``mode``: tracets,
    thinktime or poisson (with ``rate`` sessions/s). ``engine``: parameter overrides of the
    preset (``kvroute.sim.engine_params()`` lists them). ``router_cache``: the router's
    cache model size in keys per instance (``"engine"``: the engine's KV pool; None:
    unbounded). ``executor``, ``ray_address``: as :func:`sweep`. ``params``: policy
    parameters (e.g. ``overload_factor=1.3``)."""
    args.text(policy, "policy")
    args.text(mode, "mode")
    if rate is not None:
        args.number(rate, "rate", 0.0, above=True)
    args.integer(seed, "seed", 0, 2**63 - 1)
    for k, v in params.items():
        args.number(v, k)
    return sweep(
        trace,
        policies=[policy],
        modes=[mode],
        seeds=[seed],
        rates=[rate] if rate is not None else None,
        grid={k: [v] for k, v in params.items()},
        instances=instances,
        preset=preset,
        engine=engine,
        router_cache=router_cache,
        sample_interval=sample_interval,
        closed_form=closed_form,
        cap_turns=cap_turns,
        infer_sessions=infer_sessions,
        executor=executor,
        ray_address=ray_address,
    )[0]


def sweep_specs(
    policies: Sequence[str],
    modes: Sequence[str],
    seeds: Sequence[int],
    rates: Sequence[float] | None,
    grid: Mapping[str, Sequence[float]] | None,
) -> list[RunSpec]:
    """The runs of a sweep: a grid parameter multiplies only the policies that read it."""
    modes = args.names(modes, "modes")
    seeds = [args.integer(v, "seeds", 0, 2**63 - 1) for v in args.sequence(seeds, "seeds")]
    if not modes or not seeds:
        raise InvalidArgumentError("modes and seeds must not be empty")
    if rates is not None:
        rates = [args.number(v, "rates", 0.0, above=True) for v in args.sequence(rates, "rates")]
    grid = dict(args.mapping(grid, "grid"))
    for k in grid:
        if k not in PARAM_POLICIES:
            raise InvalidArgumentError(
                f"unknown policy parameter {k!r}; known: {', '.join(PARAM_POLICIES)}"
            )
        grid[k] = [args.number(v, k) for v in args.sequence(grid[k], f"grid[{k!r}]")]
    specs = []
    for policy, mode, seed in itertools.product(policies, modes, seeds):
        names = [k for k in grid if policy in PARAM_POLICIES[k] or len(grid[k]) == 1]
        combos = itertools.product(*(grid[k] for k in names)) if names else [()]
        mode_rates: Sequence[float | None] = (rates or [None]) if mode == "poisson" else [None]
        for values, rate in itertools.product(list(combos), mode_rates):
            params = {
                k: float(v)
                for k, v in zip(names, values, strict=True)
                if policy in PARAM_POLICIES[k]
            }
            specs.append(RunSpec(policy, mode, rate, seed, params))
    return specs


def sweep(
    trace: Any,
    *,
    policies: str | Iterable[str] = "all",
    modes: Sequence[str] = ("tracets", "thinktime"),
    seeds: Sequence[int] = (0,),
    rates: Sequence[float] | None = None,
    grid: Mapping[str, Sequence[float]] | None = None,
    instances: int = 8,
    preset: str = DEFAULT_PRESET,
    engine: Mapping[str, float] | None = None,
    router_cache: str | int | None = "engine",
    sample_interval: float = 1.0,
    closed_form: bool = True,
    cap_turns: int = 8,
    infer_sessions: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    on_result: Callable[[SimResult], object] | None = None,
) -> list[SimResult]:
    """Every combination of ``policies`` x ``modes`` x ``seeds`` (x ``rates`` for poisson,
    x ``grid`` values for the policies that read them), run in parallel: on this machine's
    cores (``executor="local"``) or as Ray tasks (``"ray"``, on the cluster at
    ``ray_address`` or the one this process joined, else a local one; the same results,
    bit for bit). ``out``: each run is written to ``out/<label>/`` as it arrives.
    ``resume``: runs already written there by the same configuration are read back instead
    of run again. ``on_result`` gets each new result as it arrives. Results in sweep order."""
    check_executor(executor, ray_address)
    args.flag(resume, "resume")
    if resume and out is None:
        raise InvalidArgumentError("resume needs out (the folder of an earlier sweep)")
    names = resolve_policies(policies)
    specs = sweep_specs(names, modes, seeds, rates, grid)
    s = _setup(
        trace,
        instances=instances,
        preset=preset,
        engine=engine,
        router_cache=router_cache,
        sample_interval=sample_interval,
        closed_form=closed_form,
        cap_turns=cap_turns,
        infer_sessions=infer_sessions,
        need_capped="capped" in names,
    )
    jobs = [_job(s, spec) for spec in specs]
    folder = Path(out) if out is not None else None
    done = _written(folder, jobs, s.base) if folder is not None and resume else {}

    def arrived(result: SimResult) -> None:
        if folder is not None:
            result.write(folder / result.spec.label)
        if on_result is not None:
            on_result(result)

    todo = [job for job in jobs if job[1].label not in done]
    new = execute(
        _traces(s), todo, s.base, executor=executor, ray_address=ray_address, on_result=arrived
    )
    fresh = {r.spec.label: r for r in new}
    return [done.get(spec.label) or fresh[spec.label] for spec in specs]


def _written(
    folder: Path, jobs: list[tuple[int, RunSpec, dict[str, Any]]], base: dict[str, Any]
) -> dict[str, SimResult]:
    """The runs of ``jobs`` that an earlier sweep wrote completely into ``folder``; a run
    written by another configuration is an error, not a silent mix."""
    done = {}
    for _, spec, cfg in jobs:
        run_dir = folder / spec.label
        if not (run_dir / "summary.json").is_file():
            continue
        result = SimResult.read(run_dir)
        want = json.loads(json.dumps(run_meta(base, spec, cfg)))
        for key in sorted(set(want) | set(result.run)):
            if want.get(key) != result.run.get(key):
                raise InvalidArgumentError(
                    f"{run_dir}: written by another configuration ({key}: "
                    f"{result.run.get(key)!r} there, {want.get(key)!r} now); resume only the "
                    "same sweep, or write to another folder"
                )
        done[spec.label] = result
    return done


@dataclass
class RateResult:
    """The sustainable rate of one policy: ``rate`` passed, ``upper`` failed (sessions/s);
    ``probes`` are ``(rate, ttft_p90, tpot_p90, ok)`` in the order run."""

    policy: str
    rate: float
    upper: float | None
    probes: list[tuple[float, float | None, float | None, bool]] = field(default_factory=list)


def sustainable_rate(
    trace: Any,
    *,
    policies: str | Iterable[str] = "study",
    slo_ttft_p90: float = 10.0,
    slo_tpot_p90: float = 0.05,
    start: float | None = None,
    rel_tol: float = 0.05,
    max_rounds: int = 20,
    seed: int = 0,
    instances: int = 8,
    preset: str = DEFAULT_PRESET,
    engine: Mapping[str, float] | None = None,
    router_cache: str | int | None = "engine",
    cap_turns: int = 8,
    infer_sessions: bool = False,
    params: Mapping[str, float] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> list[RateResult]:
    """Per policy, the highest Poisson session rate whose TTFT p90 and TPOT p90 (seconds)
    stay within the SLOs: bracketed by doubling/halving from ``start`` (default: the trace's
    own session rate), then bisected until ``upper / rate - 1 <= rel_tol``. Each round runs
    every policy's probe in parallel (as Ray tasks with ``executor="ray"``, as in
    :func:`sweep`). ``params``: policy parameters (e.g. unified's ``overload_factor``),
    given to the policies that read them."""
    check_executor(executor, ray_address)
    names = resolve_policies(policies)
    args.number(slo_ttft_p90, "slo_ttft_p90", 0.0, above=True)
    args.number(slo_tpot_p90, "slo_tpot_p90", 0.0, above=True)
    if start is not None:
        args.number(start, "start", 0.0, above=True)
    args.number(rel_tol, "rel_tol", 0.0, above=True)
    args.integer(max_rounds, "max_rounds", 1, 1000)
    args.integer(seed, "seed", 0, 2**63 - 1)
    for k, v in args.mapping(params, "params").items():
        args.number(v, k)
    s = _setup(
        trace,
        instances=instances,
        preset=preset,
        engine=engine,
        router_cache=router_cache,
        sample_interval=0.0,
        closed_form=True,
        cap_turns=cap_turns,
        infer_sessions=infer_sessions,
        need_capped="capped" in names,
    )
    if start is None:
        start = session_rate(s.table)
    state = {p: RateResult(p, 0.0, None) for p in names}
    probe = dict.fromkeys(names, float(start))
    # One cluster for every round (a local one starts once, not once per round).
    with connected(ray_address) if executor == "ray" else contextlib.nullcontext():
        for _ in range(max_rounds):
            todo = [p for p in names if probe[p] > 0]
            if not todo:
                break
            specs = [RunSpec(p, "poisson", probe[p], seed, _own(p, params)) for p in todo]
            jobs = [_job(s, sp) for sp in specs]
            ran = execute(_traces(s), jobs, s.base, executor=executor, ray_address=ray_address)
            for spec, res in zip(specs, ran, strict=True):
                p, rate = spec.policy, float(spec.rate or 0.0)
                ttft, tpot = res.summary["ttft"]["p90"], res.summary["tpot"]["p90"]
                ok = (
                    ttft is not None
                    and ttft <= slo_ttft_p90
                    and (tpot is None or tpot <= slo_tpot_p90)
                )
                st = state[p]
                st.probes.append((rate, ttft, tpot, ok))
                if ok:
                    st.rate = max(st.rate, rate)
                else:
                    st.upper = rate if st.upper is None else min(st.upper, rate)
                probe[p] = next_probe(st, rel_tol, float(start))
    return [state[p] for p in names]


def _own(policy: str, params: Mapping[str, float] | None) -> dict[str, float]:
    """The parameters ``policy`` reads."""
    return {k: float(v) for k, v in (params or {}).items() if policy in PARAM_POLICIES.get(k, ())}


def session_rate(trace: pa.Table) -> float:
    """A trace's own session rate: sessions over its time span (at least 1 s), per second."""
    ts = trace.column("timestamp").to_numpy()
    sessions = len(trace.column("session_id").unique())
    return float(sessions / max(float(ts.max() - ts.min()), 1.0))


def next_probe(st: RateResult, rel_tol: float, start: float) -> float:
    """Double while nothing failed, halve while nothing passed, then bisect; 0 = done."""
    if st.upper is None:
        return st.rate * 2.0
    if st.rate == 0.0:
        low = st.upper / 2.0
        return low if low > start * 1e-4 else 0.0
    if st.upper / st.rate - 1.0 <= rel_tol:
        return 0.0
    return (st.rate + st.upper) / 2.0
