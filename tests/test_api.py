"""Unit tests of kvroute's Python API: errors, input forms, the request state machine,
availability, thread safety, and small scenarios of each study policy computed by hand."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvroute
from kvroute import (
    DuplicateRequestError,
    InvalidArgumentError,
    KvrouteError,
    KvrouteTypeError,
    NoInstanceAvailableError,
    Router,
    UnknownInstanceError,
    UnknownPolicyError,
)

NO_REPORT = {"engine": None, "overloaded": False}
ZERO = {
    "num_requests": 0,
    "ongoing_tokens": 0,
    "pending_prefill_tokens": 0,
    "ongoing_decode_tokens": 0,
}


def counters(r: Router) -> list[tuple[int, int, int, int]]:
    """(num_requests, ongoing_tokens, pending_prefill_tokens, ongoing_decode_tokens) each."""
    return [
        (
            s["num_requests"],
            s["ongoing_tokens"],
            s["pending_prefill_tokens"],
            s["ongoing_decode_tokens"],
        )
        for s in r.state()
    ]


def info(r: Router, rid: Any, keys: Any, n: int, sid: Any = None) -> tuple[int, int, int, str]:
    d = r.route_info(rid, keys, n, sid)
    return d["instance"], d["hit_tokens"], d["new_prefill"], d["branch"]


# ---- module surface -------------------------------------------------------------------


def test_policies_and_properties() -> None:
    assert kvroute.policies() == [
        "lmetric",
        "load_only",
        "sticky",
        "unified",
        "leastwork",
        "unified_dynamo",
        "round_robin",
        "random",
        "power_of_two",
        "sglang_cache_aware",
        "dynamo_cost",
        "ttft",
    ]
    r = Router(3, "leastwork", block_size=16)
    assert (r.policy, r.num_instances, r.block_size, r.in_flight) == ("leastwork", 3, 16, 0)
    assert Router(2).policy == "unified"
    assert Router(2).block_size == 512
    assert int.from_bytes(b"kvroute!", "little") == kvroute.ROOT_SEED
    assert kvroute.BUILD_PROFILE in ("debug", "release")
    st = r.state()
    assert len(st) == 3
    assert st[0] == {
        **ZERO,
        "cached_blocks": 0,
        "available": True,
        "cache_view": "estimate",
        **NO_REPORT,
    }


# ---- errors ---------------------------------------------------------------------------


def test_unknown_policy() -> None:
    with pytest.raises(UnknownPolicyError, match="lru") as e:
        Router(2, "lru")
    assert isinstance(e.value, ValueError)
    assert isinstance(e.value, KvrouteError)
    assert "leastwork" in str(e.value)  # the message lists the known policies


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"cache_capacity_blocks": 0}, "cache_capacity_blocks"),
        ({"cache_capacity_blocks": -1}, "cache_capacity_blocks"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"overload_factor": float("nan")}, "overload_factor"),
        ({"hit_ratio_gate": -0.5}, "hit_ratio_gate"),
        ({"cache_threshold": -0.1}, "cache_threshold"),
        ({"balance_rel": -1.0}, "balance_rel"),
        ({"balance_abs": -1}, "balance_abs"),
        ({"overlap_weight": -2.0}, "overlap_weight"),
        ({"queued_weight": float("nan")}, "queued_weight"),
        ({"dedup_weight": 1.5}, "dedup_weight"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name) as e:
        Router(2, "unified", **kwargs)
    assert isinstance(e.value, ValueError)


def test_negative_num_instances() -> None:
    with pytest.raises(InvalidArgumentError, match="num_instances"):
        Router(-1)


def test_negative_input_length() -> None:
    r = Router(2)
    with pytest.raises(InvalidArgumentError, match="input_length") as e:
        r.route(1, [1, 2], -1)
    assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="input_length"):
        r.estimate_cache_hit(0, [1], -5)
    with pytest.raises(InvalidArgumentError, match="input_length"):
        r.estimate_cache_hits([1], -5)
    assert r.in_flight == 0
    assert counters(r) == [(0, 0, 0, 0)] * 2


@pytest.mark.parametrize("instance", [2, 3, -1, 100])
def test_unknown_instance(instance: int) -> None:
    r = Router(2)
    for call in (
        lambda: r.estimate_cache_hit(instance, [1], 4),
        lambda: r.set_available(instance, False),
        lambda: r.cached_keys(instance),
    ):
        with pytest.raises(UnknownInstanceError, match=f"unknown instance {instance}") as e:
            call()
        assert isinstance(e.value, ValueError)
        assert isinstance(e.value, IndexError)


@pytest.mark.parametrize(
    "hash_ids",
    [
        [1.0, 2.0],
        [1, 2.5],
        "abc",
        b"abc",
        ["a", "b"],
        [None],
        [True, 1],
        [2**64],
        [-(2**63) - 1],
        np.zeros((2, 2), dtype=np.uint64),
        np.zeros(3, dtype=np.float64),
        np.zeros(3, dtype=np.int32),
        np.array(["1", "2"]),
        42,
    ],
    ids=repr,
)
def test_bad_hash_ids(hash_ids: Any) -> None:
    r = Router(2)
    with pytest.raises(KvrouteTypeError) as e:
        r.route(1, hash_ids, 4)
    assert isinstance(e.value, TypeError)
    assert "hash_ids" in str(e.value)
    with pytest.raises(KvrouteTypeError):
        r.estimate_cache_hits(hash_ids, 4)
    assert r.in_flight == 0


@pytest.mark.parametrize("bad", [1.5, True, None, b"x", (1,)], ids=repr)
def test_bad_id_types(bad: Any) -> None:
    r = Router(2)
    with pytest.raises(KvrouteTypeError, match="request_id"):
        r.route(bad, [1], 4)
    with pytest.raises(KvrouteTypeError, match="request_id"):
        r.finish(bad)
    with pytest.raises(KvrouteTypeError, match="request_id"):
        r.first_token(bad)
    if bad is not None:  # session_id=None means "no session"
        with pytest.raises(KvrouteTypeError, match="session_id"):
            r.route(1, [1], 4, session_id=bad)
    assert r.in_flight == 0


def test_bad_input_length_types() -> None:
    r = Router(2)
    for bad in (4.0, True, "4"):
        with pytest.raises(KvrouteTypeError, match="input_length"):
            r.route(1, [1], bad)  # type: ignore[arg-type]


def test_duplicate_request_id() -> None:
    r = Router(2, "load_only")
    assert r.route("a", [1], 4) == 0
    before = (r.state(), r.cached_keys(0), r.cached_keys(1))
    with pytest.raises(DuplicateRequestError, match="already in flight") as e:
        r.route("a", [9, 9], 8)
    assert isinstance(e.value, ValueError)
    assert (r.state(), r.cached_keys(0), r.cached_keys(1)) == before  # nothing changed
    assert r.in_flight == 1
    # int 7 and str "7" are different ids; an id may be reused after finish.
    assert r.route(7, [1], 4) == 1
    assert r.route("7", [1], 4) == 0
    assert r.in_flight == 3
    assert r.finish("a")
    assert r.route("a", [1], 4) == 0  # loads (1, 1): first-seen
    assert r.in_flight == 3


def test_no_instance_available() -> None:
    r = Router(2, "unified")
    r.set_available(0, False)
    r.set_available(1, False)
    with pytest.raises(NoInstanceAvailableError) as e:
        r.route(1, [1], 4, "s")
    assert isinstance(e.value, RuntimeError)
    assert isinstance(e.value, KvrouteError)
    assert r.in_flight == 0
    assert r.session_affinity("s") is None
    assert counters(r) == [(0, 0, 0, 0)] * 2
    with pytest.raises(NoInstanceAvailableError):
        Router(0, "round_robin").route(1, [1], 4)


@pytest.mark.parametrize("policy", kvroute.policies())
def test_every_policy_raises_when_all_down(policy: str) -> None:
    r = Router(3, policy)
    for i in range(3):
        r.set_available(i, False)
    with pytest.raises(NoInstanceAvailableError):
        r.route(1, [1], 4)
    r.set_available(1, True)
    assert r.route(1, [1], 4) == 1


# ---- request ids and the state machine -----------------------------------------------


def test_lifecycle_and_no_op_second_calls() -> None:
    r = Router(1, "load_only", block_size=4)
    assert r.route_info(5, [1, 2, 3], 10) == {
        "instance": 0,
        "hit_tokens": 0,
        "new_prefill": 10,
        "branch": "score",
    }
    assert counters(r) == [(1, 10, 10, 0)]
    assert r.first_token(5) is True
    assert counters(r) == [(1, 10, 0, 10)]
    assert r.first_token(5) is False
    assert counters(r) == [(1, 10, 0, 10)]
    assert r.finish(5) is True
    assert counters(r) == [(0, 0, 0, 0)]
    assert r.finish(5) is False
    assert r.first_token(5) is False
    assert counters(r) == [(0, 0, 0, 0)]
    # Cache stays after finish: the next request hits two full blocks and a partial third.
    assert r.route_info("x", [1, 2, 3], 10) == {
        "instance": 0,
        "hit_tokens": 10,
        "new_prefill": 0,
        "branch": "score",
    }
    # finish before first_token undoes pending prefill (here 0) and counts.
    assert r.finish("x") is True
    assert counters(r) == [(0, 0, 0, 0)]
    assert r.finish("never-routed") is False
    assert r.first_token(12345) is False


def test_int_and_str_ids_are_distinct() -> None:
    r = Router(2, "load_only")
    assert r.route(1, [1], 4) == 0
    assert r.route("1", [2], 8) == 1
    assert r.finish("1") is True
    assert counters(r) == [(1, 4, 4, 0), (0, 0, 0, 0)]
    assert r.finish(1) is True
    assert r.in_flight == 0
    # Large ints and long strings are fine.
    assert r.route(2**63 - 1, [1], 4) == 0
    assert r.route(-(2**63), [1], 4) == 1
    assert r.route("x" * 1000, [1], 4) == 0
    assert r.in_flight == 3


def test_request_id_out_of_64_bit_range() -> None:
    with pytest.raises(InvalidArgumentError, match="request_id"):
        Router(1).route(2**63, [1], 4)


def test_estimate_reads_only() -> None:
    r = Router(2, "load_only", block_size=4, cache_capacity_blocks=3)
    r.route(1, [10, 11, 12], 12)
    assert r.cached_keys(0) == [10, 11, 12]
    assert r.estimate_cache_hit(0, [10, 11, 99], 12) == 8
    assert r.estimate_cache_hit(0, [10, 11, 12, 13], 14) == 12
    assert r.estimate_cache_hit(0, [10, 11, 12], 9) == 9  # clamped to input_length
    assert r.estimate_cache_hit(0, [99, 10], 8) == 0  # the first key is missing
    assert r.estimate_cache_hit(0, [11, 12], 8) == 8  # keys present, whatever their position
    assert r.estimate_cache_hit(1, [10], 4) == 0
    assert r.estimate_cache_hits([10, 11], 8) == [8, 0]
    assert r.estimate_cache_hits([], 8) == [0, 0]
    assert r.cached_keys(0) == [10, 11, 12]  # no recency update
    assert counters(r) == [(1, 12, 12, 0), (0, 0, 0, 0)]


def test_lru_order_and_eviction() -> None:
    r = Router(1, "load_only", block_size=4, cache_capacity_blocks=3)
    r.route(1, [1, 2, 3], 12)
    assert r.cached_keys(0) == [1, 2, 3]  # touched last to first: head most recent
    r.route(2, [7], 4)
    assert r.cached_keys(0) == [7, 1, 2]  # the prefix lost its tail first
    r.route(3, [1, 2, 3, 4, 5], 20)
    # touch 5, 4, 3, 2, 1 with capacity 3: ends with the request's first three keys.
    assert r.cached_keys(0) == [1, 2, 3]
    assert r.state()[0]["cached_blocks"] == 3


# ---- input forms -------------------------------------------------------------------------


def _replay(hash_ids_form: Any) -> list[Any]:
    """A fixed sequence through a fresh router, keys given in one form; the observations."""
    r = Router(3, "unified", block_size=4, cache_capacity_blocks=6)
    big = [2**64 - 1, 2**63, 5, 6]
    seqs = [big, [*big[:2], 8], [1, 2, 3], big, [1, 2], [9]]
    out: list[Any] = []
    for i, keys in enumerate(seqs):
        out.append(r.route_info(i, hash_ids_form(keys), 4 * len(keys) - 1, i % 2))
        out.append(r.estimate_cache_hits(hash_ids_form(keys), 4 * len(keys)))
    out.append(r.state())
    out.append([r.cached_keys(i) for i in range(3)])
    return out


def _strided(keys: list[int]) -> np.ndarray:
    wide = np.zeros(2 * len(keys), dtype=np.uint64)
    wide[::2] = keys
    view = wide[::2]
    assert not view.flags["C_CONTIGUOUS"] or len(keys) <= 1
    return view


@pytest.mark.parametrize(
    "form",
    [
        tuple,
        lambda k: np.array(k, dtype=np.uint64),
        lambda k: np.array(k, dtype=np.uint64).view(np.int64),
        _strided,
        lambda k: np.array(k, dtype=np.uint64).view(np.int64)[::-1][::-1],
        lambda k: [x - 2**64 if x >= 2**63 else x for x in k],  # negative Python ints
        lambda k: [np.uint64(x) for x in k],
    ],
    ids=["tuple", "uint64", "int64", "strided", "int64-view", "negative-ints", "np-scalars"],
)
def test_hash_id_forms_agree_with_lists(form: Any) -> None:
    assert _replay(form) == _replay(list)


def test_list_of_numpy_int64_scalars_agrees_with_int64_array() -> None:
    # docs/semantics.md §7: int64 values are taken as their two's-complement pattern. A list
    # of numpy int64 scalars (e.g. list(arr)) must mean the same keys as the array itself.
    arr = np.array([-1, 5, -(2**63)], dtype=np.int64)
    a, b = Router(1, block_size=4), Router(1, block_size=4)
    a.route(1, arr, 12)
    b.route(1, list(arr), 12)
    assert a.cached_keys(0) == b.cached_keys(0) == [2**64 - 1, 5, 2**63]


def test_numpy_array_not_modified_and_readonly_ok() -> None:
    arr = np.array([3, 4, 5], dtype=np.uint64)
    arr.flags.writeable = False
    r = Router(1, block_size=4)
    r.route(1, arr, 12)
    assert arr.tolist() == [3, 4, 5]
    assert r.cached_keys(0) == [3, 4, 5]


# ---- availability and instances -------------------------------------------------------


def test_set_available_excludes_and_keeps_in_flight() -> None:
    r = Router(3, "load_only", block_size=4)
    assert [r.route(i, [i], 4) for i in range(3)] == [0, 1, 2]
    r.set_available(0, False)
    assert r.state()[0]["available"] is False
    # 0 has the fewest requests after finishing, but it is down.
    r.finish(0)
    assert [r.route(10 + i, [9], 4) for i in range(4)] == [1, 2, 1, 2]
    # Its counters and cache stay and take first_token / finish normally.
    assert r.cached_keys(0) == [0]
    assert r.estimate_cache_hit(0, [0], 4) == 4
    r.set_available(0, True)
    assert r.route(20, [9], 4) == 0
    assert r.state()[0]["available"] is True


def test_sticky_affinity_to_down_instance_is_repicked() -> None:
    r = Router(3, "sticky")
    assert r.route(1, [1], 4, "s") == 0
    assert r.session_affinity("s") == 0
    r.set_available(0, False)
    assert info(r, 2, [1], 4, "s")[::3] == (1, "score")  # as for a new session
    assert r.session_affinity("s") == 1  # rebound
    r.set_available(0, True)
    assert info(r, 3, [1], 4, "s")[::3] == (1, "affinity")


def test_unified_affinity_to_down_instance_is_repicked() -> None:
    r = Router(2, "unified", block_size=4)
    assert r.route(1, [1, 2], 8, "s") == 0  # tie -> rr 0 -> instance 0
    r.finish(1)
    r.set_available(0, False)
    # Instance 0 would pass the gate (full hit, no load) but it is down.
    assert info(r, 2, [1, 2], 8, "s") == (1, 0, 8, "score")
    assert r.session_affinity("s") == 1


def test_add_instance() -> None:
    r = Router(0, "load_only")
    assert r.num_instances == 0
    assert r.add_instance() == 0
    assert r.add_instance() == 1
    assert r.num_instances == 2
    assert r.route(1, [1], 4) == 0
    assert r.add_instance() == 2
    assert r.state()[2] == {
        **ZERO,
        "cached_blocks": 0,
        "available": True,
        "cache_view": "estimate",
        **NO_REPORT,
    }
    assert r.route(2, [1], 4) == 1
    assert r.route(3, [1], 4) == 2


def test_session_affinity_only_for_sticky_and_the_unifieds() -> None:
    for policy in kvroute.policies():
        r = Router(2, policy)
        r.route(1, [1], 4, "s")
        r.route(2, [1], 4, 0)
        r.route(3, [1], 4)
        expect = policy in ("sticky", "unified", "unified_dynamo")
        assert (r.session_affinity("s") is not None) == expect, policy
        assert (r.session_affinity(0) is not None) == expect, policy
        assert r.session_affinity("0") is None
        assert r.session_affinity("never") is None


# ---- thread safety --------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["unified", "dynamo_cost", "sglang_cache_aware"])
def test_threads_share_one_router(policy: str) -> None:
    r = Router(8, policy, block_size=16, cache_capacity_blocks=64)
    per_thread, threads = 2000, 8
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                rid = f"t{t}-{i}" if i % 2 else t * per_thread + i
                keys = [t % 3, 100 + i % 5, 1000 + i]
                inst = r.route(rid, keys, 40, session_id=f"s{t}-{i % 4}")
                assert 0 <= inst < 8
                if i % 3:
                    assert r.first_token(rid) is True
                if i % 5 == 0:
                    r.estimate_cache_hits(keys, 40)
                    r.state()
                assert r.finish(rid) is True
                assert r.finish(rid) is False
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert errors == []
    assert r.in_flight == 0
    assert counters(r) == [(0, 0, 0, 0)] * 8
    assert sum(s["cached_blocks"] for s in r.state()) <= 8 * 64


# ---- hand-computed scenarios ---------------------------------------------------------


def test_lmetric_by_hand() -> None:
    r = Router(3, "lmetric", block_size=4)
    # All empty: score = (0 + 12) * 0 = 0 everywhere -> first-seen 0.
    assert info(r, "r1", [1, 2, 3], 12) == (0, 0, 12, "score")
    # i0: hit 12, np 4, score (12 + 4) * 1 = 16; i1, i2: (0 + 16) * 0 = 0 -> 1.
    assert info(r, "r2", [1, 2, 3, 4], 16) == (1, 0, 16, "score")
    # i0: 16; i1: hit 16, np 0, (16 + 0) * 1 = 16; i2: 0 -> 2.
    assert info(r, "r3", [1, 2, 3, 4], 16) == (2, 0, 16, "score")
    assert counters(r) == [(1, 12, 12, 0), (1, 16, 16, 0), (1, 16, 16, 0)]
    r.first_token("r1")  # i0: pending 12 -> 0, decode 0 -> 12
    assert counters(r)[0] == (1, 12, 0, 12)
    # [1, 2] of 8 tokens: i0 (0 + 0) * 1 = 0; i1 (16 + 0) * 1 = 16; i2 16 -> 0.
    assert info(r, "r4", [1, 2], 8) == (0, 8, 0, "score")
    # [5] of 4 tokens: i0 (0 + 4) * 2 = 8; i1 (16 + 4) * 1 = 20; i2 20 -> 0.
    assert info(r, "r5", [5], 4) == (0, 0, 4, "score")
    assert counters(r) == [(3, 24, 4, 12), (1, 16, 16, 0), (1, 16, 16, 0)]
    # Equal scores never round-robin in lmetric: i0 (4 + 4) * 3 = 24, i1 (16 + 4) * 1 = 20,
    # i2 20 -> first-seen 1.
    assert info(r, "r6", [6], 4) == (1, 0, 4, "score")
    for rid in ("r1", "r2", "r3", "r4", "r5", "r6"):
        assert r.finish(rid)
    assert counters(r) == [(0, 0, 0, 0)] * 3


def test_load_only_by_hand() -> None:
    r = Router(3, "load_only", block_size=4)
    # (0,0,0) -> 0; (1,0,0) -> 1; (1,1,0) -> 2; (1,1,1) -> 0.
    assert [r.route(c, [1], 4) for c in "abcd"] == [0, 1, 2, 0]
    r.finish("b")  # (2,0,1) -> 1
    assert info(r, "e", [1], 4) == (1, 4, 0, "score")
    r.finish("c")  # (2,1,0) -> 2: the cache plays no part
    assert info(r, "f", [99], 4) == (2, 0, 4, "score")


def test_sticky_by_hand() -> None:
    r = Router(3, "sticky", block_size=4)
    assert info(r, 1, [1], 4, "s") == (0, 0, 4, "score")  # new session: min load, first-seen
    assert info(r, 2, [2], 4) == (1, 0, 4, "score")  # no session: (1,0,0) -> 1
    assert info(r, 3, [1], 4, "s") == (0, 4, 0, "affinity")  # bound, although 2 is idle
    assert info(r, 4, [1], 4, "t") == (2, 0, 4, "score")  # (2,1,0) -> 2, binds t
    for i in range(5, 9):  # hard affinity: never breaks, whatever the load
        assert info(r, i, [7], 4, "s")[::3] == (0, "affinity")
    assert counters(r)[0][0] == 6
    assert r.session_affinity("s") == 0
    assert r.session_affinity("t") == 2


def test_unified_gate_by_hand() -> None:
    r = Router(3, "unified", block_size=4)
    k4, k5 = [1, 2, 3, 4], [1, 2, 3, 4, 5]
    # No affinity; every key (0, 16, 0) ties -> tied[rr=0 % 3] = 0, rr = 1.
    assert info(r, 1, k4, 16, "s") == (0, 0, 16, "tie_break")
    # Affinity 0: hit 16/20 = 0.8 > 0.5; avg = max(1/3, 1) = 1; load 1 <= 2 -> stick.
    assert info(r, 2, k5, 20, "s") == (0, 16, 4, "affinity")
    # hit 20/20; load 2 <= 2 -> stick.
    assert info(r, 3, k5, 20, "s") == (0, 20, 0, "affinity")
    # load 3 > avg 1 * 2 -> overloaded, fall back: i0 (20 + 0) * 3 = 60, key (60, 0, 3);
    # i1, i2 (0, 20, 0) tie -> tied[rr=1 % 2] = 2, rr = 2; the session moves to 2.
    assert info(r, 4, k5, 20, "s") == (2, 0, 20, "tie_break")
    assert r.session_affinity("s") == 2
    # No session: i0 (20 + 4) * 3 = 72; i1 (0 + 4) * 0 = 0; i2 (20 + 4) * 1 = 24 -> 1, no tie.
    assert info(r, 5, [9], 4) == (1, 0, 4, "score")
    # Session s at 2: hit 20/20 but now avg = max(5/3, 1) = 5/3, load 1 <= 10/3 -> stick.
    assert info(r, 6, k5, 20, "s") == (2, 20, 0, "affinity")
    assert counters(r) == [(3, 56, 20, 0), (1, 4, 4, 0), (2, 40, 20, 0)]


def test_unified_gate_is_strict_and_uses_max_len_1() -> None:
    r = Router(2, "unified", block_size=4)
    assert r.route(1, [1, 2], 8, "s") == 0  # tie -> rr 0 -> 0, rr = 1
    r.finish(1)
    # Hit ratio exactly 0.5 (4 of 8) is not > 0.5: fall back. i0: hit 4, np 4, score
    # (0 + 4) * 0 = 0, key (0, 4, 0); i1 (0, 8, 0) -> 0 by new_prefill, branch score.
    assert info(r, 2, [1, 9], 8, "s") == (0, 4, 4, "score")
    r.finish(2)
    # input_length 0: ratio = 0 / max(0, 1) = 0, never sticks; all keys (0, 0, 0) tie ->
    # tied[rr=1 % 2] = 1.
    assert info(r, 3, [1], 0, "s") == (1, 0, 0, "tie_break")
    assert r.session_affinity("s") == 1


def test_unified_round_robin_tie_counter() -> None:
    r = Router(3, "unified", block_size=4)
    # Fresh keys, finished at once: every pick is a 3-way tie; rr walks 0, 1, 2, 0.
    picks = []
    for i in range(4):
        picks.append(info(r, i, [100 + i], 4))
        r.finish(i)
    assert picks == [(j, 0, 4, "tie_break") for j in (0, 1, 2, 0)]  # rr = 4 now
    # Key 101 is on 1 only: (0, 0, 0) beats (0, 4, 0): unique, rr stays 4.
    assert info(r, 10, [101], 4) == (1, 4, 0, "score")
    r.finish(10)
    # Next tie: tied[4 % 3] = 1.
    assert info(r, 11, [555], 4) == (1, 0, 4, "tie_break")
    # A 2-way tie: i0 and i2 at (0, 4, 0), i1 (4 + 4) * 1: tied[rr=5 % 2] = [0, 2][1] = 2.
    assert info(r, 12, [556], 4) == (2, 0, 4, "tie_break")


def test_leastwork_by_hand() -> None:
    r = Router(2, "leastwork", block_size=4)
    # Both (8, 8, 0): tie -> tied[rr=0] = 0, rr = 1.
    assert info(r, 1, [1, 2], 8) == (0, 0, 8, "tie_break")
    # i0: hit 8, np 0, score 8 + 0 = 8, key (8, 0, 1); i1 (8, 8, 0): i0 wins on new_prefill.
    assert info(r, 2, [1, 2], 8) == (0, 8, 0, "score")
    r.first_token(1)  # i0 pending 8 -> 0
    # [3] of 4: i0 (0 + 4, 4, 2) vs i1 (4, 4, 0): i1 wins on num_requests.
    assert info(r, 3, [3], 4) == (1, 0, 4, "score")
    # [5] of 4: i0 (4, 4, 2), i1 (4 + 4, 4, 1) -> 0; unlike lmetric, load counts only via work.
    assert info(r, 4, [5], 4) == (0, 0, 4, "score")
    assert counters(r) == [(3, 20, 4, 8), (1, 4, 4, 0)]
    for i in (1, 2, 3, 4):
        r.finish(i)
    # Both (4, 4, 0) again: tie -> tied[rr=1 % 2] = 1.
    assert info(r, 5, [77], 4) == (1, 0, 4, "tie_break")


@pytest.mark.parametrize("queued_weight, to_the_queue", [(0.0, True), (2.0, False)])
def test_dynamo_cost_weighs_the_prefill_queued_on_an_instance(
    queued_weight: float, to_the_queue: bool
) -> None:
    # One instance decodes 4,000 tokens (its first token back), the other has 2,000 queued
    # for prefill. Without the queue term a new request goes where fewer tokens are in flight
    # (2,000 against 4,000); with the queue at weight 2 that instance costs 2,000 + 2 * 2,000.
    r = Router(2, "dynamo_cost", block_size=100, queued_weight=queued_weight)
    decoding = r.route(1, [], 4000)
    assert r.first_token(1)
    queued = r.route(2, [], 2000)
    assert queued != decoding
    assert r.route(3, [], 100) == (queued if to_the_queue else decoding)


@pytest.mark.parametrize("policy", ["dynamo_cost", "unified_dynamo"])
def test_dynamo_cost_with_dedup_weight_counts_a_block_in_flight_once(policy: str) -> None:
    # Three requests of one 8-block prefix (and a block each) in flight on instance 0, one
    # request of 9 other blocks on 1. A fourth of the prefix adds 1 block to 0's 8 + 3 and
    # prefills 1 there: cost 1 + 12; on 1 it prefills 9 beside 9 + 9: cost 27. Counting
    # each request's tokens (dedup_weight=0, the default), 0 costs 1 + 36: 1 wins.
    plain = Router(2, policy, block_size=4, overlap_weight=1.0)
    prefix = list(range(1, 9))
    plain.set_available(1, False)
    for j in range(3):
        plain.route(f"p{j}", [*prefix, 100 + j], 36)
    plain.set_available(1, True)
    plain.route("other", list(range(200, 209)), 36)
    assert plain.route("p3", [*prefix, 103], 36) == 1
    r = Router(2, policy, block_size=4, overlap_weight=1.0, dedup_weight=1.0)
    prefix = list(range(1, 9))
    r.set_available(1, False)
    for j in range(3):
        assert r.route(f"p{j}", [*prefix, 100 + j], 36) == 0
    r.set_available(1, True)
    assert r.route("other", list(range(200, 209)), 36) == 1
    assert r.route("p3", [*prefix, 103], 36) == 0
    for j in range(4):
        r.finish(f"p{j}")
    # Their blocks are no longer counted: three unrelated requests of 10 blocks on 0 are 30
    # blocks, so a fifth unrelated request costs 9 + 39 there and 9 + 18 on 1.
    r.set_available(1, False)
    for j in range(3):
        r.route(f"x{j}", list(range(400 + 10 * j, 410 + 10 * j)), 40)
    r.set_available(1, True)
    assert r.route("y", list(range(500, 509)), 36) == 1


def test_round_robin_and_seeded_policies_are_reproducible() -> None:
    r = Router(3, "round_robin")
    assert [r.route(i, [], 0) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.set_available(1, False)
    # rr = 7 over available [0, 2]: 7 % 2 = 1 -> 2, then 0, 2.
    assert [r.route(10 + i, [], 0) for i in range(3)] == [2, 0, 2]
    for policy in ("random", "power_of_two", "dynamo_cost"):
        runs = []
        for _ in range(2):
            r = Router(5, policy, seed=42, temperature=0.5)
            runs.append([r.route(i, [i % 3], 512) for i in range(50)])
        assert runs[0] == runs[1]
        assert len(set(runs[0])) > 1, policy


@pytest.mark.parametrize("policy", kvroute.policies())
def test_huge_input_lengths_never_corrupt_the_counters(policy: str) -> None:
    # input_length may be any non-negative 64-bit int. Sums of several such lengths exceed
    # 64 bits: the router must either count them exactly or refuse the request with a
    # KvrouteError and change nothing. Either way, finishing everything gets back to zero.
    r = Router(1, policy)
    big = 2**63 - 1
    routed = []
    for i in range(4):
        try:
            r.route(i, [], big)
        except KvrouteError:
            continue
        routed.append(i)
        assert r.state()[0]["num_requests"] == len(routed) == r.in_flight
        assert r.state()[0]["ongoing_tokens"] == big * len(routed)
    for i in routed:
        assert r.finish(i)
    assert counters(r) == [(0, 0, 0, 0)]


def test_shared_affinity_is_the_same_in_every_router() -> None:
    """``affinity="shared"``: a session's instance comes from what routers share (here, with
    nothing cached, a hash of the session), not from each router's own history."""
    a = kvroute.Router(3, "sticky", affinity="shared")
    b = kvroute.Router(3, "sticky", affinity="shared")
    for n in range(5):
        b.route(f"other{n}", [], 100)  # b's own counts differ
    chosen = [a.route(f"a{n}", [], 5, session_id=f"s{n}") for n in range(20)]
    assert chosen == [b.route(f"b{n}", [], 5, session_id=f"s{n}") for n in range(20)]
    assert set(chosen) == {0, 1, 2}
    with pytest.raises(kvroute.InvalidArgumentError, match="affinity"):
        kvroute.Router(3, affinity="gossip")  # type: ignore[arg-type]
