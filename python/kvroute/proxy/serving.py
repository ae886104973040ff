"""Serving the proxy and aiohttp applications (the emulator, test backends) alike.

* :func:`new_event_loop`: uvloop's loop when uvloop is installed (and not disabled), else
  asyncio's.
* :class:`Service`: what can be served: :class:`kvroute.proxy.Proxy`, or an aiohttp
  application wrapped in :class:`AppService`.
* :func:`start_app`: a runner with handler cancellation on (a client that disconnects
  cancels its handler, so upstream work is cancelled at once), no access log, and a short
  shutdown; returns the runner and the bound URL (port 0 picks a free port).
* :func:`serve_forever`: run one service until SIGINT/SIGTERM (the CLI).
* :class:`ServerThread`: an event loop in a daemon thread that hosts services for tests,
  benchmarks and notebooks; its methods are called from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from aiohttp import web

T = TypeVar("T")


class Service(Protocol):
    """Something that listens: ``start`` returns its URL, ``close`` stops it."""

    async def start(self, host: str, port: int, grace: float) -> str: ...

    async def close(self) -> None: ...


class AppService:
    """An aiohttp application as a :class:`Service`."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, grace: float) -> str:
        self.runner, url = await start_app(self.app, host, port, shutdown_timeout=grace)
        return url

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def as_service(app: web.Application | Service) -> Service:
    return AppService(app) if isinstance(app, web.Application) else app


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when asked for and installed."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def app_runner(app: web.Application, shutdown_timeout: float) -> web.AppRunner:
    """A runner of ``app`` with handler cancellation on and no access log (not set up)."""
    return web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )


def http_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 host in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def start_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 1.0
) -> tuple[web.AppRunner, str]:
    """Start ``app`` on ``host:port``; returns its runner and ``http://host:port``."""
    runner = app_runner(app, shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, http_url(host, runner.addresses[0][1])


def serve_forever(
    app: web.Application | Service,
    host: str,
    port: int,
    *,
    use_uvloop: bool = True,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM; ``on_ready(url)`` once it listens."""
    service = as_service(app)

    async def main() -> None:
        url = await service.start(host, port, 5.0)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(url)
        try:
            await stop.wait()
        finally:
            await service.close()

    with asyncio.Runner(loop_factory=lambda: new_event_loop(use_uvloop)) as r:
        r.run(main())


class ServerThread:
    """An event loop in a thread hosting aiohttp applications (see the module doc)."""

    def __init__(self, use_uvloop: bool = False) -> None:
        self.loop = new_event_loop(use_uvloop)
        self._services: dict[str, Service] = {}
        self._graces: dict[str, float] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the thread's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run a plain function on the loop's thread."""

        async def wrap() -> T:
            return fn()

        return self.call(wrap(), timeout)

    def start(self, app: web.Application | Service, grace: float = 0.5) -> str:
        """Serve a service or an aiohttp application on 127.0.0.1, a free port; its URL.
        ``grace``: how long :meth:`stop` lets its running requests finish."""

        async def go() -> str:
            service = as_service(app)
            url = await service.start("127.0.0.1", 0, grace)
            self._services[url] = service
            self._graces[url] = grace
            return url

        return self.call(go())

    def stop(self, url: str) -> None:
        """Stop one service: close its port and its connections (after its grace period)."""
        grace = self._graces.pop(url, 0.5)
        self.call(self._services.pop(url).close(), timeout=30.0 + grace)

    def close(self) -> None:
        """Stop every service and the loop."""
        for url in list(self._services):
            self.stop(url)

        async def drain() -> None:
            await asyncio.sleep(0.05)

        self.call(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
