"""Where a router's CPU time goes, per thread: one workload through one arm on two real vLLM
CPU engines, each thread's user + system time read from ``/proc`` before and after, summed by
thread name (kvroute's: ``kvroute-relay``, the relay's event loop; ``tokio-rt-worker``, its
blocking pool, which tokenizes long prompts and answers; ``kvroute``, the Python control
plane with the KV-events thread; ``ZMQbg/*``, ZMQ's I/O).

    .venv/bin/python benches/peers/cpu_parts.py [--arm kvroute-default] [--workload agentic-text]
        [--sessions 10] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client
import engines
import routers
import run
import workloads


def thread_seconds(pid: int) -> dict[tuple[str, str], float]:
    """CPU seconds of each thread of ``pid``, by (thread id, name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[(task.name, name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", default="kvroute-default")
    parser.add_argument("--workload", default="agentic-text", choices=workloads.WORKLOADS)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=run.LOADS["heavy"])
    args = parser.parse_args(argv)
    routers.require_release()
    arm = routers.arms([args.arm])[0]
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-cpu-parts-"))
    peers_bin = None if arm.kind == "kvroute" else routers.peers_venv()
    with engines.Engines(run.KV_BYTES[args.workload], log_dir / "vllm") as eng:
        fleet = eng.fleet
        work = run.build(args.workload, fleet, args.sessions, None)
        probe = workloads.Workload(
            "probe",
            [
                [
                    workloads.Request(
                        "/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": True}
                    )
                ]
            ],
            [None],
        )
        ports = tuple(engines.realvllm.free_ports(2))

        def ready(url: str) -> bool:
            return client.run(url, probe, fleet.model, 1)[0][0].ok

        with routers.start(arm, fleet, ports, log_dir, peers_bin, ready) as router:  # type: ignore[arg-type]
            pid = router.process.pid
            before = thread_seconds(pid)
            results, wall = client.run(
                router.url, work, fleet.model, args.concurrency, arm.sessions
            )
            after = thread_seconds(pid)
    per: collections.Counter[str] = collections.Counter()
    for key, seconds in after.items():
        per[key[1]] += seconds - before.get(key, 0.0)
    n, total = len(results), sum(per.values())
    print(
        f"{arm.name}, {args.workload}: {n} requests in {wall:.1f} s, {total * 1e3 / n:.2f} ms/req"
    )
    for name, seconds in per.most_common():
        if seconds > 0:
            print(f"  {name:24s} {seconds * 1e3 / n:6.3f} ms/req ({100 * seconds / total:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
