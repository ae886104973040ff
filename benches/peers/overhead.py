"""What each router adds to one request at a time: 6,000-character prompts (the first 6,000
characters of distinct LMCache miniswe prompts), as text completions and as chats, already
cached on the engine, one output token, sent one after another straight to the engine and
through each router in front of that one engine: each request goes to the engine and to every
router in turn (the routers in a rotated order each round), so that the machine's drift
cancels in the pairs. A router's added time to first token (and to the answer's end) in a
round is the median over requests of its time minus the engine's own for the same request;
the router's CPU time per request is read from its process tree.

    .venv/bin/python benches/peers/overhead.py [--arms ...] [--prompts 40] [--rounds 5]

Prints a table (median over rounds, with the range); ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import client
import engines
import routers
import workloads

DEFAULT_ARMS = ("kvroute-default", "kvroute-old-default", "smg-cache-aware", "vllm-router-kv-aware")
CHARS = 6000


def prompts(n: int) -> list[str]:
    texts: list[str] = []
    for _, session in workloads._agent_sessions(None, None):
        texts += [p[:CHARS] for p in session if len(p) >= CHARS and p[:CHARS] not in texts]
    return texts[:n]


def requests(texts: list[str], chat: bool) -> workloads.Workload:
    one = {"max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        reqs = [
            workloads.Request(
                "/v1/chat/completions", {"messages": [{"role": "user", "content": t}], **one}
            )
            for t in texts
        ]
    else:
        reqs = [workloads.Request("/v1/completions", {"prompt": t, **one}) for t in texts]
    return workloads.Workload("chat" if chat else "text", [reqs], [None])


async def _round(urls: list[str], work: workloads.Workload, model: str) -> list[list[Any]]:
    """Each request sent to every url in turn (drift cancels in the pairs): per url, each
    request's (TTFT, E2E) in ms."""
    times: list[list[Any]] = [[] for _ in urls]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=client.TIMEOUT, connector=conn) as http:
        for req in work.sessions[0]:
            for j, url in enumerate(urls):
                r = await client._one(http, url, req, model, 0, None)
                if not r.ok or r.ttft is None:
                    raise RuntimeError(f"{url}: {r.error}")
                times[j].append((r.ttft * 1e3, r.e2e * 1e3))
    return times


def paired(ours: list[Any], direct: list[Any], k: int) -> float:
    """The median over requests of a router's time minus the engine's own (k: 0 TTFT, 1 E2E)."""
    return statistics.median(a[k] - b[k] for a, b in zip(ours, direct, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    routers.require_release()
    arms = routers.arms([a for a in args.arms.split(",") if a])
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-overhead-"))
    peers_bin = routers.peers_venv()
    texts = prompts(args.prompts)
    works = {kind: requests(texts, kind == "chat") for kind in ("text", "chat")}
    added: dict[tuple[str, str], list[tuple[float, float]]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    direct_ms: list[float] = []
    with engines.Engines(256 << 20, log_dir / "vllm") as eng:
        full = eng.fleet
        # Only the first engine: every request is a cache hit on the engine it goes to.
        fleet = routers.Fleet(full.urls[:1], full.events[:1], full.replays[:1],
                              full.block_size, full.model_dir, full.model)  # fmt: skip
        direct = fleet.urls[0]
        for work in works.values():
            asyncio.run(_round([direct], work, fleet.model))  # caches every prompt
        started = []
        try:
            one = requests(texts[:1], False)
            ready = lambda url: bool(asyncio.run(_round([url], one, fleet.model))[0])  # noqa: E731
            for arm in arms:
                ports = tuple(engines.realvllm.free_ports(2))
                started.append(routers.start(arm, fleet, ports, log_dir, peers_bin, ready))
            for rnd in range(args.rounds):
                k = rnd % len(started)
                order = started[k:] + started[:k]
                for kind, work in works.items():
                    cpu0 = [r.cpu_seconds() for r in order]
                    times = asyncio.run(
                        _round([direct] + [r.url for r in order], work, fleet.model)
                    )
                    if kind == "text":
                        direct_ms.append(statistics.median(t for t, _ in times[0]))
                    for r, c0, got in zip(order, cpu0, times[1:], strict=True):
                        pair = (paired(got, times[0], 0), paired(got, times[0], 1))
                        added.setdefault((r.arm.name, kind), []).append(pair)
                        per = (r.cpu_seconds() - c0) * 1e3 / work.requests
                        cpu.setdefault((r.arm.name, kind), []).append(per)
        finally:
            for r in started:
                r.stop()
    rounds = args.rounds
    out = {"prompts": len(texts), "chars": CHARS, "rounds": rounds, "arms": {}}
    added_p50 = f"added TTFT p50 ms (median of {rounds} rounds, range)"
    print(f"| router | prompt | {added_p50} | added E2E p50 ms | router CPU ms/req |")
    print("|---|---|---:|---:|---:|")
    for (name, kind), pairs in sorted(added.items()):
        ttft, e2e = [p[0] for p in pairs], [p[1] for p in pairs]
        c = cpu[(name, kind)]
        out["arms"][f"{name}/{kind}"] = {"added_ms": ttft, "added_e2e_ms": e2e, "cpu_ms": c}
        print(
            f"| {name} | {kind} | {_spread(ttft)} | {_spread(e2e)} | {statistics.median(c):.2f} |"
        )
    print(f"\n(direct to the engine, text: TTFT p50 {statistics.median(direct_ms):.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.2f} ({min(values):+.2f} to {max(values):+.2f})"


if __name__ == "__main__":
    sys.exit(main())
