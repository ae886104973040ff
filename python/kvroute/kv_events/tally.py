"""Counts of a stream of KV-event messages per rank, decoded by the core, for summaries such as
``kvroute kv-events``. O(message bytes) per message; not synchronised."""

from __future__ import annotations

import time
from dataclasses import dataclass

import kvroute
from kvroute.errors import InvalidArgumentError


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
