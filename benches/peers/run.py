"""The peers benchmark: kvroute against SMG and vllm-router (from PyPI) on two real vLLM CPU
engines, on the same workloads, arms alternating over rounds (the machine drifts).

    .venv/bin/python benches/peers/run.py [--workloads a,b] [--loads light,heavy]
        [--arms ...] [--rounds 3] [--json out.json] [--markdown out.md]

For each workload (``workloads.py``) the engines are started with the workload's KV cache
(``KV_BYTES``), the workload is built and its APC ceiling computed on its own tokens; then
for each load (``LOADS``: sessions in flight) and round, every arm (``routers.ARMS``) in a
rotated order: the engines go idle and their prefix caches are emptied, the router starts
in its own process, the workload is sent through it, and the engines' counters and the
router's CPU time are read before and after. Per arm: the engine-reported prefix-cache hit
rate (hits over queries, in tokens) and its share of the any-session ceiling, TTFT
p50/p90/p99, mean end to end, requests per second, requests per engine, and the router's CPU
milliseconds per request. The table gives each figure's median over the rounds with its
range. ``make bench-peers`` runs it with the defaults; the results are in
``benches/README.md`` ("Peers").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client
import engines
import routers
import workloads

#: KV cache bytes per engine, per workload (the tiny model: 2 KiB a token, so 48 MiB hold
#: 24,576 tokens).
KV_BYTES = {
    "agentic-text": 48 << 20,
    "agentic-chat": 48 << 20,
    "prefix-repetition": 32 << 20,
    "mooncake-ids": 48 << 20,
}
#: Prompt tokens of each request of the outside traffic (``--outside``): random ids, so none
#: hits the prefix cache.
OUTSIDE_PROMPT_TOKENS = 2048
#: Sessions (or, without sessions, requests) in flight per load: ``overload`` is past what the
#: two engines take without queueing or preempting.
LOADS = {"light": 2, "heavy": 8, "overload": 16}
DEFAULT_ARMS = (
    "kvroute-default",
    "smg-cache-aware",
    "smg-cache-aware-sticky",
    "vllm-router-kv-aware",
    "round-robin",
)


@dataclass
class ArmRun:
    """One arm's run of one workload at one load in one round."""

    workload: str
    load: str
    round: int
    arm: str
    requests: int
    errors: int
    hit_rate: float
    ceiling_share: float
    ttft_ms: dict[str, float]
    mean_e2e_ms: float
    req_per_s: float
    per_engine: list[int]
    per_engine_hit_rate: list[float]
    preemptions: int
    cpu_ms_per_req: float
    #: The client's mean TTFT less the engines' own (their metrics: from the API server
    #: receiving a request): the time the router, the relay and HTTP add under this load;
    #: NaN with outside traffic (its requests are in the engines' figure).
    outside_engine_ms: float = float("nan")
    error_samples: list[str] = field(default_factory=list)
    #: Requests the outside traffic completed on the first engine meanwhile.
    outside_requests: int = 0


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Outside:
    """Traffic that bypasses the router (``--outside N``): N clients, each sending the first
    engine one request after another (``OUTSIDE_PROMPT_TOKENS`` random token ids, 16 output
    tokens) until stopped, as a batch job of another team would."""

    def __init__(self, url: str, model: str, clients: int) -> None:
        self.url, self.model, self.done = url, model, 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(n,)) for n in range(clients)]

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = workloads.random_ids(rng, OUTSIDE_PROMPT_TOKENS)
            body = {"model": self.model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True}
            workloads.post(self.url + "/v1/completions", body, timeout=300)
            self.done += 1

    def __enter__(self) -> Outside:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def measure_arm(
    arm: routers.Arm,
    fleet: routers.Fleet,
    work: workloads.Workload,
    ceiling: float,
    concurrency: int,
    log_dir: Path,
    peers_bin: Path | None,
    outside: int = 0,
    requests_file: Path | None = None,
) -> dict[str, Any]:
    """One arm's figures on ``work`` (see the module doc), with ``outside`` clients sending
    the first engine requests of their own meanwhile (:class:`Outside`; their requests and
    prompt tokens are taken out of its counters); each request as the client saw it in
    ``requests_file`` (JSON lines), when given."""
    urls = list(fleet.urls)
    port, metrics = engines.realvllm.free_ports(2)

    def ready(url: str) -> bool:
        body = {"prompt": "ready?", "max_tokens": 1, "stream": True}
        probe = workloads.Request("/v1/completions", body)
        res, _ = client.run(url, workloads.Workload("probe", [[probe]], [None]), fleet.model, 1)
        return res[0].ok

    with contextlib.ExitStack() as stack:
        started = []
        for n in range(arm.replicas):  # a replica's ports are drawn once the one before runs
            ports = (port, metrics) if n == 0 else tuple(engines.realvllm.free_ports(2))
            router = routers.start(arm, fleet, ports, log_dir, peers_bin, ready)  # type: ignore[arg-type]
            started.append(stack.enter_context(router))
        engines.reset(urls)
        before = [engines.counters(u) for u in urls]
        cpu0 = sum(r.cpu_seconds() for r in started)
        router_urls = [r.url for r in started]
        with Outside(urls[0], fleet.model, outside) as other:
            results, wall = client.run(router_urls, work, fleet.model, concurrency, arm.sessions)
            cpu1 = sum(r.cpu_seconds() for r in started)
        time.sleep(0.5)  # the engines' last counters
        after = [engines.counters(u) for u in urls]
    if requests_file is not None:
        requests_file.parent.mkdir(parents=True, exist_ok=True)
        requests_file.write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    pairs = list(zip(after, before, strict=True))
    hits = sum(a.hits - b.hits for a, b in pairs)
    queries = sum(a.queries - b.queries for a, b in pairs) - other.done * OUTSIDE_PROMPT_TOKENS
    outside_only = [other.done * OUTSIDE_PROMPT_TOKENS] + [0] * (len(urls) - 1)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    hit_rate = hits / queries if queries else 0.0
    engine_ttfts = sum(a.ttft_count - b.ttft_count for a, b in pairs)
    engine_ttft_ms = sum(a.ttft_sum - b.ttft_sum for a, b in pairs) * 1e3 / max(engine_ttfts, 1)
    outside_engine = (
        statistics.fmean(ttfts) - engine_ttft_ms if ttfts and not other.done else float("nan")
    )
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": hit_rate,
        "ceiling_share": hit_rate / ceiling if ceiling else 0.0,
        "ttft_ms": {q: _quantile(ttfts, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "mean_e2e_ms": statistics.fmean(r.e2e * 1e3 for r in ok) if ok else float("nan"),
        "req_per_s": len(ok) / wall if wall else 0.0,
        "per_engine": [
            int(a.requests - b.requests) - o // OUTSIDE_PROMPT_TOKENS
            for (a, b), o in zip(pairs, outside_only, strict=True)
        ],
        "per_engine_hit_rate": [
            (a.hits - b.hits) / (a.queries - b.queries - o) if a.queries - b.queries > o else 0.0
            for (a, b), o in zip(pairs, outside_only, strict=True)
        ],
        "preemptions": int(sum(a.preemptions - b.preemptions for a, b in pairs)),
        "cpu_ms_per_req": (cpu1 - cpu0) * 1e3 / max(len(results), 1),
        "outside_engine_ms": outside_engine,
        "error_samples": [r.error or "" for r in results if not r.ok][:3],
        "outside_requests": other.done,
    }


def _failed(requests: int, engines_: int, why: str) -> dict[str, Any]:
    """The figures of an arm whose router did not start: every request an error."""
    nan = float("nan")
    return {
        "requests": requests, "errors": requests, "hit_rate": nan, "ceiling_share": nan,
        "ttft_ms": {"p50": nan, "p90": nan, "p99": nan}, "mean_e2e_ms": nan, "req_per_s": 0.0,
        "per_engine": [0] * engines_, "per_engine_hit_rate": [nan] * engines_,
        "preemptions": 0, "cpu_ms_per_req": nan, "error_samples": [why[-300:]],
    }  # fmt: skip


def _median_range(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    mid = statistics.median(values)
    return f"{fmt.format(mid)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def markdown(runs: list[ArmRun], ceilings: dict[str, dict[str, float]]) -> str:
    """One table per workload and load: each arm's medians over the rounds, with ranges."""
    out = []
    keys = sorted({(r.workload, r.load) for r in runs}, key=lambda k: (k[0], LOADS[k[1]]))
    for wl, load in keys:
        c = ceilings[wl]
        out.append(
            f"\n**{wl}, {load} load** (ceiling: any-session {c['any_session']:.1%}, "
            f"intra-session {c['intra_session']:.1%})\n"
        )
        outside = [r.outside_requests for r in runs if (r.workload, r.load) == (wl, load)]
        if any(outside):
            out.append(
                f"Outside traffic: {statistics.median(outside):.0f} requests of "
                f"{OUTSIDE_PROMPT_TOKENS} uncached tokens sent straight to the first engine "
                "during each arm's run (median; taken out of the figures below).\n"
            )
        out.append(
            "| arm | rounds | hit % | of ceiling | TTFT p50 ms | p90 | p99 | mean E2E ms "
            "| req/s | per engine (hit %) | preemptions | router CPU ms/req "
            "| TTFT outside engines ms | errors |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        arms = list(dict.fromkeys(r.arm for r in runs if (r.workload, r.load) == (wl, load)))
        for arm in arms:
            rs = [r for r in runs if (r.workload, r.load, r.arm) == (wl, load, arm)]
            if all(r.errors == r.requests for r in rs):
                why = next((e for r in rs for e in r.error_samples), "")[:160].replace("|", "/")
                out.append(f"| {arm} | {len(rs)} | every request failed: {why} |" + " |" * 11)
                continue
            counts = zip(*(r.per_engine for r in rs), strict=True)
            rates = zip(*(r.per_engine_hit_rate for r in rs), strict=True)
            engines_ = " / ".join(
                f"{statistics.median(n):.0f} ({100 * statistics.median(h):.0f}%)"
                for n, h in zip(counts, rates, strict=True)
            )
            out.append(
                f"| {arm} | {len(rs)} "
                f"| {_median_range([100 * r.hit_rate for r in rs], '{:.1f}')} "
                f"| {_median_range([100 * r.ceiling_share for r in rs], '{:.0f}%')} "
                f"| {_median_range([r.ttft_ms['p50'] for r in rs], '{:.0f}')} "
                f"| {_median_range([r.ttft_ms['p90'] for r in rs], '{:.0f}')} "
                f"| {_median_range([r.ttft_ms['p99'] for r in rs], '{:.0f}')} "
                f"| {_median_range([r.mean_e2e_ms for r in rs], '{:.0f}')} "
                f"| {_median_range([r.req_per_s for r in rs], '{:.2f}')} "
                f"| {engines_} "
                f"| {_median_range([float(r.preemptions) for r in rs], '{:.0f}')} "
                f"| {_median_range([r.cpu_ms_per_req for r in rs], '{:.2f}')} "
                f"| {_median_range([r.outside_engine_ms for r in rs], '{:.1f}')} "
                f"| {sum(r.errors for r in rs)} |"
            )
    return "\n".join(out) + "\n"


def build(
    name: str, fleet: routers.Fleet, sessions: int | None, turns: int | None
) -> workloads.Workload:
    """Workload ``name``, its sessions per source and turns per session cut as given."""
    url = fleet.urls[0]
    if name in ("agentic-text", "agentic-chat"):
        return workloads.agentic(url, fleet.model, name == "agentic-chat", sessions, turns)
    if name == "prefix-repetition":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(fleet.model_dir / "tokenizer.json"))
        return workloads.prefix_repetition(url, fleet.model, tok.decode)
    if name == "mooncake-ids":
        return workloads.mooncake_ids(None if sessions is None else 2 * sessions)
    raise ValueError(f"unknown workload {name!r}; the workloads are {workloads.WORKLOADS}")


def run(
    names: list[str],
    loads: list[str],
    arm_names: list[str],
    rounds: int,
    log_dir: Path,
    sessions: int | None = None,
    turns: int | None = None,
    progress: Any = print,
    outside: int = 0,
    kv_mib: int | None = None,
) -> tuple[list[ArmRun], dict[str, dict[str, float]], dict[str, Any]]:
    """Every workload x load x round x arm (see the module doc); the runs, each workload's
    ceilings, and the run's facts (versions, sizes). ``sessions`` and ``turns`` cut the
    workloads (:func:`build`); ``outside``: clients sending the first engine traffic of
    their own meanwhile (:class:`Outside`); ``kv_mib``: KV cache per engine for every
    workload (None: ``KV_BYTES``)."""
    arms = routers.arms(arm_names)
    peers_bin = routers.peers_venv(progress) if any(a.kind != "kvroute" for a in arms) else None
    runs: list[ArmRun] = []
    ceilings: dict[str, dict[str, float]] = {}
    facts: dict[str, Any] = {
        "peers": list(routers.PEER_PACKAGES),
        "vllm": engines.realvllm.VLLM_VERSION,
        "loads": {k: LOADS[k] for k in loads},
        "kv_bytes": {}, "requests": {}, "output_tokens": workloads.OUTPUT_TOKENS,
        "outside_clients": outside,
    }  # fmt: skip
    for name in names:
        kv_bytes = KV_BYTES[name] if kv_mib is None else kv_mib << 20
        with engines.Engines(kv_bytes, log_dir / "vllm") as eng:
            fleet = eng.fleet
            if any(a.needs_profile for a in arms):
                fleet = dataclasses.replace(fleet, profile=log_dir / f"profile-{name}.json")
                facts.setdefault("profiles", {})[name] = engines.calibrate(fleet, progress)
            work = build(name, fleet, sessions, turns)
            ceilings[name] = workloads.ceiling(work, fleet.block_size)
            facts["kv_bytes"][name] = kv_bytes
            facts["requests"][name] = work.requests
            for load in loads:
                for rnd in range(rounds):
                    k = rnd % len(arms)
                    order = arms[k:] + arms[:k]
                    for arm in order:
                        try:
                            got = measure_arm(
                                arm, fleet, work, ceilings[name]["any_session"],
                                LOADS[load], log_dir / "routers", peers_bin, outside,
                                log_dir / "requests" / f"{name}-{load}-{rnd + 1}-{arm.name}.jsonl",
                            )  # fmt: skip
                        except RuntimeError as exc:  # the router did not start
                            got = _failed(work.requests, len(fleet.urls), str(exc))
                        runs.append(ArmRun(name, load, rnd, arm.name, **got))
                        progress(
                            f"{name} {load} round {rnd + 1}/{rounds} {arm.name}: "
                            f"hit {got['hit_rate']:.1%}, TTFT p50 {got['ttft_ms']['p50']:.0f} ms, "
                            f"errors {got['errors']}"
                        )
    return runs, ceilings, facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    parser.add_argument("--loads", default="light,heavy")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=None, help="sessions per trace folder")
    parser.add_argument("--turns", type=int, default=None, help="turns per session")
    parser.add_argument(
        "--outside", type=int, default=0, help="clients sending the first engine traffic of "
        "their own during each arm's run (a batch job bypassing the router)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-mib", type=int, default=None, help="KV cache per engine in MiB, for every "
        "workload (default: each workload's own, KV_BYTES)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    routers.require_release()
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvroute-peers-"))
    started = time.time()
    runs, ceilings, facts = run(
        split(args.workloads), split(args.loads), split(args.arms), args.rounds, log_dir,
        args.sessions, args.turns, outside=args.outside, kv_mib=args.kv_mib,
    )  # fmt: skip
    facts["seconds"] = round(time.time() - started)
    table = markdown(runs, ceilings)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        doc = {"facts": facts, "ceilings": ceilings, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
