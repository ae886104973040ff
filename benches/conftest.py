"""Bench setup: refuse anything but a release build of kvroute, and load the reference.

pytest runs with ``filterwarnings = error`` (pyproject.toml) and importing a debug build of
kvroute warns (``kvroute.errors.DebugBuildWarning``). Import it with that one warning
silenced, so the check below can say what to do instead of failing on the warning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from release_build import not_release

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"kvroute's native extension is a debug build")
    import kvroute

BENCHES = Path(__file__).resolve().parent
REFERENCE = BENCHES.parent / "tests" / "reference.py"

# Let bench modules `import workload` (benches/ is not a package).
sys.path.insert(0, str(BENCHES))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore::kvroute.errors.DebugBuildWarning")


_LOAD_AT_START: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _LOAD_AT_START[:] = os.getloadavg()
    why = not_release()
    if why is not None:
        pytest.exit(why, returncode=2)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """Record how busy the machine was: other processes' load skews microsecond timings."""
    machine_info["loadavg_1_5_15_at_start"] = list(_LOAD_AT_START)
    machine_info["loadavg_1_5_15_at_end"] = list(os.getloadavg())
    machine_info["kvroute_build_profile"] = kvroute.BUILD_PROFILE
    machine_info["kvroute_extension"] = kvroute._core.__file__


def load_reference() -> ModuleType | None:
    """tests/reference.py (the plain-Python ReferenceRouter), or None when it is absent."""
    if not REFERENCE.exists():
        return None
    name = "kvroute_bench_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference_router_class() -> type:
    module = load_reference()
    if module is None:
        pytest.skip(f"{REFERENCE} does not exist yet")
    return module.ReferenceRouter
