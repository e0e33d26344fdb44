"""The hybrid hit rule: worked examples, a brute-force cross-check, and vLLM's own trace."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pytest
from engine_replay import CountingIndex
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.producer.engine import find_longest_cache_hit, get_profile
from hmakv.producer.engine.hit_rule import (
    UnsupportedGroup,
    alignment_tokens,
    is_reachable_block,
    required_blocks,
)
from hmakv.producer.events import GroupSpec, KVEventBatch
from hmakv.producer.hashing import group_block_hashes

TRACE = Path(__file__).parents[2] / "data" / "vllm-trace-swa-small-seed1.jsonl.gz"

FULL = GroupSpec(kind="full_attention", block_size=16)
SWA_128 = GroupSpec(kind="sliding_window", block_size=16, sliding_window=128)


def cached_in(blocks: dict[int, set[int]]) -> Callable[[int, int], bool]:
    """is_cached over block indices used as hashes: group -> cached block indices."""
    return lambda group, block_hash: block_hash in blocks.get(group, set())


def test_gpt_oss_twenty_block_hit_needs_full_0_to_19_and_swa_12_to_19() -> None:
    """KV-EVENTS-FACTS 3: W=128, B=16 needs the trailing ceil(127/16) = 8 sliding blocks."""
    hashes = list(range(21))
    cached = {0: set(range(20)), 1: set(range(12, 20))}
    assert find_longest_cache_hit((FULL, SWA_128), hashes, 321 - 1, cached_in(cached)) == 320
    assert required_blocks(FULL, 320) == range(20)
    assert required_blocks(SWA_128, 320) == range(12, 20)


def test_missing_window_block_shortens_the_hit_to_the_next_full_window() -> None:
    hashes = list(range(21))
    # Sliding block 12 gone: no 8-block window ends at 19; blocks 4..11 form the next one.
    cached = {0: set(range(20)), 1: set(range(4, 12)) | set(range(13, 20))}
    assert find_longest_cache_hit((FULL, SWA_128), hashes, 320, cached_in(cached)) == 12 * 16
    # And with nothing left of blocks 0..11 there is no window at all: no hit.
    cached[1] = set(range(13, 20))
    assert find_longest_cache_hit((FULL, SWA_128), hashes, 320, cached_in(cached)) == 0


def test_short_prefix_hits_without_a_whole_window() -> None:
    """A run from block 0 shorter than the window is a hit: the window covers all of it."""
    cached = {0: set(range(5)), 1: set(range(3))}
    assert find_longest_cache_hit((FULL, SWA_128), list(range(5)), 80, cached_in(cached)) == 48


def test_hit_is_at_most_the_bound_and_never_past_the_hashes() -> None:
    cached = {0: set(range(10)), 1: set(range(10))}
    assert find_longest_cache_hit((FULL, SWA_128), list(range(10)), 159, cached_in(cached)) == 144
    assert find_longest_cache_hit((FULL, SWA_128), list(range(4)), 1000, cached_in(cached)) == 64


def test_hits_align_to_the_lcm_of_block_sizes() -> None:
    full_64 = GroupSpec(kind="full_attention", block_size=64)
    swa = GroupSpec(kind="sliding_window", block_size=16, sliding_window=32)
    assert alignment_tokens((full_64, swa)) == 64
    hashes = list(range(12))  # 16-token hashes; the full group sees every fourth
    assert list(group_block_hashes(hashes, 16, 64)) == [3, 7, 11]
    # Sliding blocks 8 and 9 end at 160, not a multiple of 64: the window must end at 128.
    cached = {0: {3, 7, 11}, 1: {6, 7, 8, 9}}
    assert find_longest_cache_hit((full_64, swa), hashes, 191, cached_in(cached)) == 128


def test_mamba_hit_is_the_latest_aligned_state_block() -> None:
    mamba = GroupSpec(kind="mamba", block_size=64)
    hashes = list(range(20))  # 16-token hashes: mamba block i is hash 4i+3
    cached = {0: set(range(20)), 1: {3, 11}}
    assert find_longest_cache_hit((FULL, mamba), hashes, 319, cached_in(cached)) == 192
    assert required_blocks(mamba, 192) == range(2, 3)
    assert find_longest_cache_hit((FULL, mamba), hashes, 319, cached_in({0: set(range(20))})) == 0


def test_chunked_local_attention_examples_from_vllm() -> None:
    """vLLM's ChunkedLocalAttentionManager docstring: chunk 8, block 4."""
    chunked = GroupSpec(kind="chunked_local_attention", block_size=4, chunk_size=8)
    hashes = list(range(4))
    # Max length 15: blocks 0-1 are outside the window (free), block 2 decides 12 vs 8 tokens.
    assert find_longest_cache_hit((chunked,), hashes, 15, cached_in({0: {2}})) == 12
    assert find_longest_cache_hit((chunked,), hashes, 15, cached_in({})) == 8
    # Max length 16: every block is outside the window of token 16.
    assert find_longest_cache_hit((chunked,), hashes, 16, cached_in({})) == 16
    assert required_blocks(chunked, 12) == range(2, 3)


def test_identical_groups_hit_only_where_all_hold_the_block() -> None:
    """Gemma-like: five sliding groups share one spec and are looked up together, as in vLLM."""
    groups = get_profile("gemma3-like").groups
    hashes = list(range(70))
    everywhere = set(range(70))
    cached = {group: everywhere for group in range(6)}
    assert find_longest_cache_hit(groups, hashes, 70 * 16, cached_in(cached)) == 70 * 16
    cached[3] = everywhere - {69}
    # 1024-token window = 64 blocks: without block 69 in group 3 the window must end at 68.
    assert find_longest_cache_hit(groups, hashes, 70 * 16, cached_in(cached)) == 69 * 16


def test_sliding_blocks_a_hit_can_never_read_are_unreachable() -> None:
    swa_32 = GroupSpec(kind="sliding_window", block_size=16, sliding_window=32)
    reachable = [i for i in range(8) if is_reachable_block(swa_32, i, alignment=64)]
    assert reachable == [2, 3, 6, 7]
    assert all(is_reachable_block(swa_32, i, alignment=16) for i in range(8))
    assert all(is_reachable_block(SWA_128, i, alignment=64) for i in range(8))


def test_a_sink_full_attention_group_hits_as_full_attention_does() -> None:
    """vLLM's SinkFullAttentionManager is a FullAttentionManager: its blocks from the start."""
    sink = GroupSpec(kind="sink_full_attention", block_size=16)
    cached = {0: set(range(4)), 1: {0, 1}}
    assert find_longest_cache_hit((FULL, sink), list(range(4)), 63, cached_in(cached)) == 32


@pytest.mark.parametrize(
    "spec",
    [
        GroupSpec(kind="cross_attention", block_size=16),
        GroupSpec(kind="sliding_window", block_size=16),
        GroupSpec(kind="chunked_local_attention", block_size=16, chunk_size=40),
    ],
)
def test_groups_vllm_cannot_prefix_cache_are_refused(spec: GroupSpec) -> None:
    with pytest.raises(UnsupportedGroup):
        find_longest_cache_hit((FULL, spec), [1, 2], 31, lambda g, h: True)


# Brute force, written from KV-EVENTS-FACTS 3 independently of the rule's helpers: the longest
# aligned length whose required blocks are all cached in every group.


def blocks_read(spec: GroupSpec, length: int) -> list[int]:
    k = length // spec.block_size
    if spec.kind == "sliding_window":
        assert spec.sliding_window is not None
        n = math.ceil((spec.sliding_window - 1) / spec.block_size)
        return list(range(max(0, k - n), k))
    if spec.kind == "chunked_local_attention":
        assert spec.chunk_size is not None
        return list(
            range(math.floor(length / spec.chunk_size) * spec.chunk_size // spec.block_size, k)
        )
    if spec.kind == "mamba":
        return [k - 1] if k else []
    return list(range(k))


def brute_force_hit(
    groups: Sequence[GroupSpec], num_hashes: int, bound: int, cached: dict[int, set[int]]
) -> int:
    small = math.gcd(*(spec.block_size for spec in groups))
    align = math.lcm(*(spec.block_size for spec in groups))
    best = 0
    for length in range(0, min(bound, num_hashes * small) + 1, align):
        if all(
            all(
                # A group block is named by the hash of its last hash-size sub-block.
                (index + 1) * spec.block_size // small - 1 in cached.get(group, set())
                for index in blocks_read(spec, length)
            )
            for group, spec in enumerate(groups)
        ):
            best = length
    return best


SPECS = [
    GroupSpec(kind="full_attention", block_size=16),
    GroupSpec(kind="full_attention", block_size=32),
    GroupSpec(kind="full_attention", block_size=64),
    *(
        GroupSpec(kind="sliding_window", block_size=16, sliding_window=window)
        for window in (17, 18, 32, 33, 34, 64)
    ),
    GroupSpec(kind="sliding_window", block_size=32, sliding_window=48),
    GroupSpec(kind="sliding_window", block_size=32, sliding_window=34),
    GroupSpec(kind="full_attention", block_size=48),
    GroupSpec(kind="sliding_window", block_size=48, sliding_window=64),
    GroupSpec(kind="mamba", block_size=16),
    GroupSpec(kind="mamba", block_size=32),
    GroupSpec(kind="mamba", block_size=48),
    GroupSpec(kind="mamba", block_size=64),
]
CHUNKED = GroupSpec(kind="chunked_local_attention", block_size=16, chunk_size=48)


@st.composite
def hit_cases(draw: st.DrawFn) -> tuple[tuple[GroupSpec, ...], int, int, dict[int, set[int]]]:
    # Chunked local attention needs one block size (vLLM asserts it); 48 makes the LCM exceed
    # every block size, the case where alignment is not implied by any single group.
    one_size = [s for s in SPECS if s.block_size == 16] + [CHUNKED]
    pool = one_size if draw(st.booleans()) else SPECS
    groups = tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4)))
    num_hashes = draw(st.integers(0, 24))
    bound = draw(st.integers(0, num_hashes * 16 + 20))
    density = draw(st.sampled_from([0.3, 0.7, 0.95]))
    cached = {
        group: {i for i in range(num_hashes) if draw(st.floats(0, 1)) < density}
        for group in range(len(groups))
    }
    return groups, num_hashes, bound, cached


HitCase = tuple[tuple[GroupSpec, ...], int, int, dict[int, set[int]]]


@settings(max_examples=600, deadline=None)
@given(hit_cases())
def test_rule_equals_brute_force(case: HitCase) -> None:
    groups, num_hashes, bound, cached = case
    hashes = list(range(num_hashes))
    got = find_longest_cache_hit(groups, hashes, bound, cached_in(cached))
    assert got == brute_force_hit(groups, num_hashes, bound, cached)


def test_rule_predicts_every_hit_vllm_found_in_its_recorded_trace() -> None:
    """Replaying vLLM's own events into a counting index, the rule gives vLLM's hit each time."""
    profile = get_profile("swa-small")
    with gzip.open(TRACE, "rt") as trace:
        lines = [json.loads(line) for line in trace]
    config = lines[0]
    assert (config["block_size"], config["num_blocks"]) == (16, profile.num_blocks)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    index = CountingIndex(len(profile.groups))
    probes = 0
    for line in lines[1:]:
        if line["kind"] == "batch":
            index.apply(decoder.decode(bytes.fromhex(line["payload_hex"])).events)
            continue
        hit = find_longest_cache_hit(
            profile.groups, line["block_hashes"], len(line["token_ids"]) - 1, index.is_cached
        )
        assert hit == line["expected_hit_tokens"], f"probe after seq {line['after_seq']}"
        probes += 1
    assert probes == 120
    assert index.unknown_removals == 0
