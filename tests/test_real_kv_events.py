"""The events view against real vLLM engines on CPU (``make test-vllm``): exact while an
engine evicts, gaps replayed from a real replay socket or turned degraded without one.
(Restarts are checked in ``test_real_vllm.py::test_an_engine_killed_mid_run``.)"""

from __future__ import annotations

import functools
import json
import random
import time
from typing import Any

import pytest

import kvroute
from kvroute.kv_events import Source, Subscriber, event_sources
from livekit import http, wait_until
from realvllm import BLOCK_SIZE, MODEL_NAME, SMALL_KV_CACHE_BYTES, Engines
from test_real_vllm import RealStack, metric_total

pytestmark = pytest.mark.vllm
WORDS = ["cache", "block", "prefix", "engine", "router", "token", "session", "answer"]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


def uses_events(router: kvroute.Router, inst: int) -> bool:
    view = router.kv_view(inst)
    return view is not None and view["uses_events"]


def tokenize(url: str, body: dict[str, Any]) -> list[int]:
    status, _, raw = http(
        "POST", url + "/tokenize", json.dumps({"model": MODEL_NAME, **body}).encode()
    )
    assert status == 200, raw
    return list(json.loads(raw)["tokens"])


def clear(router: kvroute.Router, urls: list[str], via: str | None = None) -> None:
    """Reset the engines' prefix caches (through the proxy ``via``, or each directly) until
    the router's views of them are complete. vLLM publishes the ``AllBlocksCleared`` with its
    next step's batch, so one step runs on each engine after the reset; a subscriber that was
    not listening yet catches the next round."""
    deadline = time.monotonic() + 30
    while not all(uses_events(router, i) for i in range(len(urls))):
        assert time.monotonic() < deadline, "timed out waiting for complete views"
        for target in [via] if via else urls:
            assert http("POST", target + "/reset_prefix_cache", b"")[0] == 200
        for url in urls:
            completion(url, [1, 2])
        time.sleep(0.3)


def test_the_events_view_is_exact_while_an_engine_evicts(engines: Engines) -> None:
    """Multi-turn chats through the proxy with ``--kv-events auto``, spread over both engines
    (round robin) so that engine 1's 32 MiB cache evicts: the router's estimate is the engine's
    ``cached_tokens`` on every request, and the estimate view's error is reported beside it."""
    rows = []
    with RealStack(engines, policy="round_robin") as s:
        router = s.proxy.router
        assert router.cache_view == "events"
        clear(router, engines.urls, s.url)
        blocks, size = s.proxy.caches.found[1]["capacity"]  # its estimate's bound
        assert size == BLOCK_SIZE and 0 < blocks * size <= SMALL_KV_CACHE_BYTES // 2048
        # Seven chats: round robin sends each turn of a chat to the other engine.
        chats = {i: [{"role": "system", "content": text(i, 1200)}] for i in range(7)}
        for turn in range(3):
            for i, messages in chats.items():
                messages.append({"role": "user", "content": f"question {turn} of chat {i}?"})
                ids = tokenize(s.url, {"messages": messages, "add_generation_prompt": True})
                keys = kvroute.block_hashes(ids, BLOCK_SIZE)
                views = {
                    v: router.estimate_cache_hits(keys, len(ids), view=v)
                    for v in ("events", "estimate")
                }
                raw = s.client.chat.completions.with_raw_response.create(
                    model=MODEL_NAME,
                    messages=messages,
                    max_tokens=40,
                    temperature=0.0,  # type: ignore[arg-type]
                )
                answer = raw.parse()
                assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
                inst = int(raw.headers["X-Kvroute-Instance"])
                cached = answer.usage.prompt_tokens_details.cached_tokens or 0
                hit = int(raw.headers["X-Kvroute-Hit-Tokens"])
                rows.append((inst, hit, cached, views["events"][inst], views["estimate"][inst]))
                messages.append(
                    {"role": "assistant", "content": answer.choices[0].message.content or ""}
                )
                time.sleep(0.2)  # the answer's last events
        s.assert_idle()
        evicted = router.kv_view(1)["ranks"][0]["blocks_removed"]  # type: ignore[index]
    assert evicted > 0, "engine 1 should have evicted"
    assert [r[1] for r in rows] == [r[2] for r in rows], rows
    assert [r[3] for r in rows] == [r[2] for r in rows], rows
    cached = sum(r[2] for r in rows)
    error = sum(abs(r[4] - r[2]) for r in rows)
    print(f"\nevents view: exact on {len(rows)} requests ({cached} cached tokens); "
          f"estimate view: off by {error} tokens ({error / max(cached, 1):.1%}); "
          f"engine 1 evicted {evicted} blocks")  # fmt: skip
    assert cached > 0


def completion(url: str, prompt: list[int]) -> int:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    status, _, raw = http("POST", url + "/v1/completions", json.dumps(body).encode())
    assert status == 200, raw
    return int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def rank0(router: kvroute.Router) -> dict[str, Any]:
    view = router.kv_view(0)
    assert view is not None
    return dict(view["ranks"][0]) if view["ranks"] else {}


def test_gaps_are_replayed_from_a_real_replay_socket(engines: Engines) -> None:
    url = engines[0].url
    sources = event_sources(json.loads(http("GET", url + "/kv_event_sources")[2]), url)
    assert sources and sources[0].replay is not None
    router = kvroute.Router(
        1, "lmetric", block_size=BLOCK_SIZE, cache_rule="vllm", cache_view="events"
    )
    with Subscriber(router) as sub:
        sub.watch(0, sources)
        clear(router, [url])
        sub.drop_next(0, 2)
        prompts = [[4000 + i] * 100 for i in range(3)]
        for p in prompts:
            completion(url, p)
        wait_until(
            lambda: sub.stats()[(0, 0)].replays >= 1 and rank0(router)["blocks_indexed"] >= 9,
            30,
            "replay",
        )
        assert uses_events(router, 0) and rank0(router)["replayed_batches"] >= 2
        for p in prompts:  # every block the engine stored, dropped batches' included
            keys = kvroute.block_hashes([*p, 1], BLOCK_SIZE)
            assert (
                router.estimate_cache_hits(keys, len(p) + 1) == [completion(url, [*p, 1])] == [96]
            )

    # Without the replay socket the same loss degrades the view: the estimate until a clear.
    router = kvroute.Router(
        1, "lmetric", block_size=BLOCK_SIZE, cache_rule="vllm", cache_view="events"
    )
    with Subscriber(router) as sub:
        sub.watch(0, [Source(0, sources[0].endpoint, None, sources[0].topic)])
        clear(router, [url])
        sub.drop_next(0, 1)
        completion(url, [5000] * 100)
        completion(url, [5001] * 100)
        wait_until(lambda: rank0(router).get("state") == "degraded", 30, "a degraded view")
        assert "no replay socket" in rank0(router)["reason"] and not uses_events(router, 0)
        clear(router, [url])  # whole again after a clear


def test_two_proxy_replicas_hold_the_same_view(engines: Engines) -> None:
    """Two proxies subscribed to the same two engines, requests through one of them only:
    once both have applied the same batches (their ``kvroute_proxy_kv_last_seq`` per engine
    agree), their events views agree block for block, including on keys the other proxy
    routed; the passive replica never routed anything."""
    with RealStack(engines, policy="round_robin") as a, RealStack(engines) as b:
        clear(a.proxy.router, engines.urls, a.url)
        clear(b.proxy.router, engines.urls)
        chats = [[{"role": "system", "content": text(100 + i, 600)}] for i in range(4)]
        probes = []
        for turn in range(2):
            for i, messages in enumerate(chats):
                messages.append({"role": "user", "content": f"turn {turn} of chat {i}?"})
                a.client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=messages,
                    max_tokens=2,  # type: ignore[arg-type]
                )
                ids = tokenize(a.url, {"messages": messages, "add_generation_prompt": True})
                probes.append(kvroute.block_hashes(ids, BLOCK_SIZE))

        def last_seqs(stack: RealStack) -> list[float]:
            text_ = http("GET", stack.url + "/metrics")[2].decode()
            return [
                metric_total(text_, "kvroute_proxy_kv_last_seq", backend=u, rank="0")
                for u in engines.urls
            ]

        def settled() -> bool:
            pending = [a.proxy.router.kv_view(i)["pending"] for i in range(2)]  # type: ignore[index]
            return last_seqs(a) == last_seqs(b) and min(last_seqs(a)) >= 0 and pending == [0, 0]

        wait_until(settled, 30, "both replicas at the same sequence numbers")
        ra, rb = a.proxy.router, b.proxy.router
        for i in range(2):
            va, vb = ra.kv_view(i), rb.kv_view(i)
            assert va is not None and vb is not None
            assert va["uses_events"] and vb["uses_events"]
            assert va["blocks"] == vb["blocks"] > 0  # round robin: both engines hold blocks
            assert va["ranks"][0]["last_seq"] == vb["ranks"][0]["last_seq"]
        for keys in probes:
            n = len(keys) * BLOCK_SIZE
            assert ra.estimate_cache_hits(keys, n, view="events") == rb.estimate_cache_hits(
                keys, n, view="events"
            )
        assert sum(s["num_requests"] for s in rb.state()) == 0
        assert (
            b.metric("kvroute_proxy_decisions_total")
            == 0
            < a.metric("kvroute_proxy_decisions_total")
        )
        print(f"\nreplicas agree at sequence numbers {last_seqs(a)}")


def seen_alike(routers: tuple[kvroute.Router, ...], keys: Any, n: int) -> bool:
    """Whether every router's events view holds the same hits of ``keys``, some of them."""
    hits = [r.estimate_cache_hits(keys, n, view="events") for r in routers]
    return all(h == hits[0] for h in hits) and max(hits[0]) > 0


@pytest.mark.parametrize("affinity", ["map", "shared"])
def test_two_replicas_send_every_turn_where_its_session_is_cached(
    engines: Engines, affinity: str
) -> None:
    """Two proxies with the default policy in front of the same engines, a session's turns
    sent to them in turn (a load balancer that knows nothing of sessions): every turn after
    the first lands on the engine holding the session's prefix, and hits it there, whichever
    replica routed the turn before (with the map of sessions too: the shared events view finds
    the prefix)."""
    options = {"block_size": BLOCK_SIZE, "affinity": affinity}
    with (
        RealStack(engines, router_options=options) as a,
        RealStack(engines, router_options=options) as b,
    ):
        clear(a.proxy.router, engines.urls)
        clear(b.proxy.router, engines.urls)
        chats = [[{"role": "system", "content": text(300 + i, 500)}] for i in range(4)]
        holder: dict[int, int] = {}
        replicas, sent = (a.proxy.router, b.proxy.router), 0
        for turn in range(3):
            for i, messages in enumerate(chats):
                messages.append({"role": "user", "content": f"turn {turn} of chat {i}?"})
                stack = (a, b)[sent % 2]
                sent += 1
                answer = stack.client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=2,
                    extra_headers={"X-Session-Id": f"chat-{i}"},
                )
                ids = tokenize(a.url, {"messages": messages, "add_generation_prompt": True})
                keys = kvroute.block_hashes(ids, BLOCK_SIZE)
                wait_until(
                    functools.partial(seen_alike, replicas, keys, len(ids)),
                    30,
                    "both replicas to see the turn's blocks",
                )
                hits = a.proxy.router.estimate_cache_hits(keys, len(ids), view="events")
                held = [e for e, h in enumerate(hits) if h > 0]
                assert len(held) == 1, f"chat {i} turn {turn}: blocks on {hits}"
                if turn > 0:
                    assert held[0] == holder[i], f"chat {i} turn {turn} left its engine"
                    details = answer.usage.prompt_tokens_details  # type: ignore[union-attr]
                    assert details is not None and (details.cached_tokens or 0) >= BLOCK_SIZE
                holder[i] = held[0]
