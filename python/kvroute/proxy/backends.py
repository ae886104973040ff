"""The backends behind the proxy: health, failures, and adding or removing them at run time.

Backend ``i`` is router instance ``i``, for good: a removed backend keeps its index (the router
only marks it unavailable, and its in-flight requests finish normally); adding the same URL
again brings that index back, a new URL gets ``router.add_instance()``.

A backend is *down* after ``unhealthy_after`` consecutive failures (failed health checks,
connection failures, 5xx answers), and *up* again after ``healthy_after`` consecutive good
health checks; the router's availability follows (``set_available``). Health checks are
``GET /health`` every ``health_interval_s``, all backends at once.

O(backends) per health round; loop-affine (one event loop owns the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

import kvroute
from kvroute.errors import InvalidArgumentError, UnknownInstanceError
from kvroute.proxy.config import ProxyConfig, normalize_url

log = logging.getLogger("kvroute.proxy")

#: ``(scheme, host, port)``; scheme ``unix`` has the socket's path as host and port 0.
Address = tuple[str, str, int]


def address_of(url: str) -> tuple[Address, str]:
    """The address of an ``http://host:port[/prefix]`` URL and its path prefix; an
    :class:`InvalidArgumentError` for anything else (no host, a port that is not a number
    in 1-65535, an unclosed IPv6 bracket, ...)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"backend URL {url!r} does not parse: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise InvalidArgumentError(f"backend URL must be http://host:port, got {url!r}")
    port = port or 80
    return (parts.scheme, parts.hostname, port), parts.path.rstrip("/")


def without_credentials(url: str) -> str:
    """``url`` without a ``user:password@`` part (for labels, logs and headers)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


@dataclass
class Backend:
    """One engine behind the proxy."""

    index: int
    url: str
    up: bool = True
    removed: bool = False
    failures: int = 0
    successes: int = 0
    #: Where requests go: the URL's address, ``Host`` header and path prefix.
    address: Address = field(init=False)
    host: str = field(init=False)
    prefix: str = field(init=False)
    #: The URL without credentials: what metrics, logs, headers and errors show.
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.address, self.prefix = address_of(self.url)
        self.label = without_credentials(self.url)
        self.host = urlsplit(self.label).netloc

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.label, "up": self.up, "removed": self.removed}


class BackendPool:
    """Backends, their health, and the router's view of their availability."""

    def __init__(self, config: ProxyConfig, router: kvroute.Router) -> None:
        self.config = config
        self.router = router
        self.backends: list[Backend] = []
        #: The data path (``kvroute._core.Relay``), once it serves: told where each backend
        #: is and whether it has failures to clear.
        self.relay: Any = None
        #: Called with a backend that comes back: up again after being down, or added again
        #: after being removed (its engine may have restarted meanwhile).
        self.on_back: list[Callable[[Backend], None]] = []
        for url in config.backends:
            self.add(url)

    def attach(self, relay: Any) -> None:
        """Serve through ``relay``: tell it every backend, and each change from now on."""
        self.relay = relay
        for b in self.backends:
            self._place(b)

    def _place(self, b: Backend) -> None:
        if self.relay is not None:
            self.relay.set_backend(b.index, b.label, b.address, b.host, b.prefix)
            self._note(b)

    def _note(self, b: Backend) -> None:
        if self.relay is not None:
            self.relay.set_failing(b.index, b.failures > 0)

    def __len__(self) -> int:
        return len(self.backends)

    def get(self, index: int) -> Backend:
        return self.backends[index]

    def live(self) -> list[Backend]:
        """Backends that take requests (added, not removed, up)."""
        return [b for b in self.backends if b.up and not b.removed]

    def _sync(self, b: Backend) -> None:
        self.router.set_available(b.index, b.up and not b.removed)

    def add(self, url: str) -> Backend:
        """Add a backend (or bring a removed one back); it starts up."""
        url = normalize_url(url)
        for b in self.backends:
            if b.url == url:
                if not b.removed:
                    raise InvalidArgumentError(f"backend {url} is already in the pool")
                b.removed, b.up, b.failures, b.successes = False, True, 0, 0
                self._sync(b)
                self._note(b)
                self._back(b)
                return b
        b = Backend(len(self.backends), url)  # checks the URL before the router changes
        if b.index >= self.router.num_instances:
            b.index = self.router.add_instance()
        self.backends.append(b)
        self._sync(b)
        self._place(b)
        return b

    def find(self, key: str | int) -> Backend:
        """A backend by index or URL."""
        if isinstance(key, int) or key.isdigit():
            i = int(key)
            if 0 <= i < len(self.backends):
                return self.backends[i]
            raise UnknownInstanceError(f"no backend {i}")
        url = normalize_url(key)
        for b in self.backends:
            if b.url == url:
                return b
        raise UnknownInstanceError(f"no backend {url}")

    def remove(self, key: str | int) -> Backend:
        """Stop routing to a backend; in-flight requests finish."""
        b = self.find(key)
        b.removed = True
        self._sync(b)
        return b

    def failure(self, b: Backend) -> None:
        b.successes = 0
        b.failures += 1
        self._note(b)
        if b.up and b.failures >= self.config.unhealthy_after:
            b.up = False
            log.warning("backend %s is down after %d failures", b.label, b.failures)
            self._sync(b)

    def success(self, b: Backend) -> None:
        """A request went well: the failure streak ends (health checks bring a backend up)."""
        b.failures = 0
        self._note(b)

    def _health_ok(self, b: Backend) -> None:
        b.failures = 0
        self._note(b)
        b.successes += 1
        if not b.up and b.successes >= self.config.healthy_after:
            b.up = True
            log.warning("backend %s is up again", b.label)
            self._sync(b)
            self._back(b)

    def _back(self, b: Backend) -> None:
        for callback in self.on_back:
            callback(b)

    async def check(self, session: aiohttp.ClientSession, b: Backend) -> bool:
        """One health check of ``b`` (updates its state)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        ok = False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(b.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
        if ok:
            self._health_ok(b)
        else:
            self.failure(b)
        return ok

    async def health_loop(self, session: aiohttp.ClientSession) -> None:
        """Check every backend each ``health_interval_s``, forever."""
        while True:
            targets = [b for b in self.backends if not b.removed]
            if targets:
                await asyncio.gather(*(self.check(session, b) for b in targets))
            await asyncio.sleep(self.config.health_interval_s)
