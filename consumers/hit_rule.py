"""vLLM's hybrid prefix-hit rule, evaluated for a whole fleet at once over worker bitsets.

vLLM (``HybridKVCacheCoordinator.find_longest_cache_hit``) shrinks a candidate hit length until
every cache group accepts it. Each group's finder returns the longest length it accepts that is
not longer than the candidate, and every group's acceptance only grows with what is cached, so the
fixed point is simply the longest length, a multiple of the alignment (LCM of the groups' block
sizes) and at most ``num_tokens - 1``, that every group accepts. Here a group's acceptance of a
length is a bitset over worker slots, so one descending scan answers for every worker at once and
costs time in the prompt's blocks, not in workers times blocks.

What a group needs for a hit of ``k`` of its blocks (``single_type_kv_cache_manager.py``):

- full attention (and MLA, sink, unknown kinds): blocks ``0..k-1``;
- sliding window ``W``: the trailing ``n = ceil((W-1)/B)`` blocks ``max(0, k-n)..k-1``;
- chunked local attention, chunk ``C``: blocks from ``floor(k*B/C)*C/B`` to ``k-1``;
- mamba: the single state block ``k-1``.

Not modelled: EAGLE's dropped last block and fine-grained (sub-block) mamba hits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import accumulate, compress, count, repeat, takewhile
from operator import and_
from typing import Literal

import msgspec

from producer.events import GroupSpec

Rule = Literal["prefix", "window", "state", "chunk"]

WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KIND = "mamba"
CHUNKED_KIND = "chunked_local_attention"
# vLLM keeps these out of prefix caching: they never decide a hit.
UNCACHED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})


class GroupRule(msgspec.Struct, frozen=True, gc=False):
    """What one group needs for a hit, in that group's own blocks."""

    group_idx: int
    rule: Rule
    block_size: int
    window_blocks: int = 0
    chunk_size: int = 0


def rule_for(group_idx: int, spec: GroupSpec) -> GroupRule | None:
    """The rule vLLM applies to a group, or None for a group that never caches a prefix.

    A kind we cannot place, or a window or chunk size we were not told, falls back to the
    full-attention rule: it needs every block, so it can only under-report a hit, never invent one.
    """
    if spec.kind in UNCACHED_KINDS:
        return None
    if spec.kind in WINDOW_KINDS and spec.sliding_window:
        # vLLM needs at least the block before the hit even for a window that fits in one token.
        needed = max(1, math.ceil((spec.sliding_window - 1) / spec.block_size))
        return GroupRule(group_idx, "window", spec.block_size, window_blocks=needed)
    if spec.kind == MAMBA_KIND:
        return GroupRule(group_idx, "state", spec.block_size)
    if spec.kind == CHUNKED_KIND and spec.chunk_size:
        return GroupRule(group_idx, "chunk", spec.block_size, chunk_size=spec.chunk_size)
    return GroupRule(group_idx, "prefix", spec.block_size)


def alignment(rules: Sequence[GroupRule]) -> int:
    """Every hit is a multiple of this many tokens: the LCM of the groups' block sizes."""
    return math.lcm(*(rule.block_size for rule in rules))


class Acceptance:
    """Which workers one group accepts a hit of a given length for.

    ``resident[j]`` is the bitset of workers holding the group's block ``j`` of the prompt (read
    lazily, and only up to the first block nobody holds, for full attention); ``everyone`` is
    the bitset of workers being scored.
    """

    __slots__ = ("_everyone", "_prefix", "_resident", "rule")

    def __init__(self, rule: GroupRule, resident: Iterable[int], everyone: int) -> None:
        self.rule = rule
        self._everyone = everyone
        self._resident: list[int] = []
        self._prefix: list[int] = []
        if rule.rule == "prefix":
            # Full attention is downward-closed: one left-to-right AND scan, stopped at the first
            # length nobody holds, answers every length (and reads no further).
            self._prefix = list(takewhile(bool, accumulate(resident, and_, initial=everyone)))
        else:
            self._resident = resident if isinstance(resident, list) else list(resident)

    def accepts(self, tokens: int) -> int:
        """Workers this group accepts a hit of ``tokens`` for (a multiple of its block size)."""
        rule = self.rule
        blocks = tokens // rule.block_size
        if rule.rule == "prefix":
            return self._prefix[blocks] if blocks < len(self._prefix) else 0
        if rule.rule == "window":
            window = self._resident[max(0, blocks - rule.window_blocks) : blocks]
            return reduce(and_, window, self._everyone)
        if rule.rule == "state":
            return self._resident[blocks - 1] if blocks else self._everyone
        chunk_start = tokens // rule.chunk_size * rule.chunk_size // rule.block_size
        return reduce(and_, self._resident[chunk_start:blocks], self._everyone)

    def bound(self, workers: int, tokens: int) -> int:
        """The longest length, at most ``tokens``, at which any of ``workers`` may be accepted.

        It lets the scan jump over lengths nobody left can hit: full attention's accepted sets
        shrink with length (bisect them); window and mamba groups need the block just before
        the hit (walk back to one a worker holds); a chunk boundary needs no block at all.
        """
        rule = self.rule
        blocks = tokens // rule.block_size
        if rule.rule == "prefix":
            prefix = self._prefix
            low, high = 0, min(blocks, len(prefix) - 1)
            while low < high:
                middle = (low + high + 1) // 2
                if prefix[middle] & workers:
                    low = middle
                else:
                    high = middle - 1
            return low * rule.block_size
        if rule.rule == "chunk":
            return tokens
        blocks = min(blocks, len(self._resident))
        held = map(and_, reversed(self._resident[:blocks]), repeat(workers))
        return next(compress(count(blocks, -1), held), 0) * rule.block_size


def longest_hits(
    acceptances: Sequence[Acceptance], everyone: int, align: int, max_tokens: int
) -> list[tuple[int, int]]:
    """Each worker's longest hit that every group accepts, as (tokens, workers) pairs.

    Longest first; every worker of ``everyone`` is in exactly one pair (hit 0 included).
    """
    remaining = everyone
    hits: list[tuple[int, int]] = []
    tokens = max_tokens // align * align
    while remaining and tokens > 0:
        bound = tokens
        for acceptance in acceptances:
            bound = acceptance.bound(remaining, bound)
        bound = bound // align * align
        if bound < tokens:
            tokens = bound
            continue
        accepted = remaining
        for acceptance in acceptances:
            accepted &= acceptance.accepts(tokens)
            if not accepted:
                break
        if accepted:
            hits.append((tokens, accepted))
            remaining ^= accepted
        tokens -= align
    if remaining:
        hits.append((0, remaining))
    return hits
