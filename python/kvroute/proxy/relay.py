"""The proxy's data path, ``kvroute._core.Relay``, and what it asks of Python.

The relay serves the proxy's port from one Rust thread (an event loop of its own, off the
GIL, on hyper): it reads requests, forwards ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (routing each with the shared :class:`kvroute.Router`, relaying the
answer chunk by chunk, retrying and failing as ``docs/proxy.md`` says), and relays every
other request to the proxy's side application (health, metrics, models, tokenize, admin),
which stays in Python on the event loop. What it needs from Python it asks through
:class:`RelayHooks`, with the GIL, from its own thread: the keys of a body (the
:class:`~kvroute.proxy.keys.Keyer`; ``backend`` mode runs its round-trip on the event loop),
the tokens an answer generated (when the router keeps vLLM's cache rule, so that the blocks
they complete are recorded), and a backend's failures and recoveries (applied to the
:class:`~kvroute.proxy.backends.BackendPool` on the event loop). Its counters are read at
scrape time (:class:`kvroute.proxy.observe.RelayCollector`).

Thread-safety: the hooks run on the relay's threads; everything they touch besides the
keyer goes through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from kvroute.proxy.backends import BackendPool
from kvroute.proxy.keys import Keyer, TextOutput, session_of
from kvroute.proxy.prompts import BadRequest, error_body, wants_stream

log = logging.getLogger("kvroute.proxy")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class RelayHooks:
    """What the relay asks of Python (see the module doc)."""

    def __init__(
        self,
        keyer: Keyer,
        pool: BackendPool,
        loop: asyncio.AbstractEventLoop,
        session_field: str | None,
    ) -> None:
        self.keyer, self.pool, self.loop = keyer, pool, loop
        self.session_field = session_field
        #: ``key`` may wait for a backend's ``/tokenize``: the relay calls it off its loop.
        self.key_may_block = keyer.mode == "backend"
        #: ``output`` can tokenize an answer's text (else the relay only asks about answers
        #: that carry the engine's ``token_ids``).
        self.output_from_text = keyer.exact

    def key(self, raw: bytes, chat: bool, header: str | None) -> tuple[Any, ...]:
        """``(keys, input_length, stream, session, tail)``, or ``(400, error body)``."""
        try:
            body, got = self.keyer.parse_now(raw, chat)
            if got is None:
                remote = self.keyer.remote_keys(body, chat)
                got = asyncio.run_coroutine_threadsafe(remote, self.loop).result()
            stream = wants_stream(body)
            session = session_of(header, body, self.session_field)
        except BadRequest as exc:
            body = error_body(str(exc), "invalid_request_error", 400, exc.param)
            return 400, json.dumps(body).encode()
        return got.keys, got.input_length, stream, session, got.tail

    def output(self, answer: bytes, stream: bool) -> tuple[Any, int] | None:
        """The ids an answer generated and how many tokens it sampled, or None."""
        got = self.keyer.output_now(answer, stream)
        if isinstance(got, TextOutput):  # text only the backend can tokenize: on the loop
            later = self.keyer.tokenize_output(got)
            return asyncio.run_coroutine_threadsafe(later, self.loop).result()
        return got

    def failure(self, index: int) -> None:
        self.loop.call_soon_threadsafe(self.pool.failure, self.pool.get(index))

    def success(self, index: int) -> None:
        self.loop.call_soon_threadsafe(self.pool.success, self.pool.get(index))

    def log_error(self, message: str) -> None:
        log.error("%s", message)
