"""``kvroute proxy``: an OpenAI-compatible, KV-cache-aware proxy in front of vLLM engines.

Every routing decision is the Rust :class:`kvroute.Router`; the proxy keys requests
(:mod:`.keys`), forwards and relays them (:mod:`.handler`), watches its backends
(:mod:`.backends`), reports (:mod:`.observe`) and can be changed at run time (:mod:`.admin`).
See ``docs/proxy.md``.

>>> from kvroute.proxy import ProxyConfig, proxy_app
>>> app = proxy_app(ProxyConfig(backends=["http://127.0.0.1:8100"], policy="unified"))
"""

from __future__ import annotations

from kvroute.proxy.app import PROXY, Proxy, proxy_app
from kvroute.proxy.config import ProxyConfig
from kvroute.proxy.serving import ServerThread, serve_forever, start_app

__all__ = [
    "PROXY",
    "Proxy",
    "ProxyConfig",
    "ServerThread",
    "proxy_app",
    "serve_forever",
    "start_app",
]
