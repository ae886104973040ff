"""Beyond one machine (``docs/distributed.md``), without Ray: the first-key partitioning of
the ceilings against the plain reference on hypothesis-made traces, sharded traces (folders,
globs, ``trace synth --shards``), sweeps that resume, and the errors, including the one for
a missing ``ray`` extra. The same paths on a Ray cluster are in ``test_ray.py``."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvroute
import kvroute.sim as ks
from kvroute.cli import main
from kvroute.errors import InvalidArgumentError, MissingExtraError, OutputExistsError
from kvroute.schema import with_block_size
from kvroute.sharded import merge, partition_ceilings, split, trace_files
from reference_ceilings import Row, reference_ceilings
from test_ceilings import table_of, traces

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_SESSIONS = ROOT / "traces" / "mooncake_sessions_32tok.parquet"


def partitioned(files: list[pa.Table], partitions: int, block: int, ms: int) -> dict:
    """What the Ray path computes, in one process: each file split by first key, each
    partition's pieces in file order, the partitions' integers added up."""
    pieces = [split(t, partitions) for t in files]
    parts = [partition_ceilings([p[i] for p in pieces], block, ms) for i in range(partitions)]
    return merge(parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(1, 4), st.integers(1, 7), st.integers(1, 4))
def test_first_key_partitions_add_up_to_the_reference(
    trace: tuple[list[Row], int], min_sessions: int, partitions: int, files: int
) -> None:
    rows, block = trace
    want = reference_ceilings(rows, block_size=block, min_sessions=min_sessions, capacities=[])
    table = table_of(rows, block_size=block)
    cuts = [len(rows) * i // files for i in range(files + 1)]
    shards = [table.slice(a, b - a) for a, b in itertools.pairwise(cuts)]
    got = partitioned(shards, partitions, block, min_sessions)
    del got["per_request"]
    assert got == want.summary


def test_partitions_of_a_real_trace_add_up() -> None:
    table = pq.read_table(MOONCAKE_SESSIONS)
    whole = kvroute.ceilings(table, min_sessions=2).to_dict()
    got = partitioned([table.slice(0, 100), table.slice(100)], 5, 32, 2)
    assert {k: got[k] for k in whole} == whole


def shards_of(table: pa.Table, folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    cuts = [table.num_rows * i // n for i in range(n + 1)]
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        paths.append(folder / f"part-{i:05d}.parquet")
        pq.write_table(table.slice(a, b - a), paths[-1])
    return paths


def test_sharded_trace_sources(tmp_path: Path) -> None:
    table = pq.read_table(MOONCAKE_SESSIONS)
    paths = shards_of(table, tmp_path / "shards", 3)
    (tmp_path / "shards" / "README.txt").write_text("not a shard")
    assert trace_files(tmp_path / "shards") == paths
    assert trace_files(str(tmp_path / "shards" / "part-*.parquet")) == paths
    assert trace_files([paths[2], paths[0]]) == [paths[2], paths[0]]
    whole = kvroute.ceilings(MOONCAKE_SESSIONS)
    assert kvroute.ceilings(tmp_path / "shards") == whole
    assert kvroute.ceilings(str(tmp_path / "shards" / "*.parquet")) == whole
    assert kvroute.ceilings(paths) == whole
    out = CliRunner().invoke(main, ["ceilings", str(tmp_path / "shards"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == whole.to_dict()


def test_sharded_trace_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match=r"no \.parquet files"):
        kvroute.ceilings(tmp_path / "empty")
    with pytest.raises(InvalidArgumentError, match="no file matches"):
        kvroute.ceilings(str(tmp_path / "nothing-*.parquet"))
    with pytest.raises(InvalidArgumentError, match="no such file"):
        kvroute.ceilings([tmp_path / "missing.parquet"])
    table = pq.read_table(MOONCAKE_SESSIONS)
    a, b = shards_of(table, tmp_path / "mixed", 2)
    pq.write_table(with_block_size(table.slice(0, 5), 16), b)
    with pytest.raises(InvalidArgumentError, match=rf"{b}: block size 16 .* but 32 in {a}"):
        kvroute.ceilings(tmp_path / "mixed")
    pq.write_table(table.slice(0, 5).set_column(2, "session_id", pa.array(["x"] * 5)), b)
    with pytest.raises(InvalidArgumentError, match=rf"{b}: column 'session_id' is string"):
        kvroute.ceilings(tmp_path / "mixed")
    with pytest.raises(InvalidArgumentError, match="partitions and task_memory are only read"):
        kvroute.ceilings(a, partitions=4)
    with pytest.raises(InvalidArgumentError, match="executor"):
        kvroute.ceilings(a, executor="dask")
    with pytest.raises(InvalidArgumentError, match="ray_address is only read"):
        kvroute.ceilings(a, ray_address="auto")


def test_synth_shards(tmp_path: Path) -> None:
    one = tmp_path / "one.parquet"
    kvroute.synthesize("agentic-glm", one, requests=3000, seed=3)
    stats = kvroute.synthesize("agentic-glm", tmp_path / "sh", requests=3000, seed=3, shards=4)
    files = sorted((tmp_path / "sh").iterdir())
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert stats.file_bytes == sum(f.stat().st_size for f in files)
    whole = pq.read_table(one)
    parts = [pq.read_table(f) for f in files]
    assert [p.num_rows for p in parts] == [750] * 4
    joined = pa.concat_tables([p.replace_schema_metadata(whole.schema.metadata) for p in parts])
    assert joined.equals(whole)
    meta = [json.loads(p.schema.metadata[b"kvroute.synth"]) for p in parts]
    assert [(m["shard"], m["shards"]) for m in meta] == [(i, 4) for i in range(4)]
    assert kvroute.ceilings(tmp_path / "sh") == kvroute.ceilings(one)
    with pytest.raises(OutputExistsError, match="already holds shards"):
        kvroute.synthesize("agentic-glm", tmp_path / "sh", requests=3000, force=False, shards=2)
    kvroute.synthesize("agentic-glm", tmp_path / "sh", requests=3000, seed=3, shards=2)
    assert len(list((tmp_path / "sh").iterdir())) == 2  # the stale shards went with force
    out = CliRunner().invoke(
        main,
        ["trace", "synth", "--requests", "500", "--shards", "3", "-o", str(tmp_path / "c")],
    )
    assert out.exit_code == 0, out.output
    assert len(list((tmp_path / "c").glob("part-*.parquet"))) == 3


def test_a_missing_ray_extra_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'kvroute\[ray\]'"):
        kvroute.ceilings(MOONCAKE_SESSIONS, executor="ray")
    with pytest.raises(MissingExtraError, match=r"kvroute\[ray\]"):
        ks.sweep(MOONCAKE_SESSIONS, policies="unified", modes=["tracets"], executor="ray")
    out = CliRunner().invoke(main, ["ceilings", str(MOONCAKE_SESSIONS), "--executor", "ray"])
    assert out.exit_code == 2
    assert "pip install 'kvroute[ray]'" in out.output


SWEEP = dict(policies="study", modes=["tracets"], seeds=[0, 1], instances=2)


def same(a: ks.SimResult, b: ks.SimResult) -> None:
    """Equal results, bit for bit (the wall time aside)."""
    assert a.spec == b.spec
    assert a.records.equals(b.records)
    assert a.instances.equals(b.instances)
    assert a.summary == b.summary
    assert a.run == b.run
    assert {k: v for k, v in a.stats.items() if k != "wall_s"} == {
        k: v for k, v in b.stats.items() if k != "wall_s"
    }


def test_an_interrupted_sweep_resumes(tmp_path: Path) -> None:
    fresh = ks.sweep(MOONCAKE_SESSIONS, **SWEEP)
    out = tmp_path / "sweep"
    seen: list[str] = []
    ks.sweep(MOONCAKE_SESSIONS, **SWEEP, out=out, on_result=lambda r: seen.append(r.spec.label))
    assert sorted(seen) == sorted(r.spec.label for r in fresh)
    # An interrupted sweep: one run never written, one cut off before its summary.
    labels = [r.spec.label for r in fresh]
    for f in (out / labels[1]).iterdir():
        f.unlink()
    (out / labels[1]).rmdir()
    (out / labels[4] / "summary.json").unlink()
    seen.clear()
    resumed = ks.sweep(
        MOONCAKE_SESSIONS,
        **SWEEP,
        out=out,
        resume=True,
        on_result=lambda r: seen.append(r.spec.label),
    )
    assert sorted(seen) == sorted([labels[1], labels[4]])
    assert len(resumed) == len(fresh)
    for a, b in zip(fresh, resumed, strict=True):
        same(a, b)
    with pytest.raises(InvalidArgumentError, match=r"written by another configuration \(instances"):
        ks.sweep(MOONCAKE_SESSIONS, **{**SWEEP, "instances": 3}, out=out, resume=True)
    with pytest.raises(InvalidArgumentError, match="resume needs out"):
        ks.sweep(MOONCAKE_SESSIONS, **SWEEP, resume=True)


def test_cli_resume(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["simulate", str(MOONCAKE_SESSIONS), "--mode", "tracets", "--instances", "2"]
    argv += ["--policy", "unified,sticky", "--out", str(out), "--json"]
    first = CliRunner().invoke(main, argv)
    assert first.exit_code == 0, first.output
    (out / "sticky-tracets-seed0" / "summary.json").unlink()
    refused = CliRunner().invoke(main, argv)
    assert refused.exit_code == 2 and "not empty" in refused.output
    again = CliRunner().invoke(main, [*argv, "--resume"])
    assert again.exit_code == 0, again.output
    runs = [json.loads(x.output)["runs"] for x in (first, again)]
    for a, b in zip(*runs, strict=True):
        assert a["summary"] == b["summary"]
    bad = CliRunner().invoke(main, ["simulate", str(MOONCAKE_SESSIONS), "--resume"])
    assert bad.exit_code == 2 and "--resume needs --out" in bad.output
    bad = CliRunner().invoke(main, ["simulate", str(MOONCAKE_SESSIONS), "--ray-address", "auto"])
    assert bad.exit_code == 2 and "--ray-address needs --executor ray" in bad.output
