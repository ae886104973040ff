"""APC ceilings at scale (release build): time against pyarrow's read of the same columns,
peak memory, and the speed-up over the plain-Python reference (``tests/reference_ceilings``).

Under pytest (``make bench``): the 100k-request slice of the full-scale synthetic trace
(Rust and the reference) and the full trace (ceilings and the Parquet read, each bench's
``extra_info`` says the ratio). As a script it prints the tables of ``benches/README.md``::

    python benches/bench_ceilings.py [--trace PATH] [--sizes 10000,100000,...] [--reference]

Every size runs in a fresh subprocess so that its peak RSS is its own. The full-scale trace
(``agentic-glm``, 2.11M requests) is made by ``kvroute.synth`` into ``$KVROUTE_BENCH_DATA``
(default ``~/.cache/kvroute``) on first use; slices are its first N rows, written beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tracedata import full_scale_trace

COLUMNS = ["timestamp", "session_id", "input_length", "hash_ids"]
TESTS = Path(__file__).resolve().parents[1] / "tests"


def sliced(full: Path, rows: int) -> Path:
    """The first ``rows`` requests of ``full`` as their own Parquet file (made once)."""
    if rows >= pq.ParquetFile(full).metadata.num_rows:
        return full
    path = full.with_name(f"{full.stem}-head{rows}.parquet")
    if not path.exists():
        table = pq.read_table(full).slice(0, rows)
        pq.write_table(table, path.with_suffix(".tmp"), compression="zstd")
        path.with_suffix(".tmp").rename(path)
    return path


def read_columns(path: Path) -> Any:
    return pq.read_table(path, columns=COLUMNS)


def peak_rss_gib() -> float:
    """This process's peak resident memory. VmHWM, not ``ru_maxrss``: Linux keeps the
    latter across ``execve``, so a fresh subprocess would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(path: Path, reference: bool = False, repeat: int = 3) -> dict[str, Any]:
    """Best-of-``repeat`` read and ceilings times for one file, in this process."""
    import kvroute

    out: dict[str, Any] = {"build": kvroute.BUILD_PROFILE, "path": str(path)}
    read_s, ceil_s = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        table = read_columns(path)
        t1 = time.perf_counter()
        result = kvroute.ceilings(table, progress=False)
        t2 = time.perf_counter()
        read_s.append(t1 - t0)
        ceil_s.append(t2 - t1)
        del table
    out.update(
        requests=result.any.total_requests,
        read_s=min(read_s),
        ceilings_s=min(ceil_s),
        ratio_to_read=min(ceil_s) / min(read_s),
        any=result.any.ratio,
        intra=result.intra.ratio,
        shared=result.shared.ratio,
        peak_rss_gib=peak_rss_gib(),
    )
    if reference:
        sys.path.insert(0, str(TESTS))
        from reference_ceilings import reference_ceilings, rows_of

        rows = rows_of(read_columns(path))
        t0 = time.perf_counter()
        ref = reference_ceilings(rows, block_size=result.block_size)
        out["reference_s"] = time.perf_counter() - t0
        mine = result.to_dict()
        out["reference_equal"] = all(
            ref.summary[k] == mine[k] for k in ("any", "intra", "shared", "reuse")
        )
        out["speedup"] = out["reference_s"] / out["ceilings_s"]
    return out


def in_subprocess(path: Path, reference: bool = False) -> dict[str, Any]:
    code = (
        "import json, sys, warnings; warnings.simplefilter('ignore');"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "import bench_ceilings as b; from pathlib import Path;"
        f"print(json.dumps(b.measure(Path({str(path)!r}), reference={reference})))"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --- pytest-benchmark -------------------------------------------------------------------


@pytest.fixture(scope="module")
def slice_100k() -> Path:
    return sliced(full_scale_trace(), 100_000)


def test_ceilings_100k_rust(benchmark: Any, slice_100k: Path) -> None:
    import kvroute

    table = read_columns(slice_100k)
    result = benchmark(kvroute.ceilings, table, progress=False)
    benchmark.extra_info["any"] = result.any.ratio
    benchmark.extra_info["requests"] = result.any.total_requests


def test_ceilings_100k_reference(benchmark: Any, slice_100k: Path) -> None:
    sys.path.insert(0, str(TESTS))
    from reference_ceilings import reference_ceilings, rows_of

    rows = rows_of(read_columns(slice_100k))
    benchmark.pedantic(reference_ceilings, args=(rows,), rounds=1, iterations=1)


def test_ceilings_full_scale_vs_read(benchmark: Any) -> None:
    import kvroute

    path = full_scale_trace()
    t0 = time.perf_counter()
    table = read_columns(path)
    read_s = time.perf_counter() - t0
    result = benchmark.pedantic(
        kvroute.ceilings, args=(table,), kwargs={"progress": False}, rounds=2, iterations=1
    )
    ratio = benchmark.stats.stats.min / read_s
    benchmark.extra_info.update(read_s=round(read_s, 2), ratio_to_read=round(ratio, 2))
    benchmark.extra_info["any"] = result.any.ratio
    assert ratio <= 3.0, f"ceilings took {ratio:.2f}x the Parquet read"


# --- script -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None, help="full-scale trace (Parquet)")
    ap.add_argument("--sizes", default="10000,100000,500000,1000000,2110000")
    ap.add_argument("--reference", action="store_true", help="also time the reference at 100k")
    args = ap.parse_args()
    full = args.trace or full_scale_trace()
    print("| requests | keys read (s) | ceilings (s) | ceilings / read | peak RSS (GiB) |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        r = in_subprocess(sliced(full, n))
        assert r["build"] == "release", r
        print(
            f"| {r['requests']:,} | {r['read_s']:.2f} | {r['ceilings_s']:.2f} "
            f"| {r['ratio_to_read']:.2f} | {r['peak_rss_gib']:.2f} |",
            flush=True,
        )
    if args.reference:
        r = in_subprocess(sliced(full, 100_000), reference=True)
        print(
            f"\n100k slice: ceilings {r['ceilings_s']:.3f} s, reference {r['reference_s']:.1f} s, "
            f"speed-up {r['speedup']:.0f}x, equal: {r['reference_equal']}"
        )


if __name__ == "__main__":
    main()
