"""Runs to report on: per-request records (simulator or HTTP replay, one schema) with their
run metadata, found from paths.

A path may be a run directory (``records.parquet`` inside, as ``kvroute simulate --out`` and
``kvroute replay --out`` write), a records Parquet file, or a directory whose subdirectories
are runs (a sweep); it expands to its runs in name order. Each run gets a short label,
``policy/mode`` (``+ " live"`` for a replay), made unique with the directory name when two
runs would share one. O(records) to read; stateless, thread-safe.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvroute.errors import InvalidArgumentError
from kvroute.records import read_records, run_info

RECORDS = "records.parquet"
#: Preferred order of policies in tables and figures; others follow alphabetically.
POLICY_ORDER = ("lmetric", "load_only", "sticky", "unified", "capped", "leastwork")
MODE_ORDER = ("tracets", "thinktime", "poisson")


@dataclass(frozen=True)
class Run:
    """One run: its records, metadata (``kvroute.run``) and the names it is shown by."""

    label: str
    policy: str
    mode: str
    source: str
    records: pa.Table
    info: dict[str, Any]
    path: Path | None = None

    @property
    def live(self) -> bool:
        """Whether the records come from an HTTP replay rather than the simulator."""
        return self.source == "replay"

    @property
    def series(self) -> str:
        """The group a run belongs to in figures: its mode, ``live`` marked."""
        return f"{self.mode} (live)" if self.live else self.mode


def _record_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / RECORDS).is_file():
        return [path / RECORDS]
    if path.is_dir():
        found = sorted(p / RECORDS for p in path.iterdir() if (p / RECORDS).is_file())
        if found:
            return found
    raise InvalidArgumentError(
        f"{path}: not a run (no {RECORDS}), a records file or a directory of runs"
    )


def make_run(records: pa.Table, path: Path | None = None, label: str | None = None) -> Run:
    """A :class:`Run` of a records table; policy and mode from its metadata."""
    info = run_info(records)
    source = str(info.get("source") or "records")
    name = path.parent.name if path is not None and path.name == RECORDS else None
    name = name or (path.stem if path is not None else "run")
    policy = str(info.get("policy") or name)
    mode = str(info.get("mode") or "unknown")
    base = f"{policy}/{mode}" + (" live" if source == "replay" else "")
    return Run(label or base, policy, mode, source, records, info, path)


def load_runs(paths: list[Path] | list[str]) -> list[Run]:
    """Every run under ``paths`` (see the module doc), in a stable order, labels unique."""
    runs = [make_run(read_records(f), f) for p in paths for f in _record_files(Path(p))]
    return unique_labels(sort_runs(runs))


def unique_labels(runs: list[Run]) -> list[Run]:
    """Append the run's directory (or a counter) to labels that several runs share."""
    counts = Counter(r.label for r in runs)
    seen: Counter[str] = Counter()
    out = []
    for r in runs:
        if counts[r.label] > 1:
            seen[r.label] += 1
            suffix = r.path.parent.name if r.path is not None else str(seen[r.label])
            r = Run(f"{r.label} [{suffix}]", r.policy, r.mode, r.source, r.records, r.info, r.path)
        out.append(r)
    return out


def policy_key(policy: str) -> tuple[int, str]:
    """Sort key: the study's policies first, in its order."""
    return (POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER), policy)


def mode_key(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def sort_runs(runs: list[Run]) -> list[Run]:
    """Simulated before live, then by policy and mode."""
    return sorted(runs, key=lambda r: (r.live, policy_key(r.policy), mode_key(r.mode), r.label))
