"""What each router adds to one request at a time: 6,000-character prompts (the first 6,000
characters of distinct LMCache miniswe prompts), as text completions and as chats, already
cached on the engine, one output token, sent one after another straight to the engine and
through each router in front of that one engine, the targets in a rotated order each round.
The added time to first token is a router's median minus the engine's own in the same
round; the router's CPU time per request is read from its process tree.

    .venv/bin/python benches/peers/overhead.py [--arms ...] [--prompts 40] [--rounds 5]

Prints a table (median over rounds, with the range); ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def ttfts(url: str, work: workloads.Workload, model: str) -> list[float]:
    results, _ = client.run(url, work, model, 1, sessions=False)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{url}: {bad[:2]}")
    return [r.ttft * 1e3 for r in results if r.ttft is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    arms = routers.arms([a for a in args.arms.split(",") if a])
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-overhead-"))
    peers_bin = routers.peers_venv()
    texts = prompts(args.prompts)
    works = {kind: requests(texts, kind == "chat") for kind in ("text", "chat")}
    added: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with engines.Engines(256 << 20, log_dir / "vllm") as eng:
        full = eng.fleet
        # Only the first engine: every request is a cache hit on the engine it goes to.
        fleet = routers.Fleet(full.urls[:1], full.events[:1], full.replays[:1],
                              full.block_size, full.model_dir, full.model)  # fmt: skip
        direct = fleet.urls[0]
        for work in works.values():
            ttfts(direct, work, fleet.model)  # caches every prompt
        started = []
        try:
            for arm in arms:
                ports = tuple(engines.realvllm.free_ports(2))
                ready = lambda url: ttfts(url, requests(texts[:1], False), fleet.model) != []  # noqa: E731
                started.append(routers.start(arm, fleet, ports, log_dir, peers_bin, ready))  # type: ignore[arg-type]
            for rnd in range(args.rounds):
                targets: list[Any] = [None, *started]
                k = rnd % len(targets)
                for target in targets[k:] + targets[:k]:
                    for kind, work in works.items():
                        url = direct if target is None else target.url
                        cpu0 = 0.0 if target is None else target.cpu_seconds()
                        med = statistics.median(ttfts(url, work, fleet.model))
                        name = "direct" if target is None else target.arm.name
                        added.setdefault((name, kind), []).append(med)
                        if target is not None:
                            per = (target.cpu_seconds() - cpu0) * 1e3 / work.requests
                            cpu.setdefault((name, kind), []).append(per)
        finally:
            for r in started:
                r.stop()
    rounds = args.rounds
    out = {"prompts": len(texts), "chars": CHARS, "rounds": rounds, "arms": {}}
    head = f"added TTFT p50 ms (median of {rounds} rounds, range)"
    print(f"| router | prompt | {head} | router CPU ms/req |")
    print("|---|---|---:|---:|")
    for (name, kind), meds in added.items():
        if name == "direct":
            continue
        base = added[("direct", kind)]
        deltas = [m - b for m, b in zip(meds, base, strict=True)]
        c = cpu[(name, kind)]
        out["arms"][f"{name}/{kind}"] = {"added_ms": deltas, "cpu_ms": c}
        print(
            f"| {name} | {kind} | {statistics.median(deltas):+.2f} ({min(deltas):+.2f} to "
            f"{max(deltas):+.2f}) | {statistics.median(c):.2f} |"
        )
    direct_text = statistics.median(added[("direct", "text")])
    print(f"\n(direct to the engine, text: TTFT p50 {direct_text:.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
