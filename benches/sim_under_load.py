"""The engine model under load, against running engines: the Mooncake sample replayed
open-loop at fixed session rates through a kvroute proxy (``kvroute bench srr``'s probe), and
the same arrivals simulated on a profile of the same engines, with the profile's
``busy_handling_s`` as fitted and with it set to 0 (the model before that term).

    .venv/bin/python benches/sim_under_load.py --url http://127.0.0.1:8101 \\
        --url http://127.0.0.1:8102 [--profile profile.json] [--rates 8,16,24] [--seeds 3]

Without ``--profile`` the engines are calibrated first (``--grid``, default short); with
``--recalibrate``, again before each rate, so that each rate is simulated on a profile
measured a minute before its replays (the machine's speed drifts over minutes). Prints,
per rate and source, TTFT p50/p90/p99 and TPOT p50/p90 (ms) over the seeds' requests
together, and each simulated figure's error against the engines'; ``--json`` writes them. Results in
``docs/report.md`` ("A later start at a busy engine"). Minutes: one replay per rate and
seed (219 requests), on engines that take one core each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvroute import sim
from kvroute.metrics import summarize
from kvroute.proxy.config import ProxyConfig
from kvroute.report.srr import SrrConfig, live_probe, scaled
from kvroute.sim.calibrate import calibrate
from kvroute.sim.profile import load_profile
from kvroute.trace_ops import annotate_ttp
from release_build import require_release

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_sessions_32tok.parquet"
POLICY = "unified_dynamo"


def figures(tables: list[pa.Table]) -> dict[str, float]:
    s = summarize(pa.concat_tables(tables))
    out = {f"ttft_{q}": 1e3 * s["ttft"][q] for q in ("p50", "p90", "p99")}
    out.update({f"tpot_{q}": 1e3 * s["tpot"][q] for q in ("p50", "p90")})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--grid", default="short", help="the calibration's, without --profile")
    parser.add_argument("--rates", default="8,16,24")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--think-scale", type=float, default=0.01)
    parser.add_argument("--recalibrate", action="store_true", help="before each rate")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    require_release()

    def measured() -> dict[str, float]:
        path = Path(tempfile.mkdtemp()) / "profile.json"
        path.write_text(json.dumps(calibrate(args.url, grid=args.grid, held_out=None)))
        return load_profile(path)

    engine = measured() if args.profile is None else load_profile(args.profile)
    trace = annotate_ttp(pq.read_table(TRACE))
    cfg = SrrConfig(
        urls=tuple(args.url), policies=(POLICY,), slo_ttft_p90=1.0, slo_tpot_p90=1.0,
        seeds=args.seeds, think_scale=args.think_scale, policy_options={POLICY: {}},
    )  # fmt: skip
    probe = live_probe(trace, cfg)
    # The policy's parameters as the proxy sets them (as `kvroute bench srr` simulates it).
    given = ProxyConfig(policy=POLICY).policy_options()
    options = {k: float(v) for k, v in given.items() if POLICY in sim.PARAM_POLICIES.get(k, ())}
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, float]] = []
    print("| sessions/s | source | TTFT p50 | p90 | p99 | TPOT p50 | p90 |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        if args.recalibrate and i > 0:
            engine = measured()
        profiles.append(engine)
        print(f"profile: busy_handling_s {1e3 * engine.get('busy_handling_s', 0.0):.1f} ms")
        variants = {
            "simulated": engine,
            "simulated, busy_handling_s=0": {**engine, "busy_handling_s": 0.0},
        }
        seeds = [cfg.seed + k for k in range(args.seeds)]
        real = figures([probe(POLICY, rate, s) for s in seeds])
        rows.append({"rate": rate, "source": "real", **real})
        for name, params in variants.items():
            done = sim.sweep(
                scaled(trace, cfg), policies=[POLICY], modes=["poisson"], seeds=seeds,
                rates=[rate], grid={k: [v] for k, v in options.items()},
                instances=len(args.url), engine=dict(params), sample_interval=0.0,
            )  # fmt: skip
            rows.append({"rate": rate, "source": name, **figures([d.records for d in done])})
        for row in rows[-3:]:
            cells = [
                f"{row[k]:.1f}" + ("" if row is rows[-3] else f" ({row[k] / real[k] - 1:+.0%})")
                for k in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90")
            ]
            print(f"| {rate:g} | {row['source']} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"profiles": profiles, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
