"""Requests that arrive at the same instant, taken in other orders.

A trace with a coarse clock sends several requests at once: the Mooncake conversation trace's
timestamps come in steps of about 3 s, with 10 requests at each on average. In a real run,
which of them reaches the router first is a race; the simulator takes them in file order
(``SEMANTICS.md``: ties keep file order), so it shows one outcome of that race.
:func:`shuffle_ties` reorders each instant's requests by a seed, a session's own requests
keeping theirs, so that simulating several orders shows how much of a policy's result hangs on
the race (``docs/simulator.md`` "Side by side").

Cost: O(n log n) per call (one sort). Pure functions of their arguments; thread-safe.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def tied_requests(trace: pa.Table) -> int:
    """How many of ``trace``'s requests share their timestamp with another."""
    _, counts = np.unique(trace.column("timestamp").to_numpy(), return_counts=True)
    return int(counts[counts > 1].sum())


def shuffle_ties(trace: pa.Table, seed: int) -> pa.Table:
    """``trace`` (the schema of :func:`kvroute.trace.read_trace`) in timestamp order, the
    sessions at each instant in an order drawn from ``seed``; one session's requests at one
    instant keep their file order."""
    n = trace.num_rows
    _, session = np.unique(trace.column("session_id").to_numpy(), return_inverse=True)
    draw = np.random.default_rng(seed).random(n)[session]
    order = np.lexsort((np.arange(n), draw, trace.column("timestamp").to_numpy()))
    return trace.take(pa.array(order))


__all__ = ["shuffle_ties", "tied_requests"]
