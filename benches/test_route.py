"""route() latency from Python on a warm cluster: kvroute against the plain reference.

Grid: unified at 8 / 64 / 256 / 1024 instances x 16 / 128 / 256 keys per request, plus
lmetric and leastwork (and kvroute fed a list instead of a numpy array) at 8 x 128. Each
timed round is ONE route() call (the next turn of a warm session, see workload.py); its
finish() and the argument building run in pytest-benchmark's setup, outside the clock.
Both implementations of a cell share a pytest-benchmark group, so the table compares them.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvroute
from workload import WarmWorkload

INSTANCES = [8, 64, 256, 1024]
KEYS = [16, 128, 256]
CELLS = [(i, k) for k in KEYS for i in INSTANCES]


def _bench(
    benchmark: Any,
    router: Any,
    impl: str,
    policy: str,
    instances: int,
    keys: int,
    key_format: Any,
    sessions: int | None = None,
) -> None:
    w = WarmWorkload(router, instances, keys, key_format=key_format, sessions=sessions)
    rounds = w.max_rounds
    benchmark.group = f"route {policy} {instances}x{keys}" + (
        f" {sessions} sessions" if sessions else ""
    )
    benchmark.extra_info.update(
        kind="route",
        impl=impl,
        policy=policy,
        instances=instances,
        keys=keys,
        key_format=key_format,
        sessions=w.sessions,
        timed="route() alone; finish() outside the clock",
        **w.spread(),
    )
    benchmark.pedantic(router.route, setup=w.setup, rounds=rounds, warmup_rounds=0, iterations=1)
    w.done()
    assert router.in_flight == 2 * instances  # only the background load is left


@pytest.mark.parametrize(("instances", "keys"), CELLS, ids=[f"{i}x{k}" for i, k in CELLS])
def test_route_unified_kvroute(benchmark: Any, instances: int, keys: int) -> None:
    router = kvroute.Router(instances, "unified")
    _bench(benchmark, router, "kvroute", "unified", instances, keys, "numpy")


@pytest.mark.parametrize(("instances", "keys"), CELLS, ids=[f"{i}x{k}" for i, k in CELLS])
def test_route_unified_reference(
    benchmark: Any, reference_router_class: type, instances: int, keys: int
) -> None:
    router = reference_router_class(instances, "unified")
    _bench(benchmark, router, "reference", "unified", instances, keys, "list")


def test_route_unified_kvroute_list_keys(benchmark: Any) -> None:
    router = kvroute.Router(8, "unified")
    _bench(benchmark, router, "kvroute[list]", "unified", 8, 128, "list")


@pytest.mark.parametrize("policy", ["lmetric", "leastwork", "unified_dynamo"])
def test_route_policy_kvroute(benchmark: Any, policy: str) -> None:
    _bench(benchmark, kvroute.Router(8, policy), "kvroute", policy, 8, 128, "numpy")


@pytest.mark.parametrize("policy", ["lmetric", "leastwork", "unified_dynamo"])
def test_route_policy_reference(benchmark: Any, reference_router_class: type, policy: str) -> None:
    router = reference_router_class(8, policy)
    _bench(benchmark, router, "reference", policy, 8, 128, "list")


@pytest.mark.parametrize("impl", ["kvroute", "reference"])
def test_route_unified_small_cache(benchmark: Any, request: Any, impl: str) -> None:
    """8 x 128 with 256 sessions instead of 1024: a 4x smaller cache model (working set)."""
    if impl == "kvroute":
        router, fmt = kvroute.Router(8, "unified"), "numpy"
    else:
        router, fmt = request.getfixturevalue("reference_router_class")(8, "unified"), "list"
    _bench(benchmark, router, impl, "unified", 8, 128, fmt, sessions=256)
