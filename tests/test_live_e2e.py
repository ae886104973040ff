"""End to end: the official openai client through the proxy to several emulators, session
routing, a 256-stream load, and the ``kvroute proxy`` / ``kvroute engine`` commands."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
import openai

from livekit import MODEL, Hold, Stack, http, spawn, wait_until

LOAD_SECONDS = 6.0
CLIENTS = 256


def test_openai_client_end_to_end() -> None:
    with (
        Stack(3, proxy={"policy": "unified"}) as s,
        openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0) as c,
    ):
        assert [m.id for m in c.models.list().data] == [MODEL]
        prompt = list(range(1000, 3000))
        out = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 5
        stream = c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == 2000
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens  # unified kept it on the warm engine
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(text.split()) == 4
        messages = [{"role": "user", "content": "Summarize prefix caching. " * 50}]
        chat = c.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].message.content and chat.usage is not None
        parts = list(
            c.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
        )
        assert parts[0].choices[0].delta.role == "assistant"
        content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert len(content.split()) == 6
        s.assert_counters_zero()


def _turns(
    url: str,
    sessions: int,
    turns: int,
    concurrent_first: bool,
    first_sent: Callable[[], None] | None = None,
) -> dict[int, list[int]]:
    """Each session's turns (growing prompts), one at a time; the instance of each turn.
    With ``concurrent_first``, ``first_sent`` runs (in a thread) once every session has
    begun; the sessions go on meanwhile."""

    async def one(http_: aiohttp.ClientSession, sid: int, n: int) -> int:
        prompt = [sid * 10_000 + i for i in range(600 * (n + 1))]
        body = {"prompt": prompt, "max_tokens": 30, "ignore_eos": True, "stream": True}
        headers = {"X-Session-Id": f"session-{sid}"}
        async with http_.post(url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            return int(resp.headers["X-Kvroute-Instance"])

    async def session(http_: aiohttp.ClientSession, sid: int) -> list[int]:
        return [await one(http_, sid, n) for n in range(turns)]

    async def main() -> dict[int, list[int]]:
        async with aiohttp.ClientSession() as http_:
            if concurrent_first:
                tasks = [asyncio.create_task(session(http_, sid)) for sid in range(sessions)]
                if first_sent is not None:
                    await asyncio.to_thread(first_sent)
                got = await asyncio.gather(*tasks)
            else:
                got = [await session(http_, sid) for sid in range(sessions)]
        return dict(enumerate(got))

    return asyncio.run(main())


def test_sticky_sessions_stick() -> None:
    """Six sessions whose first turns are all in flight at once (held at the engines until
    the sixth arrives): sticky binds each new session to the least loaded engine, two to
    each, and every later turn goes where its first went."""
    hold = Hold()
    with Stack(3, speedup=5, proxy={"policy": "sticky"}, hold=hold) as s:

        def release() -> None:
            wait_until(lambda: hold.waiting >= 6, 30, "the six first turns to arrive")
            s.st.run(hold.open)

        placed = _turns(s.url, sessions=6, turns=4, concurrent_first=True, first_sent=release)
        for insts in placed.values():
            assert len(set(insts)) == 1, placed
        assert Counter(insts[0] for insts in placed.values()) == {0: 2, 1: 2, 2: 2}, placed
        for sid, insts in placed.items():
            assert s.proxy.router.session_affinity(f"session-{sid}") == insts[0]
        s.assert_counters_zero()


def test_unified_follows_the_cache() -> None:
    with Stack(3, speedup=20, proxy={"policy": "unified"}) as s:
        placed = _turns(s.url, sessions=4, turns=4, concurrent_first=False)
        for insts in placed.values():
            assert len(set(insts)) == 1, placed  # warm cache, no overload: affinity holds
        s.assert_counters_zero()


def test_256_concurrent_streams() -> None:
    # No periodic health checks: they would share a saturated loop with the load.
    with Stack(4, speedup=50, proxy={"policy": "unified", "health_interval_s": 60}) as s:
        outcomes: Counter[str] = Counter()

        async def client(http_: aiohttp.ClientSession, cid: int, deadline: float) -> None:
            n = 0
            while n == 0 or time.monotonic() < deadline:  # one request at least, however late
                prompt = [cid * 1000 + i for i in range(256 + 64 * (n % 4))]
                body = {
                    "prompt": prompt,
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                outcomes["sent"] += 1
                async with http_.post(
                    s.url + "/v1/completions", json=body, headers={"X-Session-Id": str(cid)}
                ) as resp:
                    raw = await resp.read()
                ok = resp.status == 200 and raw.endswith(b"data: [DONE]\n\n")
                usage = ok and json.loads(raw.split(b"data: ")[-2])["usage"]
                outcomes["ok" if usage and usage["completion_tokens"] == 8 else "bad"] += 1
                n += 1

        async def main() -> None:
            timeout = aiohttp.ClientTimeout(total=120)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http_:
                deadline = time.monotonic() + LOAD_SECONDS
                await asyncio.gather(*(client(http_, c, deadline) for c in range(CLIENTS)))

        asyncio.run(main())
        assert outcomes["bad"] == 0 and outcomes["ok"] == outcomes["sent"] >= CLIENTS
        text = http("GET", s.url + "/metrics")[2].decode()
        assert "kvroute_proxy_errors_total{" not in text
        s.assert_counters_zero()


def test_the_commands_in_subprocesses() -> None:
    procs = []
    try:
        engines = []
        for _ in range(2):
            procs.append(spawn("engine", "--speedup", "20"))
            engines.append(procs[-1].url)
        args = ["--policy", "leastwork", "--admin-token", "tok", "--no-uvloop"]
        for url in engines:
            args += ["--backend", url]
        procs.append(spawn("proxy", *args))
        purl = procs[-1].url
        with openai.OpenAI(base_url=purl + "/v1", api_key="k", max_retries=0) as c:
            out = c.completions.create(model=MODEL, prompt="hello " * 100, max_tokens=3)
            assert out.choices[0].text
        status, _, raw = http(
            "GET", purl + "/admin/backends", headers={"Authorization": "Bearer tok"}
        )
        assert status == 200 and len(json.loads(raw)["backends"]) == 2
        assert "kvroute_proxy_decisions_total" in http("GET", purl + "/metrics")[2].decode()
    finally:
        for proc in procs:
            proc.stop()
