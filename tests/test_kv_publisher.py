"""Tests of the vLLM KV-event publisher and model: ``kvroute.emulator.kv_publisher``
(encoding, ``KvEventPublisher``) against bytes and frames made by vLLM 0.32 itself
(``data/kv_events_golden.json``), and
``vllm_blockpool`` against event sequences recorded from vLLM's own ``KVCacheManager``.

Socket tests use a real pyzmq SUB and DEALER and only ever wait with ``poll`` timeouts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvroute.emulator.kv_publisher import (
    END_SEQ,
    KvEventPublisher,
    cleared,
    decode_batch,
    encode_batch,
    kv_event_sources,
    normalize,
    removed,
    seq_bytes,
    stored,
)
from vllm_blockpool import BlockPool, PoolExhausted

GOLDEN_PATH = Path(__file__).parent / "data" / "kv_events_golden.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text())
TIMEOUT_MS = 30_000  # what must arrive arrives in milliseconds


def unjson(obj: Any) -> Any:
    """The golden file's JSON back to Python values ({"$bytes": hex} -> bytes)."""
    if isinstance(obj, dict):
        if set(obj) == {"$bytes"}:
            return bytes.fromhex(obj["$bytes"])
        return {k: unjson(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unjson(v) for v in obj]
    return obj


def golden_batches(part: str) -> list[tuple[str, dict[str, Any], bytes]]:
    return [(b["name"], unjson(b["batch"]), bytes.fromhex(b["payload_hex"])) for b in GOLDEN[part]]


# -- sockets ---------------------------------------------------------------------------------


class Net:
    """The test's own SUB and DEALER sockets, all closed (with their context) at teardown."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def sub(self, pub: KvEventPublisher, topic: bytes = b"") -> zmq.Socket[bytes]:
        """A SUB on ``pub``, subscribed (and seen to be) to ``topic``."""
        before = pub.subscriptions
        sock = self.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(pub.endpoint)
        assert pub.wait_for_subscribers(before + 1, timeout=30.0)
        return sock

    def dealer(self, pub: KvEventPublisher) -> zmq.Socket[bytes]:
        assert pub.replay_endpoint is not None
        sock = self.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
    yield n
    n.close()


@pytest.fixture
def pub() -> Iterator[KvEventPublisher]:
    with KvEventPublisher(buffer_steps=16) as publisher:
        yield publisher


def recv(sock: zmq.Socket[bytes], timeout_ms: int = TIMEOUT_MS) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing arrived in time"
    return sock.recv_multipart()


def silent(sock: zmq.Socket[bytes], ms: int = 50) -> bool:
    return not sock.poll(ms)


def replay(sock: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    """Replay from ``start``: every reply up to and including the end marker."""
    sock.send_multipart([b"", seq_bytes(start)])
    replies = []
    while True:
        frames = recv(sock)
        replies.append(frames)
        if frames[2] == END_SEQ:
            return replies


def seqs(replies: list[list[bytes]]) -> list[int]:
    """The seqs of replay replies, without the end marker."""
    return [int.from_bytes(f[2], "big") for f in replies[:-1]]


# -- encoding vs. vLLM's own bytes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "batch", "payload"), golden_batches("batches"), ids=lambda v: str(v)[:24]
)
def test_map_encoding_is_vllms_bytes(name: str, batch: dict[str, Any], payload: bytes) -> None:
    ours = encode_batch(batch["events"], ts=batch["ts"], rank=batch["data_parallel_rank"])
    assert ours == payload, name


@pytest.mark.parametrize(
    ("name", "batch", "payload"), golden_batches("legacy_array"), ids=lambda v: str(v)[:24]
)
def test_array_encoding_is_legacy_bytes(name: str, batch: dict[str, Any], payload: bytes) -> None:
    ours = encode_batch(
        batch["events"], ts=batch["ts"], rank=batch["data_parallel_rank"], encoding="array"
    )
    assert ours == payload, name


@pytest.mark.parametrize("part", ["batches", "legacy_array"])
def test_golden_payloads_decode_to_their_description(part: str) -> None:
    for name, batch, payload in golden_batches(part):
        got = decode_batch(payload)
        assert (got.ts, got.events, got.data_parallel_rank) == (
            batch["ts"],
            batch["events"],
            batch["data_parallel_rank"],
        ), name
        # The map form is exactly what a plain msgpack decode gives.
        if part == "batches":
            rank = batch["data_parallel_rank"]
            assert msgpack.unpackb(payload) == [batch["ts"], batch["events"], rank], name


def test_helpers_build_vllms_events() -> None:
    by_name = {name: batch for name, batch, _ in golden_batches("batches")}
    h = [0x1234, 0xFEDCBA9876543210, 7, 2**64 - 1, 2**63]
    assert by_name["stored_root_int"]["events"] == [stored(h[:2], None, range(8), 4)]
    assert by_name["stored_with_parent"]["events"] == [stored([h[2]], h[1], [8, 9, 10, 11], 4)]
    assert by_name["removed"]["events"] == [removed([h[1]]), removed([h[2]])]
    assert by_name["cleared"]["events"] == [cleared()]
    minimal = by_name["stored_lora_salt_minimal"]["events"]
    assert minimal[1] == stored(
        [7],
        None,
        [1, 2, 3, 4],
        4,
        medium=None,
        extra_keys=None,
        group_idx=None,
        kv_cache_spec_kind=None,
    )
    assert minimal[0] == stored(
        h[:2],
        None,
        range(100, 108),
        4,
        lora_id=3,
        lora_name="adapter",
        extra_keys=[("adapter", "salt"), ("adapter",)],
        session_id="sess-1",
    )
    assert minimal[2] == removed([7], medium=None, group_idx=None)


def test_normalize_orders_and_rejects() -> None:
    shuffled = {"medium": "GPU", "block_hashes": [1], "type": "BlockRemoved", "locality": None}
    assert list(normalize(shuffled)) == ["type", "block_hashes", "medium"]
    with pytest.raises(ValueError, match="no field"):
        normalize({"type": "AllBlocksCleared", "x": 1})
    with pytest.raises(ValueError, match="needs field 'medium'"):
        normalize({"type": "BlockRemoved", "block_hashes": [1]})
    with pytest.raises(ValueError, match="unknown KV event type"):
        normalize({"type": "BlockMoved"})


def test_batch_without_rank() -> None:
    payload = encode_batch([cleared()], ts=1.0, rank=None)
    assert msgpack.unpackb(payload) == [1.0, [{"type": "AllBlocksCleared"}], None]
    assert decode_batch(payload).data_parallel_rank is None
    old = msgpack.packb([1.0, [["BlockRemoved", [9], "GPU"]]])  # older vLLM: no rank field
    want = encode_batch([removed([9], group_idx=None)], ts=1.0, rank=None)
    assert decode_batch(old) == decode_batch(want)


# -- the publisher against a real ZmqEventPublisher's frames ---------------------------------


def test_wire_frames_are_vllms(net: Net) -> None:
    wire = GOLDEN["wire"]
    by_name = {name: batch for name, batch, _ in golden_batches("batches")}
    with KvEventPublisher(topic=wire["topic"], buffer_steps=wire["buffer_steps"]) as p:
        sub = net.sub(p)
        for name in wire["published"]:
            batch = by_name[name]
            p.publish(batch["events"], ts=batch["ts"])  # rank: the publisher's, 0
        got = [[f.hex() for f in recv(sub)] for _ in wire["published"]]
        assert got == wire["pub_frames_hex"]
        replies = replay(net.dealer(p), wire["replay_request"]["start_seq"])
        assert [[f.hex() for f in r] for r in replies] == wire["replay_frames_hex"]
        assert p.replay_requests == [1]

        # GET /kv_event_sources: vLLM reports the wildcard endpoints it was configured with.
        ours = p.kv_event_sources(wildcard=True)
        theirs = wire["kv_event_sources"]
        assert list(ours) == list(theirs) == ["0"]
        assert list(ours["0"]) == list(theirs["0"])
        port = p.endpoint.rsplit(":", 1)[1]
        assert ours["0"]["endpoint"] == f"tcp://*:{port}"
        for key in ("endpoint", "replay_endpoint"):
            assert theirs["0"][key].startswith("tcp://*:")
        same = {k: v for k, v in ours["0"].items() if not k.endswith("endpoint")}
        assert same == {k: v for k, v in theirs["0"].items() if not k.endswith("endpoint")}


def test_kv_event_sources_concrete_and_multi_rank() -> None:
    with KvEventPublisher() as p0, KvEventPublisher(data_parallel_rank=1, replay=False) as p1:
        src = kv_event_sources(p0, p1)
        assert list(src) == ["0", "1"]
        assert src["0"]["endpoint"] == p0.endpoint
        assert src["0"]["endpoint"].startswith("tcp://127.0.0.1:")
        assert src["0"]["replay_endpoint"] == p0.replay_endpoint
        assert src["1"]["replay_endpoint"] is None
        assert src["1"]["enable_kv_cache_events"] is True
        assert src["1"]["publisher"] == "zmq"


# -- publisher behaviour ---------------------------------------------------------------------


def test_publish_sequences_from_zero(net: Net, pub: KvEventPublisher) -> None:
    sub = net.sub(pub)
    events = [stored([1, 2], None, range(8), 4), removed([1]), cleared()]
    assert [pub.publish([e], ts=10.0 + i) for i, e in enumerate(events)] == [0, 1, 2]
    for i, event in enumerate(events):
        topic, seq, payload = recv(sub)
        assert topic == b""
        assert seq == seq_bytes(i) and len(seq) == 8
        batch = decode_batch(payload)
        assert (batch.ts, batch.events, batch.data_parallel_rank) == (10.0 + i, [event], 0)
    assert pub.next_seq == 3


def test_rank_and_topic(net: Net) -> None:
    with KvEventPublisher(topic="kv@rank", data_parallel_rank=2) as p:
        other = net.sub(p, b"nope")
        sub = net.sub(p, b"kv@")
        assert p.wait_for_subscribers(2, timeout=30.0)
        p.publish([cleared()])
        p.publish([cleared()], rank=5)
        first, second = recv(sub), recv(sub)
        assert first[0] == b"kv@rank"
        assert decode_batch(first[2]).data_parallel_rank == 2
        assert decode_batch(second[2]).data_parallel_rank == 5
        assert silent(other)


def test_array_encoding_on_the_wire(net: Net, pub: KvEventPublisher) -> None:
    sub = net.sub(pub)
    pub.encoding = "array"
    event = stored([5], 4, [1, 2], 2)
    pub.publish([event, removed([5]), cleared()], ts=3.5)
    payload = recv(sub)[2]
    assert msgpack.unpackb(payload)[1] == [
        ["BlockStored", [5], 4, [1, 2], 2, None, "GPU", None, [None], 0, "full_attention"]
        + [None] * 4,
        ["BlockRemoved", [5], "GPU", 0, None, None],
        ["AllBlocksCleared"],
    ]
    assert decode_batch(payload).events == [event, removed([5]), cleared()]


def test_drop_next_makes_a_gap_that_replay_fills(net: Net, pub: KvEventPublisher) -> None:
    sub = net.sub(pub)
    pub.publish([removed([0])])
    pub.drop_next(2)
    for h in (1, 2, 3):
        pub.publish([removed([h])])
    assert [int.from_bytes(recv(sub)[1], "big") for _ in range(2)] == [0, 3]
    assert silent(sub)
    replies = replay(net.dealer(pub), 1)
    assert seqs(replies) == [1, 2, 3]
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[removed([h])] for h in (1, 2, 3)]
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert [f[:2] for f in replies[:-1]] == [[b"", b""]] * 3  # delimiter, topic


def test_replay_buffer_keeps_the_last_buffer_steps(net: Net) -> None:
    with KvEventPublisher(buffer_steps=3) as p:
        for _ in range(5):
            p.publish([cleared()])
        d = net.dealer(p)
        assert seqs(replay(d, 0)) == [2, 3, 4]
        assert seqs(replay(d, 4)) == [4]
        assert seqs(replay(d, 9)) == []
        assert [s for s, _ in p.buffered()] == [2, 3, 4]


def test_restart_starts_again_at_zero(net: Net, pub: KvEventPublisher) -> None:
    sub = net.sub(pub)
    pub.publish([stored([1], None, [1, 2, 3, 4], 4)])
    pub.publish([stored([2], 1, [5, 6, 7, 8], 4)])
    pub.restart()
    assert pub.next_seq == 0
    assert pub.publish([cleared()]) == 0
    assert [int.from_bytes(recv(sub)[1], "big") for _ in range(3)] == [0, 1, 0]
    replies = replay(net.dealer(pub), 0)
    assert seqs(replies) == [0]
    assert decode_batch(replies[0][3]).events == [cleared()]


def test_bad_replay_request_is_ignored(net: Net, pub: KvEventPublisher) -> None:
    pub.publish([cleared()])
    d = net.dealer(pub)
    d.send_multipart([b"", b"extra", seq_bytes(0)])  # four frames at the ROUTER
    assert silent(d)
    assert seqs(replay(d, 0)) == [0]
    assert pub.replay_requests == [0]


def test_replay_paused_then_answered(net: Net, pub: KvEventPublisher) -> None:
    pub.publish([cleared()])
    pub.replay_paused = True
    d = net.dealer(pub)
    d.send_multipart([b"", seq_bytes(0)])
    assert silent(d, 60)
    pub.replay_paused = False
    assert int.from_bytes(recv(d)[2], "big") == 0
    assert recv(d)[2] == END_SEQ


def test_no_replay_socket_and_close() -> None:
    p = KvEventPublisher(replay=False)
    assert p.replay_endpoint is None
    assert p.kv_event_sources()["0"]["replay_endpoint"] is None
    p.close()
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.publish([cleared()])


def test_publish_from_threads(net: Net, pub: KvEventPublisher) -> None:
    import threading

    sub = net.sub(pub)
    threads = [
        threading.Thread(target=lambda: [pub.publish([cleared()]) for _ in range(25)])
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    got = sorted(int.from_bytes(recv(sub)[1], "big") for _ in range(100))
    assert got == list(range(100))


# -- the block-pool model --------------------------------------------------------------------


def model_apply(pool: BlockPool, running: dict[str, Any], op: dict[str, Any]) -> dict[str, Any]:
    """One golden scenario step through the model, in the generator's result shape."""
    kind = op["op"]
    try:
        if kind == "run":
            handle = pool.begin(op["tokens"], cache_salt=op.get("salt"))
            pool.finish(handle)
            return {"ok": True, "hit_blocks": handle.num_hit_blocks, "events": handle.events}
        if kind == "begin":
            handle = pool.begin(op["tokens"], cache_salt=op.get("salt"))
            running[op["id"]] = handle
            return {"ok": True, "hit_blocks": handle.num_hit_blocks, "events": handle.events}
    except PoolExhausted:
        hashes = pool.block_hashes(op["tokens"], cache_salt=op.get("salt"))
        cached = pool.cached()
        hit = 0
        for h in hashes[: (len(op["tokens"]) - 1) // pool.block_size]:
            if h not in cached:
                break
            hit += 1
        return {"ok": False, "hit_blocks": hit, "events": []}
    if kind == "extend":
        return {"ok": True, "events": pool.extend(running[op["id"]], op["tokens"])}
    if kind == "finish":
        pool.finish(running.pop(op["id"]))
        return {"ok": True, "events": []}
    assert kind == "reset"
    events = pool.reset()
    return {"ok": bool(events), "events": events}


@pytest.mark.parametrize("scenario", GOLDEN["block_pool"], ids=lambda s: s["name"])
def test_model_reproduces_vllm_kv_cache_manager(scenario: dict[str, Any]) -> None:
    pool = BlockPool(
        scenario["num_blocks"], scenario["block_size"], report_mode=scenario["report_mode"]
    )
    running: dict[str, Any] = {}
    for i, (op, want) in enumerate(zip(scenario["ops"], scenario["results"], strict=True)):
        got = model_apply(pool, running, op)
        assert got == unjson(want), f"step {i}: {op}"


def apply_events(state: dict[Any, int], events: list[dict[str, Any]]) -> None:
    """What a subscriber keeps: hash -> count of physical copies."""
    for e in events:
        if e["type"] == "BlockStored":
            for h in e["block_hashes"]:
                state[h] = state.get(h, 0) + 1
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                assert state.get(h, 0) > 0, f"removed unknown {h}"
                state[h] -= 1
                if state[h] == 0:
                    del state[h]
        else:
            state.clear()


def test_repeated_request_hits_its_prefix() -> None:
    pool = BlockPool(64, 4)
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    first = pool.run(prompt)
    assert first == [stored(pool.block_hashes(prompt), None, prompt[:16], 4)]
    handle = pool.begin(prompt)
    assert handle.num_hit_blocks == 4 and handle.events == []
    pool.finish(handle)
    aligned = pool.begin(prompt[:16])  # never the last token: block 3 is recomputed
    assert aligned.num_hit_blocks == 3
    h = pool.block_hashes(prompt)
    assert aligned.events == [stored([h[3]], h[2], prompt[12:16], 4)]
    assert pool.cached()[h[3]] == 2  # a duplicate
    pool.finish(aligned)
    assert pool.tokens_of(h[2]) == tuple(prompt[:12])


def test_eviction_is_lru_and_tail_first() -> None:
    pool = BlockPool(7, 2)  # six usable blocks
    a, b = list(range(6)), list(range(10, 16))
    ha, hb = pool.block_hashes(a), pool.block_hashes(b)
    pool.run(a)
    pool.run(b)
    # Free queue now: a's chain tail-first, then b's. Two new blocks evict a2, a1.
    events = pool.run([90, 91, 92, 93])
    assert [e for e in events if e["type"] == "BlockRemoved"] == [
        removed([ha[2]]),
        removed([ha[1]]),
    ]
    assert set(pool.cached()) == {ha[0], *hb, *pool.block_hashes([90, 91, 92, 93])}


def test_partial_block_is_reused_first() -> None:
    pool = BlockPool(5, 2)  # four usable
    pool.run([1, 2, 3])  # one full block + a partial one, freed to the head
    events = pool.run([7, 8])  # one block: the partial one, nothing evicted
    assert [e["type"] for e in events] == ["BlockStored"]
    assert pool.block_hashes([1, 2])[0] in pool.cached()


def test_concurrent_requests_duplicate_and_each_copy_is_removed() -> None:
    pool = BlockPool(9, 2)  # eight usable
    prompt = [1, 2, 3]
    a, b = pool.begin(prompt), pool.begin(prompt)
    assert b.num_hit_blocks == 1
    assert pool.reset() == []  # refused while requests run
    pool.extend(a, [4])
    pool.extend(b, [4])
    h = pool.block_hashes([1, 2, 3, 4])
    assert pool.cached() == {h[0]: 1, h[1]: 2}
    pool.finish(a)
    pool.finish(b)
    events = pool.run(list(range(100, 116)))  # all eight blocks
    removed_hashes = [e["block_hashes"][0] for e in events if e["type"] == "BlockRemoved"]
    assert sorted(removed_hashes) == sorted([h[0], h[1], h[1]])
    assert pool.reset() == [cleared()]
    assert pool.cached() == {}


def test_pool_exhausted_changes_nothing() -> None:
    pool = BlockPool(4, 4)  # three usable
    a = pool.begin(range(8))
    before = (pool.cached(), pool.num_free_blocks)
    with pytest.raises(PoolExhausted):
        pool.begin(range(100, 108))
    with pytest.raises(PoolExhausted):
        pool.extend(a, range(8, 16))
    assert (pool.cached(), pool.num_free_blocks) == before
    assert pool.take_events() == a.events
    pool.finish(a)
    with pytest.raises(ValueError, match="not running"):
        pool.finish(a)


def test_hash_options() -> None:
    tokens = list(range(8))
    default = BlockPool(8, 4).block_hashes(tokens)
    assert BlockPool(8, 4, "vllm-none-hash").block_hashes(tokens) == default
    assert BlockPool(8, 4, 42).block_hashes(tokens) != default
    raw = BlockPool(8, 4, int_hashes=False)
    as_bytes = [h for h in raw.block_hashes(tokens) if isinstance(h, bytes) and len(h) == 32]
    assert [int.from_bytes(h, "big") & (2**64 - 1) for h in as_bytes] == default
    events = raw.run(tokens)
    assert decode_batch(encode_batch(events, ts=0.0, rank=0)).events == events


@pytest.mark.parametrize("seed", range(6))
def test_events_replayed_reproduce_cached(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    pool = BlockPool(rng.randint(6, 24), bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    state: dict[Any, int] = {}
    running = []
    for _ in range(120):
        action = rng.random()
        try:
            if action < 0.45:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(50) for _ in range(rng.randint(1, 9))
                ]
                running.append(pool.begin(tokens, cache_salt=rng.choice([None, None, "s"])))
            elif action < 0.65 and running:
                pool.extend(
                    rng.choice(running), [rng.randrange(3) for _ in range(rng.randint(1, 3))]
                )
            elif action < 0.97 and running:
                pool.finish(running.pop(rng.randrange(len(running))))
            elif not running:
                assert pool.reset() == [cleared()]
        except PoolExhausted:
            pass
        events = pool.take_events()
        apply_events(state, events)
        assert state == pool.cached()
        held = {b for h in running for b in h.blocks}
        assert pool.num_free_blocks + len(held) == pool.num_blocks - 1
        for e in events:
            if e["type"] != "BlockStored":
                continue
            assert len(e["token_ids"]) == bs * len(e["block_hashes"])
            prefix = pool.tokens_of(e["parent_block_hash"]) if e["parent_block_hash"] else ()
            for i, h in enumerate(e["block_hashes"]):
                prefix = prefix + tuple(e["token_ids"][i * bs : (i + 1) * bs])
                assert pool.tokens_of(h) == prefix


def test_model_events_through_the_publisher(net: Net, pub: KvEventPublisher) -> None:
    sub = net.sub(pub)
    pool = BlockPool(6, 2)
    steps = [pool.run([1, 2, 3, 4, 5]), pool.run(list(range(20, 28))), pool.reset()]
    for events in steps:
        pub.publish(events)
    state: dict[Any, int] = {}
    for events in steps:
        got = decode_batch(recv(sub)[2]).events
        assert got == events
        apply_events(state, got)
    assert state == pool.cached() == {}


# -- provenance: the golden file is what the installed vLLM makes -----------------------------


def _without_ports(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    doc["provenance"].pop("generator_source")
    wire = doc["wire"]
    for key in ("endpoint", "replay_endpoint"):
        wire.pop(key)
        wire["kv_event_sources"]["0"].pop(key)
    return doc


@pytest.mark.vllm
def test_golden_file_regenerates_with_installed_vllm(tmp_path: Path, vllm_python: Path) -> None:
    script = tmp_path / "gen.py"
    script.write_text("\n".join(GOLDEN["provenance"]["generator_source"]) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    done = subprocess.run(
        [str(vllm_python), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(done.stdout)
    assert _without_ports(fresh) == _without_ports(GOLDEN)
