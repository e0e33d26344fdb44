"""vLLM's hybrid prefix-hit rule, evaluated for a whole fleet at once over worker bitsets.

vLLM (``HybridKVCacheCoordinator.find_longest_cache_hit``) shrinks a candidate hit length until
every cache group accepts it. Each group's finder returns the longest length it accepts that is
not longer than the candidate, and every group's acceptance only grows with what is cached, so the
fixed point is simply the longest length, a multiple of the alignment (LCM of the groups' block
sizes) and at most ``num_tokens - 1``, that every group accepts. Here a group's acceptance of a
length is a bitset over worker slots, so one descending scan answers for every worker at once and
costs time in the prompt's blocks, not in workers times blocks. Every group's bitsets travel
packed in one int per block (a ``Column``), as the index stores them.

What a group needs for a hit of ``k`` of its blocks (``single_type_kv_cache_manager.py``):

- full attention (and MLA, sink, unknown kinds): blocks ``0..k-1``;
- sliding window ``W``: the trailing ``n = ceil((W-1)/B)`` blocks ``max(0, k-n)..k-1``;
- chunked local attention, chunk ``C``: blocks from ``floor(k*B/C)*C/B`` to ``k-1``;
- mamba: the single state block ``k-1``.

Not modelled: EAGLE's dropped last block and fine-grained (sub-block) mamba hits.

``longest_hits`` runs natively (``hmakv_native.longest_hits``, the same scan over u64 words)
where it is installed; the Python scan here is the specification and the fallback, and
tests/consumers/test_hits_native.py checks that both answer alike.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from functools import reduce
from itertools import accumulate, compress, count, groupby, islice, repeat, takewhile
from operator import and_, itemgetter, ne
from typing import Literal, Protocol

import msgspec

from hmakv.producer.events import (
    CHUNKED_LOCAL_KIND,
    MAMBA_KIND,
    SLIDING_WINDOW_KINDS,
    UNCACHED_KINDS,
    GroupSpec,
)

Rule = Literal["prefix", "window", "state", "chunk"]


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
    if spec.kind in SLIDING_WINDOW_KINDS and spec.sliding_window:
        # vLLM needs at least the block before the hit even for a window that fits in one token.
        needed = max(1, math.ceil((spec.sliding_window - 1) / spec.block_size))
        return GroupRule(group_idx, "window", spec.block_size, window_blocks=needed)
    if spec.kind == MAMBA_KIND:
        return GroupRule(group_idx, "state", spec.block_size)
    if spec.kind == CHUNKED_LOCAL_KIND and spec.chunk_size:
        return GroupRule(group_idx, "chunk", spec.block_size, chunk_size=spec.chunk_size)
    return GroupRule(group_idx, "prefix", spec.block_size)


def alignment(rules: Sequence[GroupRule]) -> int:
    """Every hit is a multiple of this many tokens: the LCM of the groups' block sizes."""
    return math.lcm(*(rule.block_size for rule in rules))


# A group's lane of a column: rule, block size, window blocks, chunk size, run edges, holders.
Lane = tuple[Rule, int, int, int, list[int], list[int]]


class _NativeHits(Protocol):
    def longest_hits(
        self, lanes: list[Lane], everyone: int, align: int, max_tokens: int, /
    ) -> list[tuple[int, int]]: ...


def _native_hits() -> _NativeHits | None:
    try:
        import hmakv_native
    except ImportError:  # not built (scripts/setup builds it): the scan runs in Python
        return None
    return hmakv_native


_NATIVE = _native_hits()
NATIVE_HITS = _NATIVE is not None

RUN_SEARCH_LIMIT = 32  # runs found one by one up to this many; more: one pass over every block


class Column:
    """Which workers hold each of a prompt's blocks, every group at once, as runs.

    A block's value packs every group lane's worker bitset (see ``consumers.index``), so one AND
    of two values ANDs every group's bitsets. Neighbouring blocks mostly have equal values (a
    shared prefix is held by the same workers block after block), so the column keeps one value
    per run of equal neighbours: run ``i`` covers blocks ``edges[i]`` to ``edges[i + 1] - 1`` and
    ``held[i]`` is its value. Every question is then a bisect over the runs and a few ANDs: a
    prompt costs its lookups and time in its runs, not in its blocks times its groups.
    """

    __slots__ = ("_prefix", "edges", "held")

    def __init__(self, values: list[int]) -> None:
        self.held: list[int] = list(map(itemgetter(0), groupby(values)))
        self.edges = [*_run_starts(values, self.held), len(values)]
        self._prefix: list[int] | None = None

    @classmethod
    def from_runs(cls, edges: list[int], held: list[int]) -> Column:
        """The column whose runs a table found (``Table.runs``), not computed again."""
        column = cls.__new__(cls)
        column.edges, column.held, column._prefix = edges, held, None
        return column

    def prefix(self) -> list[int]:
        """``prefix[i]``: the AND of runs ``0..i-1`` (-1, everyone, for i = 0), up to the first 0.

        One left-to-right scan over the runs, stopped at the first one no group of anyone holds
        through: it answers every length of every prefix group (and reads no further).
        """
        if self._prefix is None:
            self._prefix = list(takewhile(bool, accumulate(self.held, and_, initial=-1)))
        return self._prefix

    def held_through(self, blocks: int) -> int:
        """Who holds every block before ``blocks`` (-1 for none asked), per lane."""
        prefix = self.prefix()
        runs = bisect_left(self.edges, blocks)
        return prefix[runs] if runs < len(prefix) else 0

    def held_between(self, start: int, stop: int) -> int:
        """Who holds every block of ``start..stop-1`` (-1 for none asked), per lane."""
        if start >= stop:
            return -1
        first = bisect_right(self.edges, start) - 1
        return reduce(and_, islice(self.held, first, bisect_left(self.edges, stop)))

    def longest_held(self, wanted: int, blocks: int) -> int:
        """The longest length, at most ``blocks``, whose every block a bit of ``wanted`` holds.

        ``prefix`` only loses bits, so this bisects it.
        """
        prefix = self.prefix()
        low, high = 0, min(bisect_left(self.edges, blocks), len(prefix) - 1)
        while low < high:
            middle = (low + high + 1) // 2
            if prefix[middle] & wanted:
                low = middle
            else:
                high = middle - 1
        return min(blocks, self.edges[low])

    def last_held(self, wanted: int, below: int) -> int:
        """One past the last block before ``below`` holding any bit of ``wanted``; 0 if none."""
        run = bisect_left(self.edges, below) - 1
        if run < 0 or self.held[run] & wanted:
            return below if run >= 0 else 0  # mostly: the block before the length is held
        earlier = islice(reversed(self.held), len(self.held) - run, None)
        found = next(compress(count(run - 1, -1), map(and_, earlier, repeat(wanted))), -1)
        return self.edges[found + 1] if found >= 0 else 0


def _run_starts(values: list[int], held: list[int]) -> list[int]:
    """Where each run of ``held`` starts in ``values``: found value by value while they are
    few, else in one pass comparing every block with the next."""
    if len(held) > RUN_SEARCH_LIMIT:
        return [0, *compress(count(1), map(ne, values, islice(values, 1, None)))]
    starts = [0] if held else []
    start = 0
    # Neighbouring runs differ, so the next run's value first appears where that run starts.
    for value in islice(held, 1, None):
        start = values.index(value, start)
        starts.append(start)
    return starts


class Acceptance:
    """Which workers one group accepts a hit of a given length for.

    It reads the group's lane of a shared ``Column``: bits ``shift`` and up of each packed value.
    ``accepts`` answers with those bits shifted down to worker slots, higher lanes' bits above
    them (or -1 for everyone): callers AND it with the workers they ask about.
    """

    __slots__ = ("_column", "_shift", "rule")

    def __init__(self, rule: GroupRule, column: Column, shift: int) -> None:
        self.rule = rule
        self._column = column
        self._shift = shift

    def accepts(self, tokens: int) -> int:
        """Workers this group accepts a hit of ``tokens`` for (a multiple of its block size)."""
        rule = self.rule
        blocks = tokens // rule.block_size
        column = self._column
        if rule.rule == "prefix":
            return column.held_through(blocks) >> self._shift
        if rule.rule == "window":
            start = max(0, blocks - rule.window_blocks)
        elif rule.rule == "state":
            start = max(0, blocks - 1)
        else:
            start = tokens // rule.chunk_size * rule.chunk_size // rule.block_size
        return column.held_between(start, blocks) >> self._shift

    def lane(self, everyone: int) -> Lane:
        """The group's lane as the native scan takes it: the rule, the runs' edges and each
        run's holders shifted down to worker slots, masked to ``everyone``."""
        rule, shift = self.rule, self._shift
        held = [value >> shift & everyone for value in self._column.held]
        return (
            rule.rule,
            rule.block_size,
            rule.window_blocks,
            rule.chunk_size,
            self._column.edges,
            held,
        )

    def bound(self, workers: int, tokens: int) -> int:
        """The longest length, at most ``tokens``, at which any of ``workers`` may be accepted.

        It lets the scan jump over lengths nobody left can hit: full attention's accepted sets
        shrink with length (bisect them); window and mamba groups need the block just before
        the hit (walk back to one a worker holds); a chunk boundary needs no block at all.
        """
        rule = self.rule
        blocks = tokens // rule.block_size
        wanted = workers << self._shift
        if rule.rule == "prefix":
            return self._column.longest_held(wanted, blocks) * rule.block_size
        if rule.rule == "chunk":
            return tokens
        return self._column.last_held(wanted, blocks) * rule.block_size


def longest_hits(
    acceptances: Sequence[Acceptance], everyone: int, align: int, max_tokens: int
) -> list[tuple[int, int]]:
    """Each worker's longest hit that every group accepts, as (tokens, workers) pairs.

    Longest first; every worker of ``everyone`` is in exactly one pair (hit 0 included).
    """
    if _NATIVE is not None:
        lanes = [acceptance.lane(everyone) for acceptance in acceptances]
        try:
            return _NATIVE.longest_hits(lanes, everyone, align, max_tokens)
        except OverflowError:  # a block size or alignment past 64 bits, as a store may claim
            pass
    return scan(acceptances, everyone, align, max_tokens)


def scan(
    acceptances: Sequence[Acceptance], everyone: int, align: int, max_tokens: int
) -> list[tuple[int, int]]:
    """``longest_hits`` in Python: one descending scan over aligned lengths, jumping by bounds."""
    remaining = everyone
    hits: list[tuple[int, int]] = []
    tokens = _settle(acceptances, remaining, max_tokens // align * align, align)
    while remaining and tokens > 0:
        accepted = remaining
        for acceptance in acceptances:
            accepted &= acceptance.accepts(tokens)
            if not accepted:
                break
        if accepted:
            hits.append((tokens, accepted))
            remaining ^= accepted
        if remaining:
            tokens = _settle(acceptances, remaining, tokens - align, align)
    if remaining:
        hits.append((0, remaining))
    return hits


def _settle(acceptances: Sequence[Acceptance], workers: int, tokens: int, align: int) -> int:
    """The longest aligned length, at most ``tokens``, that no group's bound rules out.

    Each bound is idempotent, so when only the first group lowers the length (and alignment
    leaves it), the others have already agreed to it and no second round is needed.
    """
    while tokens > 0:
        bound = tokens
        settled = True
        for position, acceptance in enumerate(acceptances):
            lower = acceptance.bound(workers, bound)
            if lower != bound:
                settled = settled and not position
                bound = lower
        aligned = bound // align * align
        if aligned == tokens or (settled and aligned == bound):
            return aligned
        tokens = aligned
    return 0
