"""APC ceilings of a trace too large for one machine, exactly, on Ray (``docs/ceilings.md``).

Two requests can share a trie node only if their first keys are equal (a node is a key path
from the root), and every quantity of the any-session, intra-session and shared-prefix
ceilings and of the reuse split is a sum over requests of something decided by the earlier
requests that share nodes with them: the trie of earlier requests (for the intra ceiling, of
the same session's), and ``S(node)``, the sessions through a node. So the requests that start
with one key can be computed apart from all others, and the integers added up. The trace is
therefore partitioned by a hash of each request's first key (requests without keys go to
partition 0), and each partition runs in the Rust core.

On Ray: one task per Parquet file reads its canonical columns, checks them as
:func:`kvroute.trace.read_trace` does, keeps those the ceilings need and splits its rows
into the partitions (a shuffle through the object store, which spills to disk when the trace
is larger than memory); one task per partition concatenates its pieces in file order (so
requests with equal timestamps keep the trace's order, as SEMANTICS §4 asks) and computes
its ceilings. The driver holds no trace data. The global-LRU capacity curve does not
partition (one cache is shared by all requests) and is not computed here.

Memory per task: one file's rows (the split), or one partition's rows plus the core's
O(keys) tables. A single first key that starts most of a trace makes its partition that
large: the partitions balance only as well as the first keys do.
"""

from __future__ import annotations

import contextlib
import glob
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvroute import _core, args
from kvroute.errors import InvalidArgumentError, KvrouteTypeError
from kvroute.files import read_parquet_present, read_parquet_schema
from kvroute.schema import BLOCK_SIZE_KEY, REQUIRED, conform

VARIANTS = ("any", "intra", "shared")
TOTALS = ("hit_tokens", "total_tokens", "hit_requests", "total_requests")
REUSE = ("intra", "cross", "shared")
_SUFFIXES = (".parquet", ".pq")


def trace_files(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """The Parquet files of a trace given as a folder (its ``*.parquet`` files), a glob, one
    file or a list of files; in name order (a sharded trace's order), each one checked."""
    if isinstance(source, str | Path):
        text = str(source)
        if not text:
            raise InvalidArgumentError("trace path is empty")
        path = Path(text)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in _SUFFIXES)
            what = f"{path}: a folder with no .parquet files"
        elif glob.has_magic(text):
            files = sorted(Path(p) for p in glob.glob(text))
            what = f"{text}: no file matches"
        else:
            files, what = [path], ""
    else:
        files, what = [], "trace: an empty list"
        for i, p in enumerate(args.sequence(source, "trace")):
            if not isinstance(p, str | Path):
                raise KvrouteTypeError(f"trace[{i}] must be a path, got {type(p).__name__}")
            if str(p) == "":
                raise InvalidArgumentError(f"trace[{i}] is an empty path")
            files.append(Path(p))
    if not files:
        raise InvalidArgumentError(what)
    for f in files:
        if not f.is_file():
            raise InvalidArgumentError(f"{f}: no such file")
    return files


def check_files(files: list[Path], columns: Sequence[str]) -> int | None:
    """Check that every file has ``columns`` with the types of the first file's and one
    block size; return that block size (None when no file records one)."""
    first: pa.Schema | None = None
    block: tuple[int, Path] | None = None
    for f in files:
        schema = read_parquet_schema(f)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise InvalidArgumentError(f"{f}: no column {missing[0]!r}")
        if first is None:
            first = schema
        for c in columns:
            if schema.field(c).type != first.field(c).type:
                raise InvalidArgumentError(
                    f"{f}: column {c!r} is {schema.field(c).type}, but "
                    f"{first.field(c).type} in {files[0]}"
                )
        raw = (schema.metadata or {}).get(BLOCK_SIZE_KEY)
        if raw is not None:
            size = int(raw)
            if block is not None and block[0] != size:
                raise InvalidArgumentError(
                    f"{f}: block size {size} in its metadata, but {block[0]} in {block[1]}"
                )
            block = (size, f)
    return block[0] if block else None


def partition_of(table: pa.Table, partitions: int) -> np.ndarray:
    """Each row's partition: a mix of its first key (splitmix64's finalizer) modulo
    ``partitions``; 0 for a request without keys. O(rows)."""
    col = table.column("hash_ids")
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
    firsts = pc.list_flatten(pc.list_slice(col, 0, 1)).to_numpy(zero_copy_only=False)
    z = np.zeros(len(lengths), np.uint64)
    z[lengths > 0] = firsts.astype(np.int64, copy=False).view(np.uint64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    part = (z % np.uint64(partitions)).astype(np.int64)
    part[lengths == 0] = 0
    return part


def split(table: pa.Table, partitions: int) -> list[pa.Table]:
    """``table``'s rows by :func:`partition_of`, each partition in the table's row order
    (one copy of the rows: ``take`` on a table of many chunks would combine them per call)."""
    table = table.combine_chunks()
    part = partition_of(table, partitions)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(partitions + 1))
    return [table.take(order[bounds[p] : bounds[p + 1]]) for p in range(partitions)]


def partition_ceilings(pieces: Sequence[pa.Table], block_size: int, min_sessions: int) -> Any:
    """The core's ceilings of one partition (its pieces in trace order), or None if empty."""
    full = [p for p in pieces if p.num_rows]
    if not full:
        return None
    table = pa.concat_tables(full)
    return _core.ceilings(table, block_size=block_size, min_sessions=min_sessions)


def merge(parts: Sequence[Any], total_requests: int = 0) -> dict[str, Any]:
    """The sums of the partitions' ceilings, in the shape of ``_core.ceilings``'s result."""
    out: dict[str, Any] = {v: dict.fromkeys(TOTALS, 0) for v in VARIANTS}
    out["reuse"] = dict.fromkeys(REUSE, 0)
    for raw in parts:
        if raw is None:
            continue
        for v in VARIANTS:
            for k in TOTALS:
                out[v][k] += int(raw[v][k])
        for k in REUSE:
            out["reuse"][k] += int(raw["reuse"][k])
    for v in VARIANTS:
        total = out[v]["total_tokens"]
        out[v]["ratio"] = out[v]["hit_tokens"] / total if total else 0.0
    out["capacity"] = []
    out["per_request"] = None
    return out


def _private_rss() -> int:
    """This process's private resident memory in bytes (``RssAnon``; 0 where Linux's
    ``/proc`` is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """The largest value of ``read()`` while a block runs, sampled every ``interval``
    seconds on a thread of its own (and once at each end)."""

    def __init__(self, read: Callable[[], float], interval: float) -> None:
        self.read, self.interval = read, interval
        self.value = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.value = max(self.value, self.read())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.value = max(self.value, self.read())


@contextlib.contextmanager
def _task(what: str) -> Iterator[PeakSampler]:
    """A task's body: its peak private memory sampled every 10 ms (not ``VmHWM``, which also
    counts the object-store pages a reused worker has touched, and its earlier tasks),
    running out of memory said as such, and what its tables took given back to the OS at
    its end (workers are reused)."""
    with PeakSampler(_private_rss, 0.01) as peak:
        try:
            yield peak
        except MemoryError as exc:
            raise MemoryError(
                f"{what}: out of memory ({exc}); give tasks more, or cut the trace finer"
            ) from None
        pa.default_memory_pool().release_unused()


def _read_split(path: str, columns: list[str], partitions: int) -> list[pa.Table]:
    table = read_parquet_present(path, ["request_id", *REQUIRED])
    return split(conform(table, source=path).select(columns), partitions)


def _split_file(path: str, columns: list[str], partitions: int) -> list[Any]:
    """Ray task: one file's rows checked as :func:`kvroute.trace.read_trace` checks them
    (errors name the file, row and field), its pieces, then its row count and the task's
    peak private memory."""
    with _task(path) as peak:
        pieces = _read_split(path, columns, partitions)
    return [*pieces, (sum(p.num_rows for p in pieces), peak.value)]


def _reduce(block_size: int, min_sessions: int, *pieces: pa.Table) -> tuple[Any, float]:
    """Ray task: one partition's ceilings and the task's peak private memory."""
    with _task("a partition's ceilings") as peak:
        raw = partition_ceilings(pieces, block_size, min_sessions)
    return raw, peak.value


def _reservation(ray: Any, task_memory: int) -> int:
    """``task_memory`` if one node could hold it (Ray would wait for ever for a task no node
    can take)."""
    task_memory = args.integer(task_memory, "task_memory", 1 << 20)
    nodes = [n.get("Resources", {}).get("memory", 0) for n in ray.nodes() if n.get("Alive")]
    if task_memory > max(nodes, default=0):
        raise InvalidArgumentError(
            f"task_memory={task_memory / 2**30:.2f} GiB is more than any node of the cluster "
            f"offers ({max(nodes, default=0) / 2**30:.2f} GiB)"
        )
    return task_memory


def ceilings_on_ray(
    source: str | Path | Sequence[str | Path],
    *,
    block_size: int | None,
    min_sessions: int,
    partitions: int | None = None,
    address: str | None = None,
    progress: Callable[[str, int, int], object] | None = None,
    task_memory: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ceilings of a (sharded) Parquet trace on Ray, and how the run went: files,
    partitions, requests, and the largest peak private memory of a split and of a partition
    task (``split_peak_rss``, ``partition_peak_rss``, bytes).
    ``partitions``: default twice the number of files. ``progress`` gets ``(stage, done,
    total)`` per task completed. ``task_memory``: bytes each task reserves (Ray's ``memory``
    resource: Ray runs no more tasks at once than the nodes' memory holds; a reservation,
    not a limit the kernel enforces)."""
    from kvroute.distributed import completed, connected

    files = trace_files(source)
    columns = ["timestamp", "session_id", "input_length", "hash_ids"]
    recorded = check_files(files, REQUIRED)
    bs = block_size or recorded or 512
    n = (
        args.integer(partitions, "partitions", 1, 1 << 16)
        if partitions is not None
        else 2 * len(files)
    )
    with connected(address) as ray:
        opts: dict[str, Any] = {"num_cpus": 1}
        if task_memory is not None:
            opts["memory"] = _reservation(ray, task_memory)
        mapper = ray.remote(num_returns=n + 1, **opts)(_split_file)
        reducer = ray.remote(**opts)(_reduce)
        splits = [mapper.remote(str(f), columns, n) for f in files]
        # Column p of the splits is partition p's pieces, in file order.
        reduces = [reducer.remote(bs, min_sessions, *(s[p] for s in splits)) for p in range(n)]
        try:
            rows, split_peak = 0, 0
            for done, (_, (count, peak)) in enumerate(completed(ray, [s[n] for s in splits]), 1):
                rows += count
                split_peak = max(split_peak, peak)
                if progress is not None:
                    progress("split", done, len(files))
            parts, reduce_peak = [], 0
            for done, (_, (raw, peak)) in enumerate(completed(ray, reduces), 1):
                parts.append(raw)
                reduce_peak = max(reduce_peak, peak)
                if progress is not None:
                    progress("partitions", done, n)
        except BaseException as exc:
            for ref in reduces:  # those still waiting for a split that failed
                ray.cancel(ref)
            if isinstance(exc, ray.exceptions.WorkerCrashedError):
                raise RuntimeError(f"{source}: a Ray worker died running a task: {exc}") from None
            raise
    stats = {
        "files": len(files),
        "partitions": n,
        "requests": rows,
        "block_size": bs,
        "split_peak_rss": split_peak,
        "partition_peak_rss": reduce_peak,
    }
    return merge(parts), stats


__all__ = [
    "PeakSampler",
    "ceilings_on_ray",
    "check_files",
    "merge",
    "partition_of",
    "split",
    "trace_files",
]
