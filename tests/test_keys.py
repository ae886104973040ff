"""Block keys: ``block_hashes`` and ``chain_ids`` against an independent xxhash-based
implementation, pinned literal values, input forms, and errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute
from kvroute import InvalidArgumentError, KvrouteTypeError

ROOT_SEED = int.from_bytes(b"kvroute!", "little")


def ref_block_hashes(tokens: list[int], block_size: int = 512) -> list[int]:
    """key_i = XXH3-64(block i's tokens as little-endian uint32, seed = key_{i-1})."""
    keys, prev = [], ROOT_SEED
    for start in range(0, len(tokens), block_size):
        block = tokens[start : start + block_size]
        prev = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=prev)
        keys.append(prev)
    return keys


def ref_chain_ids(ids: list[int]) -> list[int]:
    """key_i = XXH3-64(id_i as 8 little-endian bytes, seed = key_{i-1})."""
    keys, prev = [], ROOT_SEED
    for i in ids:
        prev = xxhash.xxh3_64_intdigest((i % 2**64).to_bytes(8, "little"), seed=prev)
        keys.append(prev)
    return keys


def test_root_seed() -> None:
    assert kvroute.ROOT_SEED == ROOT_SEED == 0x21657475_6F72766B


def test_pinned_values() -> None:
    # Literal values: a change here invalidates every stored trace and cache key.
    assert kvroute.block_hashes([1, 2, 3]).tolist() == [17135722013804238675]
    assert kvroute.chain_ids([0, 1]).tolist() == [1555794855776636713, 9155262315945842484]
    tokens = list(range(10))
    assert kvroute.block_hashes(tokens, 4).tolist() == ref_block_hashes(tokens, 4)
    assert ref_block_hashes([1, 2, 3]) == [17135722013804238675]
    assert ref_chain_ids([0, 1]) == [1555794855776636713, 9155262315945842484]


def test_matches_xxhash_reference() -> None:
    tokens = list(range(1, 2001))
    for bs in (1, 4, 16, 512, 2000, 4096):
        assert kvroute.block_hashes(tokens, bs).tolist() == ref_block_hashes(tokens, bs)
    ids = [0, 1, 2**64 - 1, 2**63, 12345]
    assert kvroute.chain_ids(ids).tolist() == ref_chain_ids(ids)


def test_default_block_size_and_partial_last_block() -> None:
    tokens = list(range(1025))
    keys = kvroute.block_hashes(tokens)
    assert keys.dtype == np.uint64
    assert keys.ndim == 1
    assert len(keys) == 3  # 512 + 512 + 1
    assert keys.tolist() == ref_block_hashes(tokens, 512)
    assert keys.tolist() == kvroute.block_hashes(tokens, block_size=512).tolist()
    # Exactly two full blocks: no empty third block.
    assert len(kvroute.block_hashes(tokens[:1024])) == 2
    # The first two keys depend only on the first 1024 tokens.
    assert keys[:2].tolist() == kvroute.block_hashes(tokens[:1024]).tolist()


def test_prefix_chaining() -> None:
    a = list(range(2048))
    b = list(a)
    b[1500] = 7
    ka, kb = kvroute.block_hashes(a).tolist(), kvroute.block_hashes(b).tolist()
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2]
    assert ka[3] != kb[3]  # a change propagates to every later key
    # The same block content at another position gets another key.
    same = [5] * 8
    k = kvroute.block_hashes(same, 4).tolist()
    assert k[0] != k[1]


def test_empty_input() -> None:
    for empty in ([], (), np.array([], dtype=np.uint32), np.array([], dtype=np.int64)):
        out = kvroute.block_hashes(empty, 16)
        assert out.dtype == np.uint64
        assert out.tolist() == []
    out = kvroute.chain_ids([])
    assert out.dtype == np.uint64
    assert out.tolist() == []


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64])
def test_numpy_dtypes_agree_with_lists(dtype: type) -> None:
    tokens = [0, 1, 2, 3, 70000, 2**31 - 1, 9, 8, 7]
    if dtype in (np.uint32, np.int64, np.uint64):
        tokens.append(2**32 - 1)
    expected = ref_block_hashes(tokens, 4)
    arr = np.array(tokens, dtype=dtype)
    assert kvroute.block_hashes(arr, 4).tolist() == expected
    assert kvroute.block_hashes(tokens, 4).tolist() == expected
    assert kvroute.block_hashes(tuple(tokens), 4).tolist() == expected
    # Lists of exact ints take a fast path; a list subclass and numpy scalars the general one.
    assert kvroute.block_hashes(type("Ids", (list,), {})(tokens), 4).tolist() == expected
    assert kvroute.block_hashes([*tokens[:-1], dtype(tokens[-1])], 4).tolist() == expected
    # Non-contiguous and reversed views.
    wide = np.zeros(2 * len(tokens), dtype=dtype)
    wide[::2] = arr
    assert kvroute.block_hashes(wide[::2], 4).tolist() == expected
    assert kvroute.block_hashes(arr[::-1], 4).tolist() == ref_block_hashes(tokens[::-1], 4)


def test_chain_ids_forms_agree() -> None:
    ids = [3, 2**64 - 1, 0, 2**63 + 5]
    expected = ref_chain_ids(ids)
    arr = np.array(ids, dtype=np.uint64)
    assert kvroute.chain_ids(ids).tolist() == expected
    assert kvroute.chain_ids(arr).tolist() == expected
    assert kvroute.chain_ids(arr.view(np.int64)).tolist() == expected
    assert kvroute.chain_ids([i - 2**64 if i >= 2**63 else i for i in ids]).tolist() == expected
    assert kvroute.chain_ids(np.repeat(arr, 2)[::2]).tolist() == expected


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, -3, 4], np.array([1, 2, -3, 4], dtype=np.int32), np.array([1, 2, -3], np.int64)],
    ids=["list", "int32", "int64"],
)
def test_negative_token_names_position(tokens: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"token_ids\[2\] = -3") as e:
        kvroute.block_hashes(tokens, 2)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("tokens", "position", "value"),
    [
        ([0, 2**32], 1, 2**32),
        (np.array([5, 6, 7, 2**40], dtype=np.int64), 3, 2**40),
        (np.array([5, 2**63], dtype=np.uint64), 1, 2**63),
        ([2**64 - 1], 0, 2**64 - 1),
    ],
    ids=["2**32", "int64 2**40", "uint64 2**63", "list 2**64-1"],
)
def test_out_of_range_token_names_position_and_value(
    tokens: object, position: int, value: int
) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        kvroute.block_hashes(tokens, 512)
    assert f"token_ids[{position}] = {value} " in str(e.value)


@pytest.mark.parametrize("block_size", [0, -1, -512])
def test_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(InvalidArgumentError, match="block_size") as e:
        kvroute.block_hashes([1, 2, 3], block_size)
    assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        kvroute.block_hashes([], block_size)


@pytest.mark.parametrize(
    "bad",
    [
        [1.5, 2.0],
        "abc",
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype=np.int16),
        np.zeros((2, 2), dtype=np.uint32),
        None,
    ],
    ids=["floats", "str", "float-array", "int16", "2-D", "None"],
)
def test_bad_token_types(bad: object) -> None:
    with pytest.raises(KvrouteTypeError, match="token_ids") as e:
        kvroute.block_hashes(bad, 4)
    assert isinstance(e.value, TypeError)


def test_chain_ids_bad_types() -> None:
    for bad in ([1.0], "ab", np.array([1.0]), np.zeros((1, 1), dtype=np.uint64)):
        with pytest.raises(KvrouteTypeError):
            kvroute.chain_ids(bad)


def test_input_not_modified() -> None:
    arr = np.arange(100, dtype=np.uint32)
    arr.flags.writeable = False
    kvroute.block_hashes(arr, 7)
    assert arr.tolist() == list(range(100))


TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, block_size=st.one_of(st.integers(1, 40), st.sampled_from([512, 1000])))
def test_block_hashes_property(tokens: list[int], block_size: int) -> None:
    expected = ref_block_hashes(tokens, block_size)
    assert kvroute.block_hashes(tokens, block_size).tolist() == expected
    assert kvroute.block_hashes(np.array(tokens, dtype=np.uint32), block_size).tolist() == expected
    assert kvroute.block_hashes(np.array(tokens, dtype=np.int64), block_size).tolist() == expected
    assert len(expected) == -(-len(tokens) // block_size)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_chain_ids_property(ids: list[int]) -> None:
    expected = ref_chain_ids(ids)
    assert kvroute.chain_ids(ids).tolist() == expected
    assert kvroute.chain_ids(np.array(ids, dtype=np.uint64)).tolist() == expected
