"""Calibration (``kvroute.sim.calibrate``, ``kvroute.sim.profile``): the fit recovers known
cost terms, from exact points and from the emulator (whose terms are set), and profiles load
with clear errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.sim.calibrate import GRIDS, CalibrationError, Grid, _interleave, calibrate
from kvroute.sim.profile import (
    COST_TERMS,
    FORMAT,
    Point,
    fit,
    load_profile,
    make_profile,
    predict,
)

#: Terms of the size real vLLM on this CPU has (docs/simulator.md "Calibration").
TRUE = {
    "step_overhead_s": 0.005,
    "prefill_s_per_token": 2.5e-5,
    "prefill_s_per_pair": 2e-8,
    "decode_s_per_seq": 6e-4,
    "decode_s_per_ctx_token": 2e-7,
    "admit_s_per_token": 3e-6,
    "request_overhead_s": 0.004,
}


def test_fit_recovers_exact_points() -> None:
    grid = GRIDS["standard"].points()
    points = [replace(p, context=p.context + 16) for p in grid]
    exact = [replace(p, seconds=predict(TRUE, p, 2048)) for p in points]
    got = fit(exact, 2048)
    for term in COST_TERMS:
        assert got[term] == pytest.approx(TRUE[term], rel=1e-6), term


def test_fit_keeps_terms_non_negative() -> None:
    points = GRIDS["short"].points()
    # Prefills that get cheaper with length would need a negative pair cost.
    noisy = [replace(p, seconds=0.01 + 1e-6 * p.prefill_tokens) for p in points]
    got = fit(noisy, 2048)
    assert all(v >= 0 for v in got.values()), got


def test_emulator_calibration_recovers_its_terms(tmp_path: Path) -> None:
    """``kvroute calibrate`` against an emulator whose terms are set gives them back within
    5%, and writes a profile that the simulator and the emulator load."""
    from livekit import http, spawn

    sets = [f"--set={k}={v}" for k, v in TRUE.items() if k != "request_overhead_s"]
    sets += ["--set=block_size=32", "--set=kv_block_size=32", "--set=kv_capacity_tokens=262144"]
    engine = spawn("engine", "--model", "m", *sets)
    path = tmp_path / "p.json"
    args = ["calibrate", "--url", engine.url, "-o", str(path), "--held-out", "none"]
    args += ["--grid", "short"]
    args += ["--max-num-batched-tokens", "8192", "--max-num-seqs", "256"]
    try:
        done = CliRunner().invoke(main, args)
        assert done.exit_code == 0, done.output
        again = CliRunner().invoke(main, args)
    finally:
        engine.stop()
    assert again.exit_code == 2 and "--force" in again.output
    assert "step_overhead_s" in done.output and "relative error" in done.output
    doc = json.loads(path.read_text())
    got = doc["params"]
    off = {t: got[t] / TRUE[t] - 1 for t in COST_TERMS[:-1]}
    # Within the 5%. In eight runs of the short grid here the step, decode and prefill
    # terms came back within 0.9% and the admission term 1.4-3.7% high (seven runs of the
    # standard grid: within 1.2%, and -2.0% to +4.2%): it is pulled up by what the
    # emulator's own HTTP path costs per prompt token (the body sent and read before the
    # engine model sees it, about 0.06 us against the 3 us set), a cost of the engine as
    # served that the fit rightly counts.
    assert all(abs(e) <= 0.05 for e in off.values()), off
    assert got["kv_capacity_tokens"] == 262144 and got["kv_block_size"] == 32
    assert doc["fit"]["error"]["all"]["p90"] < 0.05 and "held_out" not in doc
    params = load_profile(path)
    model = kvroute.EngineModel("h20-qwen3-coder-30b-a3b", **params)
    assert model.params["step_overhead_s"] == pytest.approx(got["step_overhead_s"])
    # The emulator serves the profile, hashing prompts in its KV blocks.
    engine = spawn("engine", "--model", "m", "--engine-profile", str(path))
    try:
        metrics = http("GET", engine.url + "/metrics")[2].decode()
    finally:
        engine.stop()
    assert 'block_size="32"' in metrics and 'num_gpu_blocks="8192"' in metrics


def test_held_out_points_are_measured_between_the_fit_points() -> None:
    """The held-out grid runs in the same pass as the fit, spread over it, so that a machine
    slowing down during a run reaches both alike (it reached only the later held-out pass)."""
    fit_points = [Point("prefill", 0.0, prefill_tokens=n) for n in range(1, 9)]
    held = [Point("prefill", 0.0, prefill_tokens=100 + n) for n in range(4)]
    order = _interleave([fit_points, held])
    assert [k for k, _, _ in order] == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0]
    assert [p for k, _, p in order if k == 0] == fit_points
    assert [p for k, _, p in order if k == 1] == held
    from livekit import spawn

    engine = spawn("engine", "--model", "m", "--set=kv_capacity_tokens=65536")
    small = Grid(
        prefill=(64, 256, 512, 1024),
        cached=((512, 256),),
        batches=(1, 4),
        contexts=(64,),
        mixed=(),
        decode_tokens=8,
        repeats=1,
    )
    other = replace(small, prefill=(128, 768), cached=(), batches=(2,))
    seen: list[tuple[str, int, int]] = []
    try:
        doc = calibrate(
            [engine.url], grid=small, held_out=other, progress=lambda *a: seen.append(a)
        )
    finally:
        engine.stop()
    assert doc["held_out"]["error"]["all"]["points"] == 3
    assert doc["fit"]["error"]["all"]["points"] == 7
    stages = [stage for stage, done, _ in seen if done > 0]
    # Both stages advance together: a held-out point is measured before the fit is done.
    assert stages.index("held-out") < len(stages) - 1 - stages[::-1].index("fit")


def test_calibrate_errors() -> None:
    done = CliRunner().invoke(main, ["calibrate", "--url", "http://127.0.0.1:9", "-o", "x.json"])
    assert done.exit_code == 2 and "does not answer" in done.output
    with pytest.raises(CalibrationError, match="unknown grid 'huge'"):
        calibrate(["http://127.0.0.1:9"], grid="huge")
    with pytest.raises(CalibrationError, match="at least one"):
        calibrate([])


def test_simulate_loads_an_engine_profile(tmp_path: Path) -> None:
    points = [replace(p, seconds=predict(TRUE, p, 2048)) for p in GRIDS["short"].points()]
    scheduler = {"max_num_batched_tokens": 2048, "max_num_seqs": 8}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile(points, engine={"urls": []}, scheduler=scheduler)))
    trace = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_head1000.jsonl"
    runs = {}
    for extra in (
        [],
        ["--engine-profile", str(path)],
        ["--engine-profile", str(path), "--engine", "max_num_seqs=4"],
    ):
        args = ["simulate", str(trace), "--instances", "2", "--mode", "tracets", "--json"]
        done = CliRunner().invoke(main, [*args, *extra])
        assert done.exit_code == 0, done.output
        runs[len(extra)] = json.loads(done.output.strip().splitlines()[-1])
    # The tiny engine's terms differ from the preset's, and --engine wins over the profile.
    assert runs[0]["ttft"]["p50"] != runs[2]["ttft"]["p50"] != runs[4]["ttft"]["p50"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    done = CliRunner().invoke(main, ["simulate", str(trace), "--engine-profile", str(bad)])
    assert done.exit_code == 2 and "not JSON" in done.output


def test_profile_document_and_errors(tmp_path: Path) -> None:
    points = [replace(p, seconds=predict(TRUE, p, 2048)) for p in GRIDS["short"].points()]
    doc = make_profile(
        points, engine={"urls": []}, scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": 8}
    )
    assert doc["format"] == FORMAT and doc["fit"]["error"]["all"]["max"] < 1e-6
    good = tmp_path / "good.json"
    good.write_text(json.dumps(doc))
    assert load_profile(good)["max_num_seqs"] == 8
    cases = {
        "not json": ("{", "not JSON"),
        "wrong format": (json.dumps({"format": "x"}), "field format"),
        "unknown": (json.dumps({**doc, "params": {"warp": 1}}), "params.warp"),
        "not a number": (
            json.dumps({**doc, "params": {"max_num_seqs": "8"}}),
            "params.max_num_seqs",
        ),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(kvroute.InvalidArgumentError, match=message):
            load_profile(path)
    with pytest.raises(kvroute.InvalidArgumentError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
