"""A plain-Python model of the router's events view (``docs/kv-events.md``), for the property
tests: per instance and data-parallel rank, the engine hashes it holds (with the tokens of each
block's whole sequence, so a block's kvroute key is ``kvroute.block_hashes`` of those tokens),
copies per hash, the sequence cursor and the view's state. No predictions (``pending_ttl_s``
0). Dicts and sets; no speed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import kvroute

IGNORED_MEDIA = ("CPU", "STORAGE")


@dataclass
class Rank:
    #: Engine hash -> the tokens from the sequence's start to the end of that block.
    seqs: dict[Any, tuple[int, ...]] = field(default_factory=dict)
    copies: Counter[Any] = field(default_factory=Counter)
    next_seq: int | None = None
    state: str = "awaiting"


def _key(tokens: tuple[int, ...], block_size: int) -> int:
    return int(kvroute.block_hashes(list(tokens), block_size)[-1])


def _ignored(e: dict[str, Any]) -> bool:
    if e.get("lora_id") is not None or e.get("lora_name") is not None:
        return True
    if e.get("medium") not in (None, "GPU") or e.get("group_idx") not in (None, 0):
        return True
    return any(k is not None for k in e.get("extra_keys") or [])


class ReferenceEventView:
    def __init__(self, instances: int, block_size: int) -> None:
        self.block_size = block_size
        self.ranks: list[dict[int, Rank]] = [{} for _ in range(instances)]
        #: Per instance, the estimate (no routing here): what the events view held when it
        #: last turned degraded; emptied by a restart.
        self.estimate: list[set[int]] = [set() for _ in range(instances)]

    def apply(
        self, inst: int, seq: int, events: list[dict[str, Any]], rank: int, replayed: bool
    ) -> str:
        if rank not in self.ranks[inst] and seq != 0:
            return "gap"  # a rank not seen before starts at sequence 0: no view before it
        r = self.ranks[inst].setdefault(rank, Rank())
        if r.next_seq is not None:
            if seq > r.next_seq:
                return "gap"
            if seq < r.next_seq:
                if replayed:
                    return "duplicate"
                self.ranks[inst][rank] = r = Rank()
                self.estimate[inst] = set()
        if r.next_seq is None and seq != 0 and r.state != "degraded":
            return "gap"
        if r.state == "awaiting":
            r.state = "complete"
        for e in events:
            if e["type"] == "AllBlocksCleared":
                r.seqs.clear()
                r.copies.clear()
                r.state = "complete"
            elif _ignored(e):
                continue
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    if r.copies[h]:
                        r.copies[h] -= 1
                    else:
                        r.seqs.pop(h, None)
            elif e["block_size"] != self.block_size:
                self.degrade(inst, r)
            else:
                parent = e["parent_block_hash"]
                if parent is not None and parent not in r.seqs:
                    if r.state == "complete":
                        self.degrade(inst, r)
                    continue
                prefix = r.seqs[parent] if parent is not None else ()
                bs = self.block_size
                for i, h in enumerate(e["block_hashes"]):
                    prefix = prefix + tuple(e["token_ids"][i * bs : (i + 1) * bs])
                    if h in r.seqs:
                        r.copies[h] += 1
                    else:
                        r.seqs[h] = prefix
        r.next_seq = seq + 1
        return "applied"

    def degrade(self, inst: int, r: Rank) -> None:
        if r.state != "degraded":
            self.estimate[inst] = self.keys(inst)
        r.seqs.clear()
        r.copies.clear()
        r.state = "degraded"

    def resync(self, inst: int, rank: int) -> None:
        r = self.ranks[inst].setdefault(rank, Rank())
        self.degrade(inst, r)
        r.next_seq = None

    def uses_events(self, inst: int) -> bool:
        ranks = self.ranks[inst].values()
        return bool(ranks) and all(r.state == "complete" for r in ranks)

    def keys(self, inst: int) -> set[int]:
        return {
            _key(s, self.block_size) for r in self.ranks[inst].values() for s in r.seqs.values()
        }

    def hits(self, tokens: list[int]) -> list[int]:
        """Per instance, cached tokens of a prompt of ``tokens`` (vLLM's rule) by the view
        routing reads: this one where it is whole, else the estimate."""
        keys = [int(k) for k in kvroute.block_hashes(tokens, self.block_size)]
        keys = keys[: (len(tokens) - 1) // self.block_size]
        out = []
        for i in range(len(self.ranks)):
            held = self.keys(i) if self.uses_events(i) else self.estimate[i]
            n = next((j for j, k in enumerate(keys) if k not in held), len(keys))
            out.append(n * self.block_size)
        return out
