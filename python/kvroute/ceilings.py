"""APC ceilings of a trace: how much of its prompt tokens a prefix cache could serve at best.

:func:`ceilings` takes a path, a pyarrow Table or a polars DataFrame in the canonical trace
format (:mod:`kvroute.schema`) and hands its columns to the Rust core zero-copy through the
Arrow PyCapsule interface (``list`` and ``large_list`` keys alike). The work runs with the GIL
released on all cores; a progress bar appears on a terminal once a run passes two seconds,
and Ctrl-C stops it cleanly (``KeyboardInterrupt``). The exact definitions (any-session,
intra-session, shared-prefix, capacity curve, reuse split) are SEMANTICS §4, restated in
``docs/ceilings.md``. Time O(keys) for the three ceilings (plus O(keys) for the curve),
memory O(requests + nodes new to their session + keys); stateless and thread-safe.
"""

from __future__ import annotations

import glob
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvroute import _core, args
from kvroute.distributed import check_executor
from kvroute.errors import InvalidArgumentError, KvrouteError, KvrouteTypeError
from kvroute.files import read_parquet_present
from kvroute.schema import block_size_of

COLUMNS = ("timestamp", "session_id", "input_length", "hash_ids")
SHOW_PROGRESS_AFTER_S = 2.0


@dataclass(frozen=True)
class Variant:
    """One ceiling: ``ratio = hit_tokens / total_tokens``; ``hit_requests`` have k >= 1."""

    ratio: float
    hit_tokens: int
    total_tokens: int
    hit_requests: int
    total_requests: int


@dataclass(frozen=True)
class CapacityPoint:
    """The any-session ceiling with one global LRU cache of ``capacity`` keys."""

    capacity: int
    ratio: float
    hit_tokens: int
    total_tokens: int
    hit_requests: int
    total_requests: int


@dataclass(frozen=True)
class Reuse:
    """Any-session hit tokens by where the block was reached first: the same session,
    another session through a shared prefix (``S >= min_sessions``), or another one."""

    intra: int
    cross: int
    shared: int


@dataclass(frozen=True)
class Ceilings:
    """Everything :func:`ceilings` finds. ``per_request`` (when asked for) has one row per
    request, in trace order: ``request_id``, matched keys ``any``, ``intra``, ``shared`` and
    one ``capacity_<C>`` column per capacity."""

    any: Variant
    intra: Variant
    shared: Variant
    capacity: tuple[CapacityPoint, ...]
    reuse: Reuse
    block_size: int
    min_sessions: int
    per_request: pa.Table | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of ``kvroute ceilings --json``."""
        return {
            "any": asdict(self.any),
            "intra": asdict(self.intra),
            "shared": asdict(self.shared),
            "capacity": [asdict(c) for c in self.capacity],
            "reuse": asdict(self.reuse),
        }


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer | float):
        raise KvrouteTypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, float) and not value.is_integer():
        raise InvalidArgumentError(f"{name} must be a whole number, got {value}")
    if not 1 <= int(value) <= args.MAX_SIZE:
        raise InvalidArgumentError(f"{name} must be in [1, 2**40], got {value}")
    return int(value)


def _no_keys(path: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{path}: the trace has no block keys (hash_ids), e.g. a lengths-only CSV; "
        "ceilings need keys: use a trace with hash_ids or tokenized prompts"
    )


def _load(trace: Any, need: Sequence[str]) -> tuple[Any, int | None, str]:
    """The object to hand to Rust, the block size its metadata records, and a name."""
    from kvroute.trace import KEYS_KEY, read_trace

    if isinstance(trace, list | tuple) or (
        isinstance(trace, str | Path) and (Path(trace).is_dir() or glob.has_magic(str(trace)))
    ):
        return _load_files(trace, need)
    if isinstance(trace, str | Path):
        if trace == "":
            raise InvalidArgumentError("trace path is empty")
        path = Path(trace)
        if path.suffix.lower() in (".parquet", ".pq") and path.is_file():
            table = read_parquet_present(path, list(need))
        else:
            table = read_trace(path)
        if (table.schema.metadata or {}).get(KEYS_KEY) == b"none":
            raise _no_keys(str(path))
        return table, block_size_of(table), str(path)
    if isinstance(trace, pa.Table):
        if (trace.schema.metadata or {}).get(KEYS_KEY) == b"none":
            raise _no_keys("<table>")
        table = trace.select([c for c in need if c in trace.column_names])
        return table, block_size_of(trace), "<table>"
    if type(trace).__module__.startswith("polars"):
        return trace.select([c for c in need if c in trace.columns]), None, "<polars DataFrame>"
    if hasattr(trace, "__arrow_c_stream__"):
        return pa.table(trace), None, "<arrow stream>"
    raise KvrouteTypeError(
        f"trace must be a path, a pyarrow Table or a polars DataFrame, got {type(trace).__name__}"
    )


def _load_files(source: Any, need: Sequence[str]) -> tuple[pa.Table, int | None, str]:
    """A trace given as several Parquet files (a folder, a glob, a list), in name order."""
    from kvroute.sharded import check_files, trace_files

    files = trace_files(source)
    recorded = check_files(files, COLUMNS)
    try:
        table = pa.concat_tables([read_parquet_present(f, list(need)) for f in files])
    except pa.ArrowInvalid as exc:
        raise InvalidArgumentError(f"{source}: the files' columns differ: {exc}") from exc
    return table, recorded, str(source)


def _request_ids(data: Any) -> Any:
    names = data.column_names if isinstance(data, pa.Table) else data.columns
    if "request_id" in names:
        return data.column("request_id") if isinstance(data, pa.Table) else data["request_id"]
    return pa.array(np.arange(len(data), dtype=np.int64))


class _Bar:
    """A rich progress bar on stderr that shows up only for runs longer than a few seconds."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.monotonic()
        self.progress: Any = None
        self.task: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or time.monotonic() - self.start < SHOW_PROGRESS_AFTER_S:
            return
        if self.progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TimeElapsedColumn

            self.progress = Progress(
                "ceilings",
                BarColumn(),
                "{task.percentage:>3.0f}%",
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("ceilings", total=max(total, 1))
        self.progress.update(self.task, completed=done, total=max(total, 1))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _progress(
    progress: bool | Callable[[int, int], object] | None,
) -> tuple[_Bar | None, Callable[[int, int], object]]:
    """The caller's callable, or a bar (on a terminal, or when asked for) and the bar."""
    if callable(progress):
        return None, progress
    bar = _Bar(sys.stderr.isatty() if progress is None else bool(progress))
    return bar, bar


def ceilings(
    trace: Any,
    *,
    block_size: int | None = None,
    min_sessions: int = 8,
    capacities: Sequence[int] | None = None,
    per_request: bool = False,
    progress: bool | Callable[[int, int], object] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    partitions: int | None = None,
    task_memory: int | None = None,
) -> Ceilings:
    """APC ceilings of ``trace`` (SEMANTICS §4). ``trace``: a path (one Parquet or other
    trace file, a folder of Parquet files or a glob; the files in name order), a list of
    Parquet files, a pyarrow Table or a polars DataFrame.

    ``block_size``: tokens per key (default: the trace's ``kvroute.block_size`` metadata,
    else 512). ``min_sessions``: sessions through a node for it to count as a shared prefix.
    ``capacities``: cache sizes in keys for the capacity curve (one global LRU each).
    ``per_request``: also return every request's matched key counts as an Arrow table.
    ``progress``: ``None`` shows a bar on a terminal after two seconds, ``True`` always does,
    ``False`` never; a callable gets ``(done, total)`` about every 100 ms.
    ``executor="ray"``: the trace's Parquet files are partitioned by first key and computed
    as Ray tasks (:mod:`kvroute.sharded`; on the cluster at ``ray_address``, the one this
    process joined, or a local one) into ``partitions`` parts (default: twice the files),
    each task reserving ``task_memory`` bytes if given; the same integers as a local run. Not
    with ``capacities`` (one LRU shared by all requests does not partition) or
    ``per_request``; ``progress`` counts tasks done.
    """
    check_executor(executor, ray_address)
    if executor == "ray":
        return _on_ray(
            trace,
            block_size,
            min_sessions,
            capacities,
            per_request,
            progress,
            address=ray_address,
            partitions=partitions,
            task_memory=task_memory,
        )
    if partitions is not None or task_memory is not None:
        raise InvalidArgumentError("partitions and task_memory are only read with executor='ray'")
    per_request = args.flag(per_request, "per_request")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise KvrouteTypeError(
            f"progress must be None, a bool or a callable, got {type(progress).__name__}"
        )
    need = [*COLUMNS, "request_id"] if per_request else list(COLUMNS)
    data, recorded, name = _load(trace, need)
    bs = _positive_int(block_size, "block_size") if block_size is not None else recorded or 512
    ms = _positive_int(min_sessions, "min_sessions")
    if capacities is not None and not isinstance(capacities, Sequence):
        raise KvrouteTypeError(f"capacities must be a sequence of ints, got {capacities!r:.40}")
    caps = [_positive_int(c, f"capacities[{i}]") for i, c in enumerate(capacities or ())]
    # Give back what pyarrow's allocator kept from reading the trace before Rust allocates.
    pa.default_memory_pool().release_unused()
    bar, callback = _progress(progress)
    try:
        raw = _core.ceilings(
            data,
            block_size=bs,
            min_sessions=ms,
            capacities=caps,
            per_request=per_request,
            progress=callback,
        )
    except KvrouteError as exc:
        raise type(exc)(f"{name}: {exc}") from exc
    finally:
        if bar is not None:
            bar.close()
    table = None
    if per_request:
        per = raw["per_request"]
        assert per is not None
        cols: dict[str, Any] = {
            "request_id": _request_ids(data),
            "any": per["any"],
            "intra": per["intra"],
            "shared": per["shared"],
        }
        for point, col in zip(raw["capacity"], per["capacity"], strict=True):
            cols[f"capacity_{point['capacity']}"] = col
        table = pa.table(cols)
    return _result(raw, bs, ms, table)


def _result(raw: Any, block_size: int, min_sessions: int, per: pa.Table | None) -> Ceilings:
    return Ceilings(
        any=Variant(**raw["any"]),
        intra=Variant(**raw["intra"]),
        shared=Variant(**raw["shared"]),
        capacity=tuple(CapacityPoint(**c) for c in raw["capacity"]),
        reuse=Reuse(**raw["reuse"]),
        block_size=block_size,
        min_sessions=min_sessions,
        per_request=per,
    )


def _on_ray(
    trace: Any,
    block_size: int | None,
    min_sessions: int,
    capacities: Sequence[int] | None,
    per_request: bool,
    progress: bool | Callable[[int, int], object] | None,
    **ray: Any,
) -> Ceilings:
    """:func:`ceilings` on Ray; ``ray``: :func:`kvroute.sharded.ceilings_on_ray`'s options."""
    from kvroute.sharded import ceilings_on_ray

    if not isinstance(trace, str | Path | list | tuple):
        raise KvrouteTypeError(
            "with executor='ray' the trace must be Parquet files (a path, a folder, a glob or "
            f"a list), got {type(trace).__name__}"
        )
    if capacities:
        raise InvalidArgumentError(
            "capacities need executor='local': the capacity curve is one LRU cache shared by "
            "every request, which does not partition (docs/ceilings.md)"
        )
    if args.flag(per_request, "per_request"):
        raise InvalidArgumentError("per_request needs executor='local'")
    bs = _positive_int(block_size, "block_size") if block_size is not None else None
    ms = _positive_int(min_sessions, "min_sessions")
    bar, callback = _progress(progress)
    try:
        raw, stats = ceilings_on_ray(
            trace,
            block_size=bs,
            min_sessions=ms,
            progress=lambda _stage, done, total: callback(done, total),
            **ray,
        )
    finally:
        if bar is not None:
            bar.close()
    return _result(raw, stats["block_size"], ms, None)


__all__ = ["CapacityPoint", "Ceilings", "Reuse", "Variant", "ceilings"]
