"""The warm routing workload of the route() benches, for kvroute and the reference alike.

Shape (mirrored by ``rust/kvroute-bench/src/lib.rs`` for the criterion benches):

- 1024 sessions in every cell, in 16 groups; the sessions of a group share a system prompt
  of ``min(4, keys // 4)`` blocks, then diverge. Keys are prefix-chained (``kvroute.chain_ids``).
- Background load first: ``2 x instances`` short requests (4 blocks) of other sessions stay
  in flight for the whole run, half of them past their first token, so the policies score
  real, non-zero loads (short, so the cache holds about as many keys in every cell).
- Warm-up: every session is routed twice, with a growing prefix (``ceil((keys - 1) / 2)``
  blocks, then ``keys - 1``), with ``instances`` warm-up requests in flight (finished first
  in, first out), so the sessions spread over the instances; every prefix ends up fully
  cached somewhere (checked on a sample).
- Timed call ``n``: session ``n``'s next turn, ``keys`` keys = its warm ``keys - 1`` block
  prefix + 1 new block (input length: full blocks, then a 300-token last block). Only
  ``route()`` is timed: the previous call's ``finish()`` and building the arguments happen in
  pytest-benchmark's ``setup``, outside the clock. Each session is routed at most once in the
  timed rounds, so every timed call has exactly ``keys`` keys.

Both routers see the same sequence of events; the reference gets its keys as a list of ints
(its fastest input), kvroute as a numpy uint64 array (what ``kvroute.block_hashes`` returns)
unless ``key_format="list"``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import numpy as np

import kvroute

BLOCK_SIZE = 512
GROUPS = 16
BACKGROUND_BLOCKS = 4
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def sessions_for(instances: int) -> int:
    """1024 sessions in every cell (the cache holds as many keys whatever the instance
    count, so the grid isolates the cost of instances), and at least one per instance."""
    return max(1024, instances)


def shared_blocks(keys: int) -> int:
    return min(4, keys // 4)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (synthetic block contents)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def session_chain(s: int, length: int, shared: int) -> np.ndarray:
    """Prefix-chained keys of session ``s``'s first ``length`` blocks (uint64 array)."""
    j = np.arange(length, dtype=np.uint64)
    group = np.uint64(s % GROUPS)
    own = (np.uint64(2 << 62) | (np.uint64(s) << np.uint64(24))) | j
    common = (np.uint64(1 << 62) | (group << np.uint64(32))) | j
    contents = _mix(np.where(j < shared, common, own))
    return kvroute.chain_ids(contents)


class WarmWorkload:
    """A warmed router plus the stream of timed calls (see the module docstring)."""

    def __init__(
        self,
        router: Any,
        instances: int,
        keys: int,
        *,
        key_format: Literal["numpy", "list"] = "numpy",
        sessions: int | None = None,
    ) -> None:
        if keys < 2:
            raise ValueError("a request needs a prefix and one new block")
        self.router = router
        self.instances = instances
        self.keys = keys
        self.sessions = sessions or sessions_for(instances)
        self.key_format = key_format
        shared = shared_blocks(keys)
        self.chains = [session_chain(s, keys, shared) for s in range(self.sessions)]
        self._next_id = 0
        self._pending: int | None = None
        self._calls = 0
        self._background(keys)
        self._warm(keys - 1)

    def _rid(self) -> int:
        self._next_id += 1
        return self._next_id

    def _arg(self, keys: np.ndarray) -> Any:
        return keys.tolist() if self.key_format == "list" else keys

    def _background(self, keys: int) -> None:
        for b in range(2 * self.instances):
            chain = session_chain(1_000_000 + b, BACKGROUND_BLOCKS, 0)
            rid = self._rid()
            self.router.route(rid, self._arg(chain), len(chain) * BLOCK_SIZE, -1 - b)
            if b % 2 == 0:
                self.router.first_token(rid)

    def _warm(self, prefix: int) -> None:
        # `instances` warm-up requests stay in flight (finished first in, first out), as under
        # real concurrency: they raise their instances' scores, so the sessions spread instead
        # of all tying on the same idle instance.
        window: deque[int] = deque()
        for cut in ((prefix + 1) // 2, prefix):
            for s, chain in enumerate(self.chains):
                rid = self._rid()
                self.router.route(rid, self._arg(chain[:cut]), cut * BLOCK_SIZE, s)
                window.append(rid)
                if len(window) > self.instances:
                    self.router.finish(window.popleft())
        for rid in window:
            self.router.finish(rid)
        full = prefix * BLOCK_SIZE
        for s in range(0, self.sessions, max(1, self.sessions // 64)):
            hits = self.router.estimate_cache_hits(self._arg(self.chains[s][:prefix]), full)
            if max(hits) != full:
                raise AssertionError(f"session {s} is not warm after warm-up: {max(hits)}")

    def spread(self) -> dict[str, float]:
        """How the warm cache is spread: share of instances holding any, busiest's share."""
        cached = [st["cached_blocks"] for st in self.router.state()]
        total = max(1, sum(cached))
        return {
            "instances_with_cache": sum(1 for c in cached if c) / len(cached),
            "busiest_instance_share": max(cached) / total,
        }

    @property
    def max_rounds(self) -> int:
        """Timed calls available with exactly ``keys`` keys each (one per session)."""
        return self.sessions

    def setup(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """pytest-benchmark ``setup``: finish the previous call, build the next one."""
        if self._pending is not None:
            self.router.finish(self._pending)
        s = self._calls
        if s >= self.sessions:
            raise RuntimeError("more timed rounds than sessions")
        self._calls += 1
        rid = self._rid()
        self._pending = rid
        input_length = (self.keys - 1) * BLOCK_SIZE + 300
        return (rid, self._arg(self.chains[s]), input_length, s), {}

    def done(self) -> None:
        if self._pending is not None:
            self.router.finish(self._pending)
            self._pending = None
