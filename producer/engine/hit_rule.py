"""vLLM's prefix-hit rule for hybrid models, with no block pool behind it.

This is the ground truth every consumer index is checked against, so it must reproduce what
``HybridKVCacheCoordinator.find_longest_cache_hit`` in ``vllm/v1/core/kv_cache_coordinator.py``
(and the per-type ``find_longest_cache_hit`` in ``single_type_kv_cache_manager.py``) decides, given
only "is this hash cached in group g". Keeping it free of any pool lets the engine and the
exhaustive tests use it as the oracle; the consumers' index has its own one-pass implementation
(``consumers/hit_rule.py``), checked against vLLM's traces and a model of its own.

A hit of ``L`` tokens reads, per group (``k = L // block_size``):

- full attention: blocks ``0..k-1``, found by a left-to-right scan;
- sliding window ``W``: the trailing ``ceil((W-1)/block_size)`` blocks, found right to left;
- chunked local attention ``C``: blocks from ``floor(L/C)*C / block_size`` to ``k-1``;
- mamba: the single state block ``k-1``.

``L`` is a multiple of the LCM of the groups' block sizes and at most the caller's bound (vLLM
passes ``num_tokens - 1``); the groups are re-checked until ``L`` stops shrinking.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hmakv.producer.events import (
    CHUNKED_LOCAL_KIND,
    FULL_ATTENTION_KINDS,
    MAMBA_KIND,
    PREFIX_CACHED_KINDS,
    SLIDING_WINDOW_KINDS,
    GroupSpec,
)
from hmakv.producer.hashing import group_block_hashes

H = TypeVar("H", bound=Hashable)


class UnsupportedGroup(ValueError):
    """A group this rule cannot reason about (no prefix caching in vLLM, or a bad spec)."""


def check_group(spec: GroupSpec) -> None:
    """Reject specs vLLM would not prefix-cache, before they produce a silently wrong hit."""
    if spec.kind not in PREFIX_CACHED_KINDS:
        supported = ", ".join(sorted(PREFIX_CACHED_KINDS))
        raise UnsupportedGroup(f"group kind {spec.kind!r} is not prefix-cached; use {supported}")
    if spec.block_size <= 0:
        raise UnsupportedGroup(f"block size must be positive, got {spec.block_size}")
    if spec.kind in SLIDING_WINDOW_KINDS and (spec.sliding_window or 0) < 2:
        raise UnsupportedGroup(f"a sliding-window group needs a window >= 2, got {spec}")
    if spec.kind == CHUNKED_LOCAL_KIND and (
        not spec.chunk_size or spec.chunk_size % spec.block_size
    ):
        raise UnsupportedGroup(f"a chunked group needs a chunk that is whole blocks, got {spec}")


def hash_block_size(groups: Sequence[GroupSpec]) -> int:
    """The block size hashes are computed at: one that divides every group's block size.

    vLLM hashes once at this granularity (its layouts use the smallest block size, which divides
    the others) and views a larger group block through the hash of its last sub-block
    (``BlockHashListWithBlockSize``).
    """
    return math.gcd(*(spec.block_size for spec in groups))


def alignment_tokens(groups: Sequence[GroupSpec]) -> int:
    """Every hit is a multiple of this: a hit must end on a block boundary in every group."""
    return math.lcm(*(spec.block_size for spec in groups))


def sliding_window_blocks(spec: GroupSpec) -> int:
    """Blocks a sliding-window hit must hold: the window minus the token being computed."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // spec.block_size)


def required_blocks(spec: GroupSpec, num_tokens: int) -> range:
    """Indices of the group's blocks that a hit of ``num_tokens`` reads; the others are skipped.

    These are exactly the blocks vLLM touches when it admits a request with that hit.
    """
    end = num_tokens // spec.block_size
    if spec.kind in SLIDING_WINDOW_KINDS:
        return range(max(0, end - sliding_window_blocks(spec)), end)
    if spec.kind == CHUNKED_LOCAL_KIND:
        assert spec.chunk_size is not None
        return range(num_tokens // spec.chunk_size * spec.chunk_size // spec.block_size, end)
    if spec.kind == MAMBA_KIND:
        return range(max(0, end - 1), end)
    return range(end)


def is_reachable_block(spec: GroupSpec, block_index: int, alignment: int) -> bool:
    """Whether any aligned hit can ever read this block, i.e. whether vLLM caches it.

    Only sliding-window groups whose window spans fewer blocks than an aligned segment have
    unreachable blocks (``SlidingWindowManager.reachable_block_mask``): a hit ends on a segment
    boundary, so only the last ``ceil((W-1)/B)`` blocks of each segment are ever read.
    """
    if spec.kind not in SLIDING_WINDOW_KINDS:
        return True
    per_segment = alignment // spec.block_size
    needed = sliding_window_blocks(spec)
    return needed >= per_segment or block_index % per_segment >= per_segment - needed


@dataclass(frozen=True)
class _AttentionGroup:
    """Groups with one identical spec, looked up together: a block hits only if all hold it."""

    spec: GroupSpec
    group_ids: tuple[int, ...]


def _attention_groups(groups: Sequence[GroupSpec], alignment: int) -> list[_AttentionGroup]:
    merged: dict[GroupSpec, list[int]] = {}
    for group_id, spec in enumerate(groups):
        check_group(spec)
        if spec.kind == CHUNKED_LOCAL_KIND and spec.block_size != alignment:
            raise UnsupportedGroup("vLLM supports chunked local attention only with one block size")
        merged.setdefault(spec, []).append(group_id)
    # Full attention first: its left-to-right scan gives the tightest first bound (as vLLM).
    ordered = sorted(merged.items(), key=lambda item: item[0].kind not in FULL_ATTENTION_KINDS)
    return [_AttentionGroup(spec, tuple(ids)) for spec, ids in ordered]


BlockLookup = Callable[[int], bool]


def _full_attention_hit(spec: GroupSpec, bound: int, alignment: int, cached: BlockLookup) -> int:
    blocks = 0
    while blocks < bound // spec.block_size and cached(blocks):
        blocks += 1
    return blocks * spec.block_size // alignment * alignment


def _sliding_window_hit(spec: GroupSpec, bound: int, alignment: int, cached: BlockLookup) -> int:
    size = spec.block_size
    needed = sliding_window_blocks(spec)
    run = 0
    for index in range(bound // size - 1, -1, -1):
        if not cached(index):
            run = 0
            continue
        if run == 0 and (index + 1) * size % alignment:
            continue  # a run must end on an aligned boundary
        run += 1
        if run >= needed:
            return (index + run) * size
    # No full window anywhere: only a run reaching block 0 is a hit (the window covers it all).
    return run * size // alignment * alignment


def _chunked_local_hit(spec: GroupSpec, bound: int, alignment: int, cached: BlockLookup) -> int:
    assert spec.chunk_size is not None
    blocks = bound // spec.chunk_size * spec.chunk_size // spec.block_size
    while blocks < bound // spec.block_size and cached(blocks):
        blocks += 1
    return blocks * spec.block_size


def _mamba_hit(spec: GroupSpec, bound: int, alignment: int, cached: BlockLookup) -> int:
    for index in range(bound // spec.block_size - 1, -1, -1):
        end = (index + 1) * spec.block_size
        if end % alignment == 0 and cached(index):
            return end
    return 0


def _group_hit(spec: GroupSpec) -> Callable[[GroupSpec, int, int, BlockLookup], int]:
    if spec.kind in FULL_ATTENTION_KINDS:
        return _full_attention_hit
    if spec.kind in SLIDING_WINDOW_KINDS:
        return _sliding_window_hit
    if spec.kind == CHUNKED_LOCAL_KIND:
        return _chunked_local_hit
    return _mamba_hit


def find_longest_cache_hit(
    groups: Sequence[GroupSpec],
    block_hashes: Sequence[H],
    max_hit_tokens: int,
    is_cached: Callable[[int, H], bool],
) -> int:
    """The longest prefix hit, in tokens, that vLLM's hybrid coordinator would grant.

    Each group either accepts the candidate length or shortens it to its own longest hit below
    it, until no group shortens it: the longest length every group accepts. (vLLM stops after one
    pass for full attention plus one other kind; without EAGLE that pass is already final.)
    ``block_hashes`` are at the hash block size (the smallest group block size);
    ``is_cached(group_idx, block_hash)`` says whether that group holds the block, with
    ``block_hash`` the group-granularity hash (``group_block_hashes``). ``max_hit_tokens`` is
    vLLM's ``num_tokens - 1``: the last prompt token is always recomputed for its logits.
    """
    small = hash_block_size(groups)
    alignment = alignment_tokens(groups)
    attention_groups = _attention_groups(groups, alignment)
    lookups = [_block_lookup(g, block_hashes, small, is_cached) for g in attention_groups]
    # vLLM scans up to max_hit_tokens; hashes only exist for full blocks, so that is the bound.
    hit = min(max_hit_tokens, len(block_hashes) * small)
    first_pass = True
    while True:
        candidate = hit
        for group, cached in zip(attention_groups, lookups, strict=True):
            spec = group.spec
            if spec.kind in FULL_ATTENTION_KINDS and not first_pass:
                # Full attention is downward closed: a shorter prefix of a hit is a hit.
                candidate = candidate // spec.block_size * spec.block_size
            else:
                candidate = _group_hit(spec)(spec, candidate, alignment, cached)
        if candidate >= hit:
            return hit
        hit = candidate
        first_pass = False


def _block_lookup(
    group: _AttentionGroup,
    block_hashes: Sequence[H],
    hash_block_size: int,
    is_cached: Callable[[int, H], bool],
) -> BlockLookup:
    hashes = group_block_hashes(block_hashes, hash_block_size, group.spec.block_size)

    def cached(index: int) -> bool:
        return all(is_cached(group_id, hashes[index]) for group_id in group.group_ids)

    return cached
