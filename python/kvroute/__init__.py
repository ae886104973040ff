"""kvroute: KV-cache-aware routing of LLM requests across a fleet of vLLM engines.

The routing core is Rust (``kvroute._core``); this package is its typed Python face.

>>> import kvroute
>>> r = kvroute.Router(num_instances=8, policy="unified")
>>> keys = kvroute.block_hashes(list(range(2000)))
>>> r.route("req-1", keys, 2000, session_id="s1")
0
"""

from __future__ import annotations

import warnings

from kvroute._core import (
    BUILD_PROFILE,
    ROOT_SEED,
    EngineModel,
    Router,
    __version__,
    block_hashes,
    chain_ids,
    chain_ids_lists,
    policies,
)
from kvroute.ceilings import Ceilings, ceilings
from kvroute.errors import (
    DebugBuildWarning,
    DuplicateRequestError,
    InvalidArgumentError,
    KvrouteError,
    KvrouteTypeError,
    NoInstanceAvailableError,
    UnknownInstanceError,
    UnknownPolicyError,
)

if BUILD_PROFILE != "release":
    warnings.warn(
        "kvroute's native extension is a debug build; build with `maturin develop --release` "
        "(or `make build-release`) before measuring anything",
        DebugBuildWarning,
        stacklevel=2,
    )

__all__ = [
    "BUILD_PROFILE",
    "ROOT_SEED",
    "Ceilings",
    "DebugBuildWarning",
    "DuplicateRequestError",
    "EngineModel",
    "InvalidArgumentError",
    "KvrouteError",
    "KvrouteTypeError",
    "NoInstanceAvailableError",
    "Router",
    "UnknownInstanceError",
    "UnknownPolicyError",
    "__version__",
    "block_hashes",
    "ceilings",
    "chain_ids",
    "chain_ids_lists",
    "policies",
]
