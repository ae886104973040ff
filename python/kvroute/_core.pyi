"""Type stubs of the native extension ``kvroute._core`` (checked by ``mypy.stubtest``)."""

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, TypedDict, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BUILD_PROFILE",
    "MAX_INSTANCES",
    "ROOT_SEED",
    "EngineModel",
    "Relay",
    "Router",
    "TextModel",
    "__version__",
    "block_hashes",
    "ceilings",
    "chain_ids",
    "chain_ids_lists",
    "decode_kv_events",
    "engine_params",
    "engine_presets",
    "policies",
    "prompt_ids",
    "relay_answer_output",
    "relay_text_prompt",
    "relay_token_prompt",
    "sequence_keys",
    "simulate_runs",
]

__version__: Final[str]
BUILD_PROFILE: Final[Literal["debug", "release"]]
ROOT_SEED: Final[int]
MAX_INSTANCES: Final[int]

RequestId: TypeAlias = int | str
HashIds: TypeAlias = Sequence[int] | npt.NDArray[np.uint64] | npt.NDArray[np.int64]
TokenIds: TypeAlias = (
    Sequence[int]
    | npt.NDArray[np.int32]
    | npt.NDArray[np.uint32]
    | npt.NDArray[np.int64]
    | npt.NDArray[np.uint64]
)

class EngineReport(TypedDict):
    running: int
    waiting: int
    kv_usage: float
    sent_since: int
    outside: int

class InstanceState(TypedDict):
    num_requests: int
    ongoing_tokens: int
    pending_prefill_tokens: int
    ongoing_decode_tokens: int
    cached_blocks: int
    available: bool
    cache_view: Literal["estimate", "events", "degraded"]
    engine: EngineReport | None
    overloaded: bool

class RouteInfo(TypedDict):
    instance: int
    hit_tokens: int
    new_prefill: int
    branch: str

def block_hashes(token_ids: TokenIds, block_size: int = 512) -> npt.NDArray[np.uint64]: ...
def chain_ids(ids: HashIds) -> npt.NDArray[np.uint64]: ...
def chain_ids_lists(
    values: npt.NDArray[np.uint64], offsets: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]: ...
def policies() -> list[str]: ...
def sequence_keys(
    prompt_keys: HashIds,
    input_length: int,
    tail: TokenIds,
    output: TokenIds,
    generated: int,
    block_size: int,
) -> npt.NDArray[np.uint64]: ...
def prompt_ids(body: bytes) -> tuple[npt.NDArray[np.uint32], int, int] | None: ...

class KvBatchSummary(TypedDict):
    ts: float
    rank: int
    events: int
    stored: int
    removed: int
    ignored: int
    cleared: int

def decode_kv_events(payload: bytes | list[Any]) -> KvBatchSummary: ...

class KvApplied(TypedDict):
    outcome: Literal["applied", "duplicate", "gap", "foreign"]
    expected: int | None
    reset: bool
    degraded: bool

class KvRankView(TypedDict):
    rank: int
    state: Literal["awaiting", "complete", "degraded"]
    reason: str | None
    last_seq: int | None
    batches: int
    replayed_batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    blocks_ignored: int
    unknown_removals: int
    unkeyable_blocks: int
    gaps: int
    foreign_batches: int
    resets: int
    blocks_indexed: int
    last_ts: float
    lag_s: float
    memory_bytes: int

class KvView(TypedDict):
    uses_events: bool
    blocks: int
    pending: int
    ranks: list[KvRankView]

@final
class Router:
    def __new__(
        cls,
        num_instances: int,
        policy: str = "unified",
        *,
        block_size: int = 512,
        cache_capacity_blocks: int | None = None,
        cache_rule: Literal["trace", "vllm"] = "trace",
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
        cache_view: Literal["estimate", "events"] = "estimate",
        pending_ttl_s: float = 10.0,
        affinity: Literal["map", "shared"] = "map",
        load_source: Literal["router", "engine"] = "router",
        engine_profile: dict[str, float] | None = None,
        ttft_slo_s: float = 0.0,
        delay_weight: float = 0.0,
    ) -> Router: ...
    def route(
        self,
        request_id: RequestId,
        hash_ids: HashIds,
        input_length: int,
        session_id: RequestId | None = None,
    ) -> int: ...
    def route_info(
        self,
        request_id: RequestId,
        hash_ids: HashIds,
        input_length: int,
        session_id: RequestId | None = None,
    ) -> RouteInfo: ...
    def first_token(self, request_id: RequestId) -> bool: ...
    def finish(self, request_id: RequestId) -> bool: ...
    def estimate_cache_hit(self, instance: int, hash_ids: HashIds, input_length: int) -> int: ...
    def estimate_cache_hits(
        self,
        hash_ids: HashIds,
        input_length: int,
        view: Literal["routing", "estimate", "events"] = "routing",
    ) -> list[int]: ...
    def state(self) -> list[InstanceState]: ...
    def set_engine_load(
        self, instance: int, running: int, waiting: int, kv_usage: float
    ) -> None: ...
    def clear_engine_load(self, instance: int) -> None: ...
    def set_ttft_costs(self, costs: Mapping[str, float]) -> None: ...
    def ttft_costs(self) -> dict[str, float] | None: ...
    def set_overload_rule(
        self,
        waiting: int | None = None,
        kv_usage: float | None = None,
        in_flight: int | None = None,
        tokens: int | None = None,
    ) -> None: ...
    def has_room(self) -> bool: ...
    def set_available(self, instance: int, flag: bool) -> None: ...
    def add_instance(self) -> int: ...
    def session_affinity(self, session_id: RequestId) -> int | None: ...
    def cached_keys(self, instance: int) -> list[int]: ...
    def clear_cache(self, instance: int) -> None: ...
    def extend(self, request_id: RequestId, hash_ids: HashIds) -> bool: ...
    def set_cache_capacity(self, instance: int, capacity: int | None) -> None: ...
    def apply_kv_events(
        self,
        instance: int,
        seq: int,
        batch: bytes | list[Any],
        *,
        replayed: bool = False,
        rank: int | None = None,
    ) -> KvApplied: ...
    def kv_resync(self, instance: int, rank: int, reason: str) -> None: ...
    def kv_reset(self, instance: int) -> None: ...
    def kv_view(self, instance: int) -> KvView | None: ...
    @property
    def kv_memory_bytes(self) -> int: ...
    @property
    def cache_view(self) -> str: ...
    @property
    def policy(self) -> str: ...
    @property
    def num_instances(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def cache_rule(self) -> str: ...
    @property
    def num_sessions(self) -> int: ...
    @property
    def in_flight(self) -> int: ...

class RelayBackendStats(TypedDict):
    decisions: dict[str, int]
    estimated: int
    reported: int
    prompt: int
    retries: int
    errors: dict[str, int]
    ttft: tuple[list[int], float]
    e2e: tuple[list[int], float]

class RelayQueueStats(TypedDict):
    waiting: int
    queued: int
    shed_full: int
    shed_timeout: int
    wait: tuple[list[int], float]

class RelayStats(TypedDict):
    backends: list[RelayBackendStats]
    errors: dict[str, int]
    routing: tuple[list[int], float]
    queue: RelayQueueStats

@final
class Relay:
    def __new__(
        cls,
        listen_fd: int,
        router: Router,
        side: tuple[str, str, int],
        hooks: Any,
        *,
        max_body: int,
        request_timeout_s: float,
        connect_timeout_s: float,
        max_concurrency: int,
        retries: int,
        session_header: str,
        session_field: str | None = None,
        decision_log: str | os.PathLike[str] | None = None,
        header_read_timeout_s: float = 30.0,
        body_read_timeout_s: float = 60.0,
        max_connections: int = 8192,
        upstream_idle_timeout_s: float = 30.0,
        model: TextModel | None = None,
        queue_size: int | None = None,
        queue_timeout_s: float = 30.0,
        queue_patience_s: float = 0.5,
        priority_header: str = "x-priority",
        queue_hold_s: float = 0.0,
        queue_hold_yield_s: float = 5.0,
        first_tokens: bool = False,
    ) -> Relay: ...
    def set_backend(
        self, index: int, url: str, address: tuple[str, str, int], host: str, prefix: str
    ) -> None: ...
    def set_failing(self, index: int, failing: bool) -> None: ...
    def stats(self) -> RelayStats: ...
    def take_first_tokens(self) -> list[tuple[int, int, int, int, int, float]]: ...
    def flush_log(self) -> None: ...
    def stop(self, grace_s: float = 5.0) -> None: ...

def relay_token_prompt(
    body: bytes,
    block_size: int,
    session_field: str | None = None,
    session_header: str | None = None,
) -> tuple[npt.NDArray[np.uint64], int, bool, int | str | None] | None: ...
def relay_answer_output(
    raw: bytes, stream: bool
) -> tuple[list[int] | None, str, int | None] | None: ...
def relay_text_prompt(
    model: TextModel,
    body: bytes,
    chat: bool,
    block_size: int,
    session_field: str | None = None,
    session_header: str | None = None,
) -> tuple[npt.NDArray[np.uint64], int, bool, int | str | None] | None: ...

@final
class TextModel:
    def __new__(cls, dir: str | os.PathLike[str]) -> TextModel: ...
    @property
    def dir(self) -> str: ...
    @property
    def template_error(self) -> str | None: ...
    @property
    def cache_counts(self) -> tuple[int, int]: ...
    def encode(self, text: str, special: bool = True) -> list[int]: ...
    def render_chat(self, body: bytes) -> str: ...
    def prompt_ids(self, body: bytes, chat: bool) -> list[int] | None: ...

class CeilingTotals(TypedDict):
    ratio: float
    hit_tokens: int
    total_tokens: int
    hit_requests: int
    total_requests: int

class CapacityTotals(CeilingTotals):
    capacity: int

class ReuseTotals(TypedDict):
    intra: int
    cross: int
    shared: int

class PerRequestMatches(TypedDict):
    any: npt.NDArray[np.uint32]
    intra: npt.NDArray[np.uint32]
    shared: npt.NDArray[np.uint32]
    capacity: list[npt.NDArray[np.uint32]]

class CeilingsResult(TypedDict):
    any: CeilingTotals
    intra: CeilingTotals
    shared: CeilingTotals
    reuse: ReuseTotals
    capacity: list[CapacityTotals]
    per_request: PerRequestMatches | None

def ceilings(
    data: object,
    *,
    block_size: int = 512,
    min_sessions: int = 8,
    capacities: Sequence[int] | None = None,
    per_request: bool = False,
    progress: Callable[[int, int], object] | None = None,
) -> CeilingsResult: ...

# ---- simulator (kvroute.sim, docs/simulator.md) ----

EngineEvent: TypeAlias = (
    tuple[Literal["first_token"], RequestId, float, int]
    | tuple[Literal["tokens"], RequestId, float, int]
    | tuple[Literal["finish"], RequestId, float]
)

class EngineStats(TypedDict):
    running: int
    waiting: int
    kv_used_blocks: int
    kv_cached_blocks: int
    kv_total_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    finished: int
    steps: int
    now: float

@final
class EngineModel:
    def __new__(
        cls, preset: str = "h20-qwen3-coder-30b-a3b", **overrides: float
    ) -> EngineModel: ...
    def submit(
        self,
        request_id: RequestId,
        hash_ids: HashIds,
        input_length: int,
        output_length: int,
        now: float,
    ) -> None: ...
    def next_event_time(self) -> float | None: ...
    def advance(self, now: float) -> list[EngineEvent]: ...
    def cancel(self, request_id: RequestId) -> bool: ...
    def reset_prefix_cache(self) -> int: ...
    def record_kv_events(self, on: bool) -> None: ...
    def take_kv_events(self) -> list[tuple[str, int | None]]: ...
    def stats(self) -> EngineStats: ...
    @property
    def params(self) -> dict[str, float]: ...
    @property
    def preset(self) -> str: ...
    @property
    def active(self) -> int: ...

def engine_presets() -> list[str]: ...
def engine_params(
    preset: str = "h20-qwen3-coder-30b-a3b", overrides: Mapping[str, float] | None = None
) -> dict[str, float]: ...
def simulate_runs(
    traces: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> list[dict[str, Any]]: ...
