"""Fuzzing the public API and the trace readers (hypothesis).

Every public function is called with valid arguments but one, which takes a random value of
a random type. The only outcomes allowed are a result or a :class:`kvroute.KvrouteError`
whose message names that argument (the valid call succeeds, so the replaced argument is the
cause). Trace files are truncated, bit-flipped and given wrong schemas; reading them gives a
trace or a ``KvrouteError`` naming the file. The examples per test are bounded so that the
whole module runs in well under a minute, the same examples every run.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvroute
from kvroute.errors import KvrouteError
from kvroute.trace_ops import annotate_ttp

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "traces" / "mooncake_conversation_head1000.jsonl"
# Derandomized: CI explores the same examples every run. KVROUTE_FUZZ_RANDOM=1 explores new
# ones (KVROUTE_FUZZ_EXAMPLES=N for more of them).
FUZZ = settings(
    max_examples=int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "150")),
    derandomize="KVROUTE_FUZZ_RANDOM" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

BIG = 2**70
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-BIG, BIG),
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
)
ARRAYS = st.sampled_from(
    [
        np.array([1.5, 2.0]),
        np.zeros((2, 2), dtype=np.uint64),
        np.array([1, 2], dtype=np.int8),
        np.array([-1, 2**40], dtype=np.int64),
        np.array([], dtype=np.uint64),
        np.array([3, 4], dtype=np.uint64)[::-1],
        np.array(["a"]),
        np.float32(1.0),
        np.int64(3),
        np.bool_(True),
    ]
)
ANY = st.one_of(
    SCALARS,
    ARRAYS,
    st.lists(
        st.one_of(st.integers(-BIG, BIG), st.floats(), st.none(), st.text(max_size=2)), max_size=4
    ),
    st.lists(st.integers(0, 2**32), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
    st.tuples(st.integers(0, 5)),
    st.builds(object),
)


@dataclass
class Case:
    """A callable and valid keyword arguments for it; ``names`` maps an argument to other
    words an error about it may use besides its name."""

    call: Callable[..., Any]
    valid: Callable[[], dict[str, Any]]
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Arguments whose valid values are costly when large (e.g. a trace of N requests):
    # fuzzed only with values that are not ints.
    no_ints: tuple[str, ...] = ()


def _router(**kw: Any) -> kvroute.Router:
    return kvroute.Router(3, **kw)


def _events_router() -> kvroute.Router:
    return kvroute.Router(2, cache_view="events")


KEYS = [11, 22, 33]


def _trace() -> pa.Table:
    return kvroute.read_trace(BUNDLED)


SMALL = annotate_ttp(_trace().slice(0, 60))


def _scratch() -> Path:
    """A fresh folder in the test's own (the autouse fixture below moves there), which pytest
    removes with it."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="scratch-", dir=Path.cwd()))


def _run_dir() -> Path:
    return kvroute.simulate(SMALL, mode="tracets", instances=2).write(_scratch() / "run")


def _method(make: Callable[[], Any], name: str) -> Callable[..., Any]:
    def call(**kw: Any) -> Any:
        return getattr(make(), name)(**kw)

    call.__name__ = name
    return call


CASES: dict[str, Case] = {
    "Router": Case(
        kvroute.Router,
        lambda: {
            "num_instances": 3,
            "policy": "lmetric",
            "block_size": 16,
            "cache_capacity_blocks": 100,
            "cache_rule": "vllm",
            "max_sessions": 10,
            "overload_factor": 2.0,
            "hit_ratio_gate": 0.5,
            "seed": 1,
            "cache_threshold": 0.5,
            "balance_abs": 32,
            "balance_rel": 1.1,
            "overlap_weight": 1.0,
            "queued_weight": 0.0,
            "temperature": 0.0,
            "cache_view": "events",
            "pending_ttl_s": 1.0,
            "affinity": "shared",
        },
    ),
    "route": Case(
        _method(_router, "route"),
        lambda: {"request_id": "r", "hash_ids": KEYS, "input_length": 1500, "session_id": 7},
    ),
    "route_info": Case(
        _method(_router, "route_info"),
        lambda: {"request_id": 5, "hash_ids": np.array(KEYS, np.uint64), "input_length": 9},
    ),
    "first_token": Case(_method(_router, "first_token"), lambda: {"request_id": "x"}),
    "finish": Case(_method(_router, "finish"), lambda: {"request_id": 3}),
    "estimate_cache_hit": Case(
        _method(_router, "estimate_cache_hit"),
        lambda: {"instance": 1, "hash_ids": KEYS, "input_length": 1500},
    ),
    "estimate_cache_hits": Case(
        _method(_events_router, "estimate_cache_hits"),
        lambda: {"hash_ids": KEYS, "input_length": 1500, "view": "estimate"},
    ),
    "set_available": Case(
        _method(_router, "set_available"), lambda: {"instance": 0, "flag": False}
    ),
    "session_affinity": Case(_method(_router, "session_affinity"), lambda: {"session_id": "s"}),
    "cached_keys": Case(_method(_router, "cached_keys"), lambda: {"instance": 2}),
    "extend": Case(_method(_router, "extend"), lambda: {"request_id": 1, "hash_ids": KEYS}),
    "clear_cache": Case(_method(_router, "clear_cache"), lambda: {"instance": 1}),
    "set_cache_capacity": Case(
        _method(_router, "set_cache_capacity"), lambda: {"instance": 1, "capacity": 64}
    ),
    "apply_kv_events": Case(
        _method(_events_router, "apply_kv_events"),
        lambda: {"instance": 0, "seq": 0, "batch": [0.0, [], 0], "replayed": False},
    ),
    "kv_resync": Case(
        _method(_events_router, "kv_resync"), lambda: {"instance": 1, "rank": 0, "reason": "x"}
    ),
    "kv_reset": Case(_method(_events_router, "kv_reset"), lambda: {"instance": 1}),
    "kv_view": Case(_method(_events_router, "kv_view"), lambda: {"instance": 0}),
    "block_hashes": Case(
        kvroute.block_hashes, lambda: {"token_ids": list(range(40)), "block_size": 16}
    ),
    "chain_ids": Case(kvroute.chain_ids, lambda: {"ids": [1, 2, 3]}),
    "chain_ids_lists": Case(
        kvroute.chain_ids_lists,
        lambda: {
            "values": np.array([1, 2, 3], np.uint64),
            "offsets": np.array([0, 1, 3], np.int64),
        },
    ),
    "EngineModel": Case(kvroute.EngineModel, lambda: {"preset": "h20-qwen3-coder-30b-a3b"}),
    "EngineModel.submit": Case(
        _method(kvroute.EngineModel, "submit"),
        lambda: {
            "request_id": "a",
            "hash_ids": KEYS,
            "input_length": 1500,
            "output_length": 4,
            "now": 0.0,
        },
    ),
    "EngineModel.advance": Case(_method(kvroute.EngineModel, "advance"), lambda: {"now": 1.0}),
    "ceilings": Case(
        kvroute.ceilings,
        lambda: {
            "trace": SMALL,
            "block_size": 512,
            "min_sessions": 2,
            "capacities": [10, 100],
            "per_request": True,
            "progress": False,
        },
        names={"trace": ("trace",)},
    ),
    "read_trace": Case(
        kvroute.read_trace,
        lambda: {
            "source": BUNDLED,
            "format": "mooncake",
            "block_size": 512,
            "infer_sessions": True,
            "on_error": "skip",
            "tokenizer": None,
        },
        names={"source": ("trace",), "tokenizer": ("tokenizer",)},
    ),
    "sweep": Case(
        kvroute.sweep,
        lambda: {
            "trace": SMALL,
            "policies": ["lmetric", "sticky"],
            "modes": ["tracets"],
            "seeds": [0],
            "rates": None,
            "grid": {"overload_factor": [1.5]},
            "instances": 2,
        },
        names={
            "trace": ("trace",),
            "policies": ("policy",),
            "modes": ("mode",),
            "grid": ("parameter",),
        },
        no_ints=("instances",),
    ),
    "write_trace": Case(
        kvroute.write_trace,
        lambda: {
            "table": SMALL,
            "path": _scratch() / "w.parquet",
            "block_size": 512,
            "force": True,
        },
        names={"table": ("trace",), "path": ("path", "w.parquet")},
    ),
    "sustainable_rate": Case(
        kvroute.sustainable_rate,
        lambda: {
            "trace": SMALL,
            "policies": "lmetric",
            "slo_ttft_p90": 10.0,
            "slo_tpot_p90": 0.05,
            "start": 0.5,
            "rel_tol": 0.5,
            "max_rounds": 2,
            "seed": 0,
            "instances": 2,
            "params": {"overload_factor": 1.5},
        },
        names={"trace": ("trace",), "policies": ("policy",), "params": ("parameter",)},
        no_ints=("instances", "max_rounds"),
    ),
    "synthesize": Case(
        kvroute.synthesize,
        lambda: {"profile": "w600", "path": _scratch() / "s.parquet", "requests": 50, "seed": 1},
        names={"path": ("path", "s.parquet")},
        no_ints=("requests",),
    ),
    "make_report": Case(
        kvroute.make_report,
        lambda: {"runs": [_run_dir()], "figures": False, "title": "t"},
    ),
    "simulate": Case(
        kvroute.simulate,
        lambda: {
            "trace": SMALL,
            "instances": 2,
            "policy": "unified",
            "mode": "tracets",
            "seed": 0,
            "router_cache": 1000,
            "sample_interval": 1.0,
            "cap_turns": 4,
        },
        names={"trace": ("trace",)},
        no_ints=("instances",),
    ),
}


@pytest.fixture(autouse=True)
def _in_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random relative paths land in a scratch folder."""
    monkeypatch.chdir(tmp_path)


def _check(case: Case, name: str, value: Any) -> None:
    kwargs = case.valid()
    kwargs[name] = value
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.call(**kwargs)
    except KvrouteError as exc:
        words = (name, *case.names.get(name, ()))
        assert any(w in str(exc) for w in words), f"{name}={value!r:.60}: {exc}"


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_valid_calls_succeed(case_name: str) -> None:
    case = CASES[case_name]
    case.call(**case.valid())


@pytest.mark.parametrize("case_name", sorted(CASES))
@FUZZ
@given(data=st.data())
def test_one_bad_argument(case_name: str, data: st.DataObject) -> None:
    case = CASES[case_name]
    name = data.draw(st.sampled_from(sorted(case.valid())), label="argument")
    value = data.draw(ANY, label="value")
    if name in case.no_ints:
        assume(not isinstance(value, int) or isinstance(value, bool) or value < 70)
    _check(case, name, value)


# ---- trace files: truncated, bit-flipped, wrong schemas -------------------------------


def _source_files(folder: Path) -> dict[str, Path]:
    table = _trace().slice(0, 80)
    files = {"parquet": kvroute.write_trace(table, folder / "t.parquet")}
    files["mooncake"] = folder / "m.jsonl"
    files["mooncake"].write_bytes(b"".join(BUNDLED.read_bytes().splitlines(True)[:40]))
    agentic = folder / "a.jsonl"
    with agentic.open("w") as f:
        for i in range(30):
            row = {
                "session_id": f"s{i % 4}",
                "turn": i // 4,
                "timestamp": float(i),
                "input_length": 600 + 10 * i,
                "output_length": 5,
                "hash_ids": list(range(i % 4 * 100, i % 4 * 100 + 2 + i // 4)),
            }
            f.write(json.dumps(row) + "\n")
    files["agentic"] = agentic
    csv = folder / "l.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2024-05-10 00:00:{i:02d}.000,{100 + i},{5 + i}\n" for i in range(30))
    )
    files["csv"] = csv
    return files


class Sources(dict[str, bytes]):
    """The files' bytes, with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<{len(self)} trace files>"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("sources")
    return Sources({k: p.read_bytes() for k, p in _source_files(folder).items()})


SUFFIX = {"parquet": ".parquet", "mooncake": ".jsonl", "agentic": ".jsonl", "csv": ".csv"}


def _read_damaged(folder: Path, kind: str, raw: bytes) -> None:
    path = folder / f"damaged{SUFFIX[kind]}"
    path.write_bytes(raw)
    try:
        table = kvroute.read_trace(path)
    except KvrouteError as exc:
        assert str(path) in str(exc), str(exc)
        return
    assert isinstance(table, pa.Table)


@pytest.mark.parametrize("kind", sorted(SUFFIX))
@FUZZ
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_file(
    tmp_path: Path, sources: dict[str, bytes], kind: str, fraction: float
) -> None:
    raw = sources[kind]
    _read_damaged(tmp_path, kind, raw[: int(fraction * len(raw))])


@pytest.mark.parametrize("kind", sorted(SUFFIX))
@FUZZ
@given(flips=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=8))
def test_bit_flipped_file(
    tmp_path: Path, sources: dict[str, bytes], kind: str, flips: list[float]
) -> None:
    raw = bytearray(sources[kind])
    for where in flips:
        bit = int(where * len(raw) * 8)
        raw[bit // 8] ^= 1 << (bit % 8)
    _read_damaged(tmp_path, kind, bytes(raw))


COLUMN_TYPES = st.sampled_from(
    [
        pa.int64(),
        pa.int8(),
        pa.uint64(),
        pa.float64(),
        pa.float32(),
        pa.string(),
        pa.bool_(),
        pa.list_(pa.int64()),
        pa.list_(pa.float64()),
        pa.large_list(pa.uint64()),
        pa.list_(pa.string()),
        pa.null(),
    ]
)
COLUMNS = ("timestamp", "session_id", "turn", "input_length", "output_length", "hash_ids")


def _column(t: pa.DataType, n: int, draw: Any) -> pa.Array:
    if pa.types.is_null(t):
        return pa.nulls(n)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = t.value_type
        values = [[_scalar(inner, draw) for _ in range(draw(st.integers(0, 3)))] for _ in range(n)]
        return pa.array(values, type=t)
    return pa.array([_scalar(t, draw) for _ in range(n)], type=t)


def _scalar(t: pa.DataType, draw: Any) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return None
    if pa.types.is_string(t):
        return draw(st.text(max_size=3))
    if pa.types.is_boolean(t):
        return draw(st.booleans())
    if pa.types.is_floating(t):
        return draw(st.floats(width=32 if t == pa.float32() else 64))
    if pa.types.is_unsigned_integer(t):
        return draw(st.integers(0, 2**64 - 1))
    bits = t.bit_width
    return draw(st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1))


@FUZZ
@given(data=st.data())
def test_wrong_schema(tmp_path: Path, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 5), label="rows")
    names = data.draw(st.lists(st.sampled_from(COLUMNS), unique=True), label="columns")
    cols = {name: _column(data.draw(COLUMN_TYPES, label=name), n, data.draw) for name in names}
    path = tmp_path / "schema.parquet"
    pq.write_table(pa.table(cols) if cols else pa.table({"x": pa.nulls(n)}), path)
    for read in (kvroute.read_trace, kvroute.ceilings):
        try:
            read(path)
        except KvrouteError as exc:
            assert str(path) in str(exc), str(exc)
