"""The peers benchmark's client: sends a workload's sessions through a router (or through
router replicas, each request to the next one in turn), ``concurrency`` sessions at a time (a
session's requests one after another, each sent when the one before it finished), and times
each request on the monotonic clock: its first token (the first
streamed chunk with a choice, as ``kvroute replay`` times it) and its end. One asyncio loop,
one connection pool; O(requests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass

import aiohttp
from routers import SESSION_HEADER
from workloads import Request, Workload

TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=10)


@dataclass
class Result:
    """One request as the client saw it (seconds)."""

    session: int
    ok: bool
    ttft: float | None
    e2e: float
    error: str | None = None
    turn: int = 0
    sent: float = 0.0  # seconds from the run's start
    engine: int | None = None  # kvroute's X-Kvroute-Instance, where the router says


def _has_choice(chunk: dict[str, object]) -> bool:
    """Whether a stream chunk carries a choice: the first one comes with the first token
    (vLLM sends nothing before; a token may decode to no text yet, a chat's first chunk has
    only the role)."""
    return bool(chunk.get("choices"))


async def _one(
    http: aiohttp.ClientSession, url: str, req: Request, model: str, session: int, sid: str | None
) -> Result:
    headers = {"Content-Type": "application/json"}
    if sid is not None:
        headers[SESSION_HEADER] = sid
    data = json.dumps({"model": model, **req.body}).encode()
    start = time.monotonic()
    first: float | None = None
    engine: int | None = None
    try:
        async with http.post(url + req.path, data=data, headers=headers) as resp:
            instance = resp.headers.get("X-Kvroute-Instance")
            engine = int(instance) if instance is not None else None
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Result(
                    session, False, None, time.monotonic() - start, f"{resp.status}: {text}"
                )
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                if first is None and _has_choice(json.loads(line[5:])):
                    first = time.monotonic()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        return Result(
            session, False, None, time.monotonic() - start, f"{type(exc).__name__}: {exc}"
        )
    end = time.monotonic()
    ok = first is not None
    return Result(session, ok, None if first is None else first - start, end - start,
                  None if ok else "no token", engine=engine)  # fmt: skip


async def _run(
    urls: list[str], workload: Workload, model: str, concurrency: int, sessions: bool
) -> tuple[list[Result], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(workload.sessions)):
        queue.put_nowait(i)
    results: list[Result] = []
    sent = [0]
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=conn) as http:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                sid = workload.session_ids[i] if sessions else None
                for turn, req in enumerate(workload.sessions[i]):
                    url = urls[sent[0] % len(urls)]  # per request, in turn: a round robin
                    sent[0] += 1
                    at = time.monotonic() - start
                    got = await _one(http, url, req, model, i, sid)
                    results.append(dataclasses.replace(got, turn=turn, sent=at))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - start
    return results, wall


def run(
    url: str | list[str],
    workload: Workload,
    model: str,
    concurrency: int,
    sessions: bool = True,
) -> tuple[list[Result], float]:
    """Send ``workload`` through ``url`` (several: each request to the next in turn, as a
    load balancer that knows nothing of sessions would); the results and the wall-clock
    seconds it took. ``sessions``: send each session's id in the session header."""
    urls = [url] if isinstance(url, str) else list(url)
    return asyncio.run(_run(urls, workload, model, concurrency, sessions))
