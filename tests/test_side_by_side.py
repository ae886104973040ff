"""``kvroute side-by-side`` (``kvroute.sim.side_by_side``) against emulators that serve a
profile: the replayed arms and the simulated arms run the same engine model, so what they
report must agree; the report's files, the targets and the errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.sim import side_by_side as sbs
from kvroute.sim.calibrate import GRIDS
from kvroute.sim.profile import make_profile, predict
from kvroute.trace import read_trace
from kvroute.trace_ops import shrink

REPO = Path(__file__).resolve().parents[1]
TERMS = {
    "step_overhead_s": 0.004,
    "prefill_s_per_token": 2e-5,
    "prefill_s_per_pair": 1e-8,
    "decode_s_per_seq": 5e-4,
    "decode_s_per_ctx_token": 1e-7,
    "request_overhead_s": 0.002,
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
    from livekit import spawn, stop

    prof = profile(tmp_path / "profile.json")
    trace = shrink(read_trace(REPO / "traces" / "mooncake_conversation_head1000.jsonl"), 32, 8)
    path = tmp_path / "trace.parquet"
    pq.write_table(trace.slice(0, 60), path)
    procs = [spawn("engine", "--model", "m", "--engine-profile", str(prof)) for _ in range(2)]
    out = tmp_path / "out"
    args = ["side-by-side", str(path), "--engine-profile", str(prof), "-o", str(out)]
    args += ["--time-scale", "0.2", "--policy", "unified,load_only,sticky"]
    try:
        done = CliRunner().invoke(main, [*args, *(f"--url={u}" for _, u in procs)])
    finally:
        for p, _ in procs:
            stop(p)
    assert done.exit_code == 0, done.output
    doc = json.loads((out / "side_by_side.json").read_text())
    assert [a["policy"] for a in doc["arms"]] == ["unified", "load_only", "sticky"]
    for arm in doc["arms"]:
        assert arm["errors"]["real"] == 0
        # Same engine model on both sides: the cache hits agree (the routing may differ
        # where the policies read load, which real time shifts a little).
        assert abs(arm["apc"]["points"]) <= 2.0, arm
        assert arm["apc"]["real"] > 0
        assert abs(arm["ttft_p50"]["rel"]) < 0.5, arm
        for side in ("real", "sim"):
            records = pq.read_table(out / arm["policy"] / f"{side}.parquet")
            assert records.num_rows == 60
    assert doc["targets"]["apc_within_2_points"]
    md = (out / "side_by_side.md").read_text()
    assert "| unified |" in md and "Targets:" in md
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
