"""Block hashing against vLLM's own vectors, plus the chain's structural properties."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.producer import hashing
from hmakv.producer.hashing import (
    HASH_FUNCTIONS,
    BlockHasher,
    MultiModalSpan,
    UnsupportedHashFunction,
    block_extra_keys,
    external,
    group_block_hashes,
)

VECTORS = Path(__file__).parents[1] / "data" / "vllm-hash-sha256_cbor.jsonl"


def _load_vectors() -> list[dict[str, Any]]:
    with VECTORS.open() as lines:
        return [json.loads(line) for line in lines]


VECTOR_CASES = _load_vectors()


def _extra_keys(case: dict[str, Any]) -> list[tuple[object, ...] | None] | None:
    keys = case["extra_keys"]
    return None if keys is None else [tuple(k) if k is not None else None for k in keys]


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("case", VECTOR_CASES, ids=[c["case"] for c in VECTOR_CASES])
def test_matches_vllm_vectors(case: dict[str, Any], path: str) -> None:
    """Cases without ``lookahead`` come from vLLMs before it existed: they hash without one.
    Both paths: the native hasher takes the cases without extra keys."""
    hasher = BlockHasher(case["hash_fn"], seed=case["PYTHONHASHSEED"])
    native = hashing._NATIVE if path == "native" else None
    with mock.patch.object(hashing, "_NATIVE", native):
        hashes = hasher.block_hashes(
            case["token_ids"],
            case["block_size"],
            extra_keys=_extra_keys(case),
            lookahead=case.get("lookahead", 0),
        )
        externals = hasher.external_hashes(
            case["token_ids"],
            case["block_size"],
            extra_keys=_extra_keys(case),
            lookahead=case.get("lookahead", 0),
        )
    assert hasher.none_hash.hex() == case["none_hash_hex"]
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    assert [external(h) for h in hashes] == case["external_ints"]
    assert externals.tolist() == case["external_ints"]  # packed uint64s, in their order


LOOKAHEAD_CASES = [c for c in VECTOR_CASES if c.get("lookahead")]


def test_vllm_0_33_lookahead_vectors_differ_from_the_classic_hashes() -> None:
    """Each lookahead vector hashes fewer or other blocks than vLLM's classic chain would, so a
    hasher ignoring ``lookahead`` fails them; a block is hashed once its lookahead exists."""
    assert {c["lookahead"] for c in LOOKAHEAD_CASES} >= {1, 3}
    for case in LOOKAHEAD_CASES:
        tokens, size, lookahead = case["token_ids"], case["block_size"], case["lookahead"]
        assert len(case["external_ints"]) == (len(tokens) - lookahead) // size
        classic = BlockHasher(seed=case["PYTHONHASHSEED"]).block_hashes(
            tokens, size, extra_keys=_extra_keys(case)
        )
        assert not {external(h) for h in classic} & set(case["external_ints"])


def test_a_block_aligned_prompt_leaves_its_last_block_unhashed_with_lookahead() -> None:
    hasher = BlockHasher(seed="0")
    tokens = list(range(48))
    assert len(hasher.block_hashes(tokens, 16)) == 3
    assert len(hasher.block_hashes(tokens, 16, lookahead=1)) == 2
    assert hasher.block_hashes(tokens[:3], 16, lookahead=5) == []


def test_lookahead_hashes_cover_the_tokens_after_each_block() -> None:
    hasher = BlockHasher(seed="0")
    first = hasher.block_hashes([*range(16), 100], 16, lookahead=1)
    second = hasher.block_hashes([*range(16), 101], 16, lookahead=1)
    assert len(first) == len(second) == 1
    assert first != second


def test_negative_lookahead_is_refused() -> None:
    with pytest.raises(ValueError, match="lookahead must not be negative"):
        BlockHasher().block_hashes([1, 2], 1, lookahead=-1)


def test_vectors_cover_uint64_range() -> None:
    """At least one vector int needs the unsigned range, so a signed conversion would fail."""
    assert any(v >= 2**63 for case in VECTOR_CASES for v in case["external_ints"])


def test_extra_keys_builder_reproduces_vector_keys() -> None:
    by_name = {case["case"]: case for case in VECTOR_CASES}
    lora = by_name["seed0-lora-first-block"]
    salt = by_name["seed0-salt-first-block-only"]
    assert block_extra_keys(2, 16, lora_name="adapter-x") == _extra_keys(lora)
    assert block_extra_keys(3, 16, cache_salt="salt-a") == _extra_keys(salt)


def test_xxhash_cbor_hashes_the_canonical_cbor_bytes() -> None:
    """Pins the serialized layout by hand: array(3)[bytes(16) parent, array(2)[1, 2], null]."""
    hasher = BlockHasher("xxhash_cbor", seed="0")
    assert hasher.none_hash == xxhash.xxh3_128_digest(b"\x61" + b"0")
    expected = xxhash.xxh3_128_digest(b"\x83\x50" + hasher.none_hash + b"\x82\x01\x02\xf6")
    assert hasher.block_hashes([1, 2, 3], 2) == [expected]
    assert len(expected) == 16


def test_seed_changes_every_hash() -> None:
    tokens = list(range(32))
    first = BlockHasher(seed="0").block_hashes(tokens, 16)
    second = BlockHasher(seed="1").block_hashes(tokens, 16)
    assert all(a != b for a, b in zip(first, second, strict=True))


def test_accepts_non_list_sequences() -> None:
    hasher = BlockHasher()
    assert hasher.block_hashes(range(40), 16) == hasher.block_hashes(list(range(40)), 16)


def test_empty_extra_keys_hash_like_none() -> None:
    """vLLM passes None, never an empty tuple, for a block without keys."""
    hasher = BlockHasher()
    tokens = list(range(16))
    assert hasher.block_hashes(tokens, 16, extra_keys=[()]) == hasher.block_hashes(tokens, 16)


def test_external_takes_last_eight_bytes_unsigned() -> None:
    assert external(bytes(24) + b"\xff" * 8) == 2**64 - 1
    assert external(b"\xaa" * 8 + bytes(7) + b"\x01") == 1


@pytest.mark.parametrize("name", ["sha256", "xxhash"])
def test_pickle_hash_functions_are_refused(name: str) -> None:
    with pytest.raises(UnsupportedHashFunction, match=r"pickle.*outside the engine"):
        BlockHasher(name)


def test_unknown_hash_function_is_refused() -> None:
    with pytest.raises(UnsupportedHashFunction, match="unknown hash function 'md5'"):
        BlockHasher("md5")


def test_refuses_non_positive_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockHasher().block_hashes([1, 2, 3], 0)


def test_refuses_extra_keys_missing_for_a_full_block() -> None:
    with pytest.raises(ValueError, match="1 entries for 2 full blocks"):
        BlockHasher().block_hashes(list(range(32)), 16, extra_keys=[None])


def test_extra_keys_for_a_partial_block_are_ignored() -> None:
    hasher = BlockHasher()
    tokens = list(range(20))
    with_extra = hasher.block_hashes(tokens, 16, extra_keys=[None, ("lora",)])
    assert with_extra == hasher.block_hashes(tokens, 16)


def test_multimodal_span_keys_every_block_it_overlaps() -> None:
    """An image at tokens 10..29 with block size 16, worked by hand from vLLM's rule."""
    keys = block_extra_keys(3, 16, mm_spans=[MultiModalSpan("img", 10, 20)])
    assert keys == [(("img", 10),), (("img", -6),), None]


def test_multimodal_spans_sharing_a_block_keep_offset_order() -> None:
    spans = [MultiModalSpan("b", 20, 4), MultiModalSpan("a", 17, 2)]
    assert block_extra_keys(2, 16, mm_spans=spans) == [None, (("a", 1), ("b", 4))]


def test_extra_keys_order_is_lora_then_multimodal_then_salt() -> None:
    keys = block_extra_keys(
        2, 4, lora_name="ad", mm_spans=[MultiModalSpan("img", 0, 8)], cache_salt="s"
    )
    assert keys == [("ad", ("img", 0), "s"), ("ad", ("img", -4))]


def test_group_block_hashes_are_the_last_sub_block_hashes() -> None:
    hashes = BlockHasher().block_hashes(list(range(80)), 16)
    grouped = group_block_hashes(hashes, 16, 32)
    assert list(grouped) == [hashes[1], hashes[3]]
    assert list(group_block_hashes(hashes, 16, 64)) == [hashes[3]]


def test_group_block_size_equal_to_hash_block_size_is_identity() -> None:
    hashes = BlockHasher().block_hashes(list(range(48)), 16)
    assert group_block_hashes(hashes, 16, 16) == hashes


def test_group_block_size_must_be_a_multiple() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        group_block_hashes([], 16, 24)


def test_hash_functions_lists_only_portable_ones() -> None:
    assert set(HASH_FUNCTIONS) == {"sha256_cbor", "xxhash_cbor"}


token_lists = st.lists(st.integers(min_value=0, max_value=2**32), max_size=80)
block_sizes = st.integers(min_value=1, max_value=16)
HASHERS = {name: BlockHasher(name, seed="7") for name in HASH_FUNCTIONS}
hash_fns = st.sampled_from(HASH_FUNCTIONS)


@settings(max_examples=60)
@given(hash_fns, token_lists, block_sizes, st.integers(min_value=0, max_value=80))
def test_hashes_of_a_prefix_are_a_prefix(
    hash_fn: str, tokens: list[int], block_size: int, cut: int
) -> None:
    hasher = HASHERS[hash_fn]
    whole = hasher.block_hashes(tokens, block_size)
    assert (
        hasher.block_hashes(tokens[:cut], block_size)
        == whole[: min(cut, len(tokens)) // block_size]
    )


@settings(max_examples=60)
@given(hash_fns, token_lists.filter(bool), block_sizes, st.data())
def test_changing_a_token_changes_its_block_and_all_later_ones(
    hash_fn: str, tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    hasher = HASHERS[hash_fn]
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    before = hasher.block_hashes(tokens, block_size)
    after = hasher.block_hashes(changed, block_size)
    block = position // block_size
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:], strict=True))


@settings(max_examples=60)
@given(hash_fns, token_lists, block_sizes, st.lists(st.integers(0, 1000), max_size=15))
def test_partial_trailing_block_is_ignored(
    hash_fn: str, tokens: list[int], block_size: int, tail: list[int]
) -> None:
    hasher = HASHERS[hash_fn]
    full = tokens[: len(tokens) // block_size * block_size]
    partial_tail = tail[: block_size - 1]
    hashes = hasher.block_hashes(full + partial_tail, block_size)
    assert hashes == hasher.block_hashes(full, block_size)
    assert len(hashes) == len(full) // block_size


@settings(max_examples=60)
@given(hash_fns, token_lists, token_lists, block_sizes)
def test_parent_continues_the_chain(
    hash_fn: str, head: list[int], tail: list[int], block_size: int
) -> None:
    hasher = HASHERS[hash_fn]
    head = head[: len(head) // block_size * block_size]
    head_hashes = hasher.block_hashes(head, block_size)
    parent = head_hashes[-1] if head_hashes else None
    continued = hasher.block_hashes(tail, block_size, parent=parent)
    assert head_hashes + continued == hasher.block_hashes(head + tail, block_size)


@settings(max_examples=40)
@given(hash_fns, token_lists, block_sizes, st.integers(min_value=0, max_value=5))
def test_salt_changes_every_block(
    hash_fn: str, tokens: list[int], block_size: int, salt_number: int
) -> None:
    hasher = HASHERS[hash_fn]
    num_blocks = len(tokens) // block_size
    salted = block_extra_keys(num_blocks, block_size, cache_salt=f"salt-{salt_number}")
    plain = hasher.block_hashes(tokens, block_size)
    with_salt = hasher.block_hashes(tokens, block_size, extra_keys=salted)
    assert all(a != b for a, b in zip(plain, with_salt, strict=True))
