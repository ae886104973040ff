"""Where an engine publishes its KV events: :class:`Source`, and the sources in its
``GET /kv_event_sources`` answer (:func:`event_sources`). Plain values; O(ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvroute.errors import InvalidArgumentError

#: Hosts in an endpoint that mean "every interface" (the engine binds; connect to its host).
WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Source:
    """Where one rank of one engine publishes."""

    rank: int
    endpoint: str
    replay: str | None = None
    topic: str = ""
    #: The engine connects to ``endpoint`` (a concrete host): the subscriber binds it.
    bind: bool = False


def _with_host(endpoint: str, host: str) -> tuple[str, bool]:
    """``endpoint`` with a wildcard host replaced by ``host``; and whether to bind it."""
    if not endpoint.startswith("tcp://"):
        return endpoint, False  # ipc:// and inproc://: the engine binds, on this machine
    where = endpoint[len("tcp://") :]
    at, _, port = where.rpartition(":")
    if not port.isdigit():
        raise InvalidArgumentError(f"KV-events endpoint {endpoint!r} has no port")
    if at in WILDCARDS:
        name = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{name}:{port}", False
    return endpoint, True


def event_sources(answer: Any, backend_url: str) -> list[Source]:
    """The sources in an engine's ``GET /kv_event_sources`` answer (``{rank: config}``);
    wildcard hosts are the backend's. Ranks whose events are off are left out."""
    if not isinstance(answer, dict):
        raise InvalidArgumentError(f"/kv_event_sources of {backend_url} is not an object")
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    out = []
    for rank, config in sorted(answer.items(), key=lambda kv: int(kv[0])):
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events", True):
            continue
        if config.get("publisher", "zmq") != "zmq" or not config.get("endpoint"):
            continue
        endpoint, bind = _with_host(str(config["endpoint"]), host)
        replay = config.get("replay_endpoint")
        replay = _with_host(str(replay), host)[0] if replay else None
        out.append(Source(int(rank), endpoint, replay, str(config.get("topic") or ""), bind))
    return out
