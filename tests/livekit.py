"""Helpers of the live-path tests (proxy, emulator, replay): plain HTTP calls, a stack of
emulators behind a proxy on a background event loop, and small synthetic traces.

Everything listens on 127.0.0.1 with free ports; servers run in-process on a
:class:`kvroute.proxy.ServerThread`, so tests need no subprocesses and close everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from email.message import Message
from typing import Any

import pyarrow as pa
from aiohttp import web

from kvroute.emulator import EMULATOR, Emulator, EmulatorConfig, emulator_app
from kvroute.launch import TAIL_LINES, Launched, launch
from kvroute.proxy import Proxy, ProxyConfig, ServerThread
from kvroute.schema import trace_schema

MODEL = "Qwen/Qwen3-Coder-30B-A3B-Instruct"


def http(
    method: str,
    url: str,
    body: bytes | dict[str, Any] | list[Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, Message, bytes]:
    """One HTTP call; status, headers (names case-insensitive) and body (errors are answers,
    not exceptions)."""
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and not req.has_header("Content-type"):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON decoded; ``[DONE]`` as the string)."""
    out: list[Any] = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def spawn(
    command: str,
    *args: str,
    timeout: float = 60.0,
    preexec: Callable[[], None] | None = None,
    keep: int | None = TAIL_LINES,
) -> Launched:
    """``kvroute COMMAND --port 0 ARGS`` in a process of its own, without the debug-build
    warning (``preexec`` runs in it before kvroute starts); ``.url``, ``.stop()``."""
    env = {"PYTHONWARNINGS": "ignore"}
    return launch(command, *args, env=env, preexec=preexec, timeout_s=timeout, keep=keep)


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Hold:
    """A gate in front of emulators' generation endpoints (``Stack(hold=...)``): requests
    wait at it until :meth:`open` (called on the stack's loop: ``stack.st.run(hold.open)``),
    or for ``timeout_s`` at most, so that a test can keep requests in flight without timing
    them. :attr:`waiting` counts the requests that reached it."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.waiting = 0
        self._open = asyncio.Event()

    def open(self) -> None:
        self._open.set()

    @web.middleware
    async def middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("completions"):
            self.waiting += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._open.wait(), self.timeout_s)
        return await handler(request)


class FakeEngine:
    """A hand-made engine for a test: ``POST /v1/completions`` answered by the subclass's
    ``completions``, ``GET /health`` always 200, and whatever :meth:`add_routes` adds."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        self.add_routes(app)
        return app

    def add_routes(self, app: web.Application) -> None:
        """More endpoints (none here)."""

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


#: The proxy's health checks in a :class:`Stack` unless a test sets them: a check a loaded
#: machine answers late would count as a failure (three take a backend down).
QUIET_HEALTH = {"health_interval_s": 60.0, "health_timeout_s": 30.0}


class Stack:
    """Emulators behind a proxy on one background loop (health checks once at start, then
    each minute, unless ``proxy`` sets ``health_interval_s``)."""

    def __init__(
        self,
        engines: int = 3,
        *,
        speedup: float = 50.0,
        preset: str = "h20-qwen3-coder-30b-a3b",
        proxy: dict[str, Any] | None = None,
        emulator: dict[str, Any] | None = None,
        hold: Hold | None = None,
    ) -> None:
        self.st = ServerThread()
        self.emulators: list[Emulator] = []
        self.engine_urls: list[str] = []
        self.hold = hold
        try:
            for _ in range(engines):
                self.add_engine(speedup=speedup, preset=preset, **(emulator or {}))
            config = {**QUIET_HEALTH, **(proxy or {})}
            self.proxy = Proxy(ProxyConfig(backends=list(self.engine_urls), **config))
            self.url = self.st.start(self.proxy)
        except BaseException:
            self.st.close()
            raise

    def add_engine(self, **config: Any) -> str:
        app = emulator_app(EmulatorConfig(**config))
        if self.hold is not None:
            app.middlewares.append(self.hold.middleware)
        url = self.st.start(app)
        self.emulators.append(app[EMULATOR])
        self.engine_urls.append(url)
        return url

    def state(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.proxy.router.state()]

    def idle(self) -> bool:
        """No request in flight in the router or in any emulator."""
        return self.proxy.router.in_flight == 0 and all(e.active == 0 for e in self.emulators)

    def assert_counters_zero(self, timeout: float = 20.0) -> None:
        wait_until(self.idle, timeout, "the proxy and engines to drain")
        for s in self.state():
            for key in ("num_requests", "ongoing_tokens", "pending_prefill_tokens"):
                assert s[key] == 0, (key, s)
            assert s["ongoing_decode_tokens"] == 0, s

    def close(self) -> None:
        self.st.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def small_trace(
    sessions: int = 4,
    turns: int = 3,
    first_blocks: int = 2,
    blocks_per_turn: int = 1,
    block_size: int = 512,
    gap: float = 0.2,
    ttp: float = 0.1,
    output_length: int = 8,
    string_sessions: bool = False,
    key_offset: int = 0,
) -> pa.Table:
    """Sessions whose turns extend the previous turn's keys (a growing conversation) by whole
    blocks, as a trace's keys imply (a partial last block would get a key of its own)."""
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "request_id",
            "timestamp",
            "session_id",
            "turn",
            "input_length",
            "output_length",
            "hash_ids",
            "time_to_parent_chat",
        )
    }
    rid = 0
    for s in range(sessions):
        keys: list[int] = []
        for t in range(turns):
            grow = first_blocks if t == 0 else blocks_per_turn
            keys = keys + [key_offset + (s + 1) * 1_000_000 + t * 100 + i for i in range(grow)]
            rows["request_id"].append(rid)
            rows["timestamp"].append(s * gap + t * gap * sessions)
            rows["session_id"].append(f"s{s}" if string_sessions else s)
            rows["turn"].append(t)
            rows["input_length"].append(len(keys) * block_size)
            rows["output_length"].append(output_length)
            rows["hash_ids"].append(list(keys))
            rows["time_to_parent_chat"].append(None if t == 0 else ttp)
            rid += 1
    schema = trace_schema(
        ttp=True, block_size=block_size, session_type=pa.string() if string_sessions else None
    )
    return pa.table(rows, schema=schema).sort_by("timestamp")


__all__ = [
    "MODEL",
    "Hold",
    "Stack",
    "http",
    "small_trace",
    "spawn",
    "sse_events",
    "wait_until",
]
