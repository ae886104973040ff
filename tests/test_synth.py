"""``kvroute.synth``: the synthetic agentic-trace generator and its ``synth`` command.

Small scales only: agentic-glm at 20,000 requests (about 12,400 sessions) and w600 at its
full size (1214 requests). Besides format, determinism and the key structure, the
statistics must land within loose tolerances of the study's numbers (stated at each check),
and the APC ceilings the generator reports must equal the ones computed here with plain
Python sets over the written keys.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvroute.errors import InvalidArgumentError
from kvroute.schema import block_size_of, conform, trace_schema
from kvroute.synth import PROFILES, SynthStats, synthesize

SMALL = 20_000
B = 512


class Trace:
    """A written trace, read back, with the per-request columns as numpy/lists."""

    def __init__(self, path: Path, stats: SynthStats) -> None:
        self.path = path
        self.stats = stats
        self.table = pq.read_table(path)
        t = self.table
        self.ts = t.column("timestamp").to_numpy()
        self.sid = t.column("session_id").to_numpy()
        self.turn = t.column("turn").to_numpy()
        self.inp = t.column("input_length").to_numpy()
        self.out = t.column("output_length").to_numpy()
        self.ttp = t.column("time_to_parent_chat")
        keys = t.column("hash_ids").combine_chunks()
        self.flat = keys.values.to_numpy()
        self.offsets = keys.offsets.to_numpy()
        self.keys = [
            self.flat[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)
        ]


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("synth") / "glm.parquet"
    return Trace(path, synthesize("agentic-glm", path, requests=SMALL, seed=42))


@pytest.fixture(scope="module")
def w600(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("synth") / "w600.parquet"
    return Trace(path, synthesize("w600", path, seed=42))


@pytest.fixture(params=["glm", "w600"])
def trace(request: pytest.FixtureRequest) -> Trace:
    value: Trace = request.getfixturevalue(request.param)
    return value


def set_ceilings(tr: Trace, min_sessions: int = 8) -> dict[str, Any]:
    """The APC ceilings by the book (timestamp order; a trie of chained keys is a set of
    (position, key)): any-session, intra-session and shared-prefix (>= min_sessions)."""
    seen: set[tuple[int, int]] = set()
    per_session: dict[int, set[tuple[int, int]]] = defaultdict(set)
    sessions_of: dict[tuple[int, int], set[int]] = defaultdict(set)
    for s, keys in zip(tr.sid.tolist(), tr.keys, strict=True):
        for node in enumerate(keys.tolist()):
            sessions_of[node].add(s)
    hits = {"any": 0, "intra": 0, "shared": 0}
    hit_requests = dict.fromkeys(hits, 0)
    for s, n, keys in zip(tr.sid.tolist(), tr.inp.tolist(), tr.keys, strict=True):
        nodes = list(enumerate(keys.tolist()))
        k_any = k_intra = k_shared = 0
        mine = per_session[s]
        while k_any < len(nodes) and nodes[k_any] in seen:
            if len(sessions_of[nodes[k_any]]) >= min_sessions:
                k_shared = k_any + 1
            k_any += 1
        while k_intra < len(nodes) and nodes[k_intra] in mine:
            k_intra += 1
        for name, k in (("any", k_any), ("intra", k_intra), ("shared", k_shared)):
            hits[name] += min(k * B, n)
            hit_requests[name] += k > 0
        seen.update(nodes)
        mine.update(nodes)
    total = int(tr.inp.sum())
    return {
        **{name: hits[name] / total for name in hits},
        **{f"{name}_requests": hit_requests[name] for name in hits},
    }


# ---------------------------------------------------------------------------- format


def test_schema_conforms(trace: Trace) -> None:
    t = trace.table
    want = trace_schema(ttp=True, type_column=True)
    assert t.schema.remove_metadata().equals(want.remove_metadata())
    assert block_size_of(t) == 512
    assert t.schema.metadata[b"kvroute.block_size"] == b"512"
    meta = json.loads(t.schema.metadata[b"kvroute.synth"])
    assert meta["seed"] == 42 and meta["profile"] == trace.stats.profile
    conformed = conform(t, source="synth")
    assert conformed.schema.equals(t.schema)
    assert pq.ParquetFile(trace.path).metadata.row_group(0).column(6).compression == "ZSTD"
    assert t.column("request_id").to_numpy().tolist() == list(range(t.num_rows))
    assert set(t.column("type").unique().to_pylist()) <= {"text", "tool"}
    assert (trace.inp > 0).all() and (trace.out > 0).all()


def test_timestamps_sorted(trace: Trace) -> None:
    assert trace.ts[0] >= 0.0
    assert (np.diff(trace.ts) >= 0).all()


def test_key_count_is_ceil_input_over_block(trace: Trace) -> None:
    counts = np.diff(trace.offsets)
    assert (counts == (trace.inp + B - 1) // B).all()
    assert trace.stats.keys == len(trace.flat)


# ---------------------------------------------------------------------------- sessions


def test_turns_number_each_session_in_time_order(trace: Trace) -> None:
    order = np.lexsort((np.arange(len(trace.sid)), trace.sid))  # by session, then time
    sid, turn = trace.sid[order], trace.turn[order]
    first = np.r_[True, sid[1:] != sid[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(sid)), 0))
    assert (turn == np.arange(len(sid)) - start).all()
    sizes = np.diff(np.r_[np.flatnonzero(first), len(sid)])
    assert len(sizes) == trace.stats.sessions
    assert sizes.max() == trace.stats.turns_max


def test_time_to_parent_chat(trace: Trace) -> None:
    ttp = trace.ttp.to_numpy(zero_copy_only=False)
    nulls = trace.ttp.is_null().to_numpy(zero_copy_only=False)
    assert (nulls == (trace.turn == 0)).all()
    prev_ts: dict[int, float] = {}
    for i, (s, t) in enumerate(zip(trace.sid.tolist(), trace.ts.tolist(), strict=True)):
        if s in prev_ts:
            gap = t - prev_ts[s]
            assert 0.0 < ttp[i] <= gap + 1e-9, (i, ttp[i], gap)
        prev_ts[s] = t


def test_keys_are_prefix_chained(w600: Trace, glm: Trace) -> None:
    """Equal key at position i <=> equal prefix: every key has one position and one parent."""
    chain: dict[int, tuple[int, int]] = {}
    for keys in w600.keys:
        parent = -1
        for i, k in enumerate(keys.tolist()):
            assert chain.setdefault(k, (i, parent)) == (i, parent)
            parent = k
    # the same on the larger trace, vectorized: sort by key, neighbours must agree
    counts = np.diff(glm.offsets)
    pos = np.arange(len(glm.flat)) - np.repeat(glm.offsets[:-1], counts)
    parents = np.where(pos > 0, np.roll(glm.flat, 1), np.uint64(0))
    order = np.argsort(glm.flat, kind="stable")
    k, p, par = glm.flat[order], pos[order], parents[order]
    same = k[1:] == k[:-1]
    assert same.any()  # keys do repeat
    assert (p[1:][same] == p[:-1][same]).all()
    assert (par[1:][same] == par[:-1][same]).all()


def test_sessions_are_append_only(trace: Trace) -> None:
    """Turn t+1 keeps turn t's full blocks and nothing after them; or, rarely, the session
    compacted its context (input drops below input_t + output_t) and keeps only a prefix."""
    last: dict[int, int] = {}
    compactions = later = 0
    for i, s in enumerate(trace.sid.tolist()):
        j = last.get(s)
        last[s] = i
        if j is None:
            continue
        later += 1
        a, b = trace.keys[j], trace.keys[i]
        full = int(trace.inp[j]) // B
        if trace.inp[i] >= trace.inp[j] + trace.out[j]:
            assert (b[:full] == a[:full]).all()
            assert len(b) > full
            if len(a) > full:  # the old partial block's content changed
                assert b[full] != a[full]
        else:
            compactions += 1
            shared = int(np.argmin(np.r_[a[: len(b)] == b[: len(a)], False]))
            assert shared <= 48  # only a system/project prefix survives a compaction
            assert not set(b[shared:].tolist()) & set(a.tolist())
    assert compactions == trace.stats.compactions
    assert compactions < 0.05 * later


# ---------------------------------------------------------------------------- ceilings


def test_ceilings_match_a_set_based_computation(trace: Trace) -> None:
    got = set_ceilings(trace)
    st = trace.stats
    assert got["any"] == pytest.approx(st.any_ceiling, abs=1e-12)
    assert got["intra"] == pytest.approx(st.intra_ceiling, abs=1e-12)
    assert got["shared"] == pytest.approx(st.shared_ceiling, abs=1e-12)
    assert got["any_requests"] == st.any_hit_requests
    assert got["intra_requests"] == st.intra_hit_requests
    assert got["shared_requests"] == st.shared_hit_requests
    # intra-session reuse dominates: cross-session sharing adds under one point
    assert 0.0 <= got["any"] - got["intra"] < 0.01


# ---------------------------------------------------------------------------- statistics


def test_agentic_glm_statistics_near_the_study(glm: Trace) -> None:
    st = glm.stats
    assert st.requests == SMALL
    assert st.sessions == round(SMALL * 1_310_000 / 2_110_000)
    # turns/session: exact p90 of 1 (mostly single-turn), p99 18 +- 2, heavy tail
    assert st.turns_p90 == 1
    assert 16 <= st.turns_p99 <= 20
    assert st.turns_max >= 100
    # context: within 15% of the study's p50/p90/p99 (20k / 88k / 125k), max <= 202,069
    assert st.input_p50 == pytest.approx(20_000, rel=0.15)
    assert st.input_p90 == pytest.approx(88_000, rel=0.15)
    assert st.input_p99 == pytest.approx(125_000, rel=0.10)
    assert st.input_max <= 202_069
    assert float(np.percentile(glm.inp, 50)) == st.input_p50
    # the whole trace fits the ~2 h window
    assert glm.ts.min() >= 0 and glm.ts.max() < 7200
    assert 0.5 < st.intra_ceiling <= st.any_ceiling < 0.8


def test_w600_statistics_near_the_study(w600: Trace) -> None:
    st = w600.stats
    assert (st.requests, st.sessions) == (1214, 274)
    # 53.3M input tokens +- 10%; ceilings within 2 points of 80.3% / 79.6%
    assert st.input_tokens == pytest.approx(53.3e6, rel=0.10)
    assert st.any_ceiling == pytest.approx(0.803, abs=0.02)
    assert st.intra_ceiling == pytest.approx(0.796, abs=0.02)
    # multi-turn heavy: ~30% single-turn sessions, ~37% of requests past turn 8
    assert st.single_turn_fraction == pytest.approx(0.30, abs=0.05)
    assert st.beyond_turn8_fraction == pytest.approx(0.37, abs=0.05)
    # sessions start inside the 600 s window; 807 of 1214 requests before 600 s, +- 10%
    first = w600.ts[w600.turn == 0]
    assert first.max() < 600.0
    assert st.window_requests == pytest.approx(807, rel=0.10)


def test_comparison_table_and_dict(glm: Trace) -> None:
    rows = glm.stats.comparison()
    labels = [r[0] for r in rows]
    assert "turns/session p99" in labels and "KV/request p99 (GiB)" in labels
    req = rows[labels.index("requests")]
    assert req[1] == req[2] == f"{SMALL:,}"  # the target scales with --requests
    d = glm.stats.to_dict()
    json.dumps(d)
    assert d["targets"]["requests"] == SMALL and d["targets"]["turns_p99"] == 18
    assert glm.stats.table().row_count == len(rows)


# ---------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes(tmp_path: Path, w600: Trace, glm: Trace) -> None:
    again = tmp_path / "w600.parquet"
    synthesize("w600", again, seed=42)
    assert again.read_bytes() == w600.path.read_bytes()
    again = tmp_path / "glm.parquet"
    synthesize("agentic-glm", again, requests=SMALL, seed=42)
    assert again.read_bytes() == glm.path.read_bytes()


def test_other_seed_other_trace(tmp_path: Path, w600: Trace) -> None:
    other = tmp_path / "w600_7.parquet"
    st = synthesize("w600", other, seed=7)
    assert other.read_bytes() != w600.path.read_bytes()
    keys = pq.read_table(other).column("hash_ids").combine_chunks().values.to_numpy()
    assert not set(keys.tolist()) & set(w600.flat.tolist())  # the seed salts the keys
    assert (st.requests, st.sessions) == (1214, 274)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
def test_tiny_scales(tmp_path: Path, n: int) -> None:
    st = synthesize("agentic-glm", tmp_path / "t.parquet", requests=n, seed=1)
    t = pq.read_table(tmp_path / "t.parquet")
    assert st.requests == t.num_rows == n
    assert 1 <= st.sessions <= n
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temporary left
    assert (np.diff(t.column("timestamp").to_numpy()) >= 0).all()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown synth profile"):
        synthesize("nope", tmp_path / "x.parquet")
    with pytest.raises(InvalidArgumentError, match="requests"):
        synthesize("w600", tmp_path / "x.parquet", requests=0)
    with pytest.raises(ValueError, match="seed"):
        synthesize("w600", tmp_path / "x.parquet", seed=-1)
    assert set(PROFILES) == {"agentic-glm", "w600"}


# ---------------------------------------------------------------------------- CLI


def test_cli_json(tmp_path: Path, w600: Trace) -> None:
    from kvroute.cli.synth import synth

    out = tmp_path / "cli.parquet"
    result = CliRunner().invoke(
        synth, ["--profile", "w600", "--seed", "42", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["requests"] == 1214 and d["sessions"] == 274
    assert d["any_ceiling"] == pytest.approx(w600.stats.any_ceiling)
    assert d["targets"]["any_ceiling"] == 0.803
    assert out.read_bytes() == w600.path.read_bytes()


def test_cli_table(tmp_path: Path) -> None:
    from kvroute.cli.synth import synth

    out = tmp_path / "cli.parquet"
    result = CliRunner().invoke(synth, ["--requests", "3000", "-o", str(out), "--progress"])
    assert result.exit_code == 0, result.output
    assert "turns/session p99" in result.output and "achieved" in result.output
    assert pq.read_table(out).num_rows == 3000
    result = CliRunner().invoke(synth, ["--profile", "nope", "-o", str(out)])
    assert result.exit_code == 2 and "nope" in result.output
    result = CliRunner().invoke(synth, ["--requests", "10"])
    assert result.exit_code == 2 and "--output" in result.output


def test_reads_as_a_canonical_table(glm: Trace) -> None:
    t = conform(glm.table)
    assert t.column("hash_ids").type == pa.list_(pa.uint64())
    assert math.isclose(float(np.mean(glm.inp)), glm.stats.input_mean)
