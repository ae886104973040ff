"""Calibration (``kvroute.sim.calibrate``, ``kvroute.sim.profile``): the fit recovers known
cost terms, from exact points and from the emulator (whose terms are set, measured on its own
clock so that the host's load cannot move them); a fast engine is measured; points that fail
are tried again, then skipped and listed; profiles load with clear errors."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.launch import Launched
from kvroute.sim.calibrate import (
    GRIDS,
    CalibrationError,
    Grid,
    _interleave,
    calibrate,
    warnings_of,
)
from kvroute.sim.profile import (
    FORMAT,
    STEP_TERMS,
    Point,
    fit,
    load_profile,
    make_profile,
    nearest,
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
    "admit_s_per_request": 0.003,
    "request_overhead_s": 0.004,
    "busy_handling_s": 0.003,
}


def joins(step: float, requests: int) -> tuple[tuple[float, float], ...]:
    """What requests arriving at ``(k + 0.5) / requests`` of a ``step``-long decode step
    read (:class:`Point`'s ``joins``) on an engine with the :data:`TRUE` terms."""
    out = []
    for k in range(requests):
        into = (k + 0.5) / requests * step  # the step in progress started this long before
        join = math.ceil((TRUE["busy_handling_s"] + into) / step) * step - into
        late = TRUE["request_overhead_s"]
        out.append((join + late, join - step + late))
    return tuple(out)


def test_fit_recovers_exact_points() -> None:
    grid = GRIDS["standard"].points()
    points = [replace(p, context=p.context + 16) for p in grid]
    step = 0.005 + 8 * 6e-4 + 8 * 528 * 2e-7  # a decode step of the batch of 8
    points += [
        replace(p, kind="busy", joins=joins(step, 12)) for p in points if p.kind == "arrival"
    ]
    exact = [replace(p, seconds=predict(TRUE, p, 2048)) for p in points]
    got = fit(exact, 2048)
    for term in STEP_TERMS:
        assert got[term] == pytest.approx(TRUE[term], rel=1e-6), term
    # The requests bound it to a twelfth of a step around the true value.
    assert got["busy_handling_s"] == pytest.approx(TRUE["busy_handling_s"], abs=step / 24)


def test_busy_handling_is_the_value_nearest_the_requests_bounds() -> None:
    assert nearest([(0.0, 2.0), (1.0, 3.0)]) == 1.5  # the middle of the common stretch
    # 1.5 in all from anywhere in 2-2.5: the outlier moves it no further.
    assert nearest([(0.0, 1.0), (2.0, 3.0), (2.5, 4.0)]) == 2.25
    # Read 4 ms late (request_overhead_s): the joins bound it to 6-16 ms and 1-11 ms.
    steps = [replace(p, seconds=predict(TRUE, p, 2048)) for p in GRIDS["short"].points()]
    busy = Point("busy", 0.05, batch=8, joins=((0.02, 0.01), (0.015, 0.005)))
    assert fit([*steps, busy], 2048)["busy_handling_s"] == pytest.approx(0.0085)
    assert fit(steps, 2048)["busy_handling_s"] == 0.0  # no busy point: none


def test_fit_keeps_terms_non_negative() -> None:
    points = GRIDS["short"].points()
    # Prefills that get cheaper with length would need a negative pair cost.
    noisy = [replace(p, seconds=0.01 + 1e-6 * p.prefill_tokens) for p in points]
    got = fit(noisy, 2048)
    assert all(v >= 0 for v in got.values()), got


def step_points(errors: dict[str, Any]) -> int:
    """The points of a profile's error summary but the busy ones (each arrival point also
    gives a busy point)."""
    return int(errors["all"]["points"] - errors.get("busy", {"points": 0})["points"])


def _emulator(*extra: str) -> Launched:
    """An emulator whose cost terms are :data:`TRUE`, in blocks of 32 tokens."""
    from livekit import spawn

    sets = [f"--set={k}={v}" for k, v in TRUE.items()]
    sets += ["--set=block_size=32", "--set=kv_block_size=32", "--set=kv_capacity_tokens=262144"]
    return spawn("engine", "--model", "m", *sets, *extra)


def test_emulator_calibration_recovers_its_terms(tmp_path: Path) -> None:
    """``kvroute calibrate --clock engine`` against an emulator whose terms are set gives
    every one of them back, and writes a profile that the simulator and the emulator load.
    On the engine's clock the host's load cannot move what is measured: within 0.02% here,
    idle or with three processes spinning on the two cores."""
    from livekit import http, spawn

    engine = _emulator()
    path = tmp_path / "p.json"
    args = ["calibrate", "--url", engine.url, "-o", str(path), "--held-out", "none"]
    args += ["--grid", "short", "--clock", "engine"]
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
    off = {t: got[t] / TRUE[t] - 1 for t in STEP_TERMS}
    assert all(abs(e) <= 0.01 for e in off.values()), (off, doc["fit"])
    # Read off 36 requests spread over the step in progress: within a tenth of a decode step
    # (about 11 ms here).
    assert got["busy_handling_s"] == pytest.approx(TRUE["busy_handling_s"], abs=0.001)
    assert got["kv_capacity_tokens"] == 262144 and got["kv_block_size"] == 32
    # A busy point's mean is predicted with half a step's wait, off by how its six requests
    # fell over the step; the step points are exact.
    errors = doc["fit"]["error"]
    assert all(e["max"] < 0.01 for k, e in errors.items() if k not in ("all", "busy")), errors
    assert errors["busy"]["p50"] < 0.15 and "held_out" not in doc
    assert doc["engine"]["skipped"] == [] and doc["warnings"] == []
    assert doc["engine"]["clock"] == "engine"
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


def test_a_fast_engine_is_measured(tmp_path: Path) -> None:
    """An engine that decodes a token every 50 us (the fast preset at ten times real time)
    is calibrated on the client's clock: its chunks carry many tokens each, which count as
    such, and decode points whose requests did not stream long enough together are tried
    again with more tokens: the run completes, with decode points measured, and every point
    is either measured or listed as skipped. (How close the fit comes is not held here: on
    the wall clock a busy host moves it.)"""
    from livekit import spawn

    engine = spawn("engine", "--model", "m", "--preset", "fast", "--speedup", "10")
    path = tmp_path / "p.json"
    try:
        done = CliRunner().invoke(main, ["calibrate", "--url", engine.url, "-o", str(path)])
    finally:
        engine.stop()
    assert done.exit_code == 0, done.output
    doc = json.loads(path.read_text())
    points = len(GRIDS["standard"].points()) + len(GRIDS["held-out"].points())
    measured = step_points(doc["fit"]["error"]) + step_points(doc["held_out"]["error"])
    assert measured + len(doc["engine"]["skipped"]) == points, doc["engine"]["skipped"]
    assert doc["fit"]["error"]["decode"]["points"] >= 1, doc["engine"]["skipped"]
    assert all(p["context"] > 0 for p in doc["fit"]["points"] if p["kind"] == "decode")


def test_a_point_that_cannot_be_measured_is_skipped_and_listed() -> None:
    """An engine that runs one request at a time (though said to run 128) cannot decode a
    batch of two together: that point is tried with more tokens, then skipped and listed,
    and the rest of the grid is fitted, with a warning where a kind lacks points."""
    engine = _emulator("--set=max_num_seqs=1")
    grid = Grid(
        prefill=(64, 256, 512, 1024, 2048),
        cached=((1024, 32), (2048, 512)),
        batches=(1, 2),
        contexts=(64,),
        mixed=(),
        decode_tokens=8,
        repeats=1,
    )
    try:
        doc = calibrate([engine.url], grid=grid, clock="engine", max_num_batched_tokens=8192)
    finally:
        engine.stop()
    (skipped,) = doc["engine"]["skipped"]
    assert skipped.startswith("decode batch 2 at context 64: "), skipped
    assert "did not decode together" in skipped and "tries up to" in skipped, skipped
    assert doc["fit"]["error"]["decode"]["points"] == 1
    assert doc["fit"]["error"]["all"]["points"] == len(grid.points()) - 1


def test_arrival_points_hold_their_prefixes_and_count_the_cached_tokens_reported() -> None:
    """An arrival point's six requests each cache a prefix of their own before they go: on
    a small KV pool the point whose prefixes would not fit is skipped (they would evict each
    other), and a point records the cached tokens the engine reported, not those meant."""
    import asyncio

    from kvroute.sim import calibrate as cal

    small = cal.EngineInfo("http://e", "m", 8192, kv_block_size=32, num_gpu_blocks=768)
    grid = GRIDS["short"]
    fits = {
        (b, c, n, k): cal.feasible(
            Point("arrival", 0.0, prefill_tokens=n, cached_tokens=k, batch=b, context=float(c)),
            small,
            grid,
            128,
        )
        for b, c, n, k in grid.arrivals
    }
    assert fits[(8, 512, 64, 2048)] is None
    why = fits[(8, 512, 16, 4096)]
    assert why is not None and "exceed 80% of the KV pool (24576 tokens)" in why, why

    class Evicting:
        """Reports half of each prefix cached, as an engine that evicted the rest."""

        async def arrival(
            self, batch: int, context: int, new: int, cached: int, tokens: int
        ) -> tuple[float, list[float], list[tuple[float, float]], list[int]]:
            return 0.004, [0.02] * cal.ARRIVALS, [], [cached // 2] * cal.ARRIVALS

    point = Point("arrival", 0.0, prefill_tokens=64, cached_tokens=2048, batch=8, context=512.0)
    tries, measured, busy = asyncio.run(cal._decoding(Evicting(), point, 2, 24))  # type: ignore[arg-type]
    assert tries == [0.004, 0.004]
    assert (measured.prefill_tokens, measured.cached_tokens) == (64 + 1024, 1024)
    assert busy is not None and busy.kind == "busy" and busy.cached_tokens == 1024


def test_failed_points_are_tried_again_and_a_failing_engine_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A point that fails (an error answer, a lost connection) is tried again; one that
    fails every try is skipped and listed; an engine that fails points three times in a
    row is given up while the others measure the rest; a run whose every engine was given
    up is an error."""
    from kvroute.sim import calibrate as cal

    monkeypatch.setattr(cal, "RETRY_PAUSE_S", 0.0)
    real = cal._measure_one
    calls: dict[str, int] = {}

    async def flaky(c: Any, point: Point, grid: Grid, max_num_seqs: int) -> list[Point]:
        calls[c.info.url] = calls.get(c.info.url, 0) + 1
        if c.info.url == bad.url or (c.info.url == good.url and calls[good.url] == 1):
            raise CalibrationError(f"{c.info.url} answered 500: injected")
        return await real(c, point, grid, max_num_seqs)

    monkeypatch.setattr(cal, "_measure_one", flaky)
    grid = Grid(
        prefill=(64, 128, 256, 512, 1024, 2048),
        cached=((1024, 32), (2048, 512)),
        batches=(1, 2),
        contexts=(64,),
        mixed=(),
        arrivals=((2, 64, 64, 0),),
        decode_tokens=8,
        repeats=1,
    )
    good, bad = _emulator(), _emulator()
    try:
        doc = calibrate([good.url, bad.url], grid=grid, clock="engine")
        bad_tries = calls[bad.url]
        with pytest.raises(CalibrationError, match="every engine was given up"):
            calibrate([bad.url], grid=grid, clock="engine")
    finally:
        good.stop()
        bad.stop()
    skipped = doc["engine"]["skipped"]
    assert len(skipped) == cal.MAX_FAILED_IN_ROW + 1, skipped
    assert all("injected (3 tries)" in s for s in skipped[:-1]), skipped
    assert skipped[-1] == f"{bad.url}: given up after 3 failed points in a row"
    assert bad_tries == cal.MAX_FAILED_IN_ROW * cal.POINT_TRIES
    # The good engine's first try failed and its second was measured.
    points = len(grid.points())
    assert step_points(doc["fit"]["error"]) == points - cal.MAX_FAILED_IN_ROW


def test_warnings_name_the_kinds_a_profile_cannot_be_trusted_for() -> None:
    grid = GRIDS["short"]
    points = [replace(p, seconds=predict(TRUE, p, 2048)) for p in grid.points()]
    # Decode points measured 60% slower than the terms say: the fit cannot follow them all.
    held = [
        replace(p, seconds=predict(TRUE, p, 2048) * (1.6 if p.kind == "decode" else 1.0))
        for p in GRIDS["held-out"].points()
    ]
    scheduler = {"max_num_batched_tokens": 2048, "max_num_seqs": 8}
    doc = make_profile(points, engine={}, scheduler=scheduler, held_out=held)
    (warning,) = warnings_of(doc, [grid])
    assert warning.startswith("the profile is not to be trusted for decode steps")
    # 1 / 1.6 - 1 = -37.5%, rounded either way.
    assert re.search(r"held-out decode points 3[78]% off", warning), warning
    no_mixed = [p for p in points if p.kind != "mixed"]
    doc = make_profile(no_mixed, engine={}, scheduler=scheduler)
    assert warnings_of(doc, [grid]) == [
        "no mixed point was measured: the profile's mixed terms are not fitted"
    ]


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
        arrivals=((2, 64, 64, 0),),
        decode_tokens=8,
        repeats=1,
    )
    other = replace(small, prefill=(128, 768), cached=(), batches=(2,), arrivals=())
    seen: list[tuple[str, int, int]] = []
    try:
        doc = calibrate(
            [engine.url],
            grid=small,
            held_out=other,
            clock="engine",
            progress=lambda *a: seen.append(a),
        )
    finally:
        engine.stop()
    assert doc["held_out"]["error"]["all"]["points"] == 3
    assert step_points(doc["fit"]["error"]) == 8
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
