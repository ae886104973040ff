"""The events view against plain models: vLLM's block pool (``tests/vllm_blockpool.py``, whose
events and hashes are vLLM 0.32's) for exactness, and ``tests/reference_kv.py`` on random
event streams (stores with known, unknown and missing parents, removals, clears, gaps,
replays, restarts), in both encodings."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from kvroute.emulator.kv_publisher import cleared, encode_batch, removed, stored
from reference_kv import ReferenceEventView
from vllm_blockpool import BlockPool, PoolExhausted

BS = 4


def router(n: int) -> kvroute.Router:
    return kvroute.Router(
        n, "lmetric", block_size=BS, cache_rule="vllm", cache_view="events", pending_ttl_s=0
    )


def rust_hits(r: kvroute.Router, tokens: list[int]) -> list[int]:
    return r.estimate_cache_hits(kvroute.block_hashes(tokens, BS), len(tokens))


def truth(pool: BlockPool) -> set[int]:
    """kvroute keys of the blocks the pool holds."""
    return {int(kvroute.block_hashes(list(pool.tokens_of(h)), BS)[-1]) for h in pool.cached()}


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]

requests = st.lists(
    st.tuples(
        st.integers(0, 1),  # engine
        st.sampled_from(["run", "begin", "finish", "reset"]),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(0, 3), max_size=9),  # suffix
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=requests, encoding=st.sampled_from(["map", "array"]), int_hashes=st.booleans())
def test_the_view_is_the_block_pool_exactly(
    ops: list[tuple[int, str, int, list[int]]], encoding: str, int_hashes: bool
) -> None:
    pools = [BlockPool(10, BS, hash_seed=f"seed{e}", int_hashes=int_hashes) for e in range(2)]
    r, ref = router(2), ReferenceEventView(2, BS)
    seqs, running, prompts = [0, 0], [[], []], []  # type: ignore[var-annotated]
    for engine, what, prefix, suffix in ops:
        pool, tokens = pools[engine], PREFIXES[prefix] + suffix
        try:
            if what == "run":
                pool.run(tokens)
            elif what == "begin":
                running[engine].append(pool.begin(tokens))
            elif what == "finish" and running[engine]:
                pool.finish(running[engine].pop(0))
            elif what == "reset":
                pool.reset()
        except PoolExhausted:
            continue
        prompts.append(tokens)
        events = pool.take_events()
        payload = encode_batch(events, ts=0.0, rank=0, encoding=encoding)  # type: ignore[arg-type]
        got = r.apply_kv_events(engine, seqs[engine], payload)
        assert got["outcome"] == ref.apply(engine, seqs[engine], events, 0, False) == "applied"
        seqs[engine] += 1
        assert ref.keys(engine) == truth(pool)
        for p in prompts[-6:]:
            assert rust_hits(r, [*p, 0]) == ref.hits([*p, 0])
    for e in (e for e in range(2) if seqs[e]):
        view = r.kv_view(e)
        assert view is not None and view["uses_events"] and view["blocks"] == len(truth(pools[e]))


# Random event streams: each step is one batch of events on instance 0 or 1.
hashes = st.integers(1, 12)
events = st.one_of(
    st.tuples(
        st.just("stored"),
        st.lists(hashes, min_size=1, max_size=3, unique=True),
        st.one_of(st.none(), hashes, st.just(99)),  # a parent: none, maybe known, unknown
        st.lists(st.integers(0, 2), min_size=12, max_size=12),
        st.sampled_from([None, None, None, "CPU", "lora"]),
    ),
    st.tuples(st.just("removed"), st.lists(hashes, min_size=1, max_size=2)),
    st.tuples(st.just("cleared")),
)
steps = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.sampled_from(["next"] * 6 + ["skip", "replay_old", "restart", "resync"]),
        st.lists(events, max_size=3),
    ),
    min_size=1,
    max_size=30,
)


def event_dict(e: tuple[Any, ...]) -> dict[str, Any]:
    if e[0] == "stored":
        _, hs, parent, tokens, odd = e
        extra: dict[str, Any] = {}
        if odd == "CPU":
            extra["medium"] = "CPU"
        elif odd == "lora":
            extra.update(lora_id=3, lora_name="adapter")
        return stored(hs, parent, tokens[: BS * len(hs)], BS, **extra)
    if e[0] == "removed":
        return removed(e[1])
    return cleared()


@settings(max_examples=150, deadline=None)
@given(plan=steps, encoding=st.sampled_from(["map", "array"]))
def test_random_streams_match_the_reference(
    plan: list[tuple[int, str, list[tuple[Any, ...]]]], encoding: str
) -> None:
    r, ref = router(2), ReferenceEventView(2, BS)
    seqs = [0, 0]
    for inst, how, evs in plan:
        batch = [event_dict(e) for e in evs]
        replayed = False
        if how == "skip":
            seqs[inst] += 1
        elif how == "replay_old":
            replayed, seq = True, max(0, seqs[inst] - 2)
        elif how == "restart":
            seqs[inst] = 0
        elif how == "resync":
            r.kv_resync(inst, 0, "test")
            ref.resync(inst, 0)
        seq = seq if how == "replay_old" else seqs[inst]
        payload = encode_batch(batch, ts=0.0, rank=0, encoding=encoding)  # type: ignore[arg-type]
        got = r.apply_kv_events(inst, seq, payload, replayed=replayed)
        assert got["outcome"] == ref.apply(inst, seq, batch, 0, replayed)
        if got["outcome"] == "applied" and not replayed:
            seqs[inst] = seq + 1
        for i in range(2):
            view = r.kv_view(i)
            assert view is not None
            assert view["uses_events"] == ref.uses_events(i)
            assert [x["state"] for x in view["ranks"]] == [x.state for x in ref.ranks[i].values()]
            for rank in ref.ranks[i].values():
                for tokens in rank.seqs.values():
                    query = [*tokens, 0]
                    assert rust_hits(r, query) == ref.hits(query)
