"""The emulator's KV-cache events: its engine model's pool changes (``EngineModel.
take_kv_events``) published as vLLM 0.32 publishes its own (:mod:`.kv_publisher`), so that a
router's events view (``docs/kv-events.md``) can run against ``kvroute engine --kv-events``.

The pool caches prompt blocks by their kvroute keys (``kvroute.block_hashes`` of the prompt's
ids), which vLLM's events carry no room for: a ``BlockStored`` names the engine's block
hashes, the parent's hash and the blocks' token ids. The feed keeps, for every full block of a
request in the engine and every block it has announced, the block's parent key and token ids,
and uses the key itself as the engine's (opaque) block hash. So a subscriber that re-derives
keys from token ids and parent links gets the keys the emulator caches.

As vLLM does, it announces full blocks only (the pool also caches a prompt's last, partial
block, which no later prompt can hit), one ``BlockStored`` per run of consecutive blocks of a
chain, one ``BlockRemoved`` per evicted block, and ``AllBlocksCleared`` for a reset that
emptied the pool (a reset that running requests survive names each block it dropped).

Memory: O(blocks of running requests + blocks announced and not removed). Not thread-safe:
the emulator's event loop owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.emulator.engine import RequestId
from kvroute.emulator.kv_publisher import Event, KvEventPublisher, cleared, removed, stored


@dataclass
class _Block:
    parent: int | None
    tokens: list[int]
    #: Requests in the engine whose prompt has this block.
    refs: int = 0
    announced: bool = False


class KvFeed:
    """Pool events to vLLM events on ``publisher``; blocks of ``block_size`` tokens."""

    def __init__(self, publisher: KvEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._requests: dict[RequestId, list[int]] = {}

    @property
    def blocks_known(self) -> int:
        """Blocks the feed holds token ids of (running requests' and announced ones)."""
        return len(self._blocks)

    def admit(self, request_id: RequestId, keys: Sequence[int], ids: Sequence[int]) -> None:
        """A request enters the engine with prompt ``ids`` keyed ``keys`` (one per block)."""
        full = len(ids) // self.block_size
        mine = list(keys[:full])
        for i, key in enumerate(mine):
            block = self._blocks.get(key)
            if block is None:
                start = i * self.block_size
                parent = mine[i - 1] if i else None
                block = self._blocks[key] = _Block(
                    parent, list(ids[start : start + self.block_size])
                )
            block.refs += 1
        self._requests[request_id] = mine

    def release(self, request_id: RequestId) -> None:
        """The request left the engine (finished, cancelled or refused); no-op when unknown."""
        for key in self._requests.pop(request_id, ()):
            block = self._blocks[key]
            block.refs -= 1
            self._forget_if_unused(key, block)

    def publish(self, changes: Sequence[tuple[str, int | None]]) -> None:
        """Publish the pool's ``changes`` (``EngineModel.take_kv_events``) as one batch (none
        when nothing in them is announced)."""
        events: list[Event] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                first = self._blocks[run[0]]
                tokens = [t for key in run for t in self._blocks[key].tokens]
                events.append(stored(list(run), first.parent, tokens, self.block_size))
                run.clear()

        for kind, key in changes:
            if kind == "cleared":
                flush()
                events.append(cleared())
                for k, known in list(self._blocks.items()):
                    known.announced = False
                    self._forget_if_unused(k, known)
                continue
            assert key is not None
            block = self._blocks.get(key)
            if kind == "stored":
                if block is None or block.announced:
                    continue  # a partial block (or one stored before the feed began)
                if run and block.parent != run[-1]:
                    flush()
                block.announced = True
                run.append(key)
            elif block is not None and block.announced:
                flush()
                block.announced = False
                events.append(removed([key]))
                self._forget_if_unused(key, block)
        flush()
        if events:
            self.publisher.publish(events)

    def _forget_if_unused(self, key: int, block: _Block) -> None:
        if block.refs == 0 and not block.announced:
            del self._blocks[key]
