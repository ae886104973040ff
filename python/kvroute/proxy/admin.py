"""The admin API: list, add and remove backends at run time.

Only mounted when the proxy has an admin token; every call needs
``Authorization: Bearer <token>`` (compared in constant time), else 401.

* ``GET /admin/backends``: every backend with its state and the router's counters;
* ``POST /admin/backends`` with ``{"url": "http://host:port"}``: add one (201);
* ``DELETE /admin/backends/{index or url-encoded URL}``: stop routing to one (its in-flight
  requests finish).

Loop-affine, O(backends) per call.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from kvroute.errors import InvalidArgumentError
from kvroute.proxy.backends import BackendPool
from kvroute.proxy.prompts import BadRequest, error_body, parse_body


def json_error(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error answer of the side application."""
    return web.json_response(error_body(message, kind, status), status=status)


class Admin:
    """Handlers of the admin API."""

    def __init__(self, pool: BackendPool, token: str) -> None:
        self.pool = pool
        self._token = f"Bearer {token}".encode()

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/backends", self.list)
        app.router.add_post("/admin/backends", self.add)
        app.router.add_delete("/admin/backends/{key:.+}", self.remove)

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, self._token)

    def _denied(self) -> web.Response:
        resp = json_error(401, "admin API: missing or wrong bearer token", "unauthorized")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    def _describe(self) -> list[dict[str, Any]]:
        state = self.pool.router.state()
        return [{**b.describe(), **state[b.index]} for b in self.pool.backends]

    async def list(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._denied()
        return web.json_response({"backends": self._describe()})

    async def add(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._denied()
        try:
            body = parse_body(await request.read())
            url = body.get("url")
            if not isinstance(url, str):
                raise BadRequest("'url' must be a string", "url")
            try:
                b = self.pool.add(url)  # checks the URL before the router changes
            except InvalidArgumentError as exc:
                raise BadRequest(f"url: {exc}", "url") from exc
        except BadRequest as exc:
            body = error_body(str(exc), "invalid_request_error", 400, exc.param)
            return web.json_response(body, status=400)
        return web.json_response(b.describe(), status=201)

    async def remove(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._denied()
        try:
            b = self.pool.remove(request.match_info["key"])
        except InvalidArgumentError as exc:
            return json_error(404, str(exc), "not_found")
        return web.json_response(b.describe())
