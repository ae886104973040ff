"""Pass 2's keys: the bijective mix that turns a packed ``(session, writer turn, position)``
or ``(prefix id, position)`` into a 64-bit key (the layout's field widths are in
:mod:`~kvroute.synth.profiles`).

:func:`chunk_keys` computes a chunk's keys from the plan's scalars alone, O(keys of the
chunk) time and memory.
"""

from __future__ import annotations

import numpy as np

from kvroute.synth.plan import Plan
from kvroute.synth.profiles import BLOCK_SIZE, I64, POS_BITS, TURN_BITS, U64


def _mix(x: U64) -> U64:
    """splitmix64's finalizer, in place: a bijection of uint64."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def key_salt(seed: int) -> np.uint64:
    s = np.array([(seed ^ 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.uint64(_mix(s)[0])


def chunk_keys(plan: Plan, rows: I64, salt: np.uint64) -> tuple[I64, U64]:
    """Offsets (len(rows) + 1) and keys of ``rows`` (session-order indices)."""
    inp = plan.inp[rows]
    nk = (inp + BLOCK_SIZE - 1) // BLOCK_SIZE
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(nk, out=offsets[1:])
    rk = np.repeat(np.arange(len(rows), dtype=np.int64), nk)
    pos = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][rk]
    sess = plan.sess[rows]
    pblocks = plan.prefix_blocks[sess][rk]
    inh = plan.inh_keys[rows][rk]
    writer = plan.turn[rows][rk]
    look = (pos >= pblocks) & (pos < inh)
    writer[look] = plan.table[plan.tab_start[rows][rk][look] + pos[look] - pblocks[look]]
    packed: U64 = plan.sid[sess][rk].astype(np.uint64) << np.uint64(POS_BITS + TURN_BITS)
    packed |= writer.astype(np.uint64) << np.uint64(POS_BITS)
    packed |= pos.astype(np.uint64)
    pref = pos < pblocks
    pref_packed: U64 = plan.prefix_id[sess][rk][pref].astype(np.uint64) << np.uint64(POS_BITS)
    pref_packed |= pos[pref].astype(np.uint64)
    pref_packed |= np.uint64(1 << 63)
    packed[pref] = pref_packed
    packed ^= salt
    return offsets, _mix(packed)
