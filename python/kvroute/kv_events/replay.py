"""Asking an engine's replay socket for the batches a subscriber missed, on a thread of its
own: a DEALER sends the first missing sequence number; the ROUTER answers with every batch it
kept from there, then an end marker (sequence -1). Bounded in time (silence, overall
deadline) and in bytes. One call per replay; the socket is the calling thread's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvroute.kv_events.sources import Source

#: The replay socket's end-of-replay sequence number.
END_OF_REPLAY = -1
#: Longest wait for a replay's next message, in seconds.
REPLAY_TIMEOUT_S = 2.0
#: Longest a whole replay may take, in seconds.
REPLAY_DEADLINE_S = 10.0
#: Bytes of one rank's live batches kept while its replay runs, and of a replay's batches.
MAX_WAITING_BYTES = 64 << 20
#: Times a replay that broke off after some batches is asked again from where it broke (a
#: ROUTER drops what its peer has no room for: vLLM's sends its whole buffer at once).
MAX_REPLAY_RESUMES = 16


@dataclass
class Replay:
    """A replay in flight: batches ``start..stop-1`` asked on a thread of its own; the
    rank's live batches from ``stop`` on wait in ``waiting`` (``waiting_bytes`` of them)."""

    start: int
    stop: int
    waiting: list[tuple[int, bytes]] = field(default_factory=list)
    waiting_bytes: int = 0
    #: Set by the replay's thread: the batches it got, and why it failed (None: it did not).
    batches: list[tuple[int, bytes]] = field(default_factory=list)
    failure: str | None = None
    #: Whether it failed by going quiet (a ROUTER past its high-water mark may drop the end
    #: marker too), where asking again from what is missing may help.
    went_quiet: bool = False
    #: How many replays before this one asked for the same gap and broke off.
    resumed: int = 0


def ask_replay(
    ctx: zmq.Context[Any],
    source: Source,
    replay: Replay,
    timeout_s: float,
    deadline_s: float,
    max_message_bytes: int,
    running: Callable[[], bool],
) -> str | None:
    """Ask ``source``'s replay socket for batches ``replay.start..`` and keep those before
    ``replay.stop`` in ``replay.batches``; why that failed, or None. ``timeout_s``: longest
    silence; ``deadline_s``: longest replay; ``running``: False stops it."""
    assert source.replay is not None
    dealer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    deadline = time.monotonic() + deadline_s
    kept = 0
    try:
        dealer.connect(source.replay)
        dealer.send_multipart([b"", replay.start.to_bytes(8, "big")])
        while True:
            quiet_until = time.monotonic() + timeout_s
            while not dealer.poll(100):
                now = time.monotonic()
                if not running():
                    return "the subscriber is closing"
                if now > deadline:
                    return f"not done in {deadline_s} s"
                if now > quiet_until:
                    replay.went_quiet = True
                    return f"no answer from {source.replay} in {timeout_s} s"
            if time.monotonic() > deadline:
                return f"not done in {deadline_s} s"
            frames = dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                return f"a replay message of {len(frames)} frames"
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_OF_REPLAY:
                return None
            if replay.start <= seq < replay.stop:
                kept += len(frames[3])
                if kept > MAX_WAITING_BYTES:
                    return f"over {MAX_WAITING_BYTES} bytes replayed"
                replay.batches.append((seq, frames[3]))
    finally:
        dealer.close(linger=0)
