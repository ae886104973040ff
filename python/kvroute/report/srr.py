"""B4 and B5 on running engines: each policy's sustainable request rate under SLOs, found by
replaying a trace open-loop (Poisson session arrivals) through a kvroute proxy in front of
the engines, and the causes of the SLO-violating requests at 0.9x, 1.0x and 1.1x of it
(``docs/report.md``, "Sustainable rate on running engines").

A probe at rate r replays the whole trace in ``poisson`` mode at r sessions/s, once per
seed (``seeds`` arrival draws from ``seed`` on), through a proxy (in this process, one per
run, the policy's and the given proxy settings) with the engines' prefix caches reset before
each run. It passes when every request of its runs succeeded and TTFT p90 and TPOT p90 over
all of them are within the SLOs. The search is the simulator's (:func:`kvroute.sim.next_probe`):
double from ``start`` while probes pass, halve while they fail, then bisect until
``upper / rate - 1 <= rel_tol``; one policy at a time (the engines are shared). The slow
requests of the runs at the three factors are labelled with
:func:`kvroute.report.slow.label_slow`, run by run, and counted together. With an engine
profile the simulator's answer to the same questions, by the same search on the same seeds,
is computed beside it.

Cost: ``seeds`` replays of the trace per probe (seconds to minutes each on real engines); the
probe function can be swapped for tests. Not thread-safe (it runs proxies and replays in
turn).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvroute.errors import InvalidArgumentError
from kvroute.metrics import summarize
from kvroute.records import conform_records, write_records
from kvroute.report.slow import SlowConfig, cause_counts, label_slow
from kvroute.sim import RateResult, next_probe, session_rate

#: The multiples of the sustainable rate whose slow requests are labelled (the study's B5).
FACTORS = (0.9, 1.0, 1.1)
#: The proxy's admission settings the simulator reads under the same names.
ADMISSION_PARAMS = (
    "max_in_flight",
    "max_in_flight_tokens",
    "queue_patience_s",
    "queue_hold_s",
    "queue_hold_yield_s",
)

#: A probe: (policy, rate in sessions/s, seed of the arrivals) -> the run's records.
Probe = Callable[[str, float, int], pa.Table]


@dataclass(frozen=True)
class SrrConfig:
    """What to search (see the module doc). ``proxy``: ProxyConfig settings for every
    policy (e.g. ``max_in_flight``, ``queue_size``); ``policy_options``: router keywords per
    policy (e.g. ``{"ttft": {"engine_profile": {...}}}``)."""

    urls: tuple[str, ...]
    policies: tuple[str, ...]
    slo_ttft_p90: float
    slo_tpot_p90: float
    start: float | None = None
    rel_tol: float = 0.1
    max_rounds: int = 8
    seed: int = 0
    #: Runs per probe, with the seeds ``seed``, ``seed + 1``, ...: their requests are judged
    #: together (a short trace's p90 moves with one draw of the arrivals).
    seeds: int = 1
    model: str | None = None
    slo_e2e_s: float = 30.0
    #: Multiplies the trace's think times (``time_to_parent_chat``), for the real and the
    #: simulated runs alike.
    think_scale: float = 1.0
    #: The slow-cause rules' thresholds (its SLOs are replaced by ``slo_ttft_p90`` and
    #: ``slo_e2e_s``).
    slow: SlowConfig = field(default_factory=SlowConfig)
    #: Where the runs at the factors are written (``<source>-<policy>-<factor>x``), if at all.
    records_dir: Path | None = None
    proxy: Mapping[str, Any] = field(default_factory=dict)
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.policies:
            raise InvalidArgumentError("policies must not be empty")
        for name in ("slo_ttft_p90", "slo_tpot_p90", "rel_tol", "slo_e2e_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.think_scale < 1e9:
            raise InvalidArgumentError(f"think_scale must be >= 0, got {self.think_scale}")
        if self.start is not None and not self.start > 0:
            raise InvalidArgumentError(f"start must be a positive rate, got {self.start}")
        if self.max_rounds < 1:
            raise InvalidArgumentError(f"max_rounds must be at least 1, got {self.max_rounds}")
        if self.seeds < 1:
            raise InvalidArgumentError(f"seeds must be at least 1, got {self.seeds}")


def runs(probe: Probe, cfg: SrrConfig, policy: str, rate: float) -> list[pa.Table]:
    """A probe's runs: one per seed."""
    return [probe(policy, rate, cfg.seed + k) for k in range(cfg.seeds)]


def passes(records: pa.Table | Sequence[pa.Table], cfg: SrrConfig) -> tuple[bool, dict[str, Any]]:
    """Whether a probe's runs meet the SLOs, their requests taken together, and the
    figures (requests, errors, p90s)."""
    if not isinstance(records, pa.Table):
        records = pa.concat_tables([conform_records(r) for r in records])
    s = summarize(records)
    ttft, tpot = s["ttft"]["p90"], s["tpot"]["p90"]
    ok = (
        s["errors"] == 0
        and ttft is not None
        and ttft <= cfg.slo_ttft_p90
        and (tpot is None or tpot <= cfg.slo_tpot_p90)
    )
    return ok, {
        "requests": s["requests"],
        "errors": s["errors"],
        "ttft_p90": ttft,
        "tpot_p90": tpot,
    }


def scaled(trace: pa.Table, cfg: SrrConfig) -> pa.Table:
    """The trace with its think times multiplied by ``cfg.think_scale``."""
    name = "time_to_parent_chat"
    if cfg.think_scale == 1.0 or name not in trace.column_names:
        return trace
    col = pc.multiply(trace.column(name), pa.scalar(cfg.think_scale, trace.schema.field(name).type))
    return trace.set_column(trace.schema.get_field_index(name), name, col)


def search(
    trace: pa.Table,
    cfg: SrrConfig,
    probe: Probe,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Per policy, the sustainable rate and every probe (rate, pass, figures)."""
    start = cfg.start or session_rate(trace)
    out: dict[str, Any] = {}
    for policy in cfg.policies:
        st = RateResult(policy, 0.0, None)
        figures = []
        rate = float(start)
        for _ in range(cfg.max_rounds):
            if rate <= 0:
                break
            ok, fig = passes(runs(probe, cfg, policy, rate), cfg)
            st.probes.append((rate, fig["ttft_p90"], fig["tpot_p90"], ok))
            figures.append({"rate": rate, "ok": ok, **fig})
            progress(f"{policy} at {rate:.4g} sessions/s: {'pass' if ok else 'fail'} {fig}")
            if ok:
                st.rate = max(st.rate, rate)
            else:
                st.upper = rate if st.upper is None else min(st.upper, rate)
            rate = next_probe(st, cfg.rel_tol, float(start))
        out[policy] = {"rate": st.rate, "upper": st.upper, "probes": figures}
    return out


def causes(
    cfg: SrrConfig,
    rates: Mapping[str, float],
    probe: Probe,
    factors: Sequence[float] = FACTORS,
    source: str = "real",
) -> dict[str, list[dict[str, Any]]]:
    """Per policy and factor of its rate: the runs' figures and their slow requests by
    cause (a policy whose rate is 0 has none); each run's records written under
    ``cfg.records_dir`` (``<source>-<policy>-<factor>x-seed<seed>.parquet``) when set."""
    slow = replace(cfg.slow, slo_ttft_s=cfg.slo_ttft_p90, slo_e2e_s=cfg.slo_e2e_s)
    out: dict[str, list[dict[str, Any]]] = {}
    for policy, rate in rates.items():
        rows = []
        for f in factors if rate > 0 else ():
            done = runs(probe, cfg, policy, rate * f)
            labels: list[str | None] = []
            for k, records in enumerate(done):
                if cfg.records_dir is not None:
                    name = f"{source}-{policy}-{f:g}x-seed{cfg.seed + k}.parquet"
                    write_records(records, cfg.records_dir / name)
                labels += label_slow(records, slow)
            _, fig = passes(done, cfg)
            slow_n = sum(x is not None for x in labels)
            rows.append(
                {"factor": f, "rate": rate * f, **fig, "slow": slow_n, **cause_counts(labels)}
            )
        out[policy] = rows
    return out


def live_probe(trace: pa.Table, cfg: SrrConfig) -> Probe:
    """The probe on running engines: a proxy per run, the trace replayed open-loop."""
    from kvroute.proxy import Proxy, ProxyConfig, ServerThread
    from kvroute.proxy.discover import block_size
    from kvroute.replay import ReplayConfig, replay

    block, _ = block_size(list(cfg.urls))
    trace = scaled(trace, cfg)

    def run(policy: str, rate: float, seed: int) -> pa.Table:
        options = {"block_size": block, **cfg.policy_options.get(policy, {})}
        config = ProxyConfig(
            backends=list(cfg.urls), policy=policy, router_options=options, **cfg.proxy
        )
        with ServerThread() as st:
            url = st.start(Proxy(config))
            rc = ReplayConfig(
                url=url, mode="poisson", rate=rate, seed=seed, model=cfg.model,
                reset_cache=True, request_timeout_s=600.0,
            )  # fmt: skip
            return replay(trace, rc)

    return run


def simulated(
    trace: pa.Table, cfg: SrrConfig, engine: Mapping[str, float], factors: Sequence[float] = FACTORS
) -> dict[str, Any]:
    """The simulator's answer on a calibrated profile (``engine``): the sustainable rates,
    by the same search on the same seeds (at least 12 rounds: probes cost milliseconds), and
    the slow requests by cause at the same factors of its own rates. Each policy routes with
    the parameters the proxy gives it (``ProxyConfig.policy_options``)."""
    from kvroute import sim
    from kvroute.proxy.config import ProxyConfig

    trace = scaled(trace, cfg)
    admission = {
        k: float(v) for k, v in cfg.proxy.items() if k in ADMISSION_PARAMS and v is not None
    }
    capped = admission.get("max_in_flight") or admission.get("max_in_flight_tokens")
    if not capped or cfg.proxy.get("queue_size") is None:
        admission = {}  # no admission

    def params(policy: str) -> dict[str, list[float]]:
        proxy = ProxyConfig(policy=policy, router_options=dict(cfg.policy_options.get(policy, {})))
        given = proxy.policy_options()
        own = {k: float(v) for k, v in given.items() if policy in sim.PARAM_POLICIES.get(k, ())}
        return {k: [v] for k, v in {**own, **admission}.items()}

    def probe(policy: str, rate: float, seed: int) -> pa.Table:
        done = sim.sweep(
            trace, policies=[policy], modes=["poisson"], seeds=[seed], rates=[rate],
            grid=params(policy), instances=len(cfg.urls), engine=dict(engine),
            sample_interval=0.0,
        )  # fmt: skip
        return done[0].records

    found = search(trace, replace(cfg, max_rounds=max(cfg.max_rounds, 12)), probe)
    rates = {p: float(v["rate"]) for p, v in found.items()}
    return {"rates": found, "causes": causes(cfg, rates, probe, factors, source="simulated")}


__all__ = [
    "FACTORS",
    "SrrConfig",
    "causes",
    "live_probe",
    "passes",
    "runs",
    "scaled",
    "search",
    "simulated",
]
