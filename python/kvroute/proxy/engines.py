"""The engines' own endpoints, reached through the proxy (outside the request path).

* ``GET /v1/models``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``: relayed to
  the first live backend that answers;
* ``GET /backends/{index}/health``, ``GET /backends/{index}/metrics``: relayed to that one
  backend (its own health and Prometheus text, beside the proxy's ``/health`` and
  ``/metrics``);
* ``POST /reset_prefix_cache``: sent to every live backend, and the router's cache model of
  each backend that reset is cleared too, so the next requests start cold everywhere. vLLM
  serves it only with ``VLLM_SERVER_DEV_MODE=1``: a backend that refuses it makes the answer
  an error that names the backend and what it said.

A relayed request keeps its method, path, query, body and end-to-end headers (hop-by-hop
ones and ``Host`` aside); the answer keeps its status, body and end-to-end headers.

O(backends) per call; loop-affine (runs in the proxy's side application).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

import kvroute
from kvroute.proxy.admin import json_error
from kvroute.proxy.backends import Backend, BackendPool

#: Time limit of these calls to a backend.
AUX_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
#: Paths relayed to the first live backend, by method.
TO_ANY = {"GET": ("/v1/models", "/version"), "POST": ("/tokenize", "/detokenize")}
#: Paths of one backend relayed under ``/backends/{index}``.
TO_ONE = ("health", "metrics")
_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)

#: Request headers not forwarded (hop-by-hop, framing, and compression: answers come plain).
HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "accept-encoding",
    )
)
#: Answer headers not relayed (hop-by-hop and framing: the proxy frames its own answers).
DROP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length"))


class EngineEndpoints:
    """Handlers of the module doc's endpoints; ``session`` is set by the side application."""

    def __init__(self, pool: BackendPool, router: kvroute.Router) -> None:
        self.pool, self.router = pool, router
        self.session: aiohttp.ClientSession | None = None

    def routes(self, app: web.Application) -> None:
        r = app.router
        for method, paths in TO_ANY.items():
            for path in paths:
                r.add_route(method, path, self.to_any)
        r.add_get("/backends/{index:\\d+}/{name:" + "|".join(TO_ONE) + "}", self.to_one)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def _send(
        self, b: Backend, request: web.Request, path: str, data: bytes | None
    ) -> web.Response:
        assert self.session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP)
        url = b.url + path + (f"?{request.query_string}" if request.query_string else "")
        async with self.session.request(
            request.method, url, data=data, headers=headers, timeout=AUX_TIMEOUT
        ) as resp:
            body = await resp.read()
            kept = CIMultiDict((k, v) for k, v in resp.headers.items() if k.lower() not in DROP)
            return web.Response(body=body, status=resp.status, headers=kept)

    async def to_any(self, request: web.Request) -> web.Response:
        data = await request.read() if request.can_read_body else None
        for b in self.pool.live():
            try:
                return await self._send(b, request, request.path, data)
            except _ERRORS:
                continue
        return json_error(503, "no backend is available", "service_unavailable")

    async def to_one(self, request: web.Request) -> web.Response:
        index = int(request.match_info["index"])
        if index >= len(self.pool.backends) or self.pool.backends[index].removed:
            return json_error(404, f"no backend {index}", "not_found")
        b = self.pool.backends[index]
        try:
            return await self._send(b, request, "/" + request.match_info["name"], None)
        except _ERRORS as exc:
            return json_error(502, f"backend {index} ({b.label}) failed: {exc!r}", "bad_gateway")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        live = self.pool.live()
        if not live:
            return json_error(503, "no backend is available", "service_unavailable")
        answers = await asyncio.gather(*(self._reset(b, request) for b in live))
        refused = [f"backend {b.index} ({b.label}): {why}" for b, why in answers if why]
        body: dict[str, Any] = {"reset": [b.label for b, why in answers if not why]}
        if refused:
            message = "reset_prefix_cache refused by " + "; ".join(refused)
            return json_error(502, message, "bad_gateway")
        return web.json_response(body)

    async def _reset(self, b: Backend, request: web.Request) -> tuple[Backend, str | None]:
        """Reset one backend's prefix cache, then the router's model of it; what went wrong."""
        try:
            resp = await self._send(b, request, "/reset_prefix_cache", await request.read())
        except _ERRORS as exc:
            return b, f"failed: {exc!r}"
        if resp.status >= 300:
            assert isinstance(resp.body, bytes)
            text = resp.body.decode(errors="replace").strip()[:200]
            hint = (
                " (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)" if resp.status == 404 else ""
            )
            return b, f"answered {resp.status}{hint}: {text}"
        self.router.clear_cache(b.index)
        return b, None

    async def remote_tokenize(self, query: dict[str, Any]) -> list[int] | None:
        """Token ids from a live backend's ``/tokenize`` (None when none answers)."""
        assert self.session is not None
        for b in self.pool.live():
            try:
                async with self.session.post(
                    b.url + "/tokenize", json=query, timeout=AUX_TIMEOUT
                ) as resp:
                    if resp.status == 200:
                        tokens = (await resp.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
            except (*_ERRORS, ValueError):
                continue
        return None
