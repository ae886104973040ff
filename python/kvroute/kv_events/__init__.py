"""Subscribing to engines' KV-cache events and feeding them to a :class:`kvroute.Router`.

vLLM publishes each data-parallel rank's events on a ZMQ PUB socket as messages of three
frames, ``[topic, seq (8 bytes, big-endian), msgpack batch]``, and can keep the last batches
for a ROUTER *replay* socket. :class:`Subscriber` holds one SUB socket per (instance, rank)
on one thread and applies every batch, in order, with :meth:`kvroute.Router.apply_kv_events`
(decoded in the Rust core), telling it the rank of the socket (a batch that names another
rank is refused and counted). When a batch's sequence number skips ahead, the missing
batches are asked from the replay socket (a DEALER sends the first missing number, the
ROUTER sends back every buffered batch from it and an end marker with sequence -1) on a
thread of their own, within :data:`REPLAY_DEADLINE_S`; meanwhile that rank's live batches
wait (at most :data:`MAX_WAITING_BYTES`) and every other rank's are applied. The batches a
replay brought are applied in order up to the first one it lacks; a replay that ended (or
went quiet) without all of them, after bringing some, is asked again from the first one
missing, up to :data:`MAX_REPLAY_RESUMES` times (vLLM's ROUTER sends its whole buffer at
once and drops what the subscriber has no room for yet). When the missing batches cannot be
had (no replay socket, the replay starts too late, times out, or
too much waits), the rank's view is marked degraded (:meth:`~kvroute.Router.kv_resync`) and
the router routes that instance on its estimate until the view is whole again
(``docs/kv-events.md``). A batch that cannot be decoded is a gap of one batch. Nothing is
dropped without a count.

Bounds (``docs/kv-events.md``, "Trust"): a message is at most :data:`MAX_MESSAGE_BYTES`
(ZMQ drops a larger one with its connection, which ZMQ does not open again after such an
error: the subscriber watches each socket's disconnections and opens it again; what was
missed is a gap), and at most :data:`RECEIVE_QUEUE` messages wait in ZMQ per socket (beyond,
the publisher drops them: a gap).

:func:`event_sources` turns an engine's ``GET /kv_event_sources`` answer into sources.

- ``sources.py``: :class:`Source`, :func:`event_sources`;
- ``subscriber.py``: :class:`Subscriber` (thread-safety and costs in its doc);
- ``replay.py``: one replay, on its own thread;
- ``tally.py``: :class:`Tally`, counts of a stream for summaries.
"""

from __future__ import annotations

from kvroute.kv_events.replay import (
    END_OF_REPLAY,
    MAX_REPLAY_RESUMES,
    MAX_WAITING_BYTES,
    REPLAY_DEADLINE_S,
    REPLAY_TIMEOUT_S,
)
from kvroute.kv_events.sources import WILDCARDS, Source, event_sources
from kvroute.kv_events.subscriber import (
    LOG_INTERVAL_S,
    MAX_MESSAGE_BYTES,
    RECEIVE_QUEUE,
    SourceStats,
    Subscriber,
)
from kvroute.kv_events.tally import RankTally, Tally

__all__ = [
    "END_OF_REPLAY",
    "LOG_INTERVAL_S",
    "MAX_MESSAGE_BYTES",
    "MAX_REPLAY_RESUMES",
    "MAX_WAITING_BYTES",
    "RECEIVE_QUEUE",
    "REPLAY_DEADLINE_S",
    "REPLAY_TIMEOUT_S",
    "WILDCARDS",
    "RankTally",
    "Source",
    "SourceStats",
    "Subscriber",
    "Tally",
    "event_sources",
]
