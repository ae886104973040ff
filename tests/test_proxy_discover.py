"""What ``kvroute proxy`` finds out about its backends before it starts
(``kvroute.proxy.discover``): the engines' KV block size and capacity from
``vllm:cache_config_info``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvroute.emulator import EmulatorConfig, emulator_app
from kvroute.proxy import ServerThread
from kvroute.proxy.discover import FALLBACK_BLOCK_SIZE, block_size, kv_tokens

DEAD = "http://127.0.0.1:9"


def _engines(*kv_block_sizes: int, capacity: int | None = None) -> tuple[ServerThread, list[str]]:
    st = ServerThread()
    overrides: dict[str, int] = {} if capacity is None else {"kv_capacity_tokens": capacity}
    urls = [
        st.start(emulator_app(EmulatorConfig(overrides={**overrides, "kv_block_size": size})))
        for size in kv_block_sizes
    ]
    return st, urls


def test_the_engines_block_size_is_found(caplog: pytest.LogCaptureFixture) -> None:
    st, urls = _engines(32, 32, 16)
    try:
        assert block_size(urls[:2]) == (32, "vllm:cache_config_info of 2 of 2 backend(s)")
        # A backend that does not answer is left out.
        assert block_size([urls[0], DEAD]) == (32, "vllm:cache_config_info of 1 of 2 backend(s)")
        # Engines that differ: the most common size, and a warning naming each.
        with caplog.at_level(logging.WARNING, "kvroute.proxy"):
            assert block_size(urls)[0] == 32
        assert "block sizes differ" in caplog.text and f"{urls[2]}: 16" in caplog.text
    finally:
        st.close()
    size, why = block_size([DEAD])
    assert size == FALLBACK_BLOCK_SIZE and "--block-size" in why
    assert block_size([])[0] == FALLBACK_BLOCK_SIZE


def test_the_proxy_command_says_what_it_chose() -> None:
    """``kvroute proxy`` without ``--block-size`` asks the engines and says what it chose
    (here it then stops: the port cannot be bound)."""
    from kvroute.cli import main

    st, urls = _engines(32)
    try:
        args = ["proxy", "--backend", urls[0], "--host", "256.0.0.1", "--port", "1"]
        done = CliRunner().invoke(main, args)
    finally:
        st.close()
    assert "kvroute proxy: block size 32 (vllm:cache_config_info of 1 of 1 backend(s))" in (
        done.output
    ), done.output
    assert "kvroute proxy: policy unified_dynamo (overlap_weight=8.0)" in done.output


def test_the_served_model_folder_is_found_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model the backends serve (``/v1/models``' root): a folder of this machine with a
    tokenizer.json, or a hub name whose snapshot the local Hugging Face cache holds."""
    from kvroute.proxy.discover import model_folder

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    st = ServerThread()
    try:
        urls = [
            st.start(emulator_app(EmulatorConfig(model=model)))
            for model in (str(folder), "org/name", "other/model")
        ]
        assert model_folder(urls[:1]) == (
            str(folder),
            f"the folder of {str(folder)!r}, which the backends serve",
        )
        assert model_folder([DEAD, urls[1]])[0] == str(snapshot)
        found, why = model_folder(urls[2:])
        assert found is None and "--model DIR" in why
    finally:
        st.close()
    assert model_folder([DEAD]) == (None, "no backend answered /v1/models")


def test_the_proxy_command_says_how_it_keys_text() -> None:
    from kvroute.cli import main

    st, urls = _engines(32)
    try:
        args = ["proxy", "--backend", urls[0], "--host", "256.0.0.1", "--port", "1"]
        done = CliRunner().invoke(main, args)
        both = CliRunner().invoke(main, [*args, "--model", ".", "--tokenizer", "backend"])
    finally:
        st.close()
    assert "kvroute proxy: keys text with approx (no folder of" in done.output, done.output
    assert both.exit_code == 2 and "alternatives" in both.output


def test_a_token_cap_of_cache_is_the_smallest_engines_kv_capacity() -> None:
    """``--max-in-flight-tokens cache``: the smallest ``num_gpu_blocks`` x ``block_size`` the
    backends report, said at start; an error naming the option when none reports one, and
    for a cap that is neither a number >= 1 nor ``cache``."""
    from kvroute.cli import main

    st, urls = _engines(32, capacity=8192)
    st2, small = _engines(16, capacity=4096)
    try:
        assert kv_tokens([*urls, small[0], DEAD]) == (
            4096,
            "the smallest KV cache of 2 of 3 backend(s)",
        )
        args = ["proxy", "--backend", urls[0], "--host", "256.0.0.1", "--port", "1"]
        done = CliRunner().invoke(main, [*args, "--max-in-flight-tokens", "cache"])
    finally:
        st.close()
        st2.close()
    assert "at most 8192 prompt tokens in flight per engine" in done.output, done.output
    assert kv_tokens([DEAD])[0] is None
    dead = ["proxy", "--backend", DEAD, "--block-size", "16", "--tokenizer", "approx"]
    done = CliRunner().invoke(main, [*dead, "--max-in-flight-tokens", "cache"])
    assert done.exit_code == 2 and "--max-in-flight-tokens cache: no backend" in done.output
    for bad in ("0", "lots"):
        done = CliRunner().invoke(main, [*dead, "--max-in-flight-tokens", bad])
        assert done.exit_code == 2 and "neither a number of tokens" in done.output, done.output
