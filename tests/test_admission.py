"""Admission at the router (``docs/proxy.md``, "Admission"): while every engine is at its
limit, requests wait in the router's queue and are routed when one has room, to the engine
that has it; a full queue and a wait past the timeout get 503 with ``Retry-After``; a client
that leaves while queued leaves no trace; priorities go first. The replayer's records carry
the wait, and the simulator queues the same way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from kvroute import sim
from kvroute.errors import InvalidArgumentError
from kvroute.metrics import summarize
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.replay import ReplayConfig, replay
from livekit import FakeEngine, Stack, http, small_trace, wait_until


class GatedEngine(FakeEngine):
    """A fake engine whose completions each wait for a permit (:meth:`release`, from any
    thread) and answer with their prompt; ``served`` lists the prompts it answered."""

    def __init__(self, st: ServerThread) -> None:
        self.st, self.arrived = st, 0
        self.served: list[Any] = []
        self._permits: asyncio.Semaphore | None = None

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.arrived += 1
        if self._permits is None:
            self._permits = asyncio.Semaphore(0)
        await self._permits.acquire()
        self.served.append(body["prompt"])
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": {"completion_tokens": 1}})

    def release(self) -> None:
        def give() -> None:
            if self._permits is None:
                self._permits = asyncio.Semaphore(0)
            self._permits.release()

        self.st.run(give)


def send(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A request in a thread of its own; its answer lands in the returned dict."""
    out: dict[str, Any] = {}

    def go() -> None:
        out["status"], out["headers"], out["body"] = http(
            "POST", url + "/v1/completions", {"prompt": prompt}, headers
        )

    out["thread"] = threading.Thread(target=go)
    out["thread"].start()
    return out


def queue(proxy: Proxy) -> dict[str, Any]:
    return dict(proxy._relay.stats()["queue"])


@contextlib.contextmanager
def stack(n: int, **config: Any) -> Iterator[tuple[str, Proxy, list[GatedEngine]]]:
    """``n`` gated engines behind a proxy (round robin, one request in flight per engine);
    the proxy stops first, with its connections to them."""
    with ServerThread() as st:
        engines = [GatedEngine(st) for _ in range(n)]
        urls = [st.start(e.app()) for e in engines]
        options = {"policy": "round_robin", "max_in_flight": 1, "health_interval_s": 60.0}
        proxy = Proxy(ProxyConfig(backends=urls, **{**options, **config}))
        url = st.start(proxy)
        yield url, proxy, engines
        st.stop(url)


def test_a_waiting_request_goes_to_the_engine_that_freed(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    # Without patience the first waiting takes whichever engine frees, preferred or not.
    config = {"queue_size": 8, "decision_log": str(log), "queue_patience_s": 0.0}
    with stack(2, **config) as (url, proxy, (e0, e1)):
        first = send(url, [1])
        wait_until(lambda: e0.arrived == 1, what="engine 0 busy")
        second = send(url, [2])
        wait_until(lambda: e1.arrived == 1, what="engine 1 busy")
        third = send(url, [3])
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="the third to wait")
        assert proxy.router.in_flight == 2, "not routed while it waits"
        e1.release()  # engine 1 frees first: the waiting request is bound to it then
        wait_until(lambda: e1.arrived == 2, what="the third on engine 1")
        e0.release()
        e1.release()
        for r in (first, second, third):
            r["thread"].join()
            assert r["status"] == 200
        assert (e0.served, e1.served) == ([[1]], [[2], [3]])
        q = queue(proxy)
        assert (q["waiting"], q["queued"], q["shed_full"], q["shed_timeout"]) == (0, 1, 0, 0)
        assert sum(q["wait"][0]) == 1
        text = http("GET", url + "/metrics")[2].decode()
        assert "kvroute_proxy_queue_waiting 0.0" in text
        assert 'kvroute_proxy_shed_total{reason="full"} 0.0' in text
        proxy.flush_decision_log()
        waits = [json.loads(line)["queue_wait_s"] for line in log.read_text().splitlines()]
        assert waits[:2] == [0, 0] and waits[2] > 0


PREFIX = list(range(4096))  # 8 blocks of 512 tokens


def prefix_busy_on_engine_0(url: str, e0: GatedEngine) -> dict[str, Any]:
    """PREFIX answered on engine 0, then engine 0 busy (at its cap of 1) with PREFIX + [1]:
    the request keeping it busy."""
    warm = send(url, PREFIX)
    wait_until(lambda: e0.arrived == 1, what="the prefix on engine 0")
    e0.release()
    warm["thread"].join()
    busy = send(url, [*PREFIX, 1])
    wait_until(lambda: e0.arrived == 2, what="engine 0 busy with the prefix again")
    return busy


def test_a_waiting_request_waits_for_the_engine_holding_its_prefix() -> None:
    """``leastwork``: a request whose prefix engine 0 holds prefers engine 0; while engine 0 is
    full it waits for it (engine 1 idle), and a later request that prefers engine 1 passes it;
    when engine 0 frees, the waiting one goes there."""
    with stack(2, policy="leastwork", queue_size=8, queue_patience_s=30.0) as (
        url,
        proxy,
        (e0, e1),
    ):
        busy = prefix_busy_on_engine_0(url, e0)
        cached = send(url, [*PREFIX, 2])
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="it to wait for engine 0")
        fresh = send(url, list(range(10_000, 14_096)))  # prefers the idle engine 1
        wait_until(lambda: e1.arrived == 1, what="the fresh prompt on engine 1")
        assert queue(proxy)["waiting"] == 1 and e0.arrived == 2
        e0.release()
        wait_until(lambda: e0.arrived == 3, what="the waiting one on engine 0")
        e0.release()
        e1.release()
        for r in (busy, cached, fresh):
            r["thread"].join()
            assert r["status"] == 200
        assert e0.served == [PREFIX, [*PREFIX, 1], [*PREFIX, 2]]
        assert e1.served == [list(range(10_000, 14_096))]


def test_past_its_patience_the_first_waiting_takes_any_engine_with_room() -> None:
    with stack(2, policy="leastwork", queue_size=8, queue_patience_s=0.3) as (url, proxy, (e0, e1)):
        busy = prefix_busy_on_engine_0(url, e0)
        cached = send(url, [*PREFIX, 2])
        wait_until(lambda: e1.arrived == 1, what="it to give up on engine 0")
        e0.release()
        e1.release()
        for r in (busy, cached):
            r["thread"].join()
            assert r["status"] == 200
        assert e1.served == [[*PREFIX, 2]]
        assert sum(queue(proxy)["wait"][0]) == 1


def test_an_engine_holds_a_room_for_a_sessions_next_turn() -> None:
    """With ``queue_hold_s`` the engine a session's request ended on keeps its room for the
    session's next turn: a request of another session waiting for it is passed, and goes
    when the hold runs out with no next turn."""
    a, b = {"X-Session-Id": "a"}, {"X-Session-Id": "b"}
    config = {"queue_size": 8, "queue_patience_s": 0.0, "queue_hold_s": 4.0}
    with stack(1, **config) as (url, proxy, (e0,)):
        first = send(url, [1], a)
        wait_until(lambda: e0.arrived == 1, what="a's first turn on the engine")
        other = send(url, [2], b)
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="b to wait")
        e0.release()
        first["thread"].join()
        assert queue(proxy)["waiting"] == 1, "the room is held for a"
        second = send(url, [3], a)
        wait_until(lambda: e0.arrived == 2, what="a's second turn in the held room")
        e0.release()
        second["thread"].join()
        wait_until(lambda: e0.arrived == 3, what="b once a's hold ran out")
        e0.release()
        other["thread"].join()
        assert [r["status"] for r in (first, second, other)] == [200] * 3
        assert e0.served == [[1], [3], [2]]
        assert queue(proxy)["queued"] == 1


def two_beside_and_a_third_waiting(
    url: str, proxy: Proxy, e0: GatedEngine, prompts: list[list[int]], why: str
) -> None:
    """The first two ``prompts`` on ``e0`` at once, under a token cap; the third waits while
    either is in flight (``why``), and goes once both have ended; all three answered."""
    first = send(url, prompts[0])
    wait_until(lambda: e0.arrived == 1, what="the first on the engine")
    second = send(url, prompts[1])
    wait_until(lambda: e0.arrived == 2, what="the second beside it")
    third = send(url, prompts[2])
    wait_until(lambda: queue(proxy)["waiting"] == 1, what="the third to wait")
    e0.release()
    first["thread"].join()
    assert queue(proxy)["waiting"] == 1, why
    e0.release()
    wait_until(lambda: e0.arrived == 3, what="the third once the engine is empty")
    e0.release()
    for r in (first, second, third):
        r["thread"].join()
        assert r["status"] == 200


def test_a_token_cap_admits_what_fits_beside_the_tokens_in_flight_and_held() -> None:
    """With ``max_in_flight_tokens`` (no request cap) an engine takes requests while their
    prompt tokens fit under the cap, and one alone whatever its length; a held room keeps
    its session's tokens too, so another session's request waits on an idle engine."""
    config = {"max_in_flight": None, "max_in_flight_tokens": 4, "queue_size": 8}
    with stack(1, **config, queue_patience_s=0.0) as (url, proxy, (e0,)):
        prompts = [[1, 2], [3, 4], [5, 6, 7]]  # 4 tokens beside each other
        two_beside_and_a_third_waiting(url, proxy, e0, prompts, "2 tokens in flight, 3 more")
        long = send(url, list(range(1, 11)))
        wait_until(lambda: e0.arrived == 4, what="10 tokens alone on an empty engine")
        e0.release()
        long["thread"].join()
        assert long["status"] == 200
    a, b = {"X-Session-Id": "a"}, {"X-Session-Id": "b"}
    with stack(1, **config, queue_patience_s=0.0, queue_hold_s=4.0) as (url, proxy, (e0,)):
        first = send(url, [1, 2, 3], a)
        wait_until(lambda: e0.arrived == 1, what="a's first turn")
        e0.release()
        first["thread"].join()
        other = send(url, [4, 5], b)
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="b to wait: 3 tokens held")
        assert proxy.router.in_flight == 0
        second = send(url, [1, 2, 3, 6], a)
        wait_until(lambda: e0.arrived == 2, what="a's second turn at once")
        e0.release()
        wait_until(lambda: e0.arrived == 3, what="b once a's hold ran out")
        e0.release()
        for r in (second, other):
            r["thread"].join()
            assert r["status"] == 200
        assert e0.served == [[1, 2, 3], [1, 2, 3, 6], [4, 5]]


def test_a_token_cap_does_not_count_a_prefix_in_flight_again() -> None:
    """Under ``max_in_flight_tokens`` a request whose prefix a request in flight on the
    engine holds adds only its own tokens: it goes beside it (4,097 + 1 under 5,000), where a
    prompt as long with nothing in common waits until both have ended."""
    config = {"max_in_flight": None, "max_in_flight_tokens": 5000, "queue_size": 8}
    with stack(1, **config, queue_patience_s=0.0) as (url, proxy, (e0,)):
        prompts = [[*PREFIX, 1], [*PREFIX, 2], list(range(10_000, 14_097))]
        two_beside_and_a_third_waiting(url, proxy, e0, prompts, "4,097 in flight, 4,097 more")
        assert queue(proxy)["queued"] == 1


def test_a_full_queue_and_a_long_wait_get_503_with_retry_after() -> None:
    with stack(1, queue_size=1, queue_timeout_s=0.5) as (url, proxy, (e0,)):
        busy = send(url, [1])
        wait_until(lambda: e0.arrived == 1, what="the engine busy")
        waiting = send(url, [2])
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="one waiting")
        status, headers, body = http("POST", url + "/v1/completions", {"prompt": [3]})
        assert (status, headers["Retry-After"]) == (503, "1")
        assert "queue is full" in json.loads(body)["error"]["message"]
        waiting["thread"].join()
        assert (waiting["status"], waiting["headers"]["Retry-After"]) == (503, "1")
        assert "within 0.5 s" in json.loads(waiting["body"])["error"]["message"]
        e0.release()
        busy["thread"].join()
        assert busy["status"] == 200 and e0.served == [[1]]
        q = queue(proxy)
        assert (q["waiting"], q["shed_full"], q["shed_timeout"]) == (0, 1, 1)
        wait_until(lambda: proxy.router.in_flight == 0, what="the router to drain")


def test_a_client_that_leaves_while_queued_leaves_no_trace() -> None:
    with stack(1, queue_size=4) as (url, proxy, (e0,)):
        busy = send(url, [1])
        wait_until(lambda: e0.arrived == 1, what="the engine busy")
        parts = urlsplit(url)
        body = json.dumps({"prompt": [2]}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((parts.hostname, parts.port)) as sock:
            sock.sendall(head + body)
            wait_until(lambda: queue(proxy)["waiting"] == 1, what="it to wait")
        wait_until(lambda: queue(proxy)["waiting"] == 0, what="it to leave the queue")
        e0.release()
        busy["thread"].join()
        assert e0.served == [[1]] and e0.arrived == 1, "the one that left never reached it"
        wait_until(lambda: proxy.router.in_flight == 0, what="the router to drain")
        decisions = sum(
            n for b in proxy._relay.stats()["backends"] for n in b["decisions"].values()
        )
        assert decisions == 1


def test_a_higher_priority_goes_first_and_a_bad_one_is_refused() -> None:
    with stack(1, queue_size=4) as (url, proxy, (e0,)):
        busy = send(url, [1])
        wait_until(lambda: e0.arrived == 1, what="the engine busy")
        low = send(url, [2])
        wait_until(lambda: queue(proxy)["waiting"] == 1, what="one waiting")
        high = send(url, [3], {"X-Priority": "5"})
        wait_until(lambda: queue(proxy)["waiting"] == 2, what="two waiting")
        status, _, body = http(
            "POST", url + "/v1/completions", {"prompt": [4]}, {"X-Priority": "hi"}
        )
        assert status == 400 and "X-Priority" in json.loads(body)["error"]["message"].title()
        for _ in range(3):
            e0.release()
        for r in (busy, low, high):
            r["thread"].join()
            assert r["status"] == 200
        assert e0.served == [[1], [3], [2]]


def test_without_a_queue_overloaded_engines_all_take_part() -> None:
    with stack(1) as (url, proxy, (e0,)):
        first, second = send(url, [1]), send(url, [2])
        wait_until(lambda: e0.arrived == 2, what="both on the one engine")
        e0.release()
        e0.release()
        for r in (first, second):
            r["thread"].join()
            assert r["status"] == 200
        assert queue(proxy)["queued"] == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"queue_size": -1},
        {"max_in_flight": 0},
        {"max_in_flight_tokens": 0},
        {"queue_timeout_s": 0},
        {"queue_patience_s": -1},
        {"queue_hold_s": -1},
        {"queue_hold_yield_s": -1},
    ],
)
def test_admission_options_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=next(iter(bad))):
        ProxyConfig(backends=["http://127.0.0.1:1"], **bad)


def test_with_no_engine_available_a_request_is_refused_at_once() -> None:
    with stack(1, queue_size=4, queue_timeout_s=60.0) as (url, proxy, _):
        proxy.router.set_available(0, False)
        status, _, body = http("POST", url + "/v1/completions", {"prompt": [1]}, timeout=10.0)
        assert status == 503 and "no backend" in json.loads(body)["error"]["message"]
        assert queue(proxy)["queued"] == 0


def test_replayed_records_carry_the_wait_in_the_router_queue() -> None:
    config = {"policy": "leastwork", "max_in_flight": 1, "queue_size": 64}
    with Stack(2, proxy=config) as s:
        trace = small_trace(sessions=6, turns=2)
        records = replay(trace, ReplayConfig(url=s.url, mode="tracets", time_scale=0))
        waits = records.column("router_wait").to_pylist()
        assert summarize(records)["errors"] == 0 and None not in waits
        assert min(waits) >= 0 and max(waits) > 0, "six sessions at once on two engines of one"
        s.assert_counters_zero()
    # Without a kvroute proxy in front there is nothing to read: null.
    with Stack(1) as s:
        records = replay(small_trace(sessions=1, turns=1), ReplayConfig(url=s.engine_urls[0]))
        assert records.column("router_wait").to_pylist() == [None]


def test_the_simulator_queues_as_the_proxy_does() -> None:
    trace = small_trace(sessions=8, turns=3, gap=0.001)  # eight sessions at once
    runs = sim.sweep(
        trace,
        policies=["leastwork"],
        modes=["tracets"],
        grid={"max_in_flight": [0, 1], "queue_patience_s": [0.0]},
        instances=2,
    )
    free, capped = sorted(runs, key=lambda r: r.spec.params["max_in_flight"])
    assert set(free.records.column("router_wait").to_pylist()) == {0.0}
    assert free.stats["max_waiting"] == 0 and free.stats["max_in_flight"] > 2
    waits = capped.records.column("router_wait").to_pylist()
    assert capped.stats["max_waiting"] > 0 and max(waits) > 0
    assert capped.stats["max_in_flight"] <= 2, "one per engine"
    with pytest.raises(InvalidArgumentError, match="max_in_flight"):
        sim.simulate(trace, instances=2, max_in_flight=1.5)


def test_the_simulator_holds_rooms_for_sessions_as_the_proxy_does() -> None:
    """With ``queue_hold_s`` a session's next turn goes to its engine at once, past the
    sessions waiting there, where without it it waits its turn."""
    trace = small_trace(sessions=8, turns=3, gap=0.001)
    grid = {
        "max_in_flight": [1],
        "queue_patience_s": [0.0],
        "queue_hold_s": [0.0, 1.0],
        "queue_hold_yield_s": [1e9],
    }
    runs = sim.sweep(trace, policies=["leastwork"], modes=["tracets"], grid=grid, instances=2)
    plain, held = sorted(runs, key=lambda r: r.spec.params["queue_hold_s"])

    def later_turns_waited(run: sim.SimResult) -> int:
        rows = run.records.to_pylist()
        return sum(1 for r in rows if r["turn"] > 0 and r["router_wait"] > 0)

    assert later_turns_waited(plain) > 0 and later_turns_waited(held) == 0
    assert held.stats["max_in_flight"] <= 2 and held.stats["finished"] == 24
    with pytest.raises(InvalidArgumentError, match="queue_hold_s"):
        sim.simulate(trace, instances=2, max_in_flight=1, queue_hold_s=-1.0)


def test_the_simulator_caps_prompt_tokens_in_flight_as_the_proxy_does() -> None:
    """``max_in_flight_tokens`` alone turns admission on: requests wait, and more than one
    request runs on an engine when their prompts fit."""
    trace = small_trace(sessions=8, turns=3, gap=0.001)
    longest = max(trace.column("input_length").to_pylist())
    grid = {"max_in_flight_tokens": [0, 2 * longest], "queue_patience_s": [0.0]}
    runs = sim.sweep(trace, policies=["leastwork"], modes=["tracets"], grid=grid, instances=2)
    free, capped = sorted(runs, key=lambda r: r.spec.params["max_in_flight_tokens"])
    assert free.stats["max_waiting"] == 0
    assert capped.stats["max_waiting"] > 0 and capped.stats["finished"] == 24
    rows = capped.records.to_pylist()
    for r in rows:
        at = r["send"] + r["router_wait"]
        on = [
            o["input_length"]
            for o in rows
            if o["instance"] == r["instance"] and o["send"] + o["router_wait"] <= at < o["finish"]
        ]
        assert sum(on) <= 2 * longest, (r, on)
    assert capped.stats["max_in_flight"] > 2, "more than one request per engine"
    with pytest.raises(InvalidArgumentError, match="max_in_flight_tokens"):
        sim.simulate(trace, instances=2, max_in_flight_tokens=-5)
