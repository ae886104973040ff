"""A slowed engine: how soon the proxy's new requests move away from an engine that traffic
bypassing the proxy loads with long prefills, with its policies reading the engines' own load
(``--load-source engine``, the default) or only its own counts (``router``).

    .venv/bin/python benches/peers/slowed.py [--rounds 3] [--json out.json]

Two real vLLM CPU engines (``engines.py``), the proxy with its defaults in front of them.
``CLIENTS`` clients send through it, one request after another, prompts of ``PROMPT_TOKENS``
random token ids (no session, 16 output tokens). ``WARM_S`` seconds in, ``BURST`` prompts of
``LONG_TOKENS`` random ids go straight to the first engine at once; the run ends
``AFTER_S`` seconds later. The proxy's decisions per backend are read from its ``/metrics``
every ``POLL_S``: per source and round, the first engine's share of the decisions before the
burst and in each second after it, and the first second after the burst in which that
share is under 25%. Results in ``benches/README.md`` ("A slowed engine").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engines
import routers
import workloads
from prometheus_client.parser import text_string_to_metric_families

CLIENTS, PROMPT_TOKENS = 4, 512
BURST, LONG_TOKENS = 4, 7000
WARM_S, AFTER_S, POLL_S = 6.0, 10.0, 0.25
SOURCES = ("engine", "router")


def _post(url: str, body: dict[str, Any]) -> None:
    workloads.post(url + "/v1/completions", body, timeout=300)


def decisions(url: str) -> dict[str, float]:
    """The proxy's decisions so far, per backend URL."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvroute_proxy_decisions_total":
                out[s.labels["backend"]] = out.get(s.labels["backend"], 0.0) + s.value
    return out


def one_run(fleet: routers.Fleet, source: str, seed: int, log_dir: Path) -> dict[str, Any]:
    """One source's run (see the module doc): the first engine's decisions and all of them at
    each poll, in seconds from the burst."""
    arm = routers.Arm(f"kvroute-{source}", "kvroute", routers._kvroute("--load-source", source))
    ports = tuple(engines.realvllm.free_ports(2))

    def ready(url: str) -> bool:
        try:
            _post(url, {"model": fleet.model, "prompt": "ready?", "max_tokens": 1})
        except OSError:
            return False
        return True

    first = fleet.urls[0]
    stop = threading.Event()
    with routers.start(arm, fleet, ports, log_dir, None, ready) as router:  # type: ignore[arg-type]
        engines.reset(list(fleet.urls))

        def client(n: int) -> None:
            rng = random.Random(seed * 100 + n)
            while not stop.is_set():
                body = {"model": fleet.model, "prompt": workloads.random_ids(rng, PROMPT_TOKENS)}
                try:
                    _post(router.url, {**body, "max_tokens": 16, "ignore_eos": True})
                except OSError as exc:  # counted by the proxy; the next one goes on
                    print(f"request failed: {exc}", flush=True)

        def long(n: int) -> None:
            rng = random.Random(seed * 100 + 50 + n)
            _post(
                first,
                {
                    "model": fleet.model,
                    "prompt": workloads.random_ids(rng, LONG_TOKENS),
                    "max_tokens": 1,
                },
            )

        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for t in threads:
            t.start()
        polls: list[tuple[float, float, float]] = []
        start = time.monotonic()
        burst_at: float | None = None
        while time.monotonic() - start < WARM_S + AFTER_S:
            now = time.monotonic()
            if burst_at is None and now - start >= WARM_S:
                burst_at = now
                threads += [threading.Thread(target=long, args=(n,)) for n in range(BURST)]
                for t in threads[CLIENTS:]:
                    t.start()
            d = decisions(router.url)
            polls.append((now, d.get(first, 0.0), sum(d.values())))
            time.sleep(POLL_S)
        stop.set()
        for t in threads:
            t.join()
    assert burst_at is not None
    return {"source": source, "polls": [(t - burst_at, a, n) for t, a, n in polls]}


def shares(polls: list[tuple[float, float, float]]) -> dict[str, Any]:
    """The first engine's share of the decisions before the burst and per second after it,
    and the first second after it in which it is under 25% (None: none)."""

    def share(lo: float, hi: float) -> float | None:
        inside = [p for p in polls if lo <= p[0] < hi]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])

    after = [share(s, s + 1.0) for s in range(int(AFTER_S) - 1)]
    away = next((float(s) for s, v in enumerate(after) if v is not None and v < 0.25), None)
    return {"before": share(-WARM_S + 1.0, 0.0), "per_second": after, "moved_away_s": away}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    routers.require_release()
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-slowed-"))
    runs = []
    with engines.Engines(48 << 20, log_dir / "vllm") as eng:
        for rnd in range(args.rounds):
            order = SOURCES if rnd % 2 == 0 else SOURCES[::-1]
            for source in order:
                run = one_run(eng.fleet, source, rnd, log_dir / "routers")
                run.update(shares(run["polls"]), round=rnd)
                runs.append(run)
                fmt = " ".join("-" if v is None else f"{v:.0%}" for v in run["per_second"])
                print(f"round {rnd + 1} {source}: before {run['before']:.0%}, after: {fmt}, "
                      f"moved away after {run['moved_away_s']} s", flush=True)  # fmt: skip
    print(
        "\n| load source | first engine's share before | 0-1 s | 1-2 s | 2-3 s | 3-4 s "
        "| moved away after (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for source in SOURCES:
        rs = [r for r in runs if r["source"] == source]

        def med(values: list[float | None]) -> str:
            xs = [v for v in values if v is not None]
            return f"{statistics.median(xs):.0%} ({min(xs):.0%}-{max(xs):.0%})" if xs else "-"

        cols = [med([r["before"] for r in rs])]
        cols += [med([r["per_second"][s] for r in rs]) for s in range(4)]
        away = [r["moved_away_s"] for r in rs]
        print(f"| {source} | " + " | ".join(cols) + f" | {', '.join(str(a) for a in away)} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
