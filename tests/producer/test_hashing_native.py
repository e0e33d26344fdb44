"""The native block hasher (``native/``, Rust) against the Python specification in
``producer/hashing.py``: the same digests for any chain, packed or not, and the Python path
wherever the native one cannot encode a prompt as cbor2 does."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from unittest import mock

import hmakv_native
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.producer import hashing
from hmakv.producer.hashing import (
    EXTERNAL_HASHES_TYPECODE,
    HASH_FUNCTIONS,
    NATIVE_HASHING,
    BlockHasher,
    PackedTokenIds,
    external,
)

UINT64 = st.integers(min_value=0, max_value=2**64 - 1)
UINT32 = st.integers(min_value=0, max_value=2**32 - 1)


def python_hashes(
    hasher: BlockHasher, tokens: list[int], block_size: int, **options: object
) -> list[bytes]:
    with mock.patch.object(hashing, "_NATIVE", None):
        return hasher.block_hashes(tokens, block_size, **options)  # type: ignore[arg-type]


def packed_externals(digests: list[bytes]) -> array[int]:
    """The external hashes of ``digests`` as both paths give them: uint64s in one buffer."""
    return array(EXTERNAL_HASHES_TYPECODE, map(external, digests))


@pytest.fixture
def native_calls() -> Iterator[mock.MagicMock]:
    """Counts the native calls, so that a test knows which path answered."""
    with mock.patch.object(hashing, "_NATIVE", wraps=hmakv_native) as native:
        yield native


def test_the_native_hasher_is_built() -> None:
    """scripts/setup builds it; without it every prompt is hashed in Python, five times slower."""
    assert NATIVE_HASHING


@settings(max_examples=300, deadline=None)
@given(
    hash_fn=st.sampled_from(HASH_FUNCTIONS),
    seed=st.text(max_size=8),
    tokens=st.lists(UINT64, max_size=200),
    block_size=st.integers(min_value=1, max_value=40),
    parent=st.none() | st.binary(min_size=1, max_size=40),
    lookahead=st.integers(min_value=0, max_value=5),
)
def test_native_digests_are_the_specifications(
    hash_fn: str,
    seed: str,
    tokens: list[int],
    block_size: int,
    parent: bytes | None,
    lookahead: int,
) -> None:
    hasher = BlockHasher(hash_fn, seed)
    expected = python_hashes(hasher, tokens, block_size, parent=parent, lookahead=lookahead)
    with mock.patch.object(hashing, "_NATIVE", wraps=hmakv_native) as native:
        got = hasher.block_hashes(tokens, block_size, parent=parent, lookahead=lookahead)
        externals = hasher.external_hashes(tokens, block_size, lookahead=lookahead)
    assert native.block_hashes.call_count == 1
    assert native.external_hashes.call_count == 1
    assert got == expected
    if parent is None:
        assert externals == packed_externals(expected)


@pytest.mark.parametrize("odd", [2**64, -1, True], ids=["over-uint64", "negative", "bool"])
def test_tokens_cbor_encodes_otherwise_are_hashed_in_python(
    odd: int, native_calls: mock.MagicMock
) -> None:
    """cbor2 writes 2**64 as a bignum and True as ``true``: not what the native encoder would."""
    hasher = BlockHasher()
    tokens = [1, 2, odd, 4]
    expected = python_hashes(hasher, tokens, 2)
    assert hasher.block_hashes(tokens, 2) == expected
    assert hasher.external_hashes(tokens, 2) == packed_externals(expected)
    assert native_calls.block_hashes.call_count == 2  # tried, then Python's path answered


def test_extra_keys_are_hashed_in_python(native_calls: mock.MagicMock) -> None:
    hasher = BlockHasher()
    keys: list[tuple[object, ...] | None] = [("lora-a",), None]
    expected = python_hashes(hasher, list(range(8)), 4, extra_keys=keys)
    assert hasher.block_hashes(list(range(8)), 4, extra_keys=keys) == expected
    assert native_calls.block_hashes.call_count == 0


def test_a_range_of_tokens_hashes_natively_as_a_list(native_calls: mock.MagicMock) -> None:
    hasher = BlockHasher()
    assert hasher.external_hashes(range(64), 16) == hasher.external_hashes(list(range(64)), 16)
    assert hasher.block_hashes(range(64), 16) == python_hashes(hasher, list(range(64)), 16)
    assert native_calls.external_hashes.call_count == 2
    assert native_calls.block_hashes.call_count == 1


@settings(max_examples=200, deadline=None)
@given(
    hash_fn=st.sampled_from(HASH_FUNCTIONS),
    tokens=st.lists(UINT32, max_size=120),
    block_size=st.integers(min_value=1, max_value=20),
    lookahead=st.integers(min_value=0, max_value=3),
)
def test_packed_tokens_hash_as_their_ints_on_both_paths(
    hash_fn: str, tokens: list[int], block_size: int, lookahead: int
) -> None:
    hasher = BlockHasher(hash_fn)
    packed = PackedTokenIds.pack(tokens)
    assert len(packed) == len(tokens)
    assert packed.unpack() == tuple(tokens)
    expected = python_hashes(hasher, tokens, block_size, lookahead=lookahead)
    with mock.patch.object(hashing, "_NATIVE", wraps=hmakv_native) as native:
        got = hasher.block_hashes(packed, block_size, lookahead=lookahead)
        externals = hasher.external_hashes(packed, block_size, lookahead=lookahead)
    assert native.block_hashes.call_args.args[2] is packed.data  # the buffer, read natively
    assert native.external_hashes.call_args.args[2] is packed.data
    assert got == expected
    assert externals == packed_externals(expected)
    with mock.patch.object(hashing, "_NATIVE", None):
        assert hasher.block_hashes(packed, block_size, lookahead=lookahead) == expected
        assert hasher.external_hashes(packed, block_size, lookahead=lookahead) == externals


def test_packed_tokens_with_extra_keys_are_unpacked_for_python() -> None:
    hasher = BlockHasher()
    keys: list[tuple[object, ...] | None] = [("lora-a",), None]
    tokens = [7, 2**32 - 1, 0, 5, 9, 9, 9, 9]
    expected = python_hashes(hasher, tokens, 4, extra_keys=keys)
    assert hasher.block_hashes(PackedTokenIds.pack(tokens), 4, extra_keys=keys) == expected


def test_bytes_given_as_token_ids_are_ints_not_packed(native_calls: mock.MagicMock) -> None:
    """Only a ``PackedTokenIds`` is packed: bytes are a sequence of ints as Python reads them."""
    hasher = BlockHasher()
    assert hasher.block_hashes(b"\x01\x02\x03\x04", 1) == python_hashes(hasher, [1, 2, 3, 4], 1)


def test_packed_token_ids_refuse_what_is_not_uint32s() -> None:
    with pytest.raises(ValueError, match="4 bytes each: 6 bytes"):
        PackedTokenIds(b"abcdef")
    with pytest.raises(struct.error):
        PackedTokenIds.pack([2**32])
    with pytest.raises(ValueError, match="4 bytes each: 3 bytes"):
        hmakv_native.external_hashes("sha256_cbor", b"p", b"abc", 1)


def test_the_native_hasher_refuses_what_the_specification_refuses() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        hmakv_native.block_hashes("sha256_cbor", b"p", [1, 2], 0)
    with pytest.raises(ValueError, match="unknown hash function"):
        hmakv_native.external_hashes("sha256", b"p", [1, 2], 1)
    with pytest.raises(TypeError):
        hmakv_native.block_hashes("sha256_cbor", b"p", range(4), 2)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        hmakv_native.block_hashes("sha256_cbor", b"p", [2**64], 1)
