"""The ``ttft`` policy (``docs/semantics.md`` §3): the least predicted time to first token at
an engine profile's step costs, and with a target the most cache reuse that meets it; the
proxy's ``--engine-profile`` and ``--ttft-slo``; the simulator. The rule itself is held to the
plain reference by ``test_parity.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from kvroute import sim
from kvroute.errors import InvalidArgumentError
from kvroute.proxy.ttft_fit import BUDGETS, MIN_SAMPLES, PRIOR, fit_costs, terms
from kvroute.proxy.ttft_fit import COSTS as FIT_COSTS
from kvroute.sim.profile import FORMAT, VERSION
from livekit import Stack, http, small_trace, spawn
from reference import ReferenceRouter

#: Step costs that make the arithmetic easy: 10 ms a step, 1 ms a prefill token, 1 ms per
#: running request per step, 64 tokens a step.
COSTS = {
    "step_overhead_s": 0.01,
    "prefill_s_per_token": 0.001,
    "prefill_s_per_pair": 0.0,
    "decode_s_per_seq": 0.001,
    "decode_s_per_ctx_token": 0.0,
    "admit_s_per_token": 0.0,
    "request_overhead_s": 0.0,
    "max_num_batched_tokens": 64,
}
PREFIX = list(range(1, 9))  # 8 blocks of 4 tokens


def warmed(**kw: Any) -> kvroute.Router:
    """Two instances; instance 0 holds PREFIX and is busy prefilling 6,400 other tokens."""
    r = kvroute.Router(2, "ttft", block_size=4, engine_profile=COSTS, **kw)
    r.set_available(1, False)
    assert r.route("warm", PREFIX, 32) == 0
    r.finish("warm")
    assert r.route("long", list(range(100, 1700)), 6400) == 0
    r.set_available(1, True)
    return r


def test_a_prefix_goes_where_it_is_cached_while_that_is_quickest() -> None:
    r = kvroute.Router(2, "ttft", block_size=4, engine_profile=COSTS)
    r.set_available(1, False)
    r.route("warm", PREFIX, 32)
    r.finish("warm")
    r.set_available(1, True)
    # Instance 0 prefills 4 tokens (14 ms), instance 1 all 36 (46 ms).
    d = r.route_info("next", [*PREFIX, 9], 36)
    assert (d["instance"], d["branch"], d["new_prefill"]) == (0, "score", 4)


def test_a_busy_cached_engine_loses_to_an_idle_one() -> None:
    # On 0: 6,404 tokens of prefill in 101 steps at 11 ms (1.11 s) plus 6.40 s of tokens;
    # on 1: 36 tokens in one 10 ms step plus 36 ms.
    d = warmed().route_info("next", [*PREFIX, 9], 36)
    assert (d["instance"], d["branch"], d["new_prefill"]) == (1, "score", 36)


@pytest.mark.parametrize(("handling", "instance", "new"), [(0.0, 0, 4), (0.04, 1, 36)])
def test_a_busy_engine_starts_a_request_its_handling_time_later(
    handling: float, instance: int, new: int
) -> None:
    # 0 holds PREFIX and runs a decode: 4 tokens in an 11-ms step (15 ms), 55 with 40 ms of
    # busy handling; the idle 1 prefills all 36 in a 10-ms step (46 ms).
    costs = {**COSTS, "busy_handling_s": handling}
    r = kvroute.Router(2, "ttft", block_size=4, engine_profile=costs)
    r.set_available(1, False)
    r.route("warm", PREFIX, 32)
    r.finish("warm")
    r.route("running", [500], 4)
    r.first_token("running")
    r.set_available(1, True)
    d = r.route_info("next", [*PREFIX, 9], 36)
    assert (d["instance"], d["new_prefill"]) == (instance, new)


@pytest.mark.parametrize(("slo", "instance"), [(10.0, 0), (1.0, 1)])
def test_a_target_takes_the_most_reuse_that_meets_it(slo: float, instance: int) -> None:
    # 7.5 s predicted on the cached engine: within 10 s it wins on reuse; not within 1 s.
    d = warmed(ttft_slo_s=slo).route_info("next", [*PREFIX, 9], 36)
    assert (d["instance"], d["branch"]) == (instance, "within_slo")


def test_no_engine_meets_the_target_then_the_quickest() -> None:
    d = warmed(ttft_slo_s=0.001).route_info("next", [*PREFIX, 9], 36)
    assert (d["instance"], d["branch"]) == (1, "score")


def test_bad_costs_and_targets_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="decode_s_per_seq"):
        kvroute.Router(2, "ttft", engine_profile={**COSTS, "decode_s_per_seq": -1.0})
    with pytest.raises(InvalidArgumentError, match="ttft_slo_s"):
        kvroute.Router(2, "ttft", ttft_slo_s=float("nan"))
    with pytest.raises(InvalidArgumentError, match="unknown engine parameter"):
        kvroute.Router(2, "ttft", engine_profile={"step": 1.0})


def test_without_a_profile_the_proxy_fits_the_costs_to_the_first_tokens() -> None:
    with Stack(2, proxy={"policy": "ttft"}) as stack:
        fitter = stack.proxy.ttft_costs
        assert fitter is not None and stack.proxy.router.ttft_costs() == PRIOR
        n = MIN_SAMPLES + 12
        for i in range(n):
            prompt = list(range(1000 * i, 1000 * i + 64 * (1 + i % 8)))
            body = {"prompt": prompt, "max_tokens": 2, "stream": i % 7 != 0}
            status, _, _ = http("POST", stack.url + "/v1/completions", body)
            assert status == 200
        assert stack.st.run(fitter.refit)
        # One sample per streamed request (the non-streamed ones have no first token).
        assert len(fitter.samples) == sum(i % 7 != 0 for i in range(n)) >= MIN_SAMPLES
        costs = stack.proxy.router.ttft_costs()
        assert costs is not None and costs != PRIOR
        assert 0 <= costs["prefill_s_per_token"] < 1.0
        assert costs["max_num_batched_tokens"] in BUDGETS
        assert fitter.rms_s is not None and fitter.fits == 1
        _, _, metrics = http("GET", stack.url + "/metrics")
        text = metrics.decode()
        assert "kvroute_proxy_ttft_fits_total 1.0" in text
        want = costs["prefill_s_per_token"]
        assert f'kvroute_proxy_ttft_cost{{term="prefill_s_per_token"}} {want!r}' in text
        assert not stack.st.run(fitter.refit)  # nothing new came


def test_a_proxy_that_fits_nothing_keeps_no_first_tokens() -> None:
    with Stack(2) as stack:
        assert stack.proxy.ttft_costs is None
        body = {"prompt": list(range(64)), "max_tokens": 2, "stream": True}
        assert http("POST", stack.url + "/v1/completions", body)[0] == 200
        relay = stack.proxy._relay
        assert relay is not None and relay.take_first_tokens() == []


def test_the_cli_says_how_ttft_gets_its_costs() -> None:
    engine = spawn("engine", "--model", "m")
    try:
        proxy = spawn("proxy", "--backend", engine.url, "--policy", "ttft")
        proxy.stop()
    finally:
        engine.stop()
    log = proxy.log()
    said = "kvroute proxy: policy ttft without an engine profile: prefill tokens alone until 64"
    assert said in log
    assert "kvroute proxy: policy ttft (delay_weight=1.0)" in log


@settings(max_examples=50, deadline=None)
@given(
    costs=st.fixed_dictionaries(
        {k: st.floats(1e-6 if k == "step_overhead_s" else 0.0, 0.01) for k in FIT_COSTS}
    ),
    budget=st.sampled_from(BUDGETS),
    loads=st.lists(
        st.tuples(*(st.integers(0, 50_000) for _ in range(3)), st.integers(1, 9000)),
        min_size=1,
        max_size=20,
    ),
)
def test_the_fitted_terms_are_the_rules_prediction(
    costs: dict[str, float], budget: int, loads: list[tuple[int, int, int, int]]
) -> None:
    """What the fit multiplies the costs by gives the reference's ``predicted_ttft``."""
    profile = {**costs, "admit_s_per_request": 0.0, "max_num_batched_tokens": budget}
    ref = ReferenceRouter(1, "ttft", engine_profile=profile)
    samples = []
    for pending, running, decode_ctx, length in loads:
        inst = ref.instances[0]
        inst.pending_prefill_tokens, inst.num_requests = pending, running % 40
        inst.ongoing_decode_tokens = decode_ctx
        new = length // 3
        samples.append((pending, running % 40, decode_ctx, new, length, 0.0))
        want = ref.predicted_ttft(0, new, length)
        got = terms(np.array([samples[-1]], dtype=float), budget)[0] @ [costs[k] for k in FIT_COSTS]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_the_fit_finds_costs_that_reproduce_the_times() -> None:
    rng = np.random.default_rng(7)
    true = np.array([0.008, 7e-4, 2e-7, 2.7e-5, 3e-8, 1.7e-6, 0.007, 0.012])
    n = 400
    length = rng.integers(100, 8000, n)
    cols = (
        rng.integers(0, 6000, n),
        rng.integers(0, 20, n),
        rng.integers(0, 50_000, n),
        (length * rng.random(n)).astype(int),
        length,
        np.zeros(n),
    )
    samples = np.column_stack(cols).astype(float)
    samples[:, 5] = terms(samples, 2048) @ true
    costs, rms = fit_costs(samples)
    assert rms < 1e-9 and costs["max_num_batched_tokens"] == 2048
    assert [costs[k] for k in FIT_COSTS] == pytest.approx(list(true), rel=1e-6)
    with pytest.raises(ValueError, match="no first tokens"):
        fit_costs([])


def profile(path: Path) -> Path:
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "params": COSTS}))
    return path


def test_proxy_routes_with_a_profile_and_logs_its_predictions(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    engines = [spawn("engine", "--model", "m") for _ in range(2)]
    proxy = None
    try:
        backends = [a for e in engines for a in ("--backend", e.url)]
        proxy = spawn(
            "proxy", *backends, "--policy", "ttft", "--engine-profile",
            str(profile(tmp_path / "p.json")), "--decision-log", str(log),
        )  # fmt: skip
        prompt = list(range(2000))
        for turn in range(3):
            prompt = prompt + list(range(5000 + 100 * turn, 5100 + 100 * turn))
            status, _, _ = http(
                "POST", proxy.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1}
            )
            assert status == 200
    finally:
        for p in [proxy, *engines]:
            if p is not None:
                p.stop()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 3
    # Every turn after the first goes where the conversation is cached (the engines idle).
    assert len({d["instance"] for d in lines}) == 1
    for d in lines:
        predicted = [t["predicted_ttft_s"] for t in d["terms"]]
        assert predicted[d["instance"]] == min(predicted)
    assert lines[2]["estimated_hit_tokens"] > 0


def test_simulator_runs_ttft_with_the_engines_own_costs(tmp_path: Path) -> None:
    trace = small_trace(sessions=6, turns=4)
    plain = sim.simulate(trace, instances=2, policy="ttft", mode="tracets")
    slo = sim.simulate(trace, instances=2, policy="ttft", mode="tracets", ttft_slo_s=5.0)
    for res in (plain, slo):
        assert len(res.records) == trace.num_rows
    with pytest.raises(InvalidArgumentError, match="ttft_slo_s"):
        sim.simulate(trace, instances=2, policy="ttft", ttft_slo_s=-1.0)


@pytest.mark.parametrize("delay_weight, instance", [(0.0, 0), (1.0, 1)])
def test_the_delay_to_the_running_requests_can_send_a_prefix_elsewhere(
    delay_weight: float, instance: int
) -> None:
    """The prefix is cached on 0, where 10 requests decode: 14 ms to its first token there
    (one 10 ms step, 4 tokens), 46 ms on 1 (36 tokens); its 4 ms of prefill on 0 delay each
    of the 10, 40 ms in all. Costs set while routing (from ``PRIOR``) are the ones used."""
    kw: dict[str, Any] = {"block_size": 4, "engine_profile": PRIOR, "delay_weight": delay_weight}
    rust, ref = kvroute.Router(2, "ttft", **kw), ReferenceRouter(2, "ttft", **kw)
    costs = {**COSTS, "decode_s_per_seq": 0.0}
    for r in (rust, ref):
        r.set_available(1, False)
        r.route("warm", PREFIX, 32)
        r.finish("warm")
        for j in range(10):
            r.route(f"busy{j}", [50 + j], 4)
            r.first_token(f"busy{j}")
        r.set_available(1, True)
        r.set_ttft_costs(costs)
    assert rust.ttft_costs() == pytest.approx(ref.ttft_costs()) == {**PRIOR, **costs}
    got = rust.route_info("q", [*PREFIX, 9], 36)
    assert got == ref.route_info("q", [*PREFIX, 9], 36)
    assert got["instance"] == instance
    with pytest.raises(InvalidArgumentError, match="prefill_s_per_token"):
        rust.set_ttft_costs({"prefill_s_per_token": -1.0})
