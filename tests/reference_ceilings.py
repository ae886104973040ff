"""A plain-Python reading of SEMANTICS §4 (APC ceilings), for the parity tests and the
benchmark baseline.

The trie is nested dicts over key paths (a node is a path, so unchained ids work); ``S(node)``
is a set of sessions per node; the capacity curve is one ``OrderedDict`` LRU per capacity,
touched last to first after each lookup. No shortcut that the Rust core takes (path hashes,
prefix reuse, monotonicity of ``S``) is used here. Time O(keys · (1 + capacities)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    timestamp: float
    session: Hashable
    input_length: int
    keys: Sequence[int]


@dataclass
class Result:
    summary: dict[str, Any]
    any: list[int] = field(default_factory=list)
    intra: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    capacity: dict[int, list[int]] = field(default_factory=dict)


def _variant() -> dict[str, int]:
    return {"hit_tokens": 0, "total_tokens": 0, "hit_requests": 0, "total_requests": 0}


def _record(v: dict[str, int], k: int, block: int, length: int) -> None:
    v["hit_tokens"] += min(k * block, length)
    v["total_tokens"] += length
    v["hit_requests"] += k >= 1
    v["total_requests"] += 1


def _finish(v: dict[str, int]) -> dict[str, Any]:
    total = v["total_tokens"]
    return {"ratio": v["hit_tokens"] / total if total else 0.0, **v}


def reference_ceilings(
    rows: Sequence[Row],
    *,
    block_size: int = 512,
    min_sessions: int = 8,
    capacities: Sequence[int] = (),
) -> Result:
    order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp)  # stable
    # The trie of every path in the trace: node ids, children, sessions through each node.
    children: list[dict[int, int]] = [{}]
    sessions: list[set[Hashable]] = [set()]
    paths: list[list[int]] = []
    for row in rows:
        node, path = 0, []
        for key in row.keys:
            child = children[node].get(key)
            if child is None:
                child = len(children)
                children[node][key] = child
                children.append({})
                sessions.append(set())
            sessions[child].add(row.session)
            path.append(child)
            node = child
        paths.append(path)

    seen_any: set[int] = set()
    seen_by: dict[Hashable, set[int]] = {}
    totals = {"any": _variant(), "intra": _variant(), "shared": _variant()}
    reuse = {"intra": 0, "cross": 0, "shared": 0}
    out = Result(summary={})
    n = len(rows)
    out.any, out.intra, out.shared = [0] * n, [0] * n, [0] * n
    for i in order:
        row, path = rows[i], paths[i]
        mine = seen_by.setdefault(row.session, set())
        k_any = 0
        while k_any < len(path) and path[k_any] in seen_any:
            k_any += 1
        k_intra = 0
        while k_intra < len(path) and path[k_intra] in mine:
            k_intra += 1
        k_shared = max(
            (ln for ln in range(1, k_any + 1) if len(sessions[path[ln - 1]]) >= min_sessions),
            default=0,
        )
        for j in range(k_any):
            tokens = max(0, min((j + 1) * block_size, row.input_length) - j * block_size)
            if path[j] in mine:
                reuse["intra"] += tokens
            elif len(sessions[path[j]]) >= min_sessions:
                reuse["shared"] += tokens
            else:
                reuse["cross"] += tokens
        for name, k in (("any", k_any), ("intra", k_intra), ("shared", k_shared)):
            _record(totals[name], k, block_size, row.input_length)
        out.any[i], out.intra[i], out.shared[i] = k_any, k_intra, k_shared
        seen_any.update(path)
        mine.update(path)

    curve = []
    for cap in sorted(set(capacities)):
        lru: OrderedDict[int, None] = OrderedDict()
        v = _variant()
        col = [0] * n
        for i in order:
            row = rows[i]
            k = 0
            while k < len(row.keys) and row.keys[k] in lru:
                k += 1
            _record(v, k, block_size, row.input_length)
            col[i] = k
            for key in reversed(row.keys):
                lru[key] = None
                lru.move_to_end(key)
                while len(lru) > cap:
                    lru.popitem(last=False)
        curve.append({"capacity": cap, **_finish(v)})
        out.capacity[cap] = col
    out.summary = {
        "any": _finish(totals["any"]),
        "intra": _finish(totals["intra"]),
        "shared": _finish(totals["shared"]),
        "capacity": curve,
        "reuse": reuse,
    }
    return out


def rows_of(table: Any) -> list[Row]:
    """Rows of a canonical pyarrow Table."""
    cols = table.select(["timestamp", "session_id", "input_length", "hash_ids"]).to_pydict()
    return [
        Row(t, s, n, k)
        for t, s, n, k in zip(
            cols["timestamp"],
            cols["session_id"],
            cols["input_length"],
            cols["hash_ids"],
            strict=True,
        )
    ]
