"""Sweeps, the rate search and sharded ceilings on a local Ray cluster of 2 CPUs
(``docs/distributed.md``): each equal, bit for bit, to the local run on the suite's traces;
errors from tasks arrive as themselves. Every test is bounded in time (``ray_cluster``)."""

from __future__ import annotations

import _thread
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvroute
import kvroute.sim as ks
from kvroute.cli import main
from kvroute.errors import InvalidArgumentError
from test_distributed import MOONCAKE_SESSIONS, SWEEP, same, shards_of

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "traces" / "mooncake_conversation_head1000.jsonl"
SHARED = ROOT.parent / "shared" / "traces"
TEST_LIMIT_S = 180


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    """One local cluster for the module (kvroute joins the one this process started)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def bounded() -> Iterator[None]:
    """Fail a test that runs past TEST_LIMIT_S instead of hanging CI."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test ran past {TEST_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "glm.parquet"
    kvroute.synthesize("agentic-glm", path, requests=4000, seed=5)
    return path


def test_sweep_on_ray_equals_local(synthetic: Path) -> None:
    grid = {"overload_factor": [1.3, 2.0]}
    kw: dict[str, Any] = dict(policies="study", modes=["tracets", "thinktime"], grid=grid)
    kw.update(instances=4, seeds=[0, 1])
    local = ks.sweep(synthetic, **kw)
    arrived: list[str] = []
    remote = ks.sweep(
        synthetic, **kw, executor="ray", on_result=lambda r: arrived.append(r.spec.label)
    )
    assert len(local) == len(remote) == 24  # (4 policies + unified's 2 grid values) x 2 x 2
    assert sorted(arrived) == sorted(r.spec.label for r in local)
    for a, b in zip(local, remote, strict=True):
        same(a, b)


def test_rate_search_on_ray_equals_local(synthetic: Path) -> None:
    kw: dict[str, Any] = dict(policies="unified,sticky", instances=2, max_rounds=4)
    local = ks.sustainable_rate(synthetic, **kw)
    remote = ks.sustainable_rate(synthetic, **kw, executor="ray")
    assert [(r.policy, r.rate, r.upper, r.probes) for r in local] == [
        (r.policy, r.rate, r.upper, r.probes) for r in remote
    ]


def test_resumed_sweep_on_ray(tmp_path: Path) -> None:
    fresh = ks.sweep(MOONCAKE_SESSIONS, **SWEEP)
    out = tmp_path / "sweep"
    ks.sweep(MOONCAKE_SESSIONS, **SWEEP, out=out, executor="ray")
    (out / fresh[2].spec.label / "summary.json").unlink()
    resumed = ks.sweep(MOONCAKE_SESSIONS, **SWEEP, out=out, resume=True, executor="ray")
    for a, b in zip(fresh, resumed, strict=True):
        same(a, b)


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_while_tasks_run() -> None:
    from kvroute.distributed import completed

    def slow() -> int:
        time.sleep(30)
        return 1

    task = ray.remote(slow).remote()
    threading.Timer(1.0, _thread.interrupt_main).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        list(completed(ray, [task]))
    assert time.monotonic() - started < 10
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(task, timeout=30)


def test_task_errors_arrive_as_themselves(tmp_path: Path) -> None:
    table = pq.read_table(MOONCAKE_SESSIONS)
    a, b = shards_of(table, tmp_path / "bad", 2)
    lengths = table.column("input_length").to_pylist()[110:]
    lengths[7] = -1
    pq.write_table(table.slice(110).set_column(4, "input_length", pa.array(lengths)), b)
    with pytest.raises(InvalidArgumentError, match=rf"{b}: row 7: field input_length"):
        kvroute.ceilings(tmp_path / "bad", executor="ray")
    with pytest.raises(InvalidArgumentError, match="capacities need executor='local'"):
        kvroute.ceilings(a, executor="ray", capacities=[10])
    with pytest.raises(InvalidArgumentError, match="per_request needs executor='local'"):
        kvroute.ceilings(a, executor="ray", per_request=True)


def suite_traces(tmp: Path) -> Iterator[tuple[str, Path]]:
    """Every trace of the suite as Parquet: the bundled ones, a synthetic one, and the shared
    public traces where they are present."""
    from kvroute.trace import read_trace, write_trace

    yield "mooncake sessions", MOONCAKE_SESSIONS
    sources = [("mooncake head", BUNDLED)]
    sources += [
        (p.name, p)
        for p in sorted(SHARED.glob("*/*.jsonl"))
        if p.stat().st_size < 64 << 20 and "conversation" in p.name
    ]
    for name, src in sources:
        out = tmp / f"{name.replace(' ', '_')}.parquet"
        write_trace(read_trace(src), out)
        yield name, out


@pytest.mark.parametrize("partitions", [None, 1, 5])
def test_sharded_ceilings_on_ray_equal_local(
    tmp_path: Path, synthetic: Path, partitions: int | None
) -> None:
    cases = [*suite_traces(tmp_path), ("synthetic", synthetic)]
    for name, path in cases:
        table = pq.read_table(path)
        folder = tmp_path / f"{name.replace(' ', '_')}-shards"
        shards_of(table, folder, 3)
        for ms in (2, 8):
            want = kvroute.ceilings(path, min_sessions=ms)
            got = kvroute.ceilings(folder, min_sessions=ms, executor="ray", partitions=partitions)
            assert got == want, (name, ms)


def test_cli_on_ray(tmp_path: Path, synthetic: Path) -> None:
    folder = tmp_path / "shards"
    shards_of(pq.read_table(synthetic), folder, 4)
    out = CliRunner().invoke(main, ["ceilings", str(folder), "--executor", "ray", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == kvroute.ceilings(synthetic).to_dict()
    argv = ["simulate", str(synthetic), "--policy", "unified,sticky", "--mode", "tracets"]
    argv += ["--instances", "2", "--json"]
    local = CliRunner().invoke(main, argv)
    remote = CliRunner().invoke(main, [*argv, "--executor", "ray"])
    assert local.exit_code == remote.exit_code == 0, remote.output
    runs = [json.loads(x.output)["runs"] for x in (local, remote)]
    assert [r["summary"] for r in runs[0]] == [r["summary"] for r in runs[1]]
    bad = CliRunner().invoke(main, ["ceilings", str(folder), "--partitions", "3"])
    assert bad.exit_code == 2 and "--executor ray" in bad.output


def test_task_memory_is_a_reservation(tmp_path: Path, synthetic: Path) -> None:
    folder = tmp_path / "shards"
    shards_of(pq.read_table(synthetic), folder, 2)
    got = kvroute.ceilings(folder, executor="ray", task_memory=1 << 30)
    assert got == kvroute.ceilings(synthetic)
    # More than any node has: an error now, not a task that waits for ever.
    with pytest.raises(InvalidArgumentError, match=r"task_memory=.* more than any node"):
        kvroute.ceilings(folder, executor="ray", task_memory=1 << 39)
