"""The subscriber of a router to its engines' KV events (the package doc says how it works).

Thread-safety: the public methods may be called from any thread; every live socket lives on
the subscriber's thread (commands reach it through a queue), each replay's DEALER on its own
thread, whose batches come back to the subscriber's thread to be applied. Per batch: O(its
bytes) to decode and O(its blocks) to apply.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

import kvroute
from kvroute.errors import InvalidArgumentError, KvrouteError
from kvroute.kv_events.replay import (
    MAX_REPLAY_RESUMES,
    MAX_WAITING_BYTES,
    REPLAY_DEADLINE_S,
    REPLAY_TIMEOUT_S,
    Replay,
    ask_replay,
)
from kvroute.kv_events.sources import Source

if TYPE_CHECKING:
    from kvroute._core import KvApplied

log = logging.getLogger("kvroute.kv_events")

#: Largest message taken from a publisher (a vLLM batch is well under 1 MiB).
MAX_MESSAGE_BYTES = 16 << 20
#: Messages ZMQ keeps waiting per socket.
RECEIVE_QUEUE = 64
#: How often a source's decode errors are logged at most, in seconds.
LOG_INTERVAL_S = 10.0


@dataclass
class SourceStats:
    """What a subscriber saw from one source (besides what the router's view counts)."""

    messages: int = 0
    decode_errors: int = 0
    replays: int = 0
    replay_failures: int = 0
    #: Times the socket was opened again after its connection was dropped (a message over
    #: the size limit ends a connection for good in ZMQ).
    reopened: int = 0
    #: Batches a test asked to lose (:meth:`Subscriber.drop_next`).
    dropped: int = 0


@dataclass
class _Sub:
    instance: int
    source: Source
    socket: zmq.Socket[bytes]
    #: The socket's monitor (its disconnections), for a socket that connects.
    monitor: zmq.Socket[bytes] | None
    stats: SourceStats = field(default_factory=SourceStats)
    drop: int = 0
    logged_at: float = 0.0
    replay: Replay | None = None


class Subscriber:
    """The KV-event subscriptions of one router (see the module doc)."""

    def __init__(
        self,
        router: kvroute.Router,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        *,
        replay_deadline_s: float = REPLAY_DEADLINE_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if router.cache_view != "events":
            raise InvalidArgumentError(
                "a KV-event subscriber needs a router with cache_view='events'"
            )
        self.router = router
        self.replay_timeout_s = replay_timeout_s
        self.replay_deadline_s = replay_deadline_s
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.Context()
        self._commands: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        #: Replays whose thread is done, for the subscriber's thread to apply.
        self._replayed: queue.SimpleQueue[tuple[_Sub, Replay]] = queue.SimpleQueue()
        self._replay_threads: list[threading.Thread] = []
        #: The subscriber's thread's own: its poller and what each polled socket is.
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[bytes], _Sub] = {}
        self._by_monitor: dict[zmq.Socket[bytes], _Sub] = {}
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
            for t in self._replay_threads:
                t.join(timeout=5.0)
            self._ctx.destroy(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the subscriber's thread -----------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            self._commands_in()
            self._replays_in()
            for sock, _ in self._poller.poll(50):
                if sock in self._by_monitor:
                    self._monitor_event(self._by_monitor[sock])
                    continue
                sub = self._by_socket.get(sock)
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
                self._forget(sub)

    def _commands_in(self) -> None:
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
                    sub.replay = None  # a replay in flight is not applied
                    self._forget(sub)
                if what == "watch":
                    self._subs[instance] = [
                        s for source in arg if (s := self._open(instance, source)) is not None
                    ]

    def _open(self, instance: int, source: Source) -> _Sub | None:
        stats = self._stats.setdefault((instance, source.rank), SourceStats())
        socket = self._socket(instance, source)
        if socket is None:
            return None
        sub = _Sub(instance, source, *socket, stats)
        self._listen(sub)
        log.info("instance %d rank %d: KV events from %s", instance, source.rank, source.endpoint)
        return sub

    def _socket(
        self, instance: int, source: Source
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None] | None:
        """A SUB socket for ``source`` and, when it connects, its monitor; None when it
        cannot be opened (logged)."""
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = None
        try:
            if source.bind:
                sock.bind(source.endpoint)
            else:
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                sock.connect(source.endpoint)
        except zmq.ZMQError as exc:
            log.error("instance %d: cannot listen to %s: %s", instance, source.endpoint, exc)
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            return None
        return sock, monitor

    def _listen(self, sub: _Sub) -> None:
        self._poller.register(sub.socket, zmq.POLLIN)
        self._by_socket[sub.socket] = sub
        if sub.monitor is not None:
            self._poller.register(sub.monitor, zmq.POLLIN)
            self._by_monitor[sub.monitor] = sub

    def _forget(self, sub: _Sub) -> None:
        self._poller.unregister(sub.socket)
        self._by_socket.pop(sub.socket, None)
        if sub.monitor is not None:
            self._poller.unregister(sub.monitor)
            self._by_monitor.pop(sub.monitor, None)
            sub.socket.disable_monitor()
            sub.monitor.close(linger=0)
        sub.socket.close(linger=0)

    def _monitor_event(self, sub: _Sub) -> None:
        """The connection of ``sub``'s socket was dropped: ZMQ reconnects after a network
        error but not after a protocol error (a message over the size limit), so the socket
        is opened again either way (what it missed is a gap, as any)."""
        assert sub.monitor is not None
        try:
            event = recv_monitor_message(sub.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        socket = self._socket(sub.instance, sub.source)
        if socket is None:
            return
        log.warning(
            "instance %d rank %d: %s dropped the connection; listening again",
            sub.instance,
            sub.source.rank,
            sub.source.endpoint,
        )
        sub.stats.reopened += 1
        self._forget(sub)
        sub.socket, sub.monitor = socket
        self._listen(sub)

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
        self._live(sub, seq, frames[2])

    def _live(self, sub: _Sub, seq: int, payload: bytes) -> None:
        """A live batch: applied, or waiting while the rank's replay runs; a gap starts one."""
        replay = sub.replay
        if replay is not None:
            replay.waiting.append((seq, payload))
            replay.waiting_bytes += len(payload)
            if replay.waiting_bytes > MAX_WAITING_BYTES:
                sub.replay = None  # its thread's result is not taken
                self._replay_failed(sub, replay, f"over {MAX_WAITING_BYTES} bytes waited for it")
            return
        got = self._apply(sub, seq, payload, replayed=False)
        if got is None or got["outcome"] != "gap":
            return
        expected = got["expected"]
        assert expected is not None
        if sub.source.replay is None:
            missing = f"batches {expected}..{seq - 1}"
            self._resync(sub, f"{missing} were missed and the engine has no replay socket")
            self._apply(sub, seq, payload, replayed=False)
            return
        self._ask(sub, Replay(expected, seq, [(seq, payload)], len(payload)))

    def _ask(self, sub: _Sub, replay: Replay) -> None:
        """Ask for ``replay``'s batches on a thread of its own; the rank's live batches wait."""
        sub.stats.replays += 1
        sub.replay = replay
        thread = threading.Thread(
            target=self._fetch, args=(sub, replay), name="kvroute-kv-replay", daemon=True
        )
        self._replay_threads = [t for t in self._replay_threads if t.is_alive()] + [thread]
        thread.start()

    def _replays_in(self) -> None:
        """Apply the replays whose thread is done, then the live batches that waited."""
        while True:
            try:
                sub, replay = self._replayed.get_nowait()
            except queue.Empty:
                return
            if sub.replay is not replay:
                continue  # given up on already
            sub.replay = None
            missing, failure = self._apply_replayed(sub, replay)
            if missing < replay.stop:
                ended = replay.failure is None or replay.went_quiet
                if ended and missing > replay.start and replay.resumed < MAX_REPLAY_RESUMES:
                    # It broke off after some batches: ask again from the first one missing.
                    again = Replay(missing, replay.stop, replay.waiting, replay.waiting_bytes)
                    again.resumed = replay.resumed + 1
                    self._ask(sub, again)
                    continue
                self._replay_failed(sub, replay, replay.failure or failure)
            for seq, payload in replay.waiting:
                self._live(sub, seq, payload)

    def _apply_replayed(self, sub: _Sub, replay: Replay) -> tuple[int, str]:
        """Apply a replay's batches in order up to the first one missing (even from a replay
        that failed: what came is applied); that batch (``replay.stop``: none), and why."""
        missing = replay.start
        for seq, payload in replay.batches:
            if seq != missing:
                return missing, f"the replay has batch {seq} after {missing - 1}, not {missing}"
            got = self._apply(sub, seq, payload, replayed=True)
            if got is not None and got["outcome"] == "gap":
                return missing, f"batch {seq} of the replay is not the one expected"
            missing += 1  # applied, or undecodable (a gap of its own, already handled)
        return missing, f"the replay has no batch {missing}"

    def _replay_failed(self, sub: _Sub, replay: Replay, failure: str) -> None:
        sub.stats.replay_failures += 1
        missing = f"batches {replay.start}..{replay.stop - 1}"
        self._resync(sub, f"{missing} were missed and could not be replayed: {failure}")

    def _apply(self, sub: _Sub, seq: int, payload: bytes, replayed: bool) -> KvApplied | None:
        rank = sub.source.rank
        try:
            got = self.router.apply_kv_events(
                sub.instance, seq, payload, replayed=replayed, rank=rank
            )
        except InvalidArgumentError as exc:
            self._bad(sub, seq, str(exc))
            return None
        if got["outcome"] == "foreign":  # counted in the rank's view
            self._log_now_and_then(sub, f"batch {seq} names another rank than {rank}: refused")
        if got["degraded"] or got["reset"]:
            view = self.router.kv_view(sub.instance)
            state = next((r for r in view["ranks"] if r["rank"] == rank), None) if view else None
            what = "reset (the engine restarted)" if got["reset"] else "degraded"
            log.warning(
                "instance %d rank %d: view %s: %s",
                sub.instance,
                rank,
                what,
                state and state["reason"],
            )
        return got

    def _log_now_and_then(self, sub: _Sub, what: str) -> None:
        now = time.monotonic()
        if now - sub.logged_at >= LOG_INTERVAL_S:
            sub.logged_at = now
            log.error("instance %d rank %d: %s", sub.instance, sub.source.rank, what)

    def _bad(self, sub: _Sub, seq: int | None, why: str) -> None:
        """A batch that cannot be applied: counted, logged now and then, and a gap."""
        sub.stats.decode_errors += 1
        self._log_now_and_then(sub, f"{why} ({sub.stats.decode_errors} so far)")
        self._resync(sub, f"batch {seq} could not be applied: {why}")

    def _resync(self, sub: _Sub, reason: str) -> None:
        log.warning("instance %d rank %d: view degraded: %s", sub.instance, sub.source.rank, reason)
        try:
            self.router.kv_resync(sub.instance, sub.source.rank, reason)
        except KvrouteError as exc:
            log.error("instance %d: %s", sub.instance, exc)

    def _fetch(self, sub: _Sub, replay: Replay) -> None:
        """The replay's thread: ask for batches ``replay.start..`` and keep those before
        ``replay.stop`` in ``replay.batches``, or say in ``replay.failure`` why not; then hand
        the replay back to the subscriber's thread."""
        try:
            replay.failure = ask_replay(
                self._ctx,
                sub.source,
                replay,
                self.replay_timeout_s,
                self.replay_deadline_s,
                self.max_message_bytes,
                lambda: self._running,
            )
        except zmq.ZMQError as exc:
            replay.failure = f"ZMQ: {exc}"
        self._replayed.put((sub, replay))
