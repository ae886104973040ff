"""kvroute: KV-cache-aware routing of LLM requests across a fleet of vLLM engines.

The routing core is Rust (``kvroute._core``); this package is its typed Python face.

>>> import kvroute
>>> r = kvroute.Router(num_instances=8, policy="unified")
>>> keys = kvroute.block_hashes(list(range(2000)))
>>> r.route("req-1", keys, 2000, session_id="s1")
0
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

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
    CorruptFileError,
    DebugBuildWarning,
    DuplicateRequestError,
    InvalidArgumentError,
    KvrouteError,
    KvrouteTypeError,
    MissingExtraError,
    NoInstanceAvailableError,
    OutputExistsError,
    UnknownInstanceError,
    UnknownPolicyError,
)

if TYPE_CHECKING:
    from kvroute.report import report as make_report
    from kvroute.report import write_report
    from kvroute.sim import simulate, sustainable_rate, sweep
    from kvroute.synth import synthesize
    from kvroute.trace import read_trace, read_trace_with_report, write_trace

# The trace, simulator and report entry points, imported on first use (they pull in polars
# and the simulator's modules, which `import kvroute` alone does not need).
_LAZY = {
    "read_trace": ("kvroute.trace", "read_trace"),
    "read_trace_with_report": ("kvroute.trace", "read_trace_with_report"),
    "write_trace": ("kvroute.trace", "write_trace"),
    "simulate": ("kvroute.sim", "simulate"),
    "sweep": ("kvroute.sim", "sweep"),
    "sustainable_rate": ("kvroute.sim", "sustainable_rate"),
    "synthesize": ("kvroute.synth", "synthesize"),
    "make_report": ("kvroute.report", "report"),
    "write_report": ("kvroute.report", "write_report"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


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
    "CorruptFileError",
    "DebugBuildWarning",
    "DuplicateRequestError",
    "EngineModel",
    "InvalidArgumentError",
    "KvrouteError",
    "KvrouteTypeError",
    "MissingExtraError",
    "NoInstanceAvailableError",
    "OutputExistsError",
    "Router",
    "UnknownInstanceError",
    "UnknownPolicyError",
    "__version__",
    "block_hashes",
    "ceilings",
    "chain_ids",
    "chain_ids_lists",
    "make_report",
    "policies",
    "read_trace",
    "read_trace_with_report",
    "simulate",
    "sustainable_rate",
    "sweep",
    "synthesize",
    "write_report",
    "write_trace",
]
