"""Parity of ``kvroute.Router`` (Rust) with ``reference.ReferenceRouter`` (the spec in Python).

Both routers are driven with the same random event sequences (route, first_token, finish,
set_available, add_instance, cache estimates) and must agree on every return value, every
error, every ``state()``, every ``cached_keys`` order and every session affinity, after every
step; once every request has finished, all counters must be exactly zero.

Keys are prefixes of a few random base chains plus short random tails, so caches really hit
(and, with small capacities, really evict); input lengths are mostly ``len(keys) * block_size``
minus a partial block, sometimes anything (0, or longer than the keys cover).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvroute
from reference import POLICIES, ReferenceRouter

U64 = st.integers(0, 2**64 - 1)
# int and str ids are distinct keys: 0 and "0" are two sessions.
SESSIONS: list[Any] = [None, 0, 1, "0", "s1", "s2"]
REQUEST_IDS = st.one_of(st.integers(0, 25), st.integers(0, 25).map(str))
MAX_INSTANCES = 6

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def router_config(draw: st.DrawFn, policy: str) -> tuple[int, dict[str, Any]]:
    num_instances = draw(st.integers(1, 5))
    kw: dict[str, Any] = {
        "block_size": draw(st.sampled_from([4, 16, 512, 1])),
        "cache_capacity_blocks": draw(st.sampled_from([None, None, 1, 2, 3, 5, 8, 32])),
        "seed": draw(st.one_of(st.integers(0, 3), st.integers(0, 2**63 - 1))),
        "cache_rule": draw(st.sampled_from(["trace", "vllm"])),
        "max_sessions": draw(st.sampled_from([None, None, 1, 2, 3])),
        "load_source": draw(st.sampled_from(["router", "engine"])),
    }
    if policy in ("unified", "unified_dynamo"):
        kw["overload_factor"] = draw(st.sampled_from([2.0, 0.0, 1.0, 1.5, 4.0]))
        kw["hit_ratio_gate"] = draw(st.sampled_from([0.5, 0.0, 0.25, 0.9]))
    if policy == "sglang_cache_aware":
        kw["cache_threshold"] = draw(st.sampled_from([0.5, 0.0, 0.3, 0.9]))
        kw["balance_abs"] = draw(st.sampled_from([32, 0, 1, 2]))
        kw["balance_rel"] = draw(st.sampled_from([1.1, 0.0, 1.0, 2.0]))
    if policy in ("dynamo_cost", "unified_dynamo"):
        kw["overlap_weight"] = draw(st.sampled_from([1.0, 0.0, 0.5, 2.0]))
        kw["queued_weight"] = draw(st.sampled_from([0.0, 1.0, 0.5, 8.0]))
        kw["dedup_weight"] = draw(st.sampled_from([0.0, 1.0, 0.5]))
        kw["temperature"] = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 3.0]))
    if policy == "ttft":
        kw["engine_profile"] = {
            "step_overhead_s": draw(st.sampled_from([0.0065, 1e-6, 1.0])),
            "prefill_s_per_token": draw(st.sampled_from([3.25e-5, 0.0, 0.5])),
            "prefill_s_per_pair": draw(st.sampled_from([2.69e-8, 0.0, 0.25])),
            "decode_s_per_seq": draw(st.sampled_from([7.9e-4, 0.0, 1.0])),
            "decode_s_per_ctx_token": draw(st.sampled_from([3.9e-7, 0.0, 0.1])),
            "admit_s_per_token": draw(st.sampled_from([2.55e-6, 0.0])),
            "admit_s_per_request": draw(st.sampled_from([0.004, 0.0])),
            "request_overhead_s": draw(st.sampled_from([0.0095, 0.0])),
            "busy_handling_s": draw(st.sampled_from([0.0, 0.006, 0.5])),
            "max_num_batched_tokens": draw(st.sampled_from([2048, 1, 4, 16])),
        }
        kw["ttft_slo_s"] = draw(st.sampled_from([0.0, 0.0, 0.02, 0.5, 2.0, 100.0]))
        kw["delay_weight"] = draw(st.sampled_from([0.0, 1.0, 0.5, 4.0]))
    return num_instances, kw


TAILS = st.lists(st.one_of(st.integers(0, 20), U64), max_size=3)
FORMS = st.sampled_from(["list", "list", "uint64", "int64", "strided"])
OPS = st.sampled_from(
    ["route"] * 6
    + ["first_token"] * 2
    + ["finish"] * 2
    + ["avail", "add", "est", "extend", "clear", "load", "unload", "rule"]
)
BASES = st.lists(st.lists(U64, min_size=1, max_size=10), min_size=1, max_size=3)


@st.composite
def request(draw: st.DrawFn, bases: list[list[int]], bs: int) -> tuple[list[int], int, str]:
    """Keys: a prefix of one base chain plus a short tail; length: about len(keys) * bs."""
    base = draw(st.sampled_from(bases))
    keys = base[: draw(st.integers(0, len(base)))] + draw(TAILS)
    full = len(keys) * bs
    if draw(st.integers(0, 2)):  # usually: the last block is partial (or full)
        length = draw(st.integers(max(0, full - bs + 1), full))
    else:  # sometimes anything: 0, fewer tokens than the keys cover, or more
        length = draw(st.integers(0, full + 2 * bs))
    return keys, length, draw(FORMS)


@st.composite
def scenario(draw: st.DrawFn, policy: str) -> dict[str, Any]:
    """A router configuration and a sequence of events, all drawn up front."""
    n, kw = draw(router_config(policy))
    bases = draw(BASES)
    req = request(bases, kw["block_size"])
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 40))):
        op = draw(OPS)
        if op == "route":
            rid, sid = draw(REQUEST_IDS), draw(st.sampled_from(SESSIONS))
            ops.append((op, rid, sid, *draw(req), draw(st.booleans())))
        elif op in ("first_token", "finish"):
            # ("live", i): the i-th (mod count) request in flight; ("id", x): any id at all.
            target = draw(
                st.one_of(
                    st.tuples(st.just("live"), st.integers(0, 99)),
                    st.tuples(st.just("id"), REQUEST_IDS),
                )
            )
            ops.append((op, target))
        elif op == "avail":
            ops.append((op, draw(st.integers(0, MAX_INSTANCES - 1)), draw(st.booleans())))
        elif op == "add":
            ops.append((op,))
        elif op == "extend":
            target = draw(st.tuples(st.just("live"), st.integers(0, 99)))
            ops.append((op, target, *draw(req)))
        elif op == "clear":
            ops.append((op, draw(st.integers(0, MAX_INSTANCES - 1))))
        elif op == "load":
            inst, waiting = draw(st.integers(0, 99)), draw(st.integers(0, 4))
            running = draw(st.one_of(st.integers(0, 3), st.integers(0, 3), st.just(2**64 - 1)))
            ops.append((op, inst, running, waiting, draw(st.sampled_from([0.0, 0.5, 1.0]))))
        elif op == "unload":
            ops.append((op, draw(st.integers(0, MAX_INSTANCES - 1))))
        elif op == "rule":
            waiting = draw(st.sampled_from([None, 1, 2, 3]))
            in_flight = draw(st.sampled_from([None, None, 1, 2, 4]))
            ops.append((op, waiting, draw(st.sampled_from([None, 0.5, 0.9])), in_flight))
        else:
            ops.append((op, *draw(req)))
    return {"n": n, "kw": kw, "ops": ops, "end_seed": draw(st.integers(0, 2**32))}


def hash_ids_in(form: str, keys: list[int]) -> Any:
    """The same keys in one of the accepted input forms."""
    if form == "list":
        return list(keys)
    arr = np.array(keys, dtype=np.uint64)
    if form == "int64":
        return arr.view(np.int64)
    if form == "strided":
        wide = np.zeros(2 * len(keys), dtype=np.uint64)
        wide[::2] = arr
        return wide[::2]
    return arr


def call_both(rust: Callable[[], Any], ref: Callable[[], Any]) -> Any:
    """Call both; they must return equal values or raise the same kvroute error class."""
    try:
        expected = ref()
    except kvroute.KvrouteError as e:
        with pytest.raises(type(e)) as info:
            rust()
        assert type(info.value) is type(e)
        return e
    got = rust()
    assert got == expected
    assert type(got) is type(expected)
    return got


def assert_same_state(rust: kvroute.Router, ref: ReferenceRouter) -> None:
    assert rust.state() == ref.state()
    assert rust.has_room() == ref.has_room()
    assert rust.num_instances == ref.num_instances
    assert rust.in_flight == ref.in_flight
    assert rust.num_sessions == ref.num_sessions
    for i in range(ref.num_instances):
        assert rust.cached_keys(i) == ref.cached_keys(i), f"cache of instance {i}"
    for s in SESSIONS:
        if s is not None:
            assert rust.session_affinity(s) == ref.session_affinity(s), f"session {s!r}"


def run_step(rust: kvroute.Router, ref: ReferenceRouter, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "route":
        _, rid, sid, keys, length, form, info = op
        hash_ids = hash_ids_in(form, keys)
        if info:
            got = call_both(
                lambda: rust.route_info(rid, hash_ids, length, session_id=sid),
                lambda: ref.route_info(rid, keys, length, session_id=sid),
            )
            if isinstance(got, dict):
                event(f"branch={got['branch']}")
                event(f"hit={'yes' if got['hit_tokens'] else 'no'}")
        else:
            got = call_both(
                lambda: rust.route(rid, hash_ids, length, sid),
                lambda: ref.route(rid, keys, length, sid),
            )
        if isinstance(got, Exception):
            event(f"route raised {type(got).__name__}")
    elif kind in ("first_token", "finish"):
        how, x = op[1]
        live = list(ref.requests)
        rid = live[x % len(live)] if how == "live" and live else x
        call_both(lambda: getattr(rust, kind)(rid), lambda: getattr(ref, kind)(rid))
    elif kind == "avail":
        inst, flag = op[1] % ref.num_instances, op[2]
        call_both(lambda: rust.set_available(inst, flag), lambda: ref.set_available(inst, flag))
    elif kind == "add":
        if ref.num_instances < MAX_INSTANCES:
            call_both(rust.add_instance, ref.add_instance)
    elif kind == "extend":
        (_, x), keys, _, form = op[1:]
        live = list(ref.requests)
        rid = live[x % len(live)] if live else x
        hash_ids = hash_ids_in(form, keys)
        call_both(lambda: rust.extend(rid, hash_ids), lambda: ref.extend(rid, keys))
    elif kind == "clear":
        inst = op[1] % ref.num_instances
        call_both(lambda: rust.clear_cache(inst), lambda: ref.clear_cache(inst))
    elif kind == "load":
        inst, running, waiting, usage = op[1] % ref.num_instances, *op[2:]
        call_both(
            lambda: rust.set_engine_load(inst, running, waiting, usage),
            lambda: ref.set_engine_load(inst, running, waiting, usage),
        )
    elif kind == "unload":
        inst = op[1] % ref.num_instances
        call_both(lambda: rust.clear_engine_load(inst), lambda: ref.clear_engine_load(inst))
    elif kind == "rule":
        call_both(
            lambda: rust.set_overload_rule(op[1], op[2], op[3]),
            lambda: ref.set_overload_rule(op[1], op[2], op[3]),
        )
    else:
        _, keys, length, form = op
        hash_ids = hash_ids_in(form, keys)
        call_both(
            lambda: rust.estimate_cache_hits(hash_ids, length),
            lambda: ref.estimate_cache_hits(keys, length),
        )
        for i in range(ref.num_instances):
            assert rust.estimate_cache_hit(i, hash_ids, length) == ref.estimate_cache_hit(
                i, keys, length
            )


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(data=st.data())
def test_router_matches_reference(policy: str, data: st.DataObject) -> None:
    sc = data.draw(scenario(policy), label="scenario")
    rust = kvroute.Router(sc["n"], policy, **sc["kw"])
    ref = ReferenceRouter(sc["n"], policy, **sc["kw"])
    assert rust.policy == policy and rust.block_size == sc["kw"]["block_size"]
    assert_same_state(rust, ref)
    for op in sc["ops"]:
        run_step(rust, ref, op)
        assert_same_state(rust, ref)

    # Finish everything (some after their first token): every counter back to exactly zero.
    rnd = random.Random(sc["end_seed"])
    remaining = list(ref.requests)
    rnd.shuffle(remaining)
    for rid in remaining:
        if rnd.random() < 0.5:
            assert rust.first_token(rid) == ref.first_token(rid)
        assert rust.finish(rid) is True and ref.finish(rid) is True
        assert_same_state(rust, ref)
    assert rust.in_flight == 0
    for s in rust.state():
        assert s["num_requests"] == 0
        assert s["ongoing_tokens"] == 0
        assert s["pending_prefill_tokens"] == 0
        assert s["ongoing_decode_tokens"] == 0


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=30, deadline=None, derandomize=False)
@given(
    n=st.integers(1, 6),
    seed=st.integers(0, 2**63 - 1),
    rounds=st.integers(1, 60),
    bs=st.sampled_from([4, 512]),
)
def test_fresh_traffic_without_finishes(
    policy: str, n: int, seed: int, rounds: int, bs: int
) -> None:
    """A burst of distinct one-block requests, none finished: exercises ties and the counters."""
    rust = kvroute.Router(n, policy, block_size=bs, seed=seed)
    ref = ReferenceRouter(n, policy, block_size=bs, seed=seed)
    for r in range(rounds):
        keys = [r % 7]
        sid = r % 3 if r % 2 else None
        assert rust.route_info(r, keys, bs - 1, sid) == ref.route_info(r, keys, bs - 1, sid)
        assert rust.state() == ref.state()


def test_reference_has_the_router_api() -> None:
    public = {name for name in dir(kvroute.Router) if not name.startswith("_")}
    assert public == {
        "route",
        "route_info",
        "first_token",
        "finish",
        "estimate_cache_hit",
        "estimate_cache_hits",
        "state",
        "set_available",
        "add_instance",
        "session_affinity",
        "cached_keys",
        "cache_rule",
        "clear_cache",
        "extend",
        "policy",
        "num_instances",
        "num_sessions",
        "block_size",
        "in_flight",
        # The events view and per-instance bounds (tests/test_kv_index.py, test_kv_events.py).
        "set_cache_capacity",
        "apply_kv_events",
        "kv_resync",
        "kv_reset",
        "kv_view",
        "kv_memory_bytes",
        "cache_view",
        # Engine reports and overload (tests/test_engine_load.py).
        "set_engine_load",
        "clear_engine_load",
        "set_overload_rule",
        "has_room",
        # ttft's costs refitted while routing (tests/test_ttft.py).
        "set_ttft_costs",
        "ttft_costs",
    }
    ref = ReferenceRouter(2, "lmetric", block_size=16)
    # The events view has its own reference (tests/reference_kv.py, tests/test_kv_index.py).
    events_view = {"apply_kv_events", "kv_resync", "kv_reset", "kv_view", "kv_memory_bytes"}
    for name in public - events_view - {"set_cache_capacity", "cache_view"}:
        assert hasattr(ref, name), name
    assert sorted(POLICIES) == sorted(kvroute.policies())
