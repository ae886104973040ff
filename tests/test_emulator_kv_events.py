"""The emulator's KV-cache events (``kvroute engine --kv-events``, ``kvroute.emulator.kv_feed``):
its pool's stores, evictions and resets published as vLLM publishes its own, and a proxy's
events view driven by them: exact while the engine evicts, gaps replayed or degraded."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from click.testing import CliRunner

import kvroute
from kvroute.cli import main
from kvroute.emulator import Emulator
from kvroute.emulator.kv_feed import KvFeed
from kvroute.emulator.kv_publisher import KvEventPublisher, cleared, decode_batch, removed, stored
from livekit import Stack, http, spawn, wait_until

BLOCK = 16
#: A small pool (64 blocks of 16 tokens) so that the engine evicts.
SMALL = {"block_size": BLOCK, "kv_block_size": BLOCK, "kv_capacity_tokens": 1024}


def batches(pub: KvEventPublisher) -> list[list[dict[str, Any]]]:
    return [decode_batch(payload).events for _, payload in pub.buffered()]


def test_the_feed_announces_full_blocks_as_vllm_does() -> None:
    ids = list(range(1000, 1040))  # two full blocks and a partial one
    keys = kvroute.block_hashes(ids, BLOCK).tolist()
    with KvEventPublisher(replay=False) as pub:
        feed = KvFeed(pub, BLOCK)
        feed.admit("a", keys, ids)
        feed.publish([("stored", k) for k in keys])  # the pool caches the partial block too
        feed.publish([("removed", keys[2])])  # ...which is never announced
        feed.publish([("removed", keys[1]), ("stored", 12345)])  # nor is an unknown key
        feed.release("a")
        assert feed.blocks_known == 1  # key 0 is still cached
        feed.publish([("cleared", None)])
        assert feed.blocks_known == 0
        assert batches(pub) == [
            [stored(keys[:2], None, ids[:32], BLOCK)],
            [removed([keys[1]])],
            [cleared()],
        ]
        # The announced chain keys back to what kvroute keys the same tokens with.
        r = kvroute.Router(1, block_size=BLOCK, cache_view="events")
        seq, payload = pub.buffered()[0]
        r.apply_kv_events(0, seq, payload)
        assert r.estimate_cache_hits(keys, 40, view="events") == [32]


def settled(e: Emulator, stack: Stack, i: int) -> bool:
    """The proxy's view of engine ``i`` has applied every batch the engine published."""
    assert e.kv_feed is not None
    view = stack.proxy.router.kv_view(i)
    last = view["ranks"][0]["last_seq"] if view and view["ranks"] else None
    return e.kv_feed.publisher.next_seq == 0 or last == e.kv_feed.publisher.next_seq - 1


def views_complete(s: Stack) -> None:
    """Reset the engines through the proxy until its views of them are complete: as vLLM, the
    emulator says nothing before its first change, so a view starts complete at a reset's
    ``AllBlocksCleared`` (a subscriber not listening yet replays it with the next batch)."""
    router = s.proxy.router

    def complete() -> bool:
        views = [router.kv_view(i) for i in range(len(s.emulators))]
        return all(v is not None and v["uses_events"] for v in views)

    deadline = time.monotonic() + 20
    while not complete():
        assert time.monotonic() < deadline, "timed out waiting for complete views"
        assert http("POST", s.url + "/reset_prefix_cache", b"")[0] == 200
        time.sleep(0.1)


def proxy_config(**more: Any) -> dict[str, Any]:
    return {"tokenizer": "backend", "router_options": {"block_size": BLOCK}, **more}


def test_the_events_view_follows_an_evicting_emulator_exactly() -> None:
    """Prefixes shared by requests, on two engines whose pools hold fewer blocks than the
    prefixes: the estimate on the events view is the engine's cached_tokens on every request,
    while the pools evict; the estimate view's error in the same run is printed beside it."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(30_000) for _ in range(200)] for _ in range(8)]
    emulator = {"emulator": {"kv_events": True, "overrides": SMALL}}
    with Stack(2, proxy=proxy_config(policy="sglang_cache_aware"), **emulator) as s:
        views_complete(s)
        got, estimate_error = [], 0
        for _ in range(3):
            for prefix in rng.sample(prefixes, len(prefixes)):
                prompt = prefix + [rng.randrange(30_000) for _ in range(24)]
                for i, e in enumerate(s.emulators):
                    wait_until(lambda e=e, i=i: settled(e, s, i), 10, "the view to settle")
                keys = kvroute.block_hashes(prompt, BLOCK)
                views = [
                    s.proxy.router.estimate_cache_hits(keys, len(prompt), view=v)
                    for v in ("events", "estimate")
                ]
                body = {"model": s.emulators[0].config.model, "prompt": prompt, "max_tokens": 2}
                status, headers, raw = http(
                    "POST", s.url + "/v1/completions", json.dumps(body).encode()
                )
                assert status == 200, raw
                inst = int(headers["x-kvroute-instance"])
                cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
                got.append((int(headers["x-kvroute-hit-tokens"]), cached))
                assert views[0][inst] == got[-1][0]
                estimate_error += abs(views[1][inst] - cached)
        s.assert_counters_zero()
        views = [s.proxy.router.kv_view(i) for i in (0, 1)]
    assert [e for e, _ in got] == [c for _, c in got], got
    assert sum(c for _, c in got) > 0
    removed_blocks = sum(v["ranks"][0]["blocks_removed"] for v in views if v)
    assert removed_blocks > 0  # the pools evicted
    assert all(v and v["ranks"][0]["state"] == "complete" for v in views)
    print(f"\nevents view exact on {len(got)} requests; estimate view off by {estimate_error}")


def one_engine(replay: bool) -> Stack:
    emulator = {"kv_events": True, "kv_events_replay": replay, "overrides": SMALL}
    return Stack(1, proxy=proxy_config(), emulator=emulator)


def send(s: Stack, prompt: list[int]) -> None:
    body = {"model": s.emulators[0].config.model, "prompt": prompt, "max_tokens": 1}
    assert http("POST", s.url + "/v1/completions", json.dumps(body).encode())[0] == 200


@pytest.mark.parametrize("replay", [True, False])
def test_a_lost_batch_is_replayed_or_degrades_the_view(replay: bool) -> None:
    with one_engine(replay) as s:
        e = s.emulators[0]
        assert e.kv_feed is not None
        views_complete(s)
        send(s, list(range(100, 164)))
        wait_until(lambda: settled(e, s, 0))
        rank = lambda: s.proxy.router.kv_view(0)["ranks"][0]  # noqa: E731
        before = rank()
        e.kv_feed.publisher.drop_next()
        send(s, list(range(200, 264)))  # its stores are lost on the way
        send(s, list(range(300, 364)))  # the next batch shows the gap
        if replay:
            wait_until(lambda: settled(e, s, 0) and rank()["state"] == "complete")
            assert rank()["gaps"] == before["gaps"] + 1
            assert rank()["replayed_batches"] > before["replayed_batches"]
            hits = s.proxy.router.estimate_cache_hits(
                kvroute.block_hashes(list(range(200, 264)), BLOCK), 64, view="events"
            )
            assert hits == [48]  # the lost batch's blocks, back from the replay socket
        else:
            wait_until(lambda: rank()["state"] == "degraded")
            assert s.state()[0]["cache_view"] == "degraded"
            # A reset clears the engine's cache and makes the view whole again.
            assert http("POST", s.url + "/reset_prefix_cache", b"")[0] == 200
            wait_until(lambda: rank()["state"] == "complete")
            assert s.state()[0]["cache_view"] == "events"


def test_kvroute_engine_publishes_kv_events() -> None:
    engine = spawn("engine", "--kv-events", "--set=block_size=16", "--set=kv_block_size=16")
    try:
        sources = json.loads(http("GET", engine.url + "/kv_event_sources")[2])
    finally:
        engine.stop()
    assert sources["0"]["endpoint"].startswith("tcp://*:")
    assert sources["0"]["replay_endpoint"].startswith("tcp://*:")
    engine = spawn("engine", "--kv-events", "--no-kv-replay")
    try:
        sources = json.loads(http("GET", engine.url + "/kv_event_sources")[2])
    finally:
        engine.stop()
    assert sources["0"]["replay_endpoint"] is None
    engine = spawn("engine")
    try:
        assert json.loads(http("GET", engine.url + "/kv_event_sources")[2]) == {}
    finally:
        engine.stop()
    done = CliRunner().invoke(main, ["engine", "--kv-events", "--engine", "simple"])
    assert done.exit_code == 2 and "kv_events needs the 'sim' engine" in done.output


@pytest.mark.parametrize("view", ["events", "estimate"])
def test_prefixes_an_outside_client_left_are_found_on_the_events_view(view: str) -> None:
    """A client beside the proxy sends prefixes straight to engine 1; the proxy's estimate
    never saw them, its events view did: with ``sglang_cache_aware`` the events view routes
    every later request of those prefixes to engine 1 and hits them whole."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(30_000) for _ in range(160)] for _ in range(6)]
    kv = "auto" if view == "events" else "off"
    config = proxy_config(policy="sglang_cache_aware", kv_events=kv)
    emulator = {"kv_events": True, "overrides": {**SMALL, "kv_capacity_tokens": 8192}}
    with Stack(2, proxy=config, emulator=emulator) as s:
        if view == "events":
            views_complete(s)
        model = s.emulators[0].config.model
        for prefix in prefixes:
            body = {"model": model, "prompt": prefix, "max_tokens": 1}
            assert (
                http("POST", s.engine_urls[1] + "/v1/completions", json.dumps(body).encode())[0]
                == 200
            )
        if view == "events":
            wait_until(lambda: settled(s.emulators[1], s, 1), 10, "the view to settle")
        hits = []
        for prefix in prefixes:
            prompt = prefix + [rng.randrange(30_000) for _ in range(16)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            status, headers, raw = http(
                "POST", s.url + "/v1/completions", json.dumps(body).encode()
            )
            assert status == 200, raw
            cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
            hits.append((int(headers["x-kvroute-instance"]), cached))
    print(f"\n{view} view: (engine, cached tokens) {hits}")
    if view == "events":
        assert hits == [(1, 160)] * len(prefixes)
