"""The proxy's settings, one dataclass; ``kvroute proxy`` maps its options onto it.

Stateless; a config is read-only once the proxy starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kvroute
from kvroute.errors import InvalidArgumentError


def normalize_url(url: str) -> str:
    """``url`` without trailing slashes; ``http://`` added when it has no scheme."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.startswith("https://"):
        raise InvalidArgumentError(
            f"the proxy speaks plain HTTP to its backends, not TLS ({url}); use http://"
        )
    if not url.startswith("http://"):
        raise InvalidArgumentError(f"backend URL must be http://host:port, got {url!r}")
    return url


#: The policy a proxy routes with unless told (``docs/proxy.md``, "Which policy"): a session's
#: next turn goes where its last one went while that engine holds most of its prompt and is
#: not overloaded (``unified``'s gate); everything else by Dynamo's cost, which weighs the
#: blocks a request would prefill on an engine against the blocks the engine is already
#: serving, so a prefix follows its cache whether or not it has a session, and new work goes
#: where the load is lightest.
DEFAULT_POLICY = "unified_dynamo"
#: Router options the proxy sets for a policy unless ``router_options`` gives them: a block
#: to prefill weighs 8 blocks in flight (Dynamo's own default, 1, lets an agent's long context
#: move to whichever engine holds fewer tokens, and prefill it again there).
POLICY_OPTIONS: dict[str, dict[str, Any]] = {
    "dynamo_cost": {"overlap_weight": 8.0},
    "unified_dynamo": {"overlap_weight": 8.0},
    # `ttft` counts the delay a request's prefill adds to the requests running where it goes,
    # so a prompt is prefilled again elsewhere only when that is quicker for all of them.
    "ttft": {"delay_weight": 1.0},
}


@dataclass
class ProxyConfig:
    """Everything the proxy needs to know (see ``docs/proxy.md``)."""

    backends: list[str] = field(default_factory=list)
    policy: str = DEFAULT_POLICY
    #: Keyword arguments of :class:`kvroute.Router` besides the policy (``block_size``,
    #: ``cache_capacity_blocks``, ``overload_factor``, ...), over ``POLICY_OPTIONS``.
    router_options: dict[str, Any] = field(default_factory=dict)
    #: ``"approx"`` (byte chunking, no tokenizer), ``"backend"`` (the backend's ``/tokenize``)
    #: or the path of a Hugging Face ``tokenizer.json``.
    tokenizer: str = "approx"
    session_header: str = "X-Session-Id"
    #: Body field that names the session when the header is absent (None: header only).
    session_field: str | None = "session_id"
    max_body_bytes: int = 32 << 20
    #: Longest wait for the backend's next bytes (for a non-streaming request: the whole
    #: response), in seconds.
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 3.0
    max_concurrency: int = 4096
    #: Further attempts on other backends after a connection failure or a 5xx answer,
    #: as long as no byte reached the client.
    retries: int = 2
    health_interval_s: float = 2.0
    #: Seconds between reads of each engine's own load (its ``/metrics``).
    load_interval_s: float = 2.0
    #: What the policies' load terms read: ``"engine"``, the router's own counts plus the
    #: requests each engine reported beyond them (other replicas', traffic that bypassed the
    #: router); ``"router"``, its own counts only (``docs/semantics.md`` §2).
    load_source: str = "engine"
    #: Leave out an engine whose waiting requests (reported, plus those sent since) reach
    #: this, or whose KV-cache usage (0 to 1) reaches ``overload_kv_usage``, while another is
    #: under both (None: that signal unused).
    overload_waiting: int | None = None
    overload_kv_usage: float | None = None
    #: Leave out an engine with this many requests in flight (as the policies read them).
    max_in_flight: int | None = None
    #: Leave out an engine with this many prompt tokens in flight; admission binds a request
    #: only where its tokens fit beside them and those held (``docs/proxy.md``).
    max_in_flight_tokens: int | None = None
    #: Admission (``docs/proxy.md``, "Admission"): while every engine is overloaded, up to
    #: this many requests wait in the router's queue (None: none wait, all engines take part).
    queue_size: int | None = None
    #: Longest wait in the queue, in seconds (then 503 with ``Retry-After``).
    queue_timeout_s: float = 30.0
    #: Seconds a queued request waits for the engine its policy prefers before the first in
    #: the queue takes any engine with room.
    queue_patience_s: float = 0.5
    #: Seconds an engine keeps a room for a session's next request after one ends there (0:
    #: no holds); counted against ``max_in_flight`` and ``max_in_flight_tokens``.
    queue_hold_s: float = 0.0
    #: No hold is given while a request has waited this many seconds.
    queue_hold_yield_s: float = 5.0
    #: Header with a request's priority in the queue (an integer, higher first; 0 without).
    priority_header: str = "X-Priority"
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3
    healthy_after: int = 2
    #: Bearer token of the admin API; None turns the admin API off.
    admin_token: str | None = None
    decision_log: str | None = None
    #: Longest wait for a request head to be complete (also closes a kept-alive connection
    #: that idles that long), in seconds.
    header_read_timeout_s: float = 30.0
    #: Longest wait for a request body to be complete once its head is read, in seconds.
    body_read_timeout_s: float = 60.0
    #: Client connections served at once; one beyond gets a 503 and is closed.
    max_connections: int = 8192
    #: ``"auto"``: the router reads each engine's KV-cache events wherever it publishes them
    #: (needs exact keys: a tokenizer, not ``approx``); ``"off"``: the estimate view only.
    kv_events: str = "auto"
    #: Backend URL -> ``[endpoint]`` or ``[endpoint, replay endpoint]`` of its rank 0 (instead
    #: of what its ``/kv_event_sources`` says).
    kv_event_sources: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backends = [normalize_url(u) for u in self.backends]
        if len(set(self.backends)) != len(self.backends):
            raise InvalidArgumentError("the same backend URL is given twice")
        if self.policy not in kvroute.policies():
            raise InvalidArgumentError(
                f"unknown policy {self.policy!r}; known: {', '.join(kvroute.policies())}"
            )
        names = ("max_body_bytes", "max_concurrency", "max_connections")
        for name in (*names, "unhealthy_after", "healthy_after"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1")
        timeouts = (
            "request_timeout_s",
            "connect_timeout_s",
            "header_read_timeout_s",
            "body_read_timeout_s",
        )
        for name in (*timeouts, "health_interval_s", "load_interval_s", "queue_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be positive")
        if self.overload_waiting is not None and self.overload_waiting < 1:
            raise InvalidArgumentError("overload_waiting must be at least 1")
        for name in ("max_in_flight", "max_in_flight_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1")
        if self.queue_size is not None and self.queue_size < 0:
            raise InvalidArgumentError("queue_size must be at least 0")
        if not 0 <= self.queue_patience_s < 1e9:
            raise InvalidArgumentError("queue_patience_s must be a number of seconds >= 0")
        if not 0 <= self.queue_hold_s < 1e9:
            raise InvalidArgumentError("queue_hold_s must be a number of seconds >= 0")
        if not 0 <= self.queue_hold_yield_s < 1e9:
            raise InvalidArgumentError("queue_hold_yield_s must be a number of seconds >= 0")
        if self.overload_kv_usage is not None and not 0 <= self.overload_kv_usage <= 1:
            raise InvalidArgumentError("overload_kv_usage must be in [0, 1]")
        if self.load_source not in ("router", "engine"):
            raise InvalidArgumentError(
                f"load_source must be 'router' or 'engine', got {self.load_source!r}"
            )
        if self.retries < 0:
            raise InvalidArgumentError("retries must be at least 0")
        if self.kv_events not in ("auto", "off"):
            raise InvalidArgumentError(f"kv_events must be 'auto' or 'off', got {self.kv_events!r}")
        sources = {}
        for url, endpoints in self.kv_event_sources.items():
            if normalize_url(url) not in self.backends:
                raise InvalidArgumentError(f"KV-events source for {url}, which is not a backend")
            if not 1 <= len(endpoints) <= 2 or not all(isinstance(e, str) for e in endpoints):
                raise InvalidArgumentError(
                    f"KV-events source of {url}: [endpoint] or [endpoint, replay]"
                )
            sources[normalize_url(url)] = list(endpoints)
        self.kv_event_sources = sources

    @property
    def uses_kv_events(self) -> bool:
        """Whether the router reads KV events (``auto``, with exact keys)."""
        return self.kv_events == "auto" and self.tokenizer != "approx"

    def policy_options(self) -> dict[str, Any]:
        """The router's keywords for this policy: ``POLICY_OPTIONS`` under ``router_options``."""
        return {**POLICY_OPTIONS.get(self.policy, {}), **self.router_options}

    @property
    def fits_ttft_costs(self) -> bool:
        """Whether ``ttft``'s costs are fitted while serving (no engine profile given)."""
        return self.policy == "ttft" and "engine_profile" not in self.router_options

    @property
    def block_size(self) -> int:
        return int(self.router_options.get("block_size", 512))
