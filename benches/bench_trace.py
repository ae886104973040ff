"""Trace I/O throughput: the Mooncake JSONL load, Parquet write and read-back, and reading
the full-scale synthetic trace (release build; ``make bench``).

Each bench's ``extra_info`` carries MB/s and requests/s so ``benches/README.md`` can quote
them. The full-scale trace (2.11M requests) is generated once by ``kvroute.synth`` into
``$KVROUTE_BENCH_DATA`` (default ``~/.cache/kvroute``); that bench is skipped when the
synthesizer is unavailable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from kvroute.trace import read_trace, write_trace
from tracedata import full_scale_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = SHARED / "mooncake" / "conversation_trace.jsonl"
if not MOONCAKE.exists():
    MOONCAKE = (
        Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_head1000.jsonl"
    )


def _rates(benchmark: Any, nbytes: int, rows: int) -> None:
    seconds = benchmark.stats.stats.median
    benchmark.extra_info["MB_per_s"] = round(nbytes / seconds / 1e6, 1)
    benchmark.extra_info["requests_per_s"] = round(rows / seconds)


def test_load_mooncake_jsonl(benchmark: Any) -> None:
    table = benchmark(read_trace, MOONCAKE)
    _rates(benchmark, MOONCAKE.stat().st_size, table.num_rows)


def test_load_mooncake_jsonl_infer_sessions(benchmark: Any) -> None:
    table = benchmark(read_trace, MOONCAKE, infer_sessions=True)
    _rates(benchmark, MOONCAKE.stat().st_size, table.num_rows)


def test_write_parquet(benchmark: Any, tmp_path: Path) -> None:
    table = read_trace(MOONCAKE)
    out = tmp_path / "m.parquet"
    benchmark(write_trace, table, out)
    _rates(benchmark, table.nbytes, table.num_rows)
    benchmark.extra_info["parquet_bytes"] = out.stat().st_size


def test_read_parquet_back(benchmark: Any, tmp_path: Path) -> None:
    out = write_trace(read_trace(MOONCAKE), tmp_path / "m.parquet")
    table = benchmark(read_trace, out)
    _rates(benchmark, table.nbytes, table.num_rows)


def test_read_full_scale_parquet(benchmark: Any) -> None:
    path = full_scale_trace()
    table = benchmark.pedantic(read_trace, args=(path,), rounds=3, iterations=1)
    _rates(benchmark, table.nbytes, table.num_rows)
    benchmark.extra_info["file_bytes"] = path.stat().st_size
    benchmark.extra_info["requests"] = table.num_rows


def test_read_full_scale_columns_pyarrow(benchmark: Any) -> None:
    """The baseline the ceilings are measured against: pyarrow reading the needed columns."""
    path = full_scale_trace()
    cols = ["timestamp", "session_id", "input_length", "hash_ids"]
    table = benchmark.pedantic(
        pq.read_table, args=(path,), kwargs={"columns": cols}, rounds=3, iterations=1
    )
    _rates(benchmark, table.nbytes, table.num_rows)
