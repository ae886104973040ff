"""``kvroute proxy``: an OpenAI-compatible, KV-cache-aware proxy in front of vLLM engines.

Every routing decision is the Rust :class:`kvroute.Router`; the proxy keys requests
(:mod:`.keys`), forwards and relays them (:mod:`.handler`), watches its backends
(:mod:`.backends`), reports (:mod:`.observe`) and can be changed at run time (:mod:`.admin`).
See ``docs/proxy.md``.

>>> from kvroute.proxy import Proxy, ProxyConfig, serve_forever
>>> proxy = Proxy(ProxyConfig(backends=["http://127.0.0.1:8100"], policy="dynamo_cost"))
>>> serve_forever(proxy, "127.0.0.1", 8000)  # doctest: +SKIP
"""

from __future__ import annotations

from kvroute.proxy.app import Proxy
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.serving import AppService, ServerThread, Service, serve_forever, start_app

__all__ = [
    "AppService",
    "Proxy",
    "ProxyConfig",
    "ServerThread",
    "Service",
    "serve_forever",
    "start_app",
]
