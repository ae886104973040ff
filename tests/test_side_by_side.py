"""``kvroute side-by-side`` (``kvroute.sim.side_by_side``) against emulators that serve a
profile: both sides run and are compared; the report's files, the targets (on made-up
summaries) and the errors."""

from __future__ import annotations

import collections
import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from kvroute.cli import main
from kvroute.sim import side_by_side as sbs
from kvroute.sim.calibrate import GRIDS
from kvroute.sim.profile import make_profile, predict
from kvroute.sim.ties import shuffle_ties, tied_requests
from kvroute.trace import read_trace
from kvroute.trace_ops import shrink

REPO = Path(__file__).resolve().parents[1]
TERMS = {
    "step_overhead_s": 0.004,
    "prefill_s_per_token": 2e-5,
    "prefill_s_per_pair": 1e-8,
    "decode_s_per_seq": 5e-4,
    "decode_s_per_ctx_token": 1e-7,
    "admit_s_per_token": 2e-6,
    "admit_s_per_request": 0.001,
    "request_overhead_s": 0.002,
    "busy_handling_s": 0.0,
}


def profile(path: Path) -> Path:
    points = [replace(p, seconds=predict(TERMS, p, 2048)) for p in GRIDS["short"].points()]
    scheduler = {
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
        "kv_block_size": 32,
        "kv_capacity_tokens": 65536,
    }
    path.write_text(json.dumps(make_profile(points, engine={"urls": []}, scheduler=scheduler)))
    return path


def test_side_by_side_on_emulators(tmp_path: Path) -> None:
    from livekit import spawn

    prof = profile(tmp_path / "profile.json")
    trace = shrink(read_trace(REPO / "traces" / "mooncake_conversation_head1000.jsonl"), 32, 8)
    path = tmp_path / "trace.parquet"
    pq.write_table(trace.slice(0, 60), path)
    procs = [spawn("engine", "--model", "m", "--engine-profile", str(prof)) for _ in range(2)]
    out = tmp_path / "out"
    args = ["side-by-side", str(path), "--engine-profile", str(prof), "-o", str(out)]
    args += ["--time-scale", "0.2", "--policy", "unified,load_only,sticky"]
    try:
        done = CliRunner().invoke(main, [*args, *(f"--url={p.url}" for p in procs)])
    finally:
        for p in procs:
            p.stop()
    assert done.exit_code == 0, done.output
    doc = json.loads((out / "side_by_side.json").read_text())
    assert [a["policy"] for a in doc["arms"]] == ["unified", "load_only", "sticky"]
    # How close the real arms come to the simulated ones is not held here: the real arms run
    # on the wall clock, which a busy host moves, and the policies that read load route
    # otherwise when it does. The real engines' side by side (tests/test_real_calibration.py,
    # `make test-vllm`) and docs/simulator.md hold the simulator to them.
    for arm in doc["arms"]:
        assert arm["errors"]["real"] == 0
        assert arm["apc"]["real"] > 0 and arm["apc"]["sim"] > 0
        assert arm["ttft_p50"]["real"] > 0 and arm["ttft_p50"]["sim"] > 0
        for side in ("real", "sim"):
            records = pq.read_table(out / arm["policy"] / f"{side}.parquet")
            assert records.num_rows == 60
    assert set(doc["targets"]) >= {"apc_within_2_points", "ttft_p50_within_25pct"}
    # The trace's head has requests at the same instant: simulated in 21 orders.
    assert doc["tied_requests"] > 0
    assert all(a["apc"]["sim_tie_orders"]["orders"] == 21 for a in doc["arms"])
    md = (out / "side_by_side.md").read_text()
    assert "| unified |" in md and "Targets:" in md and "in 21 orders" in md
    again = CliRunner().invoke(main, [*args, "--url=http://127.0.0.1:9"])
    assert again.exit_code == 2 and "not empty" in again.output


def test_compare_and_its_targets() -> None:
    def summary(apc: float, ttft: float) -> dict[str, object]:
        lat = {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft}
        return {"errors": 0, "apc": apc, "ttft": lat, "tpot": lat, "e2e": lat,
                "hotspot_index": 1.0, "req_bal": 1.0}  # fmt: skip

    empty = read_trace(REPO / "traces" / "mooncake_conversation_head1000.jsonl").slice(0, 0)
    arms = [
        sbs.Arm("a", empty, empty, summary(0.50, 1.0), summary(0.51, 1.2)),
        sbs.Arm("b", empty, empty, summary(0.40, 1.0), summary(0.43, 0.9)),
    ]
    doc = sbs.compare(arms)
    assert doc["arms"][0]["apc"]["points"] == pytest.approx(1.0)
    assert doc["arms"][0]["ttft_p50"]["rel"] == pytest.approx(0.2)
    assert doc["targets"] == {
        "apc_within_2_points": False,  # b is 3 points off
        "apc_order_same": True,
        "ttft_p50_within_25pct": True,
        "ttft_p90_within_40pct": True,
    }
    arms[1] = sbs.Arm("b", empty, empty, summary(0.40, 1.0), summary(0.52, 1.0))
    flipped = sbs.compare(arms)
    assert flipped["apc_order"] == {"real": ["a", "b"], "sim": ["b", "a"], "flipped": [["a", "b"]]}
    assert not flipped["targets"]["apc_order_same"]
    assert "| a |" in sbs.markdown(flipped) and "[['a', 'b']]" in sbs.markdown(flipped)
    # Real APCs within 2 points of each other are a tie: their order may differ.
    arms[1] = sbs.Arm("b", empty, empty, summary(0.49, 1.0), summary(0.52, 1.0))
    assert sbs.compare(arms)["targets"]["apc_order_same"]
    # The range over other orders of simultaneous arrivals includes the file order's APC.
    arms[1].sim_tie_apcs = [0.47, 0.55]
    ties = sbs.compare(arms)["arms"][1]["apc"]["sim_tie_orders"]
    assert ties == {"orders": 3, "min": 0.47, "p50": 0.52, "max": 0.55, "real_outside_points": 0}
    arms[1].sim_tie_apcs = [0.53]
    doc = sbs.compare(arms)
    assert doc["arms"][1]["apc"]["sim_tie_orders"]["real_outside_points"] == pytest.approx(3.0)
    assert "sim_tie_orders" not in doc["arms"][0]["apc"]
    md = sbs.markdown(doc)
    assert "[52.0-53.0%]" in md and "for 0 of 1 policies (outside: b by 3.00 points)" in md


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=30), st.integers(0, 99))
def test_shuffle_ties_reorders_only_simultaneous_sessions(
    rows: list[tuple[int, int]], seed: int
) -> None:
    """Timestamp order is kept, one session's requests keep their order, and only requests
    at one instant change places; ``tied_requests`` counts those that share an instant."""
    trace = pa.table(
        {
            "request_id": pa.array(range(len(rows)), pa.int64()),
            "timestamp": pa.array([float(t) for t, _ in rows], pa.float64()),
            "session_id": pa.array([s for _, s in rows], pa.int64()),
        }
    )
    got = shuffle_ties(trace, seed).to_pylist()
    counts = collections.Counter(t for t, _ in rows)
    assert tied_requests(trace) == sum(c for c in counts.values() if c > 1)
    assert sorted(r["request_id"] for r in got) == list(range(len(rows)))
    assert [r["timestamp"] for r in got] == sorted(float(t) for t, _ in rows)
    by_file = sorted(range(len(rows)), key=lambda i: rows[i][0])  # stable: file order in ties
    for session in {s for _, s in rows}:
        mine = [i for i in by_file if rows[i][1] == session]
        assert [r["request_id"] for r in got if r["session_id"] == session] == mine


def test_shuffle_ties_draws_other_orders() -> None:
    trace = pa.table({"timestamp": [0.0] * 6 + [1.0], "session_id": [5, 4, 3, 2, 1, 0, 9]})
    orders = {
        tuple(shuffle_ties(trace, seed).column("session_id").to_pylist()) for seed in range(8)
    }
    assert len(orders) > 1 and all(o[-1] == 9 for o in orders)


def test_side_by_side_errors(tmp_path: Path) -> None:
    trace = REPO / "traces" / "mooncake_conversation_head1000.jsonl"
    with pytest.raises(kvroute.InvalidArgumentError, match="at least one engine"):
        sbs.side_by_side(trace, [], {})
    with pytest.raises(kvroute.InvalidArgumentError, match="mode"):
        sbs.side_by_side(trace, ["http://127.0.0.1:9"], {}, mode="poisson")


def test_a_proxy_that_cannot_start_names_why() -> None:
    """An arm's proxy runs in its own process; one that exits at start-up is an error that
    quotes its last log lines, not a hang."""
    from kvroute.replay import ReplayError

    args = ["--backend=http://127.0.0.1:9", "--policy=no-such-policy"]
    with pytest.raises(ReplayError, match=r"did not start(.|\n)*policy"), sbs.proxy_process(args):
        pass
