"""Subscribing to engines' KV-cache events and feeding them to a :class:`kvroute.Router`.

vLLM publishes each data-parallel rank's events on a ZMQ PUB socket as messages of three
frames, ``[topic, seq (8 bytes, big-endian), msgpack batch]``, and can keep the last batches
for a ROUTER *replay* socket. :class:`Subscriber` holds one SUB socket per (instance, rank)
on one thread and applies every batch, in order, with :meth:`kvroute.Router.apply_kv_events`
(decoded in the Rust core). When a batch's sequence number skips ahead, the missing batches
are asked from the replay socket (a DEALER sends the first missing number, the ROUTER sends
back every buffered batch from it and an end marker with sequence -1); when they cannot be
had (no replay socket, the replay starts too late, or it times out), the rank's view is
marked degraded (:meth:`~kvroute.Router.kv_resync`) and the router routes that instance on
its estimate until the view is whole again (``docs/kv-events.md``). A batch that cannot be
decoded is a gap of one batch. Nothing is dropped without a count.

:func:`event_sources` turns an engine's ``GET /kv_event_sources`` answer into sources.

Thread-safety: the public methods may be called from any thread; every socket lives on the
subscriber's thread (commands reach it through a queue). Per batch: O(its bytes) to decode
and O(its blocks) to apply.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import zmq

import kvroute
from kvroute.errors import InvalidArgumentError, KvrouteError

if TYPE_CHECKING:
    from kvroute._core import KvApplied

log = logging.getLogger("kvroute.kv_events")

#: The replay socket's end-of-replay sequence number.
END_OF_REPLAY = -1
#: Hosts in an endpoint that mean "every interface" (the engine binds; connect to its host).
WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
#: Longest wait for a replay's next message, in seconds.
REPLAY_TIMEOUT_S = 2.0
#: How often a source's decode errors are logged at most, in seconds.
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Source:
    """Where one rank of one engine publishes."""

    rank: int
    endpoint: str
    replay: str | None = None
    topic: str = ""
    #: The engine connects to ``endpoint`` (a concrete host): the subscriber binds it.
    bind: bool = False


def _with_host(endpoint: str, host: str) -> tuple[str, bool]:
    """``endpoint`` with a wildcard host replaced by ``host``; and whether to bind it."""
    if not endpoint.startswith("tcp://"):
        return endpoint, False  # ipc:// and inproc://: the engine binds, on this machine
    where = endpoint[len("tcp://") :]
    at, _, port = where.rpartition(":")
    if not port.isdigit():
        raise InvalidArgumentError(f"KV-events endpoint {endpoint!r} has no port")
    if at in WILDCARDS:
        name = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{name}:{port}", False
    return endpoint, True


def event_sources(answer: Any, backend_url: str) -> list[Source]:
    """The sources in an engine's ``GET /kv_event_sources`` answer (``{rank: config}``);
    wildcard hosts are the backend's. Ranks whose events are off are left out."""
    if not isinstance(answer, dict):
        raise InvalidArgumentError(f"/kv_event_sources of {backend_url} is not an object")
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    out = []
    for rank, config in sorted(answer.items(), key=lambda kv: int(kv[0])):
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events", True):
            continue
        if config.get("publisher", "zmq") != "zmq" or not config.get("endpoint"):
            continue
        endpoint, bind = _with_host(str(config["endpoint"]), host)
        replay = config.get("replay_endpoint")
        replay = _with_host(str(replay), host)[0] if replay else None
        out.append(Source(int(rank), endpoint, replay, str(config.get("topic") or ""), bind))
    return out


@dataclass
class SourceStats:
    """What a subscriber saw from one source (besides what the router's view counts)."""

    messages: int = 0
    decode_errors: int = 0
    replays: int = 0
    replay_failures: int = 0
    #: Batches a test asked to lose (:meth:`Subscriber.drop_next`).
    dropped: int = 0


@dataclass
class _Sub:
    instance: int
    source: Source
    socket: zmq.Socket[bytes]
    stats: SourceStats = field(default_factory=SourceStats)
    drop: int = 0
    logged_at: float = 0.0


class Subscriber:
    """The KV-event subscriptions of one router (see the module doc)."""

    def __init__(self, router: kvroute.Router, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        if router.cache_view != "events":
            raise InvalidArgumentError(
                "a KV-event subscriber needs a router with cache_view='events'"
            )
        self.router = router
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.Context()
        self._commands: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self._subs: dict[int, list[_Sub]] = {}
        self._stats: dict[tuple[int, int], SourceStats] = {}
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvroute-kv-events", daemon=True)
        self._thread.start()

    # -- the public side (any thread) ------------------------------------------------------

    def watch(self, instance: int, sources: list[Source]) -> None:
        """Subscribe to ``instance``'s sources (replacing any it had)."""
        self._commands.put(("watch", instance, list(sources)))

    def unwatch(self, instance: int) -> None:
        """Stop listening to ``instance``."""
        self._commands.put(("unwatch", instance, None))

    def drop_next(self, instance: int, batches: int) -> None:
        """Test hook: lose ``instance``'s next ``batches`` live batches (each rank's), from the
        moment this returns."""
        self._commands.put(("drop", instance, batches))
        self.sync()

    def sync(self, timeout: float = 5.0) -> None:
        """Wait until the commands sent so far have been carried out."""
        done = threading.Event()
        self._commands.put(("sync", 0, done))
        if not done.wait(timeout):
            raise TimeoutError("the KV-event subscriber did not answer")

    def stats(self) -> dict[tuple[int, int], SourceStats]:
        """Per ``(instance, rank)``: a copy of what was seen."""
        return {k: SourceStats(**vars(v)) for k, v in list(self._stats.items())}

    def close(self) -> None:
        """Stop the thread and close every socket."""
        if self._running:
            self._running = False
            self._thread.join(timeout=5.0)
            self._ctx.destroy(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the subscriber's thread -----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], _Sub] = {}
        while self._running:
            self._commands_in(poller, by_socket)
            for sock, _ in poller.poll(50):
                sub = by_socket.get(sock)
                for _ in range(1000):  # then let the other sources and commands in
                    if sub is None:
                        break
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._message(sub, frames)
                    except Exception as exc:  # the thread must outlive any one message
                        self._bad(sub, None, f"{type(exc).__name__}: {exc}")
        for subs in self._subs.values():
            for sub in subs:
                sub.socket.close(linger=0)

    def _commands_in(self, poller: zmq.Poller, by_socket: dict[zmq.Socket[bytes], _Sub]) -> None:
        while True:
            try:
                what, instance, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if what == "sync":
                arg.set()
            elif what == "drop":
                for sub in self._subs.get(instance, []):
                    sub.drop += arg
            else:
                for sub in self._subs.pop(instance, []):
                    poller.unregister(sub.socket)
                    by_socket.pop(sub.socket, None)
                    sub.socket.close(linger=0)
                if what == "watch":
                    subs = []
                    for source in arg:
                        try:
                            subs.append(self._open(instance, source))
                        except zmq.ZMQError as exc:
                            log.error(
                                "instance %d: cannot listen to %s: %s",
                                instance,
                                source.endpoint,
                                exc,
                            )
                    self._subs[instance] = subs
                    for sub in subs:
                        poller.register(sub.socket, zmq.POLLIN)
                        by_socket[sub.socket] = sub

    def _open(self, instance: int, source: Source) -> _Sub:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        if source.bind:
            sock.bind(source.endpoint)
        else:
            sock.connect(source.endpoint)
        stats = self._stats.setdefault((instance, source.rank), SourceStats())
        log.info("instance %d rank %d: KV events from %s", instance, source.rank, source.endpoint)
        return _Sub(instance, source, sock, stats)

    def _message(self, sub: _Sub, frames: list[bytes]) -> None:
        sub.stats.messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(sub, None, f"a message of {len(frames)} frames, not [topic, seq, batch]")
            return
        seq = int.from_bytes(frames[1], "big")
        if sub.drop > 0:
            sub.drop -= 1
            sub.stats.dropped += 1
            return
        got = self._apply(sub, seq, frames[2], replayed=False)
        if got is not None and got["outcome"] == "gap":
            expected = got["expected"]
            assert expected is not None
            self._repair(sub, expected, seq, frames[2])

    def _apply(self, sub: _Sub, seq: int, payload: bytes, replayed: bool) -> KvApplied | None:
        try:
            got = self.router.apply_kv_events(sub.instance, seq, payload, replayed=replayed)
        except InvalidArgumentError as exc:
            self._bad(sub, seq, str(exc))
            return None
        if got["degraded"] or got["reset"]:
            view = self.router.kv_view(sub.instance)
            state = (
                next((r for r in view["ranks"] if r["rank"] == sub.source.rank), None)
                if view
                else None
            )
            what = "reset (the engine restarted)" if got["reset"] else "degraded"
            log.warning(
                "instance %d rank %d: view %s: %s",
                sub.instance,
                sub.source.rank,
                what,
                state and state["reason"],
            )
        return got

    def _bad(self, sub: _Sub, seq: int | None, why: str) -> None:
        """A batch that cannot be applied: counted, logged now and then, and a gap."""
        sub.stats.decode_errors += 1
        now = time.monotonic()
        if now - sub.logged_at >= LOG_INTERVAL_S:
            sub.logged_at = now
            log.error(
                "instance %d rank %d: %s (%d so far)",
                sub.instance,
                sub.source.rank,
                why,
                sub.stats.decode_errors,
            )
        self._resync(sub, f"batch {seq} could not be applied: {why}")

    def _resync(self, sub: _Sub, reason: str) -> None:
        log.warning("instance %d rank %d: view degraded: %s", sub.instance, sub.source.rank, reason)
        try:
            self.router.kv_resync(sub.instance, sub.source.rank, reason)
        except KvrouteError as exc:
            log.error("instance %d: %s", sub.instance, exc)

    def _repair(self, sub: _Sub, expected: int, seq: int, payload: bytes) -> None:
        """Batches ``expected..seq-1`` are missing: replay them, or degrade; then apply
        batch ``seq``."""
        missing = f"batches {expected}..{seq - 1}"
        if sub.source.replay is None:
            self._resync(sub, f"{missing} were missed and the engine has no replay socket")
        else:
            sub.stats.replays += 1
            failure = self._replay(sub, expected, seq)
            if failure is not None:
                sub.stats.replay_failures += 1
                self._resync(sub, f"{missing} were missed and could not be replayed: {failure}")
        got = self._apply(sub, seq, payload, replayed=False)
        if got is not None and got["outcome"] == "gap":
            self._resync(sub, f"batches {got['expected']}..{seq - 1} were missed")
            self._apply(sub, seq, payload, replayed=False)

    def _replay(self, sub: _Sub, start: int, stop: int) -> str | None:
        """Apply the batches ``start..stop-1`` from the replay socket (the later ones come
        live); why that failed, or None."""
        assert sub.source.replay is not None
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(sub.source.replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            first = None
            while True:
                if not dealer.poll(int(self.replay_timeout_s * 1000)):
                    return f"no answer from {sub.source.replay} in {self.replay_timeout_s} s"
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return f"a replay message of {len(frames)} frames"
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if seq >= stop:
                    continue
                first = seq if first is None else first
                got = self._apply(sub, seq, frames[3], replayed=True)
                if got is not None and got["outcome"] == "gap":
                    return f"the replay begins at batch {first}, after {got['expected']}"
            return None if first == start else f"the replay has no batch {start}"
        finally:
            dealer.close(linger=0)


@dataclass
class RankTally:
    """What one rank published, as :class:`Tally` counts it."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    ignored: int = 0
    cleared: int = 0
    #: Jumps in the sequence numbers, the batches they skipped, and restarts (backwards).
    gaps: int = 0
    missed: int = 0
    restarts: int = 0
    last_seq: int | None = None
    #: The last batch's timestamp to the moment it was counted, in seconds.
    lag_s: float = 0.0


class Tally:
    """Counts of a stream of messages per rank, decoded by the core (for summaries)."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankTally] = {}
        self.bad_messages = 0

    def add(self, frames: list[bytes]) -> None:
        """Count one ``[topic, seq, batch]`` message."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            got = kvroute._core.decode_kv_events(frames[2])
        except InvalidArgumentError:
            self.bad_messages += 1
            return
        t = self.ranks.setdefault(got["rank"], RankTally())
        if t.last_seq is not None and seq != t.last_seq + 1:
            if seq > t.last_seq:
                t.gaps += 1
                t.missed += seq - t.last_seq - 1
            else:
                t.restarts += 1
        t.last_seq = seq
        t.batches += 1
        for name in ("stored", "removed", "ignored", "cleared"):
            setattr(t, name, getattr(t, name) + got[name])
        t.lag_s = time.time() - got["ts"]
