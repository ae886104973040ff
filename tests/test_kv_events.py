"""The KV-event subscriber against vLLM's publisher protocol
(``kvroute.emulator.kv_publisher``): batches applied in order in both encodings, gaps
repaired from the replay socket or turned into a degraded view, restarts, undecodable
batches, and ``/kv_event_sources`` answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

import kvroute
from kvroute.emulator.kv_publisher import KvEventPublisher, cleared, encode_batch, removed, stored
from kvroute.errors import InvalidArgumentError, KvrouteTypeError
from kvroute.kv_events import Source, SourceStats, Subscriber, Tally, event_sources

BS = 4
TOKENS = list(range(100, 112))  # three blocks


def keys(n: int) -> list[int]:
    return [int(k) for k in kvroute.block_hashes(TOKENS[:n], BS)]


def router(n: int = 1) -> kvroute.Router:
    return kvroute.Router(n, "lmetric", block_size=BS, cache_rule="vllm", cache_view="events")


def hits(r: kvroute.Router, n: int = 12) -> list[int]:
    return r.estimate_cache_hits([*keys(n), 1], n + 1)


def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.fixture
def pub() -> Iterator[KvEventPublisher]:
    with KvEventPublisher() as p:
        yield p


def subscribe(r: kvroute.Router, pub: KvEventPublisher, nth: int = 1) -> Subscriber:
    """A subscriber of ``r`` to ``pub`` (its ``nth`` subscriber), once subscribed."""
    sub = Subscriber(r, replay_timeout_s=30.0)  # a replay is answered in milliseconds
    sub.watch(0, [Source(0, pub.endpoint, pub.replay_endpoint)])
    assert pub.wait_for_subscribers(nth, timeout=30.0)
    return sub


def rank0(r: kvroute.Router) -> dict[str, Any]:
    """Instance 0's rank 0 view ({} before its first batch)."""
    view = r.kv_view(0)
    assert view is not None
    return dict(view["ranks"][0]) if view["ranks"] else {}


def state(r: kvroute.Router) -> str | None:
    return rank0(r).get("state")


def chain(pub: KvEventPublisher) -> None:
    """Three blocks of TOKENS stored, in two batches (seq 0 and 1)."""
    pub.publish([stored([1, 2], None, TOKENS[:8], BS)])
    pub.publish([stored([3], 2, TOKENS[8:], BS)])


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_batches_are_applied_in_order(pub: KvEventPublisher, encoding: str) -> None:
    pub.encoding = encoding  # type: ignore[assignment]
    r = router(2)
    with subscribe(r, pub):
        chain(pub)
        until(lambda: hits(r) == [12, 0])
        pub.publish([removed([3])])
        until(lambda: hits(r) == [8, 0])
        pub.publish([cleared()])
        until(lambda: hits(r) == [0, 0])
    view = r.kv_view(0)
    assert view is not None and view["uses_events"] and view["ranks"][0]["last_seq"] == 3
    assert [s["cache_view"] for s in r.state()] == ["events", "estimate"]


def test_a_gap_is_repaired_from_the_replay_socket(pub: KvEventPublisher) -> None:
    r = router()
    with subscribe(r, pub) as sub:
        pub.publish([])
        pub.drop_next(2)
        chain(pub)  # lost on PUB, kept for replay
        pub.publish([removed([1])])
        until(lambda: rank0(r).get("last_seq") == 3)
        assert pub.replay_requests == [1]
        assert hits(r) == [0]  # block 1 removed: nothing from the start
        stats = sub.stats()[(0, 0)]
        assert (stats.replays, stats.replay_failures) == (1, 0)
    rank = rank0(r)
    assert (rank["state"], rank["gaps"], rank["replayed_batches"]) == ("complete", 1, 2)


def test_a_late_subscriber_replays_from_sequence_0(pub: KvEventPublisher) -> None:
    chain(pub)  # before anyone listens
    r = router()
    with subscribe(r, pub):
        pub.publish([])
        until(lambda: hits(r) == [12])
    assert state(r) == "complete"


def test_without_replay_a_gap_degrades_the_view_until_a_clear() -> None:
    r = router()
    with KvEventPublisher(replay=False) as pub, subscribe(r, pub):
        pub.publish([stored([1], None, TOKENS[:4], BS)])
        until(lambda: hits(r) == [4])
        r.route("a", keys(12), 12)  # pending in the events view
        pub.drop_next(1)
        pub.publish([removed([1])])
        pub.publish([stored([1, 2], None, TOKENS[:8], BS)])
        until(lambda: state(r) == "degraded")
        view = r.kv_view(0)
        assert view is not None and not view["uses_events"]
        assert "no replay socket" in (view["ranks"][0]["reason"] or "")
        assert r.state()[0]["cache_view"] == "degraded"
        # Routed on the estimate, which takes over from the events view's last blocks.
        assert hits(r) == [4], "routed on the estimate view while degraded"
        pub.publish([cleared(), stored([5], None, TOKENS[:4], BS)])
        until(lambda: state(r) == "complete")
        assert hits(r) == [4]


def test_a_replay_that_begins_too_late_degrades(pub: KvEventPublisher) -> None:
    with KvEventPublisher(buffer_steps=1) as short:
        r = router()
        with subscribe(r, short):
            short.publish([])
            short.drop_next(2)
            short.publish([])
            short.publish([])  # the buffer keeps only this one
            short.publish([])
            until(lambda: state(r) == "degraded")
            assert "could not be replayed" in rank0(r)["reason"]


def test_a_restarted_engine_resets_the_view(pub: KvEventPublisher) -> None:
    r = router()
    with subscribe(r, pub):
        chain(pub)
        until(lambda: hits(r) == [12])
        pub.restart()
        pub.publish([stored([7], None, TOKENS[:4], BS)])
        until(lambda: hits(r) == [4])
    rank = rank0(r)
    assert (rank["state"], rank["resets"], rank["last_seq"]) == ("complete", 1, 0)


def test_an_undecodable_batch_is_counted_and_degrades(pub: KvEventPublisher) -> None:
    r = router()
    with subscribe(r, pub) as sub:
        pub.publish([])
        pub.publish_raw(b"\x93\x01")
        pub.publish([stored([1], None, TOKENS[:4], BS)])
        until(lambda: state(r) == "degraded")
        assert sub.stats()[(0, 0)].decode_errors == 1
        assert "could not be applied" in rank0(r)["reason"]


def test_ranks_have_their_own_sequences() -> None:
    r = router()
    with KvEventPublisher(data_parallel_rank=1) as one, KvEventPublisher() as zero:
        sub = Subscriber(r)
        sub.watch(
            0,
            [
                Source(0, zero.endpoint, zero.replay_endpoint),
                Source(1, one.endpoint, one.replay_endpoint),
            ],
        )
        assert zero.wait_for_subscribers(1, 30.0) and one.wait_for_subscribers(1, 30.0)
        with sub:
            zero.publish([stored([1], None, TOKENS[:4], BS)])
            one.publish([stored([9], None, TOKENS[:4], BS)])
            one.publish([removed([9])])
            until(
                lambda: [x["last_seq"] for x in (r.kv_view(0) or {"ranks": []})["ranks"]] == [0, 1]
            )
            assert hits(r) == [4]  # still held by rank 0


def test_apply_takes_a_decoded_batch_and_checks_its_arguments() -> None:
    r = router()
    batch = [1.0, [stored([1], None, TOKENS[:4], BS)], 0]
    assert r.apply_kv_events(0, 0, batch)["outcome"] == "applied"
    assert r.apply_kv_events(0, 0, msgpack.packb(batch), replayed=True)["outcome"] == "duplicate"
    assert r.apply_kv_events(0, 5, encode_batch([], ts=0, rank=0)) == {
        "outcome": "gap",
        "expected": 1,
        "reset": False,
        "degraded": False,
    }
    with pytest.raises(InvalidArgumentError, match="event 0: field token_ids"):
        r.apply_kv_events(0, 1, [1.0, [{"type": "BlockStored", "token_ids": "x"}], 0])
    with pytest.raises(KvrouteTypeError, match="bytes"):
        r.apply_kv_events(0, 1, 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cache_view='events'"):
        kvroute.Router(1).apply_kv_events(0, 0, batch)
    with pytest.raises(InvalidArgumentError, match="cache_view"):
        kvroute.Router(1, cache_view="exact")  # type: ignore[arg-type]
    assert kvroute.Router(1).kv_view(0) is None
    # The wire's sequence numbers are unsigned 64-bit; the source's rank refuses others.
    r.kv_resync(0, 0, "test")
    assert r.apply_kv_events(0, 2**64 - 1, encode_batch([], ts=0, rank=0))["outcome"] == "applied"
    with pytest.raises(InvalidArgumentError, match="seq must be an int in"):
        r.apply_kv_events(0, 2**64, encode_batch([], ts=0, rank=0))
    foreign = r.apply_kv_events(0, 0, encode_batch([cleared()], ts=0, rank=7), rank=0)
    assert foreign["outcome"] == "foreign" and rank0(r)["foreign_batches"] == 1


def test_event_sources_of_a_kv_event_sources_answer(pub: KvEventPublisher) -> None:
    got = event_sources(pub.kv_event_sources(wildcard=True), "http://10.1.2.3:8000")
    port = pub.endpoint.rsplit(":", 1)[1]
    assert got[0].endpoint == f"tcp://10.1.2.3:{port}" and not got[0].bind
    assert event_sources(pub.kv_event_sources(), "http://h:1")[0].endpoint == pub.endpoint
    answer = {
        "1": {"endpoint": "tcp://*:7001"},
        "0": {"endpoint": "tcp://[::]:7000", "topic": "kv"},
    }
    assert event_sources(answer, "http://[::1]:8000") == [
        Source(0, "tcp://[::1]:7000", None, "kv"),
        Source(1, "tcp://[::1]:7001", None, ""),
    ]
    assert (
        event_sources({"0": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}}, "http://h")
        == []
    )
    with pytest.raises(InvalidArgumentError, match="no port"):
        event_sources({"0": {"endpoint": "tcp://*"}}, "http://h")


def test_tally_counts_rates_gaps_and_restarts() -> None:
    t = Tally()
    for seq, events in [
        (0, [stored([1, 2], None, TOKENS[:8], BS)]),
        (1, [removed([2])]),
        (4, [cleared()]),
        (0, []),
    ]:
        t.add([b"", seq.to_bytes(8, "big"), encode_batch(events, ts=time.time(), rank=0)])
    t.add([b"only one frame"])
    r = t.ranks[0]
    assert (r.batches, r.stored, r.removed, r.cleared, r.gaps, r.missed, r.restarts) == (
        4,
        2,
        1,
        1,
        1,
        2,
        1,
    )
    assert t.bad_messages == 1


def test_the_kv_events_command_prints_a_summary(pub: KvEventPublisher) -> None:
    import json
    import threading

    from click.testing import CliRunner

    from kvroute.cli import main

    def publish() -> None:
        assert pub.wait_for_subscribers(1, timeout=30.0)
        chain(pub)
        pub.drop_next(1)
        pub.publish([removed([3])])
        pub.publish([cleared()])

    threading.Thread(target=publish, daemon=True).start()
    # Three batches arrive (one of the four is dropped); --duration only bounds a failure.
    args = ["kv-events", pub.endpoint, "--batches", "3", "--duration", "60", "--json"]
    args += ["--interval", "0.5"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    last = json.loads(res.output.strip().splitlines()[-1])["ranks"][0]
    assert (last["batches"], last["stored"], last["cleared"], last["gaps"], last["missed"]) == (
        3,
        3,
        1,
        1,
        1,
    )
    assert last["last_seq"] == 3


def test_two_replicas_hold_the_same_view(pub: KvEventPublisher) -> None:
    """Two routers (two proxy replicas) subscribed to one engine: the same blocks, and each
    reports the last sequence number it applied; one that joined late catches up by replay."""
    first = router()
    with subscribe(first, pub):
        chain(pub)
        until(lambda: rank0(first).get("last_seq") == 1)
        second = router()
        with subscribe(second, pub, nth=2):
            pub.publish([removed([3]), stored([8], None, TOKENS[4:8], BS)])
            until(lambda: rank0(second).get("last_seq") == rank0(first).get("last_seq") == 2)
            assert hits(first) == hits(second) == [8]
            other = [*TOKENS[4:8], 0]
            assert first.estimate_cache_hits(kvroute.block_hashes(other, BS), 5) == [4]
            assert second.estimate_cache_hits(kvroute.block_hashes(other, BS), 5) == [4]
            assert rank0(second)["replayed_batches"] == 2


def test_the_proxy_reads_each_engines_kv_capacity() -> None:
    from kvroute.proxy.caches import kv_capacity
    from livekit import Stack, wait_until

    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="512",swap_space="0"} 1.0\n'
    )
    assert kv_capacity(text) == (512, 32)
    assert kv_capacity("vllm:num_requests_running 0\n") is None
    with Stack(2) as s:  # emulators: no KV events, so the estimate, bounded
        wait_until(lambda: len(s.proxy.caches.found) == 2, 30, "both backends probed")
        for i, e in enumerate(s.emulators):
            stats = e.engine.stats()
            # Blocks of the engine's KV block size (16 tokens), not of the trace's keys.
            size = int(stats.get("kv_block_size", e.block_size))
            assert size == 16
            assert s.proxy.caches.found[i]["capacity"] == (int(stats["num_gpu_blocks"]), size)


def test_a_bad_endpoint_or_instance_does_not_stop_the_subscriber(pub: KvEventPublisher) -> None:
    r = router()
    with Subscriber(r) as sub:
        sub.watch(5, [Source(0, "tcp://no-such-host.invalid:1", bind=True)])  # cannot bind
        sub.watch(7, [Source(0, pub.endpoint)])  # no instance 7: every batch is an error
        sub.watch(0, [Source(0, pub.endpoint, pub.replay_endpoint)])
        assert pub.wait_for_subscribers(2, 30.0)
        chain(pub)
        until(lambda: hits(r) == [12])
        until(lambda: sub.stats().get((7, 0), SourceStats()).decode_errors >= 1)
