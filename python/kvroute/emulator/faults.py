"""Fault injection for the emulator: errors, stalls and dying mid-stream, for tests.

Each generation request draws once from a seeded RNG, in arrival order, one of three
disjoint faults (the rates add up to at most 1): with probability ``error_rate`` it gets
``error_status`` with an OpenAI-style error at once; with probability ``stall_rate`` it waits
``stall_s`` seconds before anything happens (no byte sent); with probability ``die_rate`` the
connection is closed after ``die_after_tokens`` tokens have been sent (no clean end).
``unhealthy`` makes ``/health`` answer 503. ``done_gap_s`` waits that long between a stream's
``data: [DONE]`` and the end of its chunked body, which vLLM writes separately (a client that
closes at ``[DONE]``, as the ``openai`` package does, is then gone before the end). Fields
may be changed while the server runs (from its loop's thread).

O(1) per request; not thread-safe (owned by the server's loop).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

Fault = Literal["error", "stall", "die"] | None


@dataclass
class FaultConfig:
    """What to inject (see the module doc); all off by default."""

    error_rate: float = 0.0
    error_status: int = 500
    stall_rate: float = 0.0
    stall_s: float = 30.0
    die_rate: float = 0.0
    die_after_tokens: int = 1
    unhealthy: bool = False
    done_gap_s: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("error_rate", "stall_rate", "die_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.error_rate + self.stall_rate + self.die_rate > 1.0:
            raise ValueError("error_rate + stall_rate + die_rate must be at most 1")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return bool(self.error_rate or self.stall_rate or self.die_rate)

    def draw(self) -> Fault:
        """The fault for the next request (None: none)."""
        if not self.active:
            return None
        u = self._rng.random()
        if u < self.error_rate:
            return "error"
        u -= self.error_rate
        if u < self.stall_rate:
            return "stall"
        u -= self.stall_rate
        return "die" if u < self.die_rate else None
