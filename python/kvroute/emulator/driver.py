"""Real-time driving of an :class:`~kvroute.emulator.engine.Engine` on an asyncio loop.

Engine time is ``(perf_counter() - start) * speedup``. The driver keeps one timer on the loop,
set for the engine's next event (but no sooner than ``min_tick_s`` of wall time after the last
wake, so a fast engine is advanced in batches); each wake calls ``advance(now)`` once and hands
the events to the per-request :class:`Channel`. The loop's timers are good to a millisecond
only (asyncio's fire up to 1 ms late, uvloop's up to 0.5 ms early), a fifth of a short step:
the driver sets its timer ``TIMER_LEAD_S`` early and sleeps the rest on the clock (holding
the loop at most that long, while it would idle), so that events reach their requests within
about 0.2 ms of their engine time. A submit that makes the next event earlier moves the
timer. A request may be submitted as of when it arrived (``arrived``: before the
server parsed and hashed it), so the server's own work does not add to the engine's times;
the engine's clock still only moves forward. A request submitted ``stepwise`` gets the
events of each engine step apart, each at its step's time, however late a wake comes (while
one is active the driver advances the engine event by event; otherwise once per wake, and
an engine may report the steps since the last wake as one event).

Cost per wake: O(events); per request: O(1) channel work. Loop-affine: every method must be
called on the loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvroute.emulator.engine import Engine, EngineEvent, RequestId

#: How much earlier than an event the driver's timer is set (see the module doc).
TIMER_LEAD_S = 0.0015


def _sleep_until(wall: float) -> None:
    """Block until ``perf_counter()`` reaches ``wall``, at most ``TIMER_LEAD_S`` from now."""
    wait = wall - time.perf_counter()
    if wait > 0:
        time.sleep(min(wait, TIMER_LEAD_S))


class Channel:
    """The events of one request, in order; one reader. ``arrived``: the engine time the
    request was submitted at."""

    __slots__ = ("_events", "_loop", "_waiter", "arrived")

    def __init__(self, loop: asyncio.AbstractEventLoop, arrived: float = 0.0) -> None:
        self._loop = loop
        self.arrived = arrived
        self._events: list[EngineEvent] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, event: EngineEvent) -> None:
        self._events.append(event)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> list[EngineEvent]:
        """Every event not read yet (waits for at least one)."""
        while not self._events:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events


class Driver:
    """Runs one engine against the wall clock (see the module doc)."""

    def __init__(self, engine: Engine, *, speedup: float = 1.0, min_tick_s: float = 0.001) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        self.engine = engine
        self.speedup = speedup
        self.min_tick_s = min_tick_s
        self._loop = asyncio.get_running_loop()
        self._start = time.perf_counter()
        self._last_wake = self._start
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._channels: dict[RequestId, Channel] = {}
        #: Requests that want each step's events apart (see the module doc).
        self._stepwise: set[RequestId] = set()
        #: The latest engine time given to the engine.
        self._clock = 0.0

    def now(self) -> float:
        """Engine time now."""
        return (time.perf_counter() - self._start) * self.speedup

    async def hold_until(self, t: float) -> None:
        """Return at engine time ``t`` (at once when it has passed)."""
        wall = self._start + t / self.speedup
        while (wait := wall - time.perf_counter()) > TIMER_LEAD_S:
            await asyncio.sleep(wait - TIMER_LEAD_S)
        _sleep_until(wall)

    @property
    def active(self) -> int:
        """Requests submitted and not finished or cancelled."""
        return len(self._channels)

    def submit(
        self,
        request_id: RequestId,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        arrived: float | None = None,
        stepwise: bool = False,
    ) -> Channel:
        """Submit a request at engine time ``arrived`` (default now; never before the last
        time the engine was given); its events arrive on the returned channel, each step's
        apart with ``stepwise``."""
        at = self.now() if arrived is None else min(max(arrived, self._clock), self.now())
        self._clock = at
        channel = Channel(self._loop, at)
        self.engine.submit(request_id, hash_ids, input_length, output_length, at)
        self._channels[request_id] = channel
        if stepwise:
            self._stepwise.add(request_id)
        self._schedule()
        return channel

    def cancel(self, request_id: RequestId) -> None:
        """Drop a request (client gone); no-op when it already finished."""
        self._stepwise.discard(request_id)
        if self._channels.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            self._schedule()

    def _advance(self, now: float) -> list[EngineEvent]:
        """The engine's events up to ``now``: event by event while a stepwise request is
        active, else in one call."""
        if not self._stepwise:
            return self.engine.advance(now)
        events: list[EngineEvent] = []
        last = float("-inf")
        while (t := self.engine.next_event_time()) is not None and last < t < now:
            events += self.engine.advance(t)
            last = t
        return events + self.engine.advance(now)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        t = self.engine.next_event_time()
        if t is None:
            return
        wall = max(self._start + t / self.speedup, self._last_wake + self.min_tick_s)
        if self._timer is not None:
            if wall >= self._timer_at:
                return
            self._timer.cancel()
        self._timer_at = wall
        delay = wall - TIMER_LEAD_S - time.perf_counter()
        self._timer = self._loop.call_later(max(delay, 0.0), self._wake)

    def _wake(self) -> None:
        self._timer = None
        due, self._timer_at = self._timer_at, float("inf")
        if due - time.perf_counter() > TIMER_LEAD_S:  # a timer that fired early: set it again
            self._schedule()
            return
        t = self.engine.next_event_time()
        if t is not None:  # to the event itself: a wake held back by min_tick_s is late already
            _sleep_until(min(due, self._start + t / self.speedup))
        self._last_wake = time.perf_counter()
        channels = self._channels
        self._clock = self.now()
        for ev in self._advance(self._clock):
            ch = channels.get(ev.request_id)
            if ch is None:
                continue
            ch.push(ev)
            if ev.kind == "finish":
                del channels[ev.request_id]
                self._stepwise.discard(ev.request_id)
        self._schedule()
