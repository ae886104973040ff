"""The KV-event subscriber against publishers that are broken or hostile (raw pyzmq PUB and
ROUTER sockets): batches naming a foreign rank, a replay socket that trickles and never
ends, messages over the size limit, and stores far beyond an engine's capacity. Throughout,
the other engines' live batches keep being applied and the router's memory stays bounded
(``docs/kv-events.md``, "Trust")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

import kvroute
from kvroute.emulator.kv_publisher import cleared, encode_batch
from kvroute.emulator.kv_publisher import stored as publisher_stored
from kvroute.kv_events import Source, Subscriber

BS = 4


def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


def batch(events: list[Any], rank: int = 0) -> bytes:
    return encode_batch(events, ts=time.time(), rank=rank)


def stored(hashes: list[int], parent: int | None, first_token: int) -> Any:
    return publisher_stored(hashes, parent, range(first_token, first_token + BS * len(hashes)), BS)


class Engine:
    """A publisher of one rank: a PUB socket, and a ROUTER replay socket answered by
    ``replay`` (from the frames asked: what to send back), on a thread of its own."""

    def __init__(self, ctx: zmq.Context[Any], replay: Callable[[int], Iterator[Any]]) -> None:
        self.pub = ctx.socket(zmq.PUB)
        # A flood of a thousand batches must not lose the one after it on this side (PUB
        # drops past its high-water mark, and nothing after the last batch would show the
        # gap): what is under test is the subscriber.
        self.pub.setsockopt(zmq.SNDHWM, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.replay, self.asked = replay, threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, _, start = self.router.recv_multipart()
            self.asked.set()
            for frame in self.replay(int.from_bytes(start, "big")):
                if self._stop.is_set():
                    return
                self.router.send_multipart([ident, b"", *frame])  # type: ignore[arg-type]

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def router(n: int) -> kvroute.Router:
    return kvroute.Router(n, "lmetric", block_size=BS, cache_rule="vllm", cache_view="events")


def subscribed(r: kvroute.Router, engines: list[Engine], **kw: Any) -> Subscriber:
    """A subscriber of ``r`` to each engine (instance i: engine i), once every one of them
    delivers (a first batch, sequence 0, each)."""
    sub = Subscriber(r, replay_timeout_s=5.0, **kw)
    for i, e in enumerate(engines):
        sub.watch(i, [Source(0, e.endpoint, e.replay_endpoint)])
    for i, e in enumerate(engines):

        def first(i: int = i, e: Engine = e) -> bool:
            e.send(0, batch([]))
            time.sleep(0.05)
            view = r.kv_view(i)
            return bool(view and view["ranks"] and view["ranks"][0]["last_seq"] is not None)

        until(first)
    return sub


def rank_of(r: kvroute.Router, i: int) -> dict[str, Any]:
    view = r.kv_view(i)
    assert view is not None
    return dict(view["ranks"][0])


def nothing(_start: int) -> Iterator[Any]:
    """A replay socket that has kept nothing: only the end marker."""
    yield b"", (-1).to_bytes(8, "big", signed=True), b""


def test_a_foreign_rank_is_refused_and_the_source_goes_on(ctx: zmq.Context[Any]) -> None:
    """Batches naming rank 7 on rank 0's socket: refused and counted, no view of rank 7 is
    made, and rank 0's batches after them apply in order (no gap, no phantom rank)."""
    e = Engine(ctx, nothing)
    r = router(1)
    try:
        with subscribed(r, [e]):
            seq = rank_of(r, 0)["last_seq"]
            e.send(seq + 1, batch([stored([1], None, 0)]))
            for k in range(1000):  # as many ranks as there are values
                e.send(seq + 2 + k, batch([cleared()], rank=7 + k))
            e.send(seq + 1002, batch([stored([2], 1, 100)]))
            until(lambda: rank_of(r, 0)["last_seq"] == seq + 1002)
            view = r.kv_view(0)
            assert view is not None and len(view["ranks"]) == 1 and view["uses_events"]
            rank = rank_of(r, 0)
            assert (rank["state"], rank["foreign_batches"], rank["gaps"]) == ("complete", 1000, 0)
            assert rank["blocks_indexed"] == 2, "the foreign clears were not applied"
    finally:
        e.close()


def test_a_trickling_replay_does_not_hold_up_other_engines(ctx: zmq.Context[Any]) -> None:
    """Engine 0's replay socket sends a batch every 0.3 s (not the first one missing) and
    never its end marker: engine 1's live batches are applied all the while; engine 0's
    replay is cut at its deadline, its view degraded, and its live batches that waited are
    applied after."""

    def trickle(start: int) -> Iterator[Any]:
        seq = start + 1  # never the first one missing: what it brings fills nothing
        while True:
            time.sleep(0.3)
            yield b"", seq.to_bytes(8, "big", signed=True), batch([])  # topic, seq, batch
            seq += 1

    slow, fine = Engine(ctx, trickle), Engine(ctx, nothing)
    r = router(2)
    try:
        with subscribed(r, [slow, fine], replay_deadline_s=3.0):
            s0, s1 = rank_of(r, 0)["last_seq"], rank_of(r, 1)["last_seq"]
            slow.send(s0 + 5, batch([]))  # batches s0+1..s0+4 are missing: a replay
            assert slow.asked.wait(10)
            t0 = time.monotonic()
            for k in range(1, 6):
                fine.send(s1 + k, batch([stored([k], k - 1 if k > 1 else None, 4 * k)]))
                slow.send(s0 + 5 + k, batch([]))  # waits for the replay
                until(lambda k=k: rank_of(r, 1)["last_seq"] == s1 + k, timeout=2.0)
            assert time.monotonic() - t0 < 2.5, "engine 1 waited for engine 0's replay"
            assert rank_of(r, 0)["state"] == "complete"  # still replaying
            until(lambda: rank_of(r, 0)["state"] == "degraded", timeout=10.0)
            assert "not done in 3.0 s" in rank_of(r, 0)["reason"]
            until(lambda: rank_of(r, 0)["last_seq"] == s0 + 10)  # the waiting ones
    finally:
        slow.close()
        fine.close()


def test_a_replay_that_breaks_off_is_asked_again_from_what_it_lacks(
    ctx: zmq.Context[Any],
) -> None:
    """A replay socket that drops batches past a high-water mark, as vLLM's ROUTER does when
    it sends its whole buffer at once: the batches before the first dropped one are applied
    and the rest asked again, until the view is whole. One that brings nothing more after
    that fails, and the rank degrades."""
    asked: list[int] = []

    def dropping(start: int) -> Iterator[Any]:
        asked.append(start)
        for seq in range(start, stop):
            if (len(asked) == 1 and seq in (first + 3, first + 4)) or seq >= limit:
                continue  # dropped
            yield b"", seq.to_bytes(8, "big", signed=True), batch([stored([seq], None, 0)])
        yield b"", (-1).to_bytes(8, "big", signed=True), b""

    e = Engine(ctx, dropping)
    r = router(1)
    try:
        with subscribed(r, [e]) as sub:
            first = rank_of(r, 0)["last_seq"] + 1
            stop, limit = first + 10, first + 10
            e.send(stop, batch([]))  # batches first..first+9 are missing: a replay
            until(lambda: rank_of(r, 0)["last_seq"] == stop)
            assert asked == [first, first + 3]
            rank = rank_of(r, 0)
            assert (rank["state"], rank["replayed_batches"]) == ("complete", 10)
            assert (sub.stats()[(0, 0)].replays, sub.stats()[(0, 0)].replay_failures) == (2, 0)
            # Now a replay that stops bringing anything: one resume, then degraded.
            asked.clear()
            first = stop + 1
            stop, limit = first + 10, first + 5
            e.send(stop, batch([]))
            until(lambda: rank_of(r, 0)["state"] == "degraded")
            assert asked == [first, first + 3, first + 5]
            assert f"has no batch {first + 5}" in rank_of(r, 0)["reason"]
    finally:
        e.close()


def test_messages_over_the_size_limit_are_not_taken(ctx: zmq.Context[Any]) -> None:
    """A message over the subscriber's limit is dropped by ZMQ (with the connection, which
    comes back): its batch is never applied, memory does not grow with it, and batches after
    it apply (the gap it leaves repaired or degraded, as any gap)."""
    e = Engine(ctx, nothing)
    r = router(1)
    try:
        with subscribed(r, [e], max_message_bytes=1 << 20) as sub:
            seq = rank_of(r, 0)["last_seq"]
            hashes = list(range(1, 60_001))  # about 2.5 MB of msgpack
            for k in range(1, 11):
                e.send(seq + k, batch([stored(hashes, None, 0)]))
            before = r.kv_memory_bytes
            sent = [seq + 10]

            def on() -> bool:
                sent.append(sent[-1] + 1)
                e.send(sent[-1], batch([stored([9], None, 0)]))
                time.sleep(0.1)
                return bool(rank_of(r, 0)["last_seq"] == sent[-1])

            until(on)
            rank = rank_of(r, 0)
            assert rank["blocks_stored"] <= 1, "an oversized batch was applied"
            assert r.kv_memory_bytes <= before + 4096
            assert sub.stats()[(0, 0)].reopened >= 1
    finally:
        e.close()


def test_stores_beyond_the_engines_capacity_are_bounded(ctx: zmq.Context[Any]) -> None:
    """Five stores of fresh blocks, each as large as the engine's capacity, with no removal:
    the view turns degraded instead of growing (at most twice the capacity is held), and its
    memory comes back after a clear."""
    e = Engine(ctx, nothing)
    r = router(1)
    capacity = 20_000
    try:
        with subscribed(r, [e]):
            r.set_cache_capacity(0, capacity)
            seq = rank_of(r, 0)["last_seq"]
            peak = 0
            for k in range(5):
                hashes = list(range(1 + k * capacity, 1 + (k + 1) * capacity))
                e.send(seq + 1 + k, batch([stored(hashes, None, k * 7)]))
                until(lambda k=k: rank_of(r, 0)["last_seq"] == seq + 1 + k)
                assert rank_of(r, 0)["blocks_indexed"] <= 2 * capacity
                peak = max(peak, r.kv_memory_bytes)
            rank = rank_of(r, 0)
            assert rank["state"] == "degraded" and "missed removals" in rank["reason"]
            # Tables sized for the capacity: about 2 x 20,000 blocks at most, well under 8 MB.
            assert peak < 8 << 20, peak
            e.send(seq + 6, batch([cleared()]))
            until(lambda: rank_of(r, 0)["state"] == "complete")
            assert r.kv_memory_bytes <= peak
    finally:
        e.close()
