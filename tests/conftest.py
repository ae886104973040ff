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
from pathlib import Path
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
def vllm_python() -> Path:
    """The Python of the real-vLLM environment (``tests/realvllm.py``), made on first use
    (about 5 minutes on a new machine). Skipped, with the reason, only where it cannot be
    made (no package index to install vLLM from)."""
    import realvllm

    try:
        return realvllm.ensure_venv()
    except realvllm.HarnessError as exc:
        pytest.skip(f"the real-vLLM environment cannot be made here: {exc}")


@pytest.fixture(scope="session")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> Iterator[Any]:
    """Two real vLLM engines on CPU (``tests/realvllm.py``), for the ``vllm``-marked tests
    (engine 1 with a 32 MiB KV cache): made once per run, stopped at its end."""
    import realvllm

    try:
        realvllm.ensure_model(vllm_python)
    except realvllm.HarnessError as exc:
        pytest.skip(f"real vLLM engines cannot be made here: {exc}")
    ports = realvllm.free_ports(4)
    logs = tmp_path_factory.mktemp("vllm-logs")
    # Engine 1 has a small KV cache (32 MiB: 16,384 tokens of the tiny model), so that it
    # evicts; both publish KV events with a replay socket.
    small = ["--kv-cache-memory-bytes", str(realvllm.SMALL_KV_CACHE_BYTES)]
    engines = realvllm.start_engines(2, ports[:2], ports[2:], logs, extra_args=[[], small])
    try:
        yield engines
    finally:
        engines.stop()


@pytest.fixture
def engines(vllm_engines: Any) -> Iterator[Any]:
    """The session's engines, reset to cold caches before the test (once they are idle: vLLM
    answers a reset with 200 even when blocks still in use made it fail, and a request an
    earlier test abandoned may still be running)."""
    from kvroute.sim.side_by_side import wait_idle
    from livekit import http

    wait_idle([e.url for e in vllm_engines])
    for e in vllm_engines:
        assert http("POST", e.url + "/reset_prefix_cache", b"")[0] == 200
    yield vllm_engines


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer (every byte a token, as in models' tokenizers) that
    puts ``<s>`` before a single sequence, with the special tokens of the test templates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token
    )
    corpus = ["hello world, the cache keeps every prefix warm", "déjà vu 日本語 🙂 tools"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path
