"""Sharded ceilings on Ray at scale (release build): a 21M-request synthetic trace (10x the
study's) in 32 Parquet shards through a local Ray cluster of 2 CPUs, against the
single-process run on the 2.11M trace; the result checked against the synthesizer's own
count, and the 2.11M trace through Ray checked against the local run (``docs/distributed.md``,
``benches/README.md``)::

    python benches/bench_distributed.py [--requests 21100000] [--shards 32] [--partitions 64]

The sharded traces are made by ``kvroute trace synth --shards`` into ``$KVROUTE_BENCH_DATA``
(default ``~/.cache/kvroute``) on first use, with their achieved statistics beside them.
Every measurement runs in a fresh subprocess; memory is each process's peak (``VmHWM``) and
the machine's (total minus available, sampled every 0.2 s). Under pytest (``make bench``):
a 200k-request trace in 4 shards, through Ray and locally.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench_ceilings import in_subprocess, peak_rss_gib
from tracedata import DATA, FULL_REQUESTS, full_scale_trace

GIB = 2**30


def sharded_trace(requests: int, shards: int) -> tuple[Path, dict[str, Any]]:
    """The agentic-glm trace (seed 42) of ``requests`` in ``shards`` files, made once, and
    the synthesizer's statistics (its own count of the any/intra-session ceilings)."""
    from kvroute.synth import synthesize

    folder = DATA / f"agentic-glm-{requests}-seed42-{shards}shards"
    info = folder.with_name(folder.name + ".json")
    if info.exists():
        return folder, json.loads(info.read_text())
    if folder.is_dir() and len(list(folder.glob("part-*.parquet"))) == shards:
        # Made by the command line: the statistics come from the generator's first pass.
        from kvroute.synth.plan import build_plan
        from kvroute.synth.profiles import PROFILES
        from kvroute.synth.stats import plan_stats

        plan, per_prefix = build_plan(PROFILES["agentic-glm"], requests, 42)
        doc = plan_stats(plan, per_prefix, requests, folder).to_dict()
        doc["file_bytes"] = sum(f.stat().st_size for f in folder.glob("part-*.parquet"))
    else:
        t0 = time.perf_counter()
        stats = synthesize("agentic-glm", folder, requests=requests, seed=42, shards=shards)
        doc = {**stats.to_dict(), "wall_s": time.perf_counter() - t0, "peak_gib": peak_rss_gib()}
    info.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return folder, doc


def machine_in_use_gib() -> float:
    """The machine's memory in use: MemTotal - MemAvailable."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return (info["MemTotal"] - info["MemAvailable"]) / GIB


def on_ray(folder: Path, partitions: int, task_memory_gib: float) -> dict[str, Any]:
    """One sharded run on a fresh local cluster of 2 CPUs, in this process."""
    import ray

    import kvroute
    from kvroute.sharded import PeakSampler, ceilings_on_ray

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    started = time.perf_counter()
    try:
        with PeakSampler(machine_in_use_gib, 0.2) as machine:
            raw, stats = ceilings_on_ray(
                folder,
                block_size=None,
                min_sessions=8,
                partitions=partitions,
                task_memory=int(task_memory_gib * GIB),
            )
    finally:
        ray.shutdown()
    return {
        "build": kvroute.BUILD_PROFILE,
        **stats,
        "init_s": started - t0,
        "wall_s": time.perf_counter() - started,
        "machine_peak_gib": machine.value,
        "driver_peak_gib": peak_rss_gib(),
        **{v: raw[v] for v in ("any", "intra", "shared", "reuse")},
    }


def in_fresh_process(code: str) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON object last) in a new interpreter beside this file."""
    prelude = (
        "import json, sys, time, warnings; warnings.simplefilter('ignore');"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + code], check=True, capture_output=True, text=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def ray_in_subprocess(folder: Path, partitions: int, task_memory_gib: float) -> dict[str, Any]:
    return in_fresh_process(
        "import bench_distributed as b\n"
        f"print(json.dumps(b.on_ray(Path({str(folder)!r}), {partitions}, {task_memory_gib})))"
    )


def local_in_subprocess(path: Path) -> dict[str, Any]:
    """The single-process run (read + ceilings, best of three) and the exact integers."""
    return in_fresh_process(
        "import kvroute, bench_ceilings as b\n"
        f"p = Path({str(path)!r}); best = None\n"
        "for _ in range(3):\n"
        "    t0 = time.perf_counter(); r = kvroute.ceilings(p, progress=False)\n"
        "    best = min(best or 1e9, time.perf_counter() - t0)\n"
        "print(json.dumps({'wall_s': best, 'peak_gib': b.peak_rss_gib(), **r.to_dict()}))"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10 * FULL_REQUESTS)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--partitions", type=int, default=64)
    ap.add_argument("--task-memory-gib", type=float, default=3.0)
    a = ap.parse_args()

    full = full_scale_trace()
    local = local_in_subprocess(full)
    print(
        f"local, 2.11M (read + ceilings, best of 3): {local['wall_s']:.1f} s, "
        f"peak {local['peak_gib']:.2f} GiB; any {local['any']['ratio']:.5f}",
        flush=True,
    )
    read = in_subprocess(full)
    print(f"  (ceilings alone {read['ceilings_s']:.2f} s after a {read['read_s']:.2f} s read)")

    small, _ = sharded_trace(FULL_REQUESTS, 8)
    r = ray_in_subprocess(small, 16, a.task_memory_gib)
    equal = all(r[v] == local[v] for v in ("any", "intra", "shared", "reuse"))
    print(
        f"ray, 2.11M in 8 shards, 16 partitions: {r['wall_s']:.1f} s (+{r['init_s']:.1f} s "
        f"start), equal to local: {equal}",
        flush=True,
    )
    report(r)

    big, synth = sharded_trace(a.requests, a.shards)
    print(
        f"synth {a.requests:,} requests in {a.shards} shards: {synth['file_bytes'] / GIB:.2f} "
        f"GiB of Parquet; made in {synth.get('wall_s', 'n/a')} s, peak "
        f"{synth.get('peak_gib', 'n/a')} GiB",
        flush=True,
    )
    r = ray_in_subprocess(big, a.partitions, a.task_memory_gib)
    print(
        f"ray, {r['requests']:,} requests in {r['files']} shards, {r['partitions']} "
        f"partitions: {r['wall_s']:.1f} s (+{r['init_s']:.1f} s start)"
    )
    report(r)
    print(
        f"  any {r['any']['ratio']:.5f} (synthesizer: {synth['any_ceiling']:.5f}), intra "
        f"{r['intra']['ratio']:.5f} (synthesizer: {synth['intra_ceiling']:.5f})"
    )
    print(json.dumps({"local": local, "ray": r, "synth": synth}, sort_keys=True))


def report(r: dict[str, Any]) -> None:
    print(
        f"  peak private memory per task: split {r['split_peak_rss'] / GIB:.2f} GiB, partition "
        f"{r['partition_peak_rss'] / GIB:.2f} GiB; driver {r['driver_peak_gib']:.2f} GiB; "
        f"machine in use {r['machine_peak_gib']:.1f} GiB",
        flush=True,
    )


# --- pytest-benchmark -------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards_200k() -> Path:
    return sharded_trace(200_000, 4)[0]


def test_ceilings_200k_sharded_on_ray(benchmark: Any, shards_200k: Path) -> None:
    import ray

    import kvroute

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        result = benchmark.pedantic(
            kvroute.ceilings,
            args=(shards_200k,),
            kwargs={"executor": "ray", "partitions": 8, "progress": False},
            rounds=3,
            iterations=1,
        )
    finally:
        ray.shutdown()
    assert result == kvroute.ceilings(shards_200k, progress=False)


def test_ceilings_200k_sharded_local(benchmark: Any, shards_200k: Path) -> None:
    import kvroute

    benchmark.pedantic(
        kvroute.ceilings, args=(shards_200k,), kwargs={"progress": False}, rounds=3, iterations=1
    )


if __name__ == "__main__":
    main()
