"""The main job (``kvroute demo``, ``make demo``): the whole policy study in one call.

1. synthesize the w600-profile trace (:func:`kvroute.synth.synthesize`), or take one;
2. compute its APC ceilings (:func:`kvroute.ceilings.ceilings`);
3. simulate every policy (and ``capped``) on ``instances`` simulated engines in both dispatch
   modes (:func:`kvroute.sim.sweep`), writing one run directory each;
4. a live check: ``live_engines`` emulators and a ``unified`` proxy in-process on 127.0.0.1
   (free ports), replaying the trace's first ``live_requests`` requests through the proxy;
   the emulators run ``speedup`` x faster than real time and trace times are scaled to
   match, and the records' times are scaled back, so the live run reads in emulated seconds;
5. the report (:mod:`kvroute.report`): ``report.md``, ``report.json``, ``figures/*.png``.

Everything lands under ``out`` (``trace/``, ``runs/<label>/``, the report). Servers always
shut down. Time: seconds for steps 1-3 on 2 cores (release build), a few for the live check,
a few for the figures. Not thread-safe (matplotlib).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from kvroute.records import RUN_KEY, run_info, write_records
from kvroute.report import Report, Run, analyze, make_run, trace_ceilings, write_report
from kvroute.report.runs import sort_runs

QUICK_POLICIES = ("lmetric", "load_only", "sticky", "unified", "capped", "leastwork")


@dataclass
class DemoConfig:
    """What the demo runs; ``quick`` is CI's shortened form (300-request trace, the study's
    policies and leastwork, 16 live requests)."""

    out: Path = Path("kvroute-demo")
    quick: bool = False
    trace: Path | None = None
    instances: int = 8
    policies: tuple[str, ...] = ()
    live: bool = True
    live_requests: int = 48
    live_engines: int = 3
    speedup: float = 50.0
    seed: int = 42
    timings: dict[str, float] = field(default_factory=dict)


def _step(cfg: DemoConfig, name: str, log: Callable[[str], object], t0: float) -> None:
    cfg.timings[name] = round(time.perf_counter() - t0, 3)
    log(f"{name}: {cfg.timings[name]:.1f} s")


def make_trace(cfg: DemoConfig) -> Path:
    """The trace of the study: the given one, or w600 synthesized under ``out/trace``."""
    if cfg.trace is not None:
        return cfg.trace
    from kvroute.synth import synthesize

    path = cfg.out / "trace" / "w600.parquet"
    synthesize("w600", path, seed=cfg.seed, requests=300 if cfg.quick else None)
    return path


def simulate_all(cfg: DemoConfig, trace: pa.Table) -> list[Run]:
    """Every policy x dispatch mode on the simulator; run directories under ``out/runs``."""
    import kvroute
    import kvroute.sim as ks

    names = list(cfg.policies or (QUICK_POLICIES if cfg.quick else [*kvroute.policies(), "capped"]))
    modes = ["tracets", "thinktime"] if "time_to_parent_chat" in trace.column_names else ["tracets"]
    runs = []
    for res in ks.sweep(trace, policies=names, modes=modes, instances=cfg.instances):
        path = res.write(cfg.out / "runs" / res.spec.label)
        runs.append(make_run(res.records, path / "records.parquet"))
    return runs


def live_check(cfg: DemoConfig, trace: pa.Table, policy: str = "unified") -> Run:
    """Emulators behind a proxy, in-process; replay the first requests through the proxy."""
    from kvroute.emulator import EmulatorConfig, emulator_app
    from kvroute.proxy import Proxy, ProxyConfig, ServerThread
    from kvroute.replay import ReplayConfig, replay

    n = 16 if cfg.quick else cfg.live_requests
    mode = "thinktime" if "time_to_parent_chat" in trace.column_names else "tracets"
    st = ServerThread()
    try:
        urls = [
            st.start(emulator_app(EmulatorConfig(speedup=cfg.speedup)))
            for _ in range(cfg.live_engines)
        ]
        proxy = st.start(Proxy(ProxyConfig(backends=urls, policy=policy)))
        rc = ReplayConfig(
            url=proxy,
            mode=mode,
            time_scale=1.0 / cfg.speedup,
            max_requests=n,
            request_timeout_s=120.0,
        )
        records = replay(trace, rc)
    finally:
        st.close()
    scaled = _emulated_time(records, cfg, policy)
    mode = run_info(records).get("mode", mode)
    path = write_records(scaled, cfg.out / "runs" / f"live-{policy}-{mode}" / "records.parquet")
    return make_run(scaled, path)


def _emulated_time(records: pa.Table, cfg: DemoConfig, policy: str) -> pa.Table:
    cols = {}
    for name in records.column_names:
        col = records.column(name)
        if name in ("send", "first_token", "finish", "queue_wait", "router_wait"):
            col = pa.compute.multiply(col, cfg.speedup)
        cols[name] = col
    info = {
        **run_info(records),
        "policy": policy,
        "instances": cfg.live_engines,
        "speedup": cfg.speedup,
        "time_unit": f"emulated s (wall x {cfg.speedup:g})",
    }
    meta = {RUN_KEY: json.dumps(info, sort_keys=True).encode()}
    return pa.table(cols, schema=records.schema.with_metadata(meta))


def run_demo(cfg: DemoConfig, log: Callable[[str], object] = print) -> Report:
    """Steps 1-5 of the module doc; returns the report (also written under ``cfg.out``)."""

    from kvroute.trace import read_trace
    from kvroute.trace_ops import trace_stats

    cfg.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    path = make_trace(cfg)
    trace = read_trace(path)
    _step(cfg, "trace", log, t)
    t = time.perf_counter()
    ceil = trace_ceilings(trace)
    _step(cfg, "ceilings", log, t)
    t = time.perf_counter()
    runs = simulate_all(cfg, trace)
    _step(cfg, f"simulate ({len(runs)} runs)", log, t)
    if cfg.live:
        t = time.perf_counter()
        runs.append(live_check(cfg, trace))
        _step(cfg, "live check", log, t)
    t = time.perf_counter()
    doc = {**trace_stats(trace), "path": str(path)}
    rep = analyze(sort_runs(runs), ceilings=ceil, trace=doc)
    rep.notes.append(
        f"Trace {path.name}: {doc['requests']} requests, {doc['sessions']} sessions. "
        f"Simulated runs: {cfg.instances} engines (h20-qwen3-coder-30b-a3b). "
        + (
            f"Live run: {cfg.live_engines} emulators behind the proxy, times in emulated s."
            if cfg.live
            else ""
        )
    )
    write_report(rep, cfg.out, trace=trace, title="kvroute demo: the policy study")
    _step(cfg, "report", log, t)
    return rep
