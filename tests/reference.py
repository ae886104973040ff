"""A plain Python reference of SEMANTICS.md §1-3: the spec in code.

Written for obviousness, not speed: an ``OrderedDict`` per instance as the LRU, a dict of
in-flight requests, a dict of session affinities, one round-robin counter, Python ints for
every score (no overflow). ``ReferenceRouter`` has the constructor and methods of
``kvroute.Router`` so that the parity tests can drive both with the same events.

The five study policies (``lmetric``, ``load_only``, ``sticky``, ``unified``, ``leastwork``)
follow SEMANTICS.md §3 word for word. The five industry policies (``round_robin``,
``random``, ``power_of_two``, ``sglang_cache_aware``, ``dynamo_cost``) are not on that page;
their rules are those documented in ``rust/kvroute-core/src/picker.rs`` and restated in the
docstrings below. ``SplitMix64`` is the generator of ``rng.rs`` so seeded picks compare
bit-for-bit.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvroute.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    NoInstanceAvailableError,
    UnknownInstanceError,
    UnknownPolicyError,
)
from kvroute.sim import engine_params
from kvroute.sim.profile import COST_TERMS

MASK64 = (1 << 64) - 1

POLICIES = [
    "lmetric",
    "load_only",
    "sticky",
    "unified",
    "leastwork",
    "unified_dynamo",
    "round_robin",
    "random",
    "power_of_two",
    "sglang_cache_aware",
    "dynamo_cost",
    "ttft",
]

# Policies that keep a session -> instance affinity. SEMANTICS.md §3 defines affinity for
# `sticky` and `unified` only (and `unified_dynamo`, which keeps `unified`'s gate); every other
# policy ignores session ids.
AFFINITY_POLICIES = {"sticky", "unified", "unified_dynamo"}


U64_MAX = 2**64 - 1


class SplitMix64:
    """SplitMix64 (Steele, Lea and Flood, 2014), as ``rng.rs``."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform in ``range(n)``: ``(next * n) >> 64``."""
        return (self.next_u64() * n) >> 64

    def unit(self) -> float:
        """Uniform in ``[0, 1)`` with 53 random bits."""
        return (self.next_u64() >> 11) * 2.0**-53


@dataclass
class Instance:
    num_requests: int = 0
    ongoing_tokens: int = 0
    pending_prefill_tokens: int = 0
    ongoing_decode_tokens: int = 0
    available: bool = True
    # LRU of block keys: the *last* entry is the most recently touched.
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # Requests in flight holding each stored key (Dynamo's cost counts a shared block once).
    holders: Counter[int] = field(default_factory=Counter)


#: The engine parameters ``ttft`` predicts with (``Router.ttft_costs``).
TTFT_TERMS = (*COST_TERMS, "max_num_batched_tokens")


@dataclass
class InFlight:
    instance: int
    input_length: int
    new_prefill: int
    first_token_seen: bool = False
    held: list[int] = field(default_factory=list)


def _keys(hash_ids: Any) -> list[int]:
    """Keys as unsigned 64-bit ints (negative ints are their two's complement pattern)."""
    return [int(k) & MASK64 for k in hash_ids]


def _check_id(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"ids must be int or str, got {type(value).__name__}")
    return value


class ReferenceRouter:
    def __init__(
        self,
        num_instances: int,
        policy: str = "unified",
        *,
        block_size: int = 512,
        cache_capacity_blocks: int | None = None,
        cache_rule: str = "trace",
        max_sessions: int | None = None,
        overload_factor: float = 2.0,
        hit_ratio_gate: float = 0.5,
        seed: int = 0,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.1,
        overlap_weight: float = 1.0,
        queued_weight: float = 0.0,
        dedup_weight: float = 0.0,
        temperature: float = 0.0,
        load_source: str = "router",
        engine_profile: dict[str, float] | None = None,
        ttft_slo_s: float = 0.0,
        delay_weight: float = 0.0,
    ) -> None:
        if num_instances < 0:
            raise InvalidArgumentError(f"num_instances must be >= 0, got {num_instances}")
        if policy not in POLICIES:
            raise UnknownPolicyError(f"unknown policy {policy!r}")
        if block_size <= 0:
            raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
        if cache_capacity_blocks is not None and cache_capacity_blocks <= 0:
            raise InvalidArgumentError("cache_capacity_blocks must be positive or None")
        if cache_rule not in ("trace", "vllm"):
            raise InvalidArgumentError(f"cache_rule must be 'trace' or 'vllm', got {cache_rule!r}")
        if load_source not in ("router", "engine"):
            raise InvalidArgumentError(
                f"load_source must be 'router' or 'engine', got {load_source!r}"
            )
        if seed < 0 or balance_abs < 0:
            raise InvalidArgumentError("seed and balance_abs must be >= 0")
        for name, value in [
            ("overload_factor", overload_factor),
            ("hit_ratio_gate", hit_ratio_gate),
            ("cache_threshold", cache_threshold),
            ("balance_rel", balance_rel),
            ("overlap_weight", overlap_weight),
            ("queued_weight", queued_weight),
            ("dedup_weight", dedup_weight),
            ("temperature", temperature),
            ("ttft_slo_s", ttft_slo_s),
            ("delay_weight", delay_weight),
        ]:
            if not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"{name} must be a finite number >= 0")
        self.policy = policy
        self.block_size = block_size
        self.capacity = cache_capacity_blocks
        self.cache_rule = cache_rule
        self.overload_factor = overload_factor
        self.hit_ratio_gate = hit_ratio_gate
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.overlap_weight = overlap_weight
        self.queued_weight = queued_weight
        if dedup_weight > 1:
            raise InvalidArgumentError("dedup_weight must be at most 1")
        self.dedup_weight = dedup_weight
        self.temperature = temperature
        # `ttft` predicts with the h20 preset's step costs under the profile's parameters.
        self.step_costs = engine_params("h20-qwen3-coder-30b-a3b", **(engine_profile or {}))
        self.ttft_slo_s = ttft_slo_s
        self.delay_weight = delay_weight
        self.instances = [Instance() for _ in range(num_instances)]
        self.requests: dict[Any, InFlight] = {}
        self.affinity: OrderedDict[Any, int] = OrderedDict()  # least recently routed first
        if max_sessions is not None and max_sessions <= 0:
            raise InvalidArgumentError("max_sessions must be positive or None")
        self.max_sessions = max_sessions
        self.rr = 0
        self.rng = SplitMix64(seed)
        # Engine reports: instance -> (running, waiting, kv_usage, requests sent by then,
        # requests reported beyond this router's own in flight there then).
        self.reports: dict[int, tuple[int, int, float, int, int]] = {}
        self.sent = [0] * num_instances
        self.load_source = load_source
        # Requests routed so far, and the sums of their input_length and new_prefill.
        self.routed = [0, 0, 0]
        self.rule: tuple[int | None, float | None, int | None] = (None, None, None)

    # ---- §1: blocks and keys ------------------------------------------------------------

    def hit_tokens(self, k: int, input_length: int) -> int:
        return min(k * self.block_size, input_length)

    def matched_blocks(self, i: int, keys: list[int]) -> int:
        """Number of leading keys present in instance i's cache (reads only)."""
        k = 0
        for key in keys:
            if key not in self.instances[i].cache:
                break
            k += 1
        return k

    def hit(self, i: int, keys: list[int], input_length: int) -> int:
        return self.hit_tokens(
            self.matched_blocks(i, self.lookup(keys, input_length)), input_length
        )

    def lookup(self, keys: list[int], input_length: int) -> list[int]:
        """The keys that may hit: all of them, or (vLLM) the full blocks before the last token."""
        if self.cache_rule == "trace":
            return keys
        return keys[: max(input_length - 1, 0) // self.block_size]

    def stored(self, keys: list[int], input_length: int) -> list[int]:
        """The keys the engine keeps: all of them, or (vLLM) the full blocks."""
        return keys if self.cache_rule == "trace" else keys[: input_length // self.block_size]

    def _touch(self, inst: Instance, keys: list[int]) -> None:
        for key in reversed(keys):  # last to first: the head of the prefix ends most recent
            inst.cache[key] = None
            inst.cache.move_to_end(key)
        # Evict least recently touched keys while over capacity. Evicting once after all the
        # touches leaves the same set and order as evicting after each touch, because LRU is
        # a stack algorithm (a size-C LRU always holds the C most recent keys).
        while self.capacity is not None and len(inst.cache) > self.capacity:
            inst.cache.popitem(last=False)

    def new_prefill(self, i: int, keys: list[int], input_length: int) -> int:
        return max(0, input_length - self.hit(i, keys, input_length))

    # ---- public API ---------------------------------------------------------------------

    @property
    def num_instances(self) -> int:
        return len(self.instances)

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def _check_instance(self, instance: int) -> int:
        if not 0 <= instance < len(self.instances):
            raise UnknownInstanceError(f"unknown instance {instance}")
        return instance

    def _check_length(self, input_length: int) -> int:
        if isinstance(input_length, bool) or not isinstance(input_length, int):
            raise TypeError("input_length must be an int")
        if input_length < 0:
            raise InvalidArgumentError(f"input_length must be non-negative, got {input_length}")
        return input_length

    def estimate_cache_hit(self, instance: int, hash_ids: Any, input_length: int) -> int:
        keys = _keys(hash_ids)
        self._check_length(input_length)
        return self.hit(self._check_instance(instance), keys, input_length)

    def estimate_cache_hits(
        self, hash_ids: Any, input_length: int, view: str = "routing"
    ) -> list[int]:
        if view == "events":  # this reference models the estimate view only
            return [0] * len(self.instances)
        keys = _keys(hash_ids)
        self._check_length(input_length)
        return [self.hit(i, keys, input_length) for i in range(len(self.instances))]

    def state(self) -> list[dict[str, Any]]:
        return [
            {
                "num_requests": inst.num_requests,
                "ongoing_tokens": inst.ongoing_tokens,
                "pending_prefill_tokens": inst.pending_prefill_tokens,
                "ongoing_decode_tokens": inst.ongoing_decode_tokens,
                "cached_blocks": len(inst.cache),
                "available": inst.available,
                "cache_view": "estimate",
                "engine": self._report(i),
                "overloaded": self._overloaded(i),
            }
            for i, inst in enumerate(self.instances)
        ]

    # ---- engine reports and overload -----------------------------------------------------

    def _report(self, i: int) -> dict[str, Any] | None:
        if i not in self.reports:
            return None
        running, waiting, kv_usage, at, outside = self.reports[i]
        return {
            "running": running,
            "waiting": waiting,
            "kv_usage": kv_usage,
            "sent_since": self.sent[i] - at,
            "outside": outside,
        }

    def _overloaded(self, i: int) -> bool:
        waiting, kv_usage, in_flight = self.rule
        report = self._report(i)
        outside = report["outside"] if report and self.load_source == "engine" else 0
        if in_flight is not None and self.instances[i].num_requests + outside >= in_flight:
            return True
        if report is None:
            return False
        over_waiting = waiting is not None and report["waiting"] + report["sent_since"] >= waiting
        return over_waiting or (kv_usage is not None and report["kv_usage"] >= kv_usage)

    def has_room(self) -> bool:
        return any(
            inst.available and not self._overloaded(i) for i, inst in enumerate(self.instances)
        )

    def set_engine_load(self, instance: int, running: int, waiting: int, kv_usage: float) -> None:
        i = self._check_instance(instance)
        if not 0 <= kv_usage <= 1:
            raise InvalidArgumentError(f"kv_usage must be in [0, 1], got {kv_usage}")
        outside = min(
            max(min(running + waiting, U64_MAX) - self.instances[i].num_requests, 0), 2**32
        )
        self.reports[i] = (running, waiting, kv_usage, self.sent[i], outside)

    def clear_engine_load(self, instance: int) -> None:
        self.reports.pop(self._check_instance(instance), None)

    def _outside_loads(self) -> list[tuple[int, int, int, int]]:
        """Per instance, what ``load_source="engine"`` adds to its counters: the outside
        requests of its report, each at this router's mean request so far (num_requests,
        ongoing_tokens, pending_prefill_tokens for those reported waiting,
        ongoing_decode_tokens for the others)."""
        n, input_sum, prefill_sum = self.routed
        out = []
        for i, inst in enumerate(self.instances):
            report = self._report(i)
            if self.load_source != "engine" or report is None:
                out.append((0, 0, 0, 0))
                continue
            everyone = report["outside"]
            waiting = min(everyone, report["waiting"])

            def share(count: int, total: int, now: int) -> int:
                # Added with saturation at 2**64 - 1, as the core's u64 counters.
                return min(count * total // max(n, 1), U64_MAX - now)

            out.append(
                (
                    everyone,
                    share(everyone, input_sum, inst.ongoing_tokens),
                    share(waiting, prefill_sum, inst.pending_prefill_tokens),
                    share(everyone - waiting, input_sum, inst.ongoing_decode_tokens),
                )
            )
        return out

    def _add_loads(self, extra: list[tuple[int, int, int, int]], sign: int) -> None:
        for inst, (reqs, ongoing, pending, decode) in zip(self.instances, extra, strict=True):
            inst.num_requests += sign * reqs
            inst.ongoing_tokens += sign * ongoing
            inst.pending_prefill_tokens += sign * pending
            inst.ongoing_decode_tokens += sign * decode

    def set_overload_rule(
        self,
        waiting: int | None = None,
        kv_usage: float | None = None,
        in_flight: int | None = None,
    ) -> None:
        if waiting is not None and waiting < 1:
            raise InvalidArgumentError("waiting must be an int >= 1")
        if in_flight is not None and in_flight < 1:
            raise InvalidArgumentError("in_flight must be an int >= 1")
        if kv_usage is not None and not 0 <= kv_usage <= 1:
            raise InvalidArgumentError("an overload rule needs kv_usage in [0, 1]")
        self.rule = (waiting, kv_usage, in_flight)

    def set_available(self, instance: int, flag: bool) -> None:
        self.instances[self._check_instance(instance)].available = bool(flag)

    def add_instance(self) -> int:
        self.instances.append(Instance())
        self.sent.append(0)
        return len(self.instances) - 1

    @property
    def num_sessions(self) -> int:
        return len(self.affinity)

    def session_affinity(self, session_id: Any) -> int | None:
        return self.affinity.get(_check_id(session_id))

    def cached_keys(self, instance: int) -> list[int]:
        """Most recently touched first."""
        return list(reversed(self.instances[self._check_instance(instance)].cache))

    def route(
        self, request_id: Any, hash_ids: Any, input_length: int, session_id: Any = None
    ) -> int:
        return int(self.route_info(request_id, hash_ids, input_length, session_id)["instance"])

    def route_info(
        self, request_id: Any, hash_ids: Any, input_length: int, session_id: Any = None
    ) -> dict[str, Any]:
        request_id = _check_id(request_id)
        keys = _keys(hash_ids)
        self._check_length(input_length)
        if session_id is not None:
            _check_id(session_id)
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} is already in flight")

        available = [i for i, inst in enumerate(self.instances) if inst.available]
        if not available:
            raise NoInstanceAvailableError("no instance is available to route to")
        # Overloaded instances sit out (as if unavailable) while one available is not.
        over = [i for i in available if self._overloaded(i)]
        if len(over) == len(available):
            over = []
        for i in over:
            self.instances[i].available = False
        # With load_source="engine" the policies read the outside requests too.
        extra = self._outside_loads()
        self._add_loads(extra, 1)
        try:
            available = [i for i in available if i not in over]
            chosen, branch = self._pick(available, keys, input_length, session_id)
        finally:
            self._add_loads(extra, -1)
            for i in over:
                self.instances[i].available = True
        self.sent[chosen] += 1

        # §2 step 1, against the cache *before* this request's blocks are added.
        inst = self.instances[chosen]
        hit = self.hit(chosen, keys, input_length)
        new_prefill = max(0, input_length - hit)
        inst.num_requests += 1
        inst.ongoing_tokens += input_length
        inst.pending_prefill_tokens += new_prefill
        held = self.stored(keys, input_length)
        self._touch(inst, held)
        inst.holders.update(held)
        self.routed = [
            self.routed[0] + 1,
            self.routed[1] + input_length,
            self.routed[2] + new_prefill,
        ]

        self.requests[request_id] = InFlight(chosen, input_length, new_prefill, held=held)
        if session_id is not None and self.policy in AFFINITY_POLICIES:
            self.affinity[session_id] = chosen
            self.affinity.move_to_end(session_id)
            while self.max_sessions is not None and len(self.affinity) > self.max_sessions:
                self.affinity.popitem(last=False)
        return {"instance": chosen, "hit_tokens": hit, "new_prefill": new_prefill, "branch": branch}

    def extend(self, request_id: Any, hash_ids: Any) -> bool:
        keys = _keys(hash_ids)
        r = self.requests.get(_check_id(request_id))
        if r is None:
            return False
        self._touch(self.instances[r.instance], keys)
        return True

    def clear_cache(self, instance: int) -> None:
        self.instances[self._check_instance(instance)].cache.clear()

    def first_token(self, request_id: Any) -> bool:
        r = self.requests.get(_check_id(request_id))
        if r is None or r.first_token_seen:
            return False
        r.first_token_seen = True
        inst = self.instances[r.instance]
        inst.pending_prefill_tokens -= r.new_prefill
        inst.ongoing_decode_tokens += r.input_length
        return True

    def finish(self, request_id: Any) -> bool:
        r = self.requests.pop(_check_id(request_id), None)
        if r is None:
            return False
        inst = self.instances[r.instance]
        inst.num_requests -= 1
        inst.ongoing_tokens -= r.input_length
        inst.holders.subtract(r.held)
        inst.holders = +inst.holders  # drop the keys no request holds
        if r.first_token_seen:
            inst.ongoing_decode_tokens -= r.input_length
        else:
            inst.pending_prefill_tokens -= r.new_prefill
        return True

    # ---- §3: pickers --------------------------------------------------------------------

    def _pick(self, avail: list[int], keys: list[int], n: int, session: Any) -> tuple[int, str]:
        def nreq(i: int) -> int:
            return self.instances[i].num_requests

        def lmetric_key(i: int) -> tuple[int, int, int]:
            np_ = self.new_prefill(i, keys, n)
            score = (self.instances[i].pending_prefill_tokens + np_) * nreq(i)
            return (score, np_, nreq(i))

        # The session's affinity instance, if it has one and it is available.
        aff = None
        if session is not None and session in self.affinity:
            a = self.affinity[session]
            if self.instances[a].available:
                aff = a

        p = self.policy
        if p == "lmetric":
            # min(...) returns the first-seen minimum.
            return min(avail, key=lambda i: lmetric_key(i)[0]), "score"
        if p == "load_only":
            return min(avail, key=nreq), "score"
        if p == "sticky":
            if aff is not None:
                return aff, "affinity"
            return min(avail, key=nreq), "score"
        if p in ("unified", "unified_dynamo"):
            if aff is not None:
                avg = max(sum(nreq(i) for i in avail) / len(avail), 1.0)
                ratio = self.hit(aff, keys, n) / max(n, 1)
                if ratio > self.hit_ratio_gate and nreq(aff) <= avg * self.overload_factor:
                    return aff, "affinity"
            if p == "unified":
                return self._min_round_robin(avail, lmetric_key)
            return self._dynamo(avail, keys, n)
        if p == "leastwork":

            def lpwl_key(i: int) -> tuple[int, int, int]:
                np_ = self.new_prefill(i, keys, n)
                return (self.instances[i].pending_prefill_tokens + np_, np_, nreq(i))

            return self._min_round_robin(avail, lpwl_key)
        if p == "round_robin":
            chosen = avail[self.rr % len(avail)]
            self.rr += 1
            return chosen, "round_robin"
        if p == "random":
            return avail[self.rng.below(len(avail))], "sampled"
        if p == "power_of_two":
            return self._power_of_two(avail), "sampled"
        if p == "sglang_cache_aware":
            return self._sglang(avail, keys, n)
        if p == "dynamo_cost":
            return self._dynamo(avail, keys, n)
        if p == "ttft":
            return self._ttft(avail, keys, n)
        raise AssertionError(p)

    def _min_round_robin(self, avail: list[int], key: Any) -> tuple[int, str]:
        """Minimum of key; ties -> tied[rr % len(tied)] (by index), then rr += 1."""
        best = min(key(i) for i in avail)
        tied = [i for i in avail if key(i) == best]
        if len(tied) == 1:
            return tied[0], "score"
        winner = tied[self.rr % len(tied)]
        self.rr += 1
        return winner, "tie_break"

    def set_ttft_costs(self, costs: dict[str, float]) -> None:
        """Predict with these step costs (over the H20 preset's) from now on."""
        self.step_costs = engine_params("h20-qwen3-coder-30b-a3b", **costs)

    def ttft_costs(self) -> dict[str, float]:
        """The step costs ``ttft`` predicts with, by name."""
        return {k: self.step_costs[k] for k in TTFT_TERMS}

    def predicted_ttft(self, i: int, new_prefill: int, n: int) -> float:
        """Seconds until this request's first token on instance i (SEMANTICS §3 ``ttft``):
        ``steps * per_step + prefill_s_per_token * work + prefill_s_per_pair * new * (hit +
        new / 2) + admit_s_per_token * input_length + admit_s_per_request +
        request_overhead_s`` (+ ``busy_handling_s`` on an instance with a request in flight),
        where work is the instance's pending prefill plus this request's, steps = ceil(work /
        batch) (>= 1), and per_step the step overhead plus the decode terms of its running
        requests."""
        c, inst = self.step_costs, self.instances[i]
        work = min(inst.pending_prefill_tokens + new_prefill, U64_MAX)
        steps = max(1, -(-work // int(c["max_num_batched_tokens"])))
        per_step = (
            c["step_overhead_s"]
            + c["decode_s_per_seq"] * inst.num_requests
            + c["decode_s_per_ctx_token"] * inst.ongoing_decode_tokens
        )
        new = float(new_prefill)
        return (
            steps * per_step
            + c["prefill_s_per_token"] * work
            + c["prefill_s_per_pair"] * new * ((n - new_prefill) + new / 2.0)
            + c["admit_s_per_token"] * n
            + c["admit_s_per_request"]
            + c["request_overhead_s"]
            + (c["busy_handling_s"] if inst.num_requests > 0 else 0.0)
        )

    def _ttft(self, avail: list[int], keys: list[int], n: int) -> tuple[int, str]:
        """The least predicted time, LPWL's tie-breaks (new_prefill, num_requests, then
        round robin), the time plus ``delay_weight`` times the delay the request's prefill
        adds to the requests running there (``prefill_s_per_token * new_prefill *
        num_requests``). With ``ttft_slo_s`` > 0, first: among the instances predicted
        within it, the least new_prefill, then the least predicted time, the same
        tie-breaks."""

        def key(i: int) -> tuple[float, int, int]:
            new = self.new_prefill(i, keys, n)
            return (self.predicted_ttft(i, new, n), new, self.instances[i].num_requests)

        if self.ttft_slo_s > 0:
            within = [i for i in avail if key(i)[0] <= self.ttft_slo_s]
            if within:
                chosen, _ = self._min_round_robin(within, lambda i: (key(i)[1], *key(i)))
                return chosen, "within_slo"

        def cost(i: int) -> tuple[float, int, int]:
            t, new, running = key(i)
            delay = self.step_costs["prefill_s_per_token"] * float(new) * running
            return (t + self.delay_weight * delay, new, running)

        return self._min_round_robin(avail, cost)

    def _power_of_two(self, avail: list[int]) -> int:
        """Two distinct seeded samples; the one with fewer requests, the first on a tie."""
        if len(avail) == 1:
            return avail[0]
        first = self.rng.below(len(avail))
        second = self.rng.below(len(avail) - 1)
        if second >= first:
            second += 1
        a, b = avail[first], avail[second]
        return a if self.instances[a].num_requests <= self.instances[b].num_requests else b

    def _sglang(self, avail: list[int], keys: list[int], n: int) -> tuple[int, str]:
        """SGLang cache-aware: balance when imbalanced, else best match or smallest cache.

        Imbalanced when ``max - min > balance_abs`` and ``max > min * balance_rel`` (requests
        over the available instances): min ``num_requests`` first-seen. Otherwise the
        first-seen instance with the most matched blocks, if its hit rate
        ``hit_tokens / input_length`` (0 for an empty input) is above ``cache_threshold``;
        else the first-seen instance with the fewest cached blocks.
        """
        loads = [self.instances[i].num_requests for i in avail]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return min(avail, key=lambda i: self.instances[i].num_requests), "load_balance"
        lookup = self.lookup(keys, n)  # the keys that may hit, by the cache rule
        best = max(avail, key=lambda i: self.matched_blocks(i, lookup))  # first-seen maximum
        rate = 0.0 if n == 0 else self.hit(best, keys, n) / n
        if rate > self.cache_threshold:
            return best, "cache_match"
        return min(avail, key=lambda i: len(self.instances[i].cache)), "smallest_cache"

    def _dynamo(self, avail: list[int], keys: list[int], n: int) -> tuple[int, str]:
        """Dynamo KV router: cost = overlap_weight * prefill_blocks + queued_weight *
        queued_blocks + decode_blocks.

        prefill_blocks = new_prefill / block_size, queued_blocks = pending_prefill_tokens /
        block_size, decode_blocks = max(ongoing_tokens + input_length - dedup_weight *
        block_size * again, 0) / block_size, where ``again`` counts the blocks that several
        requests in flight there hold beyond their first holder, and this request's leading
        stored keys that one holds already (``dedup_weight`` 1: a block in flight once, as
        Dynamo counts it; 0, the default: each request's whole prompt). Temperature
        0: the minimum, ties by a seeded draw among them. Above 0: a seeded softmax draw over
        ``-(cost / (max - min)) / temperature`` (a uniform draw among the minima when every
        cost is equal).
        """
        bs = float(self.block_size)
        costs = []
        for i in avail:
            prefill_blocks = float(self.new_prefill(i, keys, n)) / bs
            queued_blocks = float(self.instances[i].pending_prefill_tokens) / bs
            inst = self.instances[i]
            in_flight = float(inst.ongoing_tokens + n)
            if self.dedup_weight != 0.0:
                again = sum(c - 1 for c in inst.holders.values())
                for key in self.stored(keys, n):
                    if key not in inst.holders:
                        break
                    again += 1
                in_flight -= self.dedup_weight * float(self.block_size * again)
            decode_blocks = max(in_flight, 0.0) / bs
            costs.append(
                self.overlap_weight * prefill_blocks
                + self.queued_weight * queued_blocks
                + decode_blocks
            )
        lo, hi = min(costs), max(costs)
        if self.temperature == 0.0 or hi == lo:
            tied = [i for i, c in zip(avail, costs, strict=True) if c == lo]
            if self.temperature == 0.0 and len(tied) == 1:
                return tied[0], "score"
            chosen = tied[self.rng.below(len(tied))]
            return chosen, "tie_break" if self.temperature == 0.0 else "sampled"
        scaled = [-(c / (hi - lo)) / self.temperature for c in costs]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        total = 0.0
        for w in weights:  # a plain left-to-right sum (no compensated summation)
            total += w
        draw = self.rng.unit()
        cumulative = 0.0
        for i, w in zip(avail, weights, strict=True):
            cumulative += w / total
            if draw <= cumulative:
                return i, "sampled"
        return avail[-1], "sampled"
