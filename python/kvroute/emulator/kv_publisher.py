"""vLLM's KV-cache event publisher (``ZmqEventPublisher``) and its wire format, for the
emulator (``kvroute engine --kv-events``, which publishes its engine model's stores and
evictions) and for tests (byte-exact against vLLM itself, with knobs for gaps and restarts).

What it holds:

- the event helpers :func:`stored`, :func:`removed`, :func:`cleared`, which build events as the
  plain dicts a subscriber gets from decoding vLLM 0.32's msgpack (tag field ``"type"`` first,
  fields in vLLM's declaration order, fields at their default ``None`` left out, as msgspec's
  ``omit_defaults=True`` does);
- :func:`encode_batch` / :func:`decode_batch`: a ``KVEventBatch`` payload, byte-for-byte what
  ``msgspec.msgpack.Encoder().encode(KVEventBatch(...))`` makes (checked against
  ``tests/data/kv_events_golden.json``, made by vLLM itself); ``encoding="array"`` gives the
  layout of older vLLM releases, whose events were msgspec ``array_like`` structs
  (``["BlockStored", block_hashes, parent_block_hash, ...]``: every field, in order, defaults
  included, since msgspec's ``omit_defaults`` does not apply to ``array_like`` structs), here
  with 0.32's fields (older releases had fewer: 0.9's BlockStored stopped at ``lora_id``);
- :class:`KvEventPublisher`: the sockets and the protocol of ``ZmqEventPublisher`` (vLLM 0.32,
  ``vllm/distributed/kv_events.py``), with knobs for making gaps and restarts:

  * PUB: multipart ``[topic, seq (8-byte big-endian unsigned), payload]``, seq from 0;
  * replay, a ROUTER: a DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` and gets, for
    every buffered batch with ``seq >= start_seq``, ``[b"", topic, seq, payload]``, then the end
    marker ``[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]``; a request that is not
    three frames at the ROUTER is ignored (vLLM logs it and answers nothing);
  * a replay buffer of the last ``buffer_steps`` batches (vLLM's ``deque(maxlen=...)``).

Where it differs from vLLM, on purpose: it binds ``tcp://127.0.0.1:<free port>`` (vLLM binds
only endpoints with a ``*``, ``::``, ``ipc://`` or ``inproc://`` and *connects* to others); its
PUB socket is an XPUB, the same on the wire to a SUB, so that
:meth:`KvEventPublisher.wait_for_subscribers` can tell when a subscription has arrived (a plain
PUB drops what it sends before then: the "slow joiner"); it sends synchronously in
:meth:`KvEventPublisher.publish`, where vLLM queues the batch for a publisher thread; it answers
replay on its own thread at once, where vLLM's thread looks for replay requests between
batches (up to 0.1 s later when idle).

Thread-safety: every public method may be called from any thread (one lock around the PUB
socket and the buffer). Per batch O(its events) to encode.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import msgpack  # type: ignore[import-untyped]
import zmq

Event = dict[str, Any]
"""One KV-cache event in vLLM 0.32's map form, e.g. ``{"type": "AllBlocksCleared"}``."""
BlockHash = int | bytes
"""An external block hash: a uint64 (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or
the engine's 32-byte hash (``=0``)."""
Encoding = Literal["map", "array"]

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay end marker."""

# vLLM 0.32's event structs: field names in declaration order, and whether each has a default
# (all defaults are None). Required fields are always encoded, even when None.
FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "BlockStored": (
        ("block_hashes", False),
        ("parent_block_hash", False),
        ("token_ids", False),
        ("block_size", False),
        ("lora_id", False),
        ("medium", False),
        ("lora_name", False),
        ("extra_keys", True),
        ("group_idx", True),
        ("kv_cache_spec_kind", True),
        ("kv_cache_spec_sliding_window", True),
        ("locality", True),
        ("ownership", True),
        ("session_id", True),
    ),
    "BlockRemoved": (
        ("block_hashes", False),
        ("medium", False),
        ("group_idx", True),
        ("locality", True),
        ("ownership", True),
    ),
    "AllBlocksCleared": (),
}


def _plain(value: Any) -> Any:
    """Tuples as lists, as they come back from msgpack."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def normalize(event: Mapping[str, Any]) -> Event:
    """``event`` as a subscriber decodes it from vLLM 0.32: ``"type"`` first, then the fields
    in declaration order, optional fields that are ``None`` left out, tuples as lists.

    Raises ``ValueError`` on an unknown type or field, or a missing required field."""
    kind = event.get("type")
    if not isinstance(kind, str) or kind not in FIELDS:
        raise ValueError(f"unknown KV event type {kind!r}")
    fields = FIELDS[kind]
    unknown = set(event) - {"type"} - {name for name, _ in fields}
    if unknown:
        raise ValueError(f"{kind} has no field(s) {sorted(unknown)}")
    out: Event = {"type": kind}
    for name, optional in fields:
        if name not in event:
            if optional:
                continue
            raise ValueError(f"{kind} needs field {name!r}")
        value = event[name]
        if optional and value is None:
            continue
        out[name] = _plain(value)
    return out


def stored(
    hashes: Sequence[BlockHash],
    parent: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    **extra: Any,
) -> Event:
    """A ``BlockStored`` as vLLM 0.32's ``KVCacheManager`` emits it for a plain text request on
    a full-attention model: ``lora_id``/``lora_name`` None, ``medium`` "GPU", ``extra_keys`` one
    ``None`` per block, ``group_idx`` 0, ``kv_cache_spec_kind`` "full_attention". ``extra``
    overrides or adds fields (``extra_keys=None``, ``group_idx=None`` ... leave them out)."""
    event: Event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": FULL_ATTENTION,
    }
    event.update(extra)
    return normalize(event)


def removed(hashes: Sequence[BlockHash], **extra: Any) -> Event:
    """A ``BlockRemoved`` as vLLM 0.32 emits it (one per evicted block): ``medium`` "GPU",
    ``group_idx`` 0; ``extra`` overrides or adds fields."""
    event: Event = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": MEDIUM_GPU}
    event["group_idx"] = 0
    event.update(extra)
    return normalize(event)


def cleared() -> Event:
    """An ``AllBlocksCleared`` (vLLM emits it when the prefix cache is reset)."""
    return {"type": "AllBlocksCleared"}


def encode_event(event: Mapping[str, Any], encoding: Encoding = "map") -> Any:
    """The msgpack-ready form of one event: the normalized dict (``"map"``, vLLM 0.32), or
    ``[type, every field in order]`` (``"array"``: msgspec's ``array_like=True``, older vLLM;
    ``omit_defaults`` leaves nothing out of an array)."""
    ev = normalize(event)
    if encoding == "map":
        return ev
    if encoding != "array":
        raise ValueError(f"unknown encoding {encoding!r}")
    return [ev["type"], *(ev.get(name) for name, _ in FIELDS[ev["type"]])]


def encode_batch(
    events: Iterable[Mapping[str, Any]],
    *,
    ts: float,
    rank: int | None,
    encoding: Encoding = "map",
) -> bytes:
    """A ``KVEventBatch`` payload: msgpack ``[ts (float64), [events...], data_parallel_rank]``
    (``EventBatch`` is ``array_like``, so a ``None`` rank is sent as nil; vLLM's publisher
    always fills it in)."""
    body = [float(ts), [encode_event(e, encoding) for e in events], rank]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


@dataclass(frozen=True)
class Batch:
    """A decoded ``KVEventBatch``; events in map form whichever encoding they came in."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None


def decode_event(raw: Any) -> Event:
    """One decoded event, map or array form, as a normalized map."""
    if isinstance(raw, dict):
        return normalize(raw)
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in FIELDS:
        fields = FIELDS[raw[0]]
        if len(raw) - 1 > len(fields):
            raise ValueError(f"{raw[0]} has {len(raw) - 1} fields, at most {len(fields)}")
        values = dict(zip((name for name, _ in fields), raw[1:], strict=False))
        return normalize({"type": raw[0], **values})
    raise ValueError(f"not a KV event: {raw!r}")


def decode_batch(payload: bytes) -> Batch:
    """Decode a payload from vLLM (any encoding; a two-element batch, as before vLLM added
    ``data_parallel_rank``, gives rank None) or from :func:`encode_batch`."""
    body = msgpack.unpackb(payload, raw=False)
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise ValueError(f"not a KVEventBatch: {body!r}")
    rank = body[2] if len(body) == 3 else None
    return Batch(float(body[0]), [decode_event(e) for e in body[1]], rank)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes, big-endian, unsigned."""
    return seq.to_bytes(8, "big")


class KvEventPublisher:
    """vLLM's ``ZmqEventPublisher`` (see the module docstring for the protocol).

    ``publish`` assigns the next sequence number (from 0), keeps the payload in the replay
    buffer and sends it on the PUB socket, unless :meth:`drop_next` asked to drop it (it stays
    in the buffer: a gap that replay can fill). :meth:`restart` is an engine restart: sequence
    numbers start again at 0 and the buffer is emptied (the sockets stay). The replay socket,
    if any, is served on a background thread. Methods may be called from any thread.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        *,
        replay: bool = True,
        buffer_steps: int = 10_000,
        topic: str = "",
        encoding: Encoding = "map",
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        host: str = "127.0.0.1",
    ) -> None:
        self.encoding: Encoding = encoding
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self.replay_paused = False
        """While True, replay requests wait unanswered (queued at the ROUTER)."""
        self.replay_requests: list[int] = []
        """The ``start_seq`` of every replay request answered, in order."""

        self._topic = topic.encode("utf-8")
        self._lock = threading.Lock()
        self._seq = 0
        self._drop = 0
        self._subscriptions = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._router: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.endpoint = self._bind(self._pub, host)
            self.replay_endpoint: str | None = None
            if replay:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._router, host)
                self._thread = threading.Thread(
                    target=self._serve_replay, name="kv-replay", daemon=True
                )
                self._thread.start()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], host: str) -> str:
        sock.bind(f"tcp://{host}:*")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    # -- publishing --------------------------------------------------------------------------

    def publish(
        self,
        events: Iterable[Mapping[str, Any]],
        rank: int | None = None,
        ts: float | None = None,
    ) -> int:
        """Publish one batch of events (map-form dicts, see :func:`stored`), encoded with
        ``self.encoding``; ``rank`` defaults to ``data_parallel_rank`` (vLLM fills a missing
        rank with the publisher's), ``ts`` to now. Returns its sequence number."""
        payload = encode_batch(
            events,
            ts=time.time() if ts is None else ts,
            rank=self.data_parallel_rank if rank is None else rank,
            encoding=self.encoding,
        )
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Publish ``payload`` as is (for malformed or hand-made batches); returns its seq."""
        with self._lock:
            if self._closed:
                raise RuntimeError("Publisher is closed")
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._drop > 0:
                self._drop -= 1
            else:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            return seq

    def drop_next(self, n: int = 1) -> None:
        """Do not send the next ``n`` batches on PUB (they still get a seq and are buffered for
        replay), so subscribers see a gap. Adds to drops still pending."""
        if n < 0:
            raise ValueError("n must be >= 0")
        with self._lock:
            self._drop += n

    def restart(self) -> None:
        """Act as a restarted engine: the next batch is seq 0 and the replay buffer is empty.
        Pending :meth:`drop_next` drops are kept; sockets and subscriptions stay."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        with self._lock:
            return self._seq

    def buffered(self) -> list[tuple[int, bytes]]:
        """The replay buffer: ``(seq, payload)``, oldest first."""
        with self._lock:
            return list(self._buffer)

    @property
    def subscriptions(self) -> int:
        """Subscriptions seen so far (see :meth:`wait_for_subscribers`)."""
        self.wait_for_subscribers(0, timeout=0)
        with self._lock:
            return self._subscriptions

    def wait_for_subscribers(self, n: int = 1, timeout: float = 1.0) -> bool:
        """Wait until ``n`` subscriptions have reached the PUB socket since it was made (each
        SUB's ``SUBSCRIBE`` counts once per topic it subscribes to); False on timeout. Publish
        only after this, or a PUB socket drops the batches (a SUB that joins late must replay).
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                while self._pub.poll(0):
                    frame = self._pub.recv()
                    if frame[:1] == b"\x01":
                        self._subscriptions += 1
                if self._subscriptions >= n:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.005, left))

    # -- replay ------------------------------------------------------------------------------

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while not self._stop.is_set():
            if self.replay_paused:
                time.sleep(0.005)
                continue
            # Look at the flag again once a request is here: pausing, then requesting, is
            # then never answered while paused.
            if not router.poll(20) or self.replay_paused:
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM: logger.warning("Invalid replay request: ...")
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                batches = [(seq, buf) for seq, buf in self._buffer if seq >= start_seq]
                self.replay_requests.append(start_seq)  # before the client can see the end
            for seq, buf in batches:
                router.send_multipart((client_id, b"", self._topic, seq_bytes(seq), buf))
            router.send_multipart((client_id, b"", b"", END_SEQ, b""))

    # -- discovery ---------------------------------------------------------------------------

    def kv_event_sources(self, *, wildcard: bool = False) -> dict[str, dict[str, Any]]:
        """What vLLM's ``GET /kv_event_sources`` returns for an engine with this publisher:
        ``{"<dp rank>": KVEventsConfig as JSON}``, with the endpoints the publisher resolved.
        ``wildcard=True`` reports them as ``tcp://*:<port>``, as vLLM does when configured
        with ``"endpoint": "tcp://*:5557"`` (the reader must put the engine's host in)."""
        endpoint, replay = self.endpoint, self.replay_endpoint
        if wildcard:
            endpoint = "tcp://*:" + endpoint.rsplit(":", 1)[1]
            if replay is not None:
                replay = "tcp://*:" + replay.rsplit(":", 1)[1]
        return {
            str(self.data_parallel_rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "buffer_steps": self.buffer_steps,
                "hwm": self.hwm,
                "max_queue_size": self.max_queue_size,
                "topic": self.topic,
            }
        }

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def kv_event_sources(*publishers: KvEventPublisher, wildcard: bool = False) -> dict[str, Any]:
    """``GET /kv_event_sources`` of one engine with several DP ranks (one publisher each)."""
    out: dict[str, Any] = {}
    for p in publishers:
        out.update(p.kv_event_sources(wildcard=wildcard))
    return out
