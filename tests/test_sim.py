"""The simulator's Python API and CLI: records in the one record schema, conservation,
determinism, the dispatch-mode rules, sweeps, the sustainable rate, and errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvroute
import kvroute.sim as ks
from kvroute.cli import main
from kvroute.metrics import summarize
from kvroute.records import read_records, record_schema, run_info
from kvroute.schema import trace_schema


def small_trace(sessions: int = 12, turns: int = 4, *, string_ids: bool = False) -> pa.Table:
    """Sessions of growing turns (turn t+1 extends turn t's keys), starting 0.7 s apart."""
    rows: list[dict[str, object]] = []
    for s in range(sessions):
        for t in range(turns):
            blocks = 4 + 3 * t + s % 3
            rows.append(
                {
                    "timestamp": s * 0.7 + t * 4.0,
                    "session_id": f"s{s}" if string_ids else s,
                    "turn": t,
                    "input_length": blocks * 512 - 100,
                    "output_length": 20 + 10 * (s % 5),
                    "hash_ids": [(s << 32) | b for b in range(blocks)],
                    "time_to_parent_chat": None if t == 0 else 0.5 + s % 4,
                }
            )
    rows.sort(key=lambda r: r["timestamp"])  # type: ignore[arg-type, return-value]
    schema = trace_schema(ttp=True, session_type=pa.string() if string_ids else None)
    for i, r in enumerate(rows):
        r["request_id"] = 1000 + i
    return pa.Table.from_pylist(rows, schema=schema)


@pytest.fixture(scope="module")
def trace() -> pa.Table:
    return small_trace()


def test_records_follow_the_record_schema(trace: pa.Table, tmp_path: Path) -> None:
    r = ks.simulate(trace, instances=3, policy="unified", mode="thinktime")
    want = record_schema(run={})
    assert [f.name for f in r.records.schema] == [f.name for f in want]
    assert r.records.schema.equals(want, check_metadata=False)
    info = run_info(r.records)
    assert info["policy"] == "unified" and info["mode"] == "thinktime"
    assert info["instances"] == 3 and info["source"] == "sim"
    assert info["preset"] == ks.DEFAULT_PRESET
    assert r.records.column("request_id").to_pylist() == trace.column("request_id").to_pylist()
    out = r.write(tmp_path / "run")
    back = read_records(out / "records.parquet")
    assert back.num_rows == trace.num_rows
    again = summarize(back)
    assert again["ttft"] == r.summary["ttft"] and again["apc"] == r.summary["apc"]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["summary"]["requests"] == trace.num_rows
    series = pq.read_table(out / "instances.parquet")
    assert set(series.column("instance").to_pylist()) == {0, 1, 2}
    assert series.column_names[:4] == ["time", "instance", "running", "waiting"]
    assert (
        0.0
        <= min(series.column("kv_usage").to_pylist())
        <= max(series.column("kv_usage").to_pylist())
        <= 1.0
    )


def test_string_session_ids_survive(tmp_path: Path) -> None:
    t = small_trace(5, 3, string_ids=True)
    r = ks.simulate(t, instances=2, policy="sticky", mode="tracets")
    assert r.records.schema.field("session_id").type == pa.string()
    assert sorted(set(r.records.column("session_id").to_pylist())) == [f"s{i}" for i in range(5)]


@pytest.mark.parametrize("policy", kvroute.policies())
@pytest.mark.parametrize("mode", ["tracets", "thinktime", "poisson"])
def test_every_request_finishes_once_and_the_router_drains(
    trace: pa.Table, policy: str, mode: str
) -> None:
    r = ks.simulate(
        trace, instances=4, policy=policy, mode=mode, rate=1.0 if mode == "poisson" else None
    )
    st = r.stats
    assert st["finished"] == trace.num_rows and st["rejected"] == 0
    assert st["router_in_flight"] == 0 and st["router_counters_sum"] == 0
    rec = r.records
    assert rec.column("error").null_count == rec.num_rows
    send, first, fin = (rec.column(c).to_numpy() for c in ("send", "first_token", "finish"))
    assert (send <= first).all() and (first <= fin).all()
    assert r.summary["requests"] == trace.num_rows
    assert sum(r.summary["per_instance_requests"]) == trace.num_rows


def test_runs_are_deterministic_for_a_seed(trace: pa.Table) -> None:
    a = ks.simulate(trace, policy="random", mode="poisson", rate=2.0, seed=3)
    b = ks.simulate(trace, policy="random", mode="poisson", rate=2.0, seed=3)
    c = ks.simulate(trace, policy="random", mode="poisson", rate=2.0, seed=4)
    assert a.records.equals(b.records)
    assert not a.records.column("send").equals(c.records.column("send"))


def test_chunked_keys_give_the_same_run(trace: pa.Table) -> None:
    """A trace in several (sliced) Arrow chunks runs exactly as the same trace in one."""
    cuts = [0, 5, 6, 20, trace.num_rows]
    chunked = pa.concat_tables([trace.slice(a, b - a) for a, b in itertools.pairwise(cuts)])
    assert chunked.column("hash_ids").num_chunks == 4
    one = ks.simulate(trace.combine_chunks(), instances=3, mode="tracets")
    many = ks.simulate(chunked, instances=3, mode="tracets")
    assert many.records.equals(one.records)
    assert many.summary == one.summary


def test_closed_form_matches_step_by_step(trace: pa.Table) -> None:
    a = ks.simulate(trace, policy="leastwork", mode="thinktime")
    b = ks.simulate(trace, policy="leastwork", mode="thinktime", closed_form=False)
    assert a.records.column("instance").equals(b.records.column("instance"))
    np.testing.assert_allclose(
        a.records.column("finish").to_numpy(), b.records.column("finish").to_numpy(), rtol=1e-9
    )
    assert a.stats["segments"] < b.stats["segments"]
    assert a.stats["engine_steps"] == b.stats["engine_steps"]


def _by_session(t: pa.Table, r: ks.SimResult) -> dict[object, list[dict[str, object]]]:
    rows = r.records.to_pylist()
    ts = t.column("timestamp").to_pylist()
    ttp = t.column("time_to_parent_chat").to_pylist()
    out: dict[object, list[dict[str, object]]] = {}
    for row, a, g in zip(rows, ts, ttp, strict=True):
        out.setdefault(row["session_id"], []).append({**row, "ts": a, "ttp": g})
    for v in out.values():
        v.sort(key=lambda x: x["turn"])  # type: ignore[arg-type, return-value]
    return out


@pytest.mark.parametrize("mode", ["tracets", "thinktime", "poisson"])
def test_dispatch_mode_rules(trace: pa.Table, mode: str) -> None:
    r = ks.simulate(
        trace, instances=3, policy="lmetric", mode=mode, rate=0.5 if mode == "poisson" else None
    )
    starts = []
    for turns in _by_session(trace, r).values():
        starts.append(turns[0]["send"])
        if mode != "poisson":
            assert turns[0]["send"] == pytest.approx(turns[0]["ts"])
        for prev, nxt in itertools.pairwise(turns):
            assert nxt["send"] >= prev["finish"]  # type: ignore[operator]
            want = (
                max(nxt["ts"], prev["finish"]) if mode == "tracets" else prev["finish"] + nxt["ttp"]
            )  # type: ignore[operator, type-var]
            assert nxt["send"] == pytest.approx(want)
    if mode == "poisson":
        assert len(set(starts)) == len(starts) and min(starts) > 0  # type: ignore[type-var]


def test_thinktime_needs_the_ttp_column(trace: pa.Table) -> None:
    with pytest.raises(kvroute.InvalidArgumentError, match="time_to_parent_chat"):
        ks.simulate(trace.drop_columns(["time_to_parent_chat"]), mode="thinktime")
    ks.simulate(trace.drop_columns(["time_to_parent_chat"]), mode="tracets")


def test_bad_arguments_raise_kvroute_errors(trace: pa.Table) -> None:
    with pytest.raises(kvroute.UnknownPolicyError, match="lru"):
        ks.simulate(trace, policy="lru")
    with pytest.raises(kvroute.InvalidArgumentError, match="burst"):
        ks.simulate(trace, mode="burst")
    with pytest.raises(kvroute.InvalidArgumentError, match="rate"):
        ks.simulate(trace, mode="poisson")
    with pytest.raises(kvroute.InvalidArgumentError, match="a100"):
        ks.simulate(trace, preset="a100")
    with pytest.raises(kvroute.InvalidArgumentError, match="warp"):
        ks.simulate(trace, engine={"warp": 1.0})
    with pytest.raises(kvroute.InvalidArgumentError, match="max_num_seqs"):
        ks.simulate(trace, engine={"max_num_seqs": 2.5})
    with pytest.raises(kvroute.InvalidArgumentError, match="overload_factor"):
        ks.simulate(trace, policy="unified", overload_factor=-1.0)
    with pytest.raises(kvroute.InvalidArgumentError, match="instances"):
        ks.simulate(trace, instances=0)
    with pytest.raises(kvroute.InvalidArgumentError, match="no requests"):
        ks.simulate(trace.slice(0, 0))


def test_oversized_requests_fail_cleanly(trace: pa.Table) -> None:
    r = ks.simulate(trace, instances=2, mode="tracets", engine={"kv_capacity_tokens": 4096})
    err = r.records.column("error").to_pylist()
    assert any(e and "KV capacity" in e for e in err)
    assert r.stats["finished"] + r.stats["rejected"] == trace.num_rows
    assert r.stats["router_counters_sum"] == 0
    assert r.summary["errors"] == r.stats["rejected"]


def test_sweep_grid_multiplies_only_the_policies_that_read_it(trace: pa.Table) -> None:
    rs = ks.sweep(
        trace,
        policies=["unified", "lmetric", "capped"],
        modes=["tracets", "thinktime"],
        seeds=[0, 1],
        grid={"overload_factor": [1.3, 2.0]},
        instances=3,
        cap_turns=2,
    )
    labels = [r.spec.label for r in rs]
    assert len(labels) == len(set(labels)) == (2 + 1 + 1) * 2 * 2
    assert "unified-thinktime-seed1-overload_factor=1.3" in labels
    capped = [r for r in rs if r.spec.policy == "capped"]
    assert all(r.records.num_rows == trace.num_rows // 2 for r in capped)  # 2 of 4 turns kept
    assert {r.run["policy"] for r in rs} == {"unified", "lmetric", "capped"}
    assert ks.resolve_policies("all") == kvroute.policies()
    assert ks.resolve_policies("study") == list(ks.STUDY_POLICIES)


def test_sustainable_rate_brackets_the_slo() -> None:
    t = small_trace(30, 3)
    res = ks.sustainable_rate(
        t,
        policies=["leastwork", "load_only"],
        slo_ttft_p90=1.0,
        slo_tpot_p90=0.03,
        instances=1,
        rel_tol=0.1,
    )
    for r in res:
        assert r.probes
        oks = [rate for rate, _, _, ok in r.probes if ok]
        bad = [rate for rate, _, _, ok in r.probes if not ok]
        assert r.rate == (max(oks) if oks else 0.0)
        if r.upper is not None:
            assert r.upper == min(bad) and r.upper > r.rate
            if r.rate > 0:
                assert r.upper / r.rate - 1 <= 0.1 + 1e-9


def test_presets_and_params() -> None:
    assert ks.presets() == ["h20-qwen3-coder-30b-a3b", "h200-qwen3-coder-30b-a3b"]
    p = ks.engine_params()
    assert p["max_num_batched_tokens"] == 8192 and p["kv_block_size"] == 16
    assert 250_000 < p["kv_capacity_tokens"] < 350_000
    assert ks.engine_params(max_num_seqs=8)["max_num_seqs"] == 8
    h200 = ks.engine_params("h200-qwen3-coder-30b-a3b")
    assert h200["kv_capacity_tokens"] > 2 * p["kv_capacity_tokens"]
    assert h200["prefill_s_per_token"] < p["prefill_s_per_token"] / 4


def _write(trace: pa.Table, path: Path) -> Path:
    pq.write_table(trace, path)
    return path


def test_cli_single_run_json_and_out(trace: pa.Table, tmp_path: Path) -> None:
    path = _write(trace, tmp_path / "t.parquet")
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            str(path),
            "--instances",
            "3",
            "--policy",
            "unified",
            "--mode",
            "thinktime",
            "--out",
            str(tmp_path / "o"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    for key in (
        "requests",
        "ttft",
        "tpot",
        "e2e",
        "apc",
        "interference_index",
        "hotspot_index",
        "req_bal",
        "per_instance_requests",
    ):
        assert key in doc
    assert set(doc["ttft"]) == {"p50", "p90", "p99"}
    assert doc["requests"] == trace.num_rows and len(doc["per_instance_requests"]) == 3
    for name in ("records.parquet", "instances.parquet", "summary.json"):
        assert (tmp_path / "o" / name).exists()
    assert run_info(read_records(tmp_path / "o" / "records.parquet"))["policy"] == "unified"


def test_cli_sweep_table_and_json(trace: pa.Table, tmp_path: Path) -> None:
    path = _write(trace, tmp_path / "t.parquet")
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "simulate",
            str(path),
            "--policies",
            "all",
            "--mode",
            "both",
            "--seeds",
            "2",
            "--out",
            str(tmp_path / "sw"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "round_robin" in res.output and "tracets" in res.output
    runs = json.loads((tmp_path / "sw" / "sweep.json").read_text())["runs"]
    assert len(runs) == len(kvroute.policies()) * 2 * 2
    assert (tmp_path / "sw" / runs[0]["label"] / "records.parquet").exists()
    res = runner.invoke(
        main,
        [
            "simulate",
            str(path),
            "--policy",
            "unified",
            "--param",
            "overload_factor=1.3,2.0",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)["runs"]) == 2
    res = runner.invoke(
        main,
        [
            "simulate",
            str(path),
            "--policy",
            "leastwork",
            "--sustainable-rate",
            "--slo-ttft-p90",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["policies"][0]["policy"] == "leastwork"


def test_cli_errors_are_one_line(trace: pa.Table, tmp_path: Path) -> None:
    path = _write(trace, tmp_path / "t.parquet")
    runner = CliRunner()
    for args, text in (
        (["--policy", "lru"], "unknown policy"),
        (["--mode", "poisson"], "--rate"),
        (["--engine", "max_num_seqs=abc"], "NAME=VALUE"),
        (["--engine", "warp=1"], "warp"),
    ):
        res = runner.invoke(main, ["simulate", str(path), *args])
        assert res.exit_code != 0
        assert text in res.output, res.output


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_stops_a_long_run_cleanly(tmp_path: Path) -> None:
    import gc
    import os
    import signal
    import threading
    import time

    from kvroute.synth import synthesize

    path = tmp_path / "glm.parquet"
    synthesize("agentic-glm", path, requests=60_000, seed=1)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    started = time.perf_counter()
    # A KeyboardInterrupt raised while a gc callback runs (hypothesis installs one in this
    # process) is swallowed as "unraisable": no collections while the signal is due.
    gc.disable()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ks.sweep(
                path,
                policies=["unified", "lmetric"],
                modes=["tracets"],
                seeds=[0, 1, 2],
                closed_form=False,
                instances=16,
            )
    finally:
        timer.cancel()
        gc.enable()
    assert time.perf_counter() - started < 20.0
