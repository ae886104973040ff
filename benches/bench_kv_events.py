"""The KV-event subscriber path end to end, in one run (release build; ``make bench``):

- ``read``: the frames received by a plain pyzmq SUB socket, nothing decoded (reading the
  data);
- ``subscriber``: :class:`kvroute.kv_events.Subscriber` receiving the same frames, decoding
  them in the core and applying them to a router's events view;
- ``apply``: ``Router.apply_kv_events`` on the same payloads, no sockets.

Each batch is what vLLM publishes for one request: a ``BlockStored`` of 16 blocks of 32
tokens, and a ``BlockRemoved`` of the 16 blocks stored 64 batches before (so the view holds
about 1,000 blocks). ``extra_info`` has blocks per second (stored and removed). The publisher
(``kvroute.emulator.kv_publisher``) sends from the same process, so the socket rows include
its cost.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import kvroute
from kvroute.emulator.kv_publisher import KvEventPublisher, encode_batch, removed, stored
from kvroute.kv_events import Source, Subscriber

BATCHES, PER, BS, LAG = 2000, 16, 32, 64


def payloads() -> list[bytes]:
    def hashes(i: int) -> list[int]:
        return [i * PER + b + 1 for b in range(PER)]

    out = []
    for i in range(BATCHES):
        tokens = [(i * 7919 + t) % 32000 for t in range(PER * BS)]
        events = [stored(hashes(i), None, tokens, BS)]
        if i >= LAG:
            events.append(removed(hashes(i - LAG)))
        out.append(encode_batch(events, ts=time.time(), rank=0))
    return out


PAYLOADS = payloads()
BLOCKS = sum(PER * (2 if i >= LAG else 1) for i in range(BATCHES))


def _rate(benchmark: Any) -> None:
    benchmark.extra_info["blocks_per_s"] = round(BLOCKS / benchmark.stats.stats.median)


def router() -> kvroute.Router:
    return kvroute.Router(1, "lmetric", block_size=BS, cache_rule="vllm", cache_view="events")


@pytest.fixture
def pub() -> Iterator[KvEventPublisher]:
    with KvEventPublisher(replay=False) as p:
        yield p


def test_read(benchmark: Any, pub: KvEventPublisher) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(pub.endpoint)
    assert pub.wait_for_subscribers(1, 3.0)

    def run() -> None:
        for p in PAYLOADS:
            pub.publish_raw(p)
        for _ in PAYLOADS:
            sock.recv_multipart()

    benchmark.pedantic(run, rounds=5, iterations=1)
    _rate(benchmark)
    ctx.destroy(linger=0)


def test_subscriber(benchmark: Any, pub: KvEventPublisher) -> None:
    state: dict[str, Any] = {}

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        r = router()
        sub = Subscriber(r)
        sub.watch(0, [Source(0, pub.endpoint)])
        assert pub.wait_for_subscribers(len(state) + 1, 3.0)
        pub.restart()  # each round from sequence 0
        state[len(state)] = sub
        return (r, sub), {}

    def run(r: kvroute.Router, sub: Subscriber) -> None:
        for p in PAYLOADS:
            pub.publish_raw(p)
        last = BATCHES - 1
        while True:
            view = r.kv_view(0)
            if view and view["ranks"] and view["ranks"][0]["last_seq"] == last:
                break
            time.sleep(0.0005)
        assert view["uses_events"] and view["ranks"][0]["blocks_indexed"] == LAG * PER
        sub.close()

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    _rate(benchmark)


def test_apply(benchmark: Any) -> None:
    def run() -> None:
        r = router()
        for seq, p in enumerate(PAYLOADS):
            r.apply_kv_events(0, seq, p)

    benchmark.pedantic(run, rounds=5, iterations=1)
    _rate(benchmark)
