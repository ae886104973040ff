"""kvroute.block_hashes over 4k / 64k / 200k tokens (numpy int32; a list and uint32 at 64k).

Target: under 50 microseconds for a 64k-token int32 numpy array. The baseline is the same
chained hash in plain Python with the `xxhash` package (one xxh3_64 call per block), at 64k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import xxhash

import kvroute

VOCAB = 151_936  # a modern tokenizer's vocabulary


def _tokens(n: int, dtype: Any = np.int32) -> np.ndarray:
    return np.random.default_rng(n).integers(0, VOCAB, size=n).astype(dtype)


def _info(benchmark: Any, impl: str, tokens: int, fmt: str) -> None:
    benchmark.group = f"block_hashes {tokens}"
    benchmark.extra_info.update(kind="block_hashes", impl=impl, tokens=tokens, input=fmt)


@pytest.mark.parametrize("n", [4_096, 65_536, 200_000])
def test_block_hashes_int32(benchmark: Any, n: int) -> None:
    toks = _tokens(n)
    _info(benchmark, "kvroute", n, "numpy int32")
    keys = benchmark(kvroute.block_hashes, toks)
    assert len(keys) == -(-n // 512)


def test_block_hashes_uint32(benchmark: Any) -> None:
    toks = _tokens(65_536, np.uint32)
    _info(benchmark, "kvroute", 65_536, "numpy uint32")
    benchmark(kvroute.block_hashes, toks)


def test_block_hashes_list(benchmark: Any) -> None:
    toks = _tokens(65_536).tolist()
    _info(benchmark, "kvroute", 65_536, "list of int")
    benchmark(kvroute.block_hashes, toks)


def _python_block_hashes(tokens: np.ndarray, block_size: int = 512) -> list[int]:
    data = tokens.astype("<u4").tobytes()
    step = 4 * block_size
    prev = kvroute.ROOT_SEED
    out = []
    for start in range(0, len(data), step):
        prev = xxhash.xxh3_64_intdigest(data[start : start + step], seed=prev)
        out.append(prev)
    return out


def test_block_hashes_python_xxhash(benchmark: Any) -> None:
    toks = _tokens(65_536)
    assert _python_block_hashes(toks) == kvroute.block_hashes(toks).tolist()
    _info(benchmark, "python+xxhash", 65_536, "numpy int32")
    benchmark(_python_block_hashes, toks)


# -- keying a request body: the proxy's two ways ---------------------------------------------


def _body(n: int) -> bytes:
    import json

    ids = _tokens(n).tolist()
    return json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "stream": True}).encode()


@pytest.mark.parametrize("n", [512, 44_000])
def test_key_body_scan(benchmark: Any, n: int) -> None:
    """The proxy's way: scan the bytes for the ids, parse the rest, hash a uint32 array."""
    import asyncio

    from kvroute.proxy.keys import Keyer

    raw, keyer = _body(n), Keyer("approx", 512)
    loop = asyncio.new_event_loop()
    benchmark.group = f"key a body {n}"
    benchmark.extra_info.update(kind="key_body", impl="scan", tokens=n)
    _, keys, got, _ = benchmark(lambda: loop.run_until_complete(keyer.parse(raw, False)))
    loop.close()
    assert got == n and len(keys) == -(-n // 512)


@pytest.mark.parametrize("n", [512, 44_000])
def test_key_body_parse(benchmark: Any, n: int) -> None:
    """The reference way: parse the whole body (orjson), hash the list of ids (the same
    coroutine around it as the scan's)."""
    import asyncio

    from kvroute.proxy.keys import Keyer
    from kvroute.proxy.prompts import parse_body

    raw, keyer = _body(n), Keyer("approx", 512)

    async def parse() -> Any:
        return await keyer.keys(parse_body(raw), False)

    loop = asyncio.new_event_loop()
    benchmark.group = f"key a body {n}"
    benchmark.extra_info.update(kind="key_body", impl="parse", tokens=n)
    keys, got, _ = benchmark(lambda: loop.run_until_complete(parse()))
    loop.close()
    assert got == n and len(keys) == -(-n // 512)


@pytest.mark.parametrize("n", [512, 44_000])
def test_key_body_relay(benchmark: Any, n: int) -> None:
    """The native data path's way: the relay keys the body in Rust (prompt scan, strict JSON
    check of the rest, ``stream`` and session fields), no Python and no event loop."""
    from kvroute._core import relay_token_prompt

    raw = _body(n)
    benchmark.group = f"key a body {n}"
    benchmark.extra_info.update(kind="key_body", impl="relay", tokens=n)
    got = benchmark(relay_token_prompt, raw, 512, "session_id", None)
    assert got is not None and got[1] == n and len(got[0]) == -(-n // 512) and got[2] is True
