"""Type stubs of the native extension ``kvroute._core`` (checked by ``mypy.stubtest``)."""

from collections.abc import Sequence
from typing import Final, Literal, TypeAlias, TypedDict, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BUILD_PROFILE",
    "ROOT_SEED",
    "Router",
    "__version__",
    "block_hashes",
    "chain_ids",
    "chain_ids_lists",
    "policies",
]

__version__: Final[str]
BUILD_PROFILE: Final[Literal["debug", "release"]]
ROOT_SEED: Final[int]

RequestId: TypeAlias = int | str
HashIds: TypeAlias = Sequence[int] | npt.NDArray[np.uint64] | npt.NDArray[np.int64]
TokenIds: TypeAlias = (
    Sequence[int]
    | npt.NDArray[np.int32]
    | npt.NDArray[np.uint32]
    | npt.NDArray[np.int64]
    | npt.NDArray[np.uint64]
)

class InstanceState(TypedDict):
    num_requests: int
    ongoing_tokens: int
    pending_prefill_tokens: int
    ongoing_decode_tokens: int
    cached_blocks: int
    available: bool

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

@final
class Router:
    def __new__(
        cls,
        num_instances: int,
        policy: str = "unified",
        *,
        block_size: int = 512,
        cache_capacity_blocks: int | None = None,
        overload_factor: float = 2.0,
        hit_ratio_gate: float = 0.5,
        seed: int = 0,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.1,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
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
    def estimate_cache_hits(self, hash_ids: HashIds, input_length: int) -> list[int]: ...
    def state(self) -> list[InstanceState]: ...
    def set_available(self, instance: int, flag: bool) -> None: ...
    def add_instance(self) -> int: ...
    def session_affinity(self, session_id: RequestId) -> int | None: ...
    def cached_keys(self, instance: int) -> list[int]: ...
    @property
    def policy(self) -> str: ...
    @property
    def num_instances(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
