"""A plain-Python model of vLLM 0.32's prefix-cache block pool, making realistic KV events.

:class:`BlockPool` follows ``vllm/v1/core/block_pool.py`` (``BlockPool``,
``BlockHashToBlockMap``), ``FreeKVCacheBlockQueue`` and ``request_block_hasher``
(``kv_cache_utils.py``), ``FullAttentionManager`` (``single_type_kv_cache_manager.py``) and
``KVCacheManager.get_computed_blocks`` / ``allocate_slots`` / ``free`` / ``take_events``
(``kv_cache_manager.py``) for one full-attention KV cache group:

- a request's full blocks are hashed in a chain, ``sha256(pickle((parent or NONE_HASH,
  tuple(tokens), extra_keys)))`` with ``NONE_HASH = sha256(pickle(hash_seed))``, exactly vLLM's
  default ``sha256`` hasher (the default seed is vLLM's ``"vllm-none-hash"``; a
  ``PYTHONHASHSEED`` value replaces it there); events carry the low 64 bits as an int
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or the 32 bytes;
- the longest cached prefix is a hit, but never the last token (at most ``(n - 1) //
  block_size`` blocks), so a block-aligned prompt recomputes its last block;
- the rest is allocated from the free queue's head; a reused block that still holds a cached
  hash is evicted from the cache with one ``BlockRemoved`` per block;
- the newly full blocks are cached, duplicates included (the cache maps a hash to every
  physical block that holds it and never deduplicates; a hit takes the oldest), with one
  ``BlockStored`` per call covering them, its parent the hash of the block before them;
- a finished request's blocks are freed in reverse order: cached ones to the queue's tail (so a
  chain's tail is evicted before its head), uncached ones (the partial last block) to its head;
- ``reset`` clears the cache (one ``AllBlocksCleared``) only when no request holds a block.

The checks in ``tests/test_kv_publisher.py`` replay scripted requests recorded from vLLM's own
``KVCacheManager`` (``tests/data/kv_events_golden.json``) and get the same events, hashes
included.

Simplifications: one KV cache group, ``block_size == hash_block_size`` (so no partial-block
cache entries); each call computes all the tokens it is given in one scheduler step (no chunked
prefill; :meth:`BlockPool.extend` is one step of decode or a later chunk); extra keys only from
``cache_salt`` (no LoRA, multimodal or prompt embeds); no speculative decoding, lookahead
slots, watermark, sliding window, KV connector or offloading; when the pool is too small a call
raises :class:`PoolExhausted` and changes nothing, where vLLM's scheduler would leave the
request waiting or preempt another.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvroute.emulator.kv_publisher import (
    FULL_ATTENTION,
    MEDIUM_GPU,
    BlockHash,
    Event,
    cleared,
    removed,
    stored,
)

DEFAULT_HASH_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for sha256 when PYTHONHASHSEED is not set."""
_UINT64 = (1 << 64) - 1
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on the Pythons vLLM 0.32 supports

ExtraKeys = tuple[tuple[str, str], ...] | None


class PoolExhausted(RuntimeError):
    """Not enough free blocks for the call (vLLM's ``allocate_slots`` returns None)."""


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


@dataclass
class Handle:
    """A running request, from :meth:`BlockPool.begin` to :meth:`BlockPool.finish`."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    num_hit_blocks: int
    """Blocks taken from the prefix cache when it began."""
    events: list[Event]
    """The events :meth:`BlockPool.begin` emitted for it."""
    blocks: list[int] = field(default_factory=list)
    """Physical block ids, in token order."""
    hashes: list[bytes] = field(default_factory=list)
    """Engine hashes of its full blocks."""
    num_cached_blocks: int = 0
    finished: bool = False


class BlockPool:
    """vLLM's prefix-cache block pool, for one full-attention group (see the module docstring).

    ``num_blocks`` counts vLLM's null block (block 0, never allocated), so ``num_blocks - 1``
    blocks hold tokens, as with ``num_gpu_blocks`` in vLLM. ``report_mode="full"`` is vLLM's
    per-request ``kv_cache_report_mode`` "full": a hit also re-reports the hit prefix as one
    ``BlockStored`` (parent None) before anything else.

    Every mutating call returns the events it emitted; :meth:`take_events` also hands out all
    events since the last ``take_events`` (vLLM's ``BlockPool.take_events``, drained once per
    scheduler step into one ``KVEventBatch``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_seed: str | int = DEFAULT_HASH_SEED,
        *,
        int_hashes: bool = True,
        report_mode: Literal["incremental", "full"] = "incremental",
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is vLLM's null block)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.report_mode = report_mode
        self.medium = medium
        self.none_hash = _sha256(str(hash_seed))
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # FreeKVCacheBlockQueue: block ids in eviction order, head first; starts by id.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # BlockHashToBlockMap: hash -> physical blocks holding it, oldest first.
        self._cache: dict[bytes, list[int]] = {}
        self._tokens: dict[BlockHash, tuple[int, ...]] = {}
        self._pending: list[Event] = []
        self._running: dict[str, Handle] = {}
        self._ids = itertools.count()

    # -- hashes ------------------------------------------------------------------------------

    def external(self, engine_hash: bytes) -> BlockHash:
        """The hash as events carry it (vLLM's ``maybe_convert_block_hash``)."""
        if not self.int_hashes:
            return engine_hash
        return int.from_bytes(engine_hash, "big") & _UINT64

    def _extra_keys(self, index: int, cache_salt: str | None) -> ExtraKeys:
        # generate_block_hash_extra_keys: the salt is an extra key of the first block only.
        return (("cache_salt", cache_salt),) if index == 0 and cache_salt else None

    def _event_extra_keys(self, first: int, count: int, cache_salt: str | None) -> list[object]:
        # to_event_extra_keys: untagged, one entry per block.
        keys = (self._extra_keys(i, cache_salt) for i in range(first, first + count))
        return [None if k is None else [v for _, v in k] for k in keys]

    def _hash_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None, known: list[bytes]
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` after the ``known`` ones."""
        out = list(known)
        bs = self.block_size
        for i in range(len(known), len(token_ids) // bs):
            tokens = tuple(int(t) for t in token_ids[i * bs : (i + 1) * bs])
            parent = out[-1] if out else self.none_hash
            h = _sha256((parent, tokens, self._extra_keys(i, cache_salt)))
            self._tokens.setdefault(
                self.external(h), tuple(int(t) for t in token_ids[: (i + 1) * bs])
            )
            out.append(h)
        return out[len(known) :]

    def block_hashes(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The external hashes of the full blocks of ``token_ids`` (the cache is untouched)."""
        return [self.external(h) for h in self._hash_blocks(token_ids, cache_salt, [])]

    # -- requests ----------------------------------------------------------------------------

    def run(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[Event]:
        """One request from start to finish (prefill in one step, then freed): its events."""
        handle = self.begin(token_ids, cache_salt=cache_salt)
        self.finish(handle)
        return handle.events

    def begin(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> Handle:
        """Schedule a new request's whole prompt (``get_computed_blocks`` + ``allocate_slots``);
        its events are in ``handle.events``. Raises :class:`PoolExhausted`, changing nothing,
        when the free blocks do not suffice."""
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("a request needs at least one token")
        bs = self.block_size
        hashes = self._hash_blocks(tokens, cache_salt, [])
        hits: list[int] = []
        for h in hashes[: (len(tokens) - 1) // bs]:
            holders = self._cache.get(h)
            if not holders:
                break
            hits.append(holders[0])
        num_new = -(-len(tokens) // bs) - len(hits)
        evictable = sum(1 for b in hits if self._ref[b] == 0)
        if num_new + evictable > len(self._free):
            raise PoolExhausted(
                f"{num_new} new blocks (+{evictable} cached ones to take out of the free "
                f"queue) needed, {len(self._free)} free"
            )
        events: list[Event] = []
        if self.report_mode == "full" and hits:
            events.append(self._stored(hashes, 0, len(hits), tokens, cache_salt))
        for b in hits:  # touch
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        handle = Handle(
            request_id=f"req-{next(self._ids)}",
            token_ids=tokens,
            cache_salt=cache_salt,
            num_hit_blocks=len(hits),
            events=events,
            blocks=hits,
            hashes=hashes,
            num_cached_blocks=len(hits),
        )
        events += self._allocate(handle, num_new)
        events += self._cache_full_blocks(handle)
        self._running[handle.request_id] = handle
        self._pending += events
        return handle

    def extend(self, handle: Handle, token_ids: Sequence[int]) -> list[Event]:
        """Append ``token_ids`` to a running request and compute them in one step (one decode
        step when it is one token): blocks that become full are cached. Raises
        :class:`PoolExhausted`, changing nothing, when the free blocks do not suffice."""
        self._check_running(handle)
        tokens = [int(t) for t in token_ids]
        total = len(handle.token_ids) + len(tokens)
        num_new = -(-total // self.block_size) - len(handle.blocks)
        if num_new > len(self._free):
            raise PoolExhausted(f"{num_new} new blocks needed, {len(self._free)} free")
        handle.token_ids += tokens
        handle.hashes += self._hash_blocks(handle.token_ids, handle.cache_salt, handle.hashes)
        events = self._allocate(handle, num_new)
        events += self._cache_full_blocks(handle)
        self._pending += events
        return events

    def finish(self, handle: Handle) -> None:
        """Free a request's blocks (``free_blocks(reversed(blocks))``); emits nothing."""
        self._check_running(handle)
        evict_first: list[int] = []
        evict_last: list[int] = []
        for b in reversed(handle.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                (evict_first if self._hash[b] is None else evict_last).append(b)
        for b in reversed(evict_first):  # prepend_n: the list's order, at the head
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        for b in evict_last:  # append_n
            self._free[b] = None
        handle.finished = True
        del self._running[handle.request_id]

    def reset(self) -> list[Event]:
        """``reset_prefix_cache``: forget every cached hash and emit ``AllBlocksCleared``; refused
        (no event, nothing changes) while a request holds blocks, as in vLLM."""
        if self._running:
            return []
        self._cache.clear()
        self._hash = [None] * self.num_blocks
        events = [cleared()]
        self._pending += events
        return events

    def take_events(self) -> list[Event]:
        """All events emitted since the last call, oldest first."""
        events, self._pending = self._pending, []
        return events

    # -- the truth ---------------------------------------------------------------------------

    def cached(self) -> dict[BlockHash, int]:
        """External hash -> how many physical blocks hold it in the prefix cache now."""
        out: dict[BlockHash, int] = {}
        for h, holders in self._cache.items():
            key = self.external(h)
            out[key] = out.get(key, 0) + len(holders)
        return out

    def tokens_of(self, block_hash: BlockHash) -> tuple[int, ...]:
        """All the tokens from the root to the end of the block with this external hash (any
        hash this pool has computed); KeyError for others."""
        return self._tokens[block_hash]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def running(self) -> list[Handle]:
        return list(self._running.values())

    # -- internals ---------------------------------------------------------------------------

    def _check_running(self, handle: Handle) -> None:
        if handle.finished or self._running.get(handle.request_id) is not handle:
            raise ValueError(f"{handle.request_id} is not running in this pool")

    def _allocate(self, handle: Handle, num_new: int) -> list[Event]:
        """``get_new_blocks``: pop from the free queue's head, evicting cached blocks."""
        events: list[Event] = []
        for _ in range(num_new):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                holders = self._cache[h]
                holders.remove(b)
                if not holders:
                    del self._cache[h]
                self._hash[b] = None
                events.append(removed([self.external(h)], medium=self.medium))
            self._ref[b] = 1
            handle.blocks.append(b)
        return events

    def _cache_full_blocks(self, handle: Handle) -> list[Event]:
        first = handle.num_cached_blocks
        full = len(handle.token_ids) // self.block_size
        if full <= first:
            return []
        for i in range(first, full):
            b = handle.blocks[i]
            h = handle.hashes[i]
            self._hash[b] = h
            self._cache.setdefault(h, []).append(b)
        handle.num_cached_blocks = full
        return [self._stored(handle.hashes, first, full, handle.token_ids, handle.cache_salt)]

    def _stored(
        self,
        hashes: list[bytes],
        first: int,
        end: int,
        tokens: list[int],
        cache_salt: str | None,
    ) -> Event:
        bs = self.block_size
        return stored(
            [self.external(h) for h in hashes[first:end]],
            self.external(hashes[first - 1]) if first > 0 else None,
            tokens[first * bs : end * bs],
            bs,
            medium=self.medium,
            extra_keys=self._event_extra_keys(first, end - first, cache_salt),
            kv_cache_spec_kind=FULL_ATTENTION,
        )
