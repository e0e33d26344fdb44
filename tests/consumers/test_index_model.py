"""A brute-force model of the index, and checks of the model itself on hand-worked cases.

Written for clarity, not speed: per worker one Counter per (group, medium), and the hybrid
lookup structured as vLLM structures it (``HybridKVCacheCoordinator.find_longest_cache_hit``):
each group's own finder, scanning the way vLLM's manager for that kind scans, repeated until the
length stops changing. The index computes the same answer differently (bitsets over all workers,
one descending scan), so the property and trace tests compare the two.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hmakv.consumers.index import DEFAULT_TIER_WEIGHTS, ApplyOutcome
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import BlockRemoved, BlockStored, ExternalBlockHash, GroupSpec

Finder = Callable[[int], int]
IsCached = Callable[[int], bool]

FULL_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
WINDOW_KINDS = {"sliding_window", "sliding_window_mla"}


def find_full(is_cached: IsCached, max_len: int, block: int, align: int) -> int:
    """Left to right; a missing block ends the chain."""
    blocks = 0
    while blocks < max_len // block and is_cached(blocks):
        blocks += 1
    hit = blocks * block
    return hit - hit % align


def find_window(is_cached: IsCached, max_len: int, block: int, align: int, window: int) -> int:
    """Right to left for a run of the trailing blocks the window needs, ending aligned."""
    needed = max(1, math.ceil((window - 1) / block))
    run = 0
    for i in range(max_len // block - 1, -1, -1):
        if not is_cached(i):
            run = 0
            continue
        if run == 0 and (i + 1) * block % align:
            continue
        run += 1
        if run >= needed:
            return (i + run) * block
    hit = run * block
    while hit % align:
        hit -= block
    return hit


def find_state(is_cached: IsCached, max_len: int, block: int, align: int) -> int:
    """Right to left for the last aligned state block."""
    for i in range(max_len // block - 1, -1, -1):
        if is_cached(i) and (i + 1) * block % align == 0:
            return (i + 1) * block
    return 0


def find_chunk(is_cached: IsCached, max_len: int, block: int, chunk: int, align: int) -> int:
    """The longest aligned length whose current chunk is cached; blocks before it are skipped.

    With one group (``align == block``) this is vLLM's scan from the chunk's start. Beside
    groups of a larger block size a hit must be aligned too, and an aligned length short of the
    chunk's start lies in an earlier chunk, whose blocks it then needs.
    """
    for length in range(max_len - max_len % align, 0, -align):
        start = length // chunk * chunk // block
        if all(is_cached(i) for i in range(start, length // block)):
            return length
    return 0


def hybrid_hit(finders: Sequence[Finder], max_len: int) -> int:
    """vLLM's fixed point: every group cuts the candidate until no group cuts it further."""
    hit = max_len
    while True:
        current = hit
        for finder in finders:
            current = finder(current)
        if current >= hit:
            return hit
        hit = current


@dataclass
class ModelWorker:
    epoch: int = 0
    health: str = "live"
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    last_seq: dict[int, int] = field(default_factory=dict)
    next_event: dict[int, int] = field(default_factory=dict)
    held: dict[tuple[int, str], Counter[ExternalBlockHash]] = field(default_factory=dict)


@dataclass
class ModelCounters:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    restarts: int = 0
    anomalies: int = 0
    partial_evictions: int = 0
    duplicate_copies: int = 0
    duplicates_ignored: int = 0
    stale_epoch_ignored: int = 0
    sizeless_stores: int = 0


class ReferenceIndex:
    """The model. ``counting=False`` keeps plain sets; ``removal_means_gone`` drops a removed
    hash from every group of the worker: the two simplifications peers make."""

    def __init__(
        self,
        hash_block_size: int = 16,
        tier_weights: Mapping[str, float] | None = None,
        *,
        counting: bool = True,
        removal_means_gone: bool = False,
    ) -> None:
        self.hash_block_size = hash_block_size
        weights = DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights
        self.tiers = sorted(weights.items(), key=lambda tier: -tier[1])
        self.counting = counting
        self.removal_means_gone = removal_means_gone
        self.workers: dict[str, ModelWorker] = {}
        self.counters = ModelCounters()

    # applying

    def worker(self, name: str) -> ModelWorker:
        return self.workers.setdefault(name, ModelWorker())

    def set_catalog(self, name: str, groups: Mapping[int, GroupSpec]) -> None:
        self.worker(name).groups = dict(groups)

    def apply(self, record: EventRecord) -> ApplyOutcome:
        worker = self.worker(record.worker)
        if record.epoch < worker.epoch:
            self.counters.stale_epoch_ignored += 1
            return ApplyOutcome.STALE_EPOCH
        if record.epoch > worker.epoch:
            worker.held = {}
            worker.last_seq = {}
            worker.next_event = {}
            worker.epoch = record.epoch
            self.counters.restarts += 1
        group = record.group_idx
        # Events are numbered by (seq, position in the batch's group); each applies once, and
        # nothing before the newest seq seen.
        last_seq = worker.last_seq.get(group, -2)
        applied = worker.next_event.get(group, 0) if record.seq == last_seq else 0
        positions = range(record.first_event, record.first_event + len(record.events))
        new = [e for p, e in zip(positions, record.events, strict=True) if p >= applied]
        if record.seq < last_seq or (record.seq == last_seq and not new):
            self.counters.duplicates_ignored += 1
            return ApplyOutcome.DUPLICATE
        worker.last_seq[group] = record.seq
        worker.next_event[group] = positions.stop
        for event in new:
            if isinstance(event, BlockStored):
                self._learn(worker, group, event)
                self._store(worker, group, event.medium or "GPU", event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, group, event.medium or "GPU", event.block_hashes)
            else:
                for key in [key for key in worker.held if key[0] == group]:
                    del worker.held[key]
                self.counters.cleared += 1
        return ApplyOutcome.APPLIED

    def _learn(self, worker: ModelWorker, group: int, event: BlockStored) -> None:
        window = event.kv_cache_spec_sliding_window
        if event.block_size <= 0 or (window is not None and window <= 0):
            self.counters.sizeless_stores += 1  # no group has such sizes: nothing to learn
            return
        known = worker.groups.get(group)
        if event.kv_cache_spec_kind is None and known is not None:
            return
        learned = GroupSpec(
            event.kv_cache_spec_kind or "unknown",
            event.block_size,
            event.kv_cache_spec_sliding_window,
            known.chunk_size if known else None,
        )
        if known is None or (known.kind, known.block_size, known.sliding_window) != (
            learned.kind,
            learned.block_size,
            learned.sliding_window,
        ):
            worker.groups[group] = learned

    def _store(
        self, worker: ModelWorker, group: int, medium: str, hashes: Sequence[ExternalBlockHash]
    ) -> None:
        held = worker.held.setdefault((group, medium), Counter())
        for block_hash in hashes:
            self.counters.stored += 1
            if held[block_hash]:
                self.counters.duplicate_copies += 1
            held[block_hash] = held[block_hash] + 1 if self.counting else 1

    def _remove(
        self, worker: ModelWorker, group: int, medium: str, hashes: Sequence[ExternalBlockHash]
    ) -> None:
        held = worker.held.setdefault((group, medium), Counter())
        spec = worker.groups.get(group)
        is_window = spec is not None and spec.kind in WINDOW_KINDS
        for block_hash in hashes:
            if held[block_hash] <= 0:
                self.counters.anomalies += 1
                continue
            self.counters.removed += 1
            if is_window and any(
                s.kind in FULL_KINDS and worker.held.get((g, medium), Counter())[block_hash] > 0
                for g, s in worker.groups.items()
            ):
                self.counters.partial_evictions += 1
            held[block_hash] = held[block_hash] - 1 if self.counting else 0
            if self.removal_means_gone:
                for (_, other_medium), other in worker.held.items():
                    if other_medium == medium:
                        other[block_hash] = 0

    def resident(self, name: str) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for (group, medium), held in self.workers[name].held.items():
            count = sum(1 for copies in held.values() if copies > 0)
            if count:
                out.setdefault(group, {})[medium] = count
        return out

    # scoring

    def _is_cached(
        self, name: str, group: int, media: Sequence[str], hashes: Sequence[ExternalBlockHash]
    ) -> Callable[[int, int], bool]:
        worker = self.workers[name]

        def is_cached(block: int, step: int) -> bool:
            block_hash = hashes[(block + 1) * step - 1]
            return any(
                worker.held.get((group, medium), Counter())[block_hash] > 0 for medium in media
            )

        return is_cached

    def _finder(
        self,
        name: str,
        group: int,
        spec: GroupSpec,
        align: int,
        media: Sequence[str],
        hashes: Sequence[ExternalBlockHash],
    ) -> Finder | None:
        step = spec.block_size // self.hash_block_size
        cached = self._is_cached(name, group, media, hashes)

        def is_cached(block: int) -> bool:
            return cached(block, step)

        size = spec.block_size
        if spec.kind in {"encoder_only_attention", "cross_attention"}:
            return None
        if spec.kind in WINDOW_KINDS and spec.sliding_window:
            window = spec.sliding_window
            return lambda max_len: find_window(is_cached, max_len, size, align, window)
        if spec.kind == "mamba":
            return lambda max_len: find_state(is_cached, max_len, size, align)
        if spec.kind == "chunked_local_attention" and spec.chunk_size:
            chunk = spec.chunk_size
            return lambda max_len: find_chunk(is_cached, max_len, size, chunk, align)
        return lambda max_len: find_full(is_cached, max_len, size, align)

    def _max_len(self, hashes: Sequence[ExternalBlockHash], num_tokens: int) -> int:
        return max(0, min(num_tokens - 1, len(hashes) * self.hash_block_size))

    def _cacheable(self, name: str) -> dict[int, GroupSpec]:
        return {
            group: spec
            for group, spec in self.workers[name].groups.items()
            if spec.kind not in {"encoder_only_attention", "cross_attention"}
        }

    def catalog_ok(self, name: str) -> bool:
        groups = self._cacheable(name)
        return bool(groups) and all(
            spec.block_size % self.hash_block_size == 0 for spec in groups.values()
        )

    def hit_tokens(
        self,
        name: str,
        hashes: Sequence[ExternalBlockHash],
        num_tokens: int,
        media: Sequence[str] = ("GPU",),
        only_groups: Sequence[int] | None = None,
    ) -> int:
        if not self.catalog_ok(name):
            return 0
        groups = self._cacheable(name)
        align = math.lcm(*(spec.block_size for spec in groups.values()))
        if only_groups is not None:
            groups = {g: s for g, s in groups.items() if g in only_groups}
        finders = [
            finder
            for group, spec in sorted(groups.items(), key=lambda gs: gs[1].kind not in FULL_KINDS)
            if (finder := self._finder(name, group, spec, align, media, hashes))
        ]
        return hybrid_hit(finders, self._max_len(hashes, num_tokens))

    def group_hit_tokens(
        self, name: str, hashes: Sequence[ExternalBlockHash], num_tokens: int
    ) -> dict[int, int]:
        if not self.catalog_ok(name):
            return {}
        return {
            group: self.hit_tokens(name, hashes, num_tokens, only_groups=[group])
            for group in self._cacheable(name)
        }

    def tier_hit_tokens(
        self, name: str, hashes: Sequence[ExternalBlockHash], num_tokens: int
    ) -> dict[str, int]:
        media = [medium for medium, _ in self.tiers]
        return {
            medium: self.hit_tokens(name, hashes, num_tokens, media[: i + 1])
            for i, medium in enumerate(media)
        }

    def weighted_tokens(
        self, name: str, hashes: Sequence[ExternalBlockHash], num_tokens: int
    ) -> float:
        tiers = self.tier_hit_tokens(name, hashes, num_tokens)
        total, faster = 0.0, 0
        for medium, weight in self.tiers:
            total += weight * (tiers[medium] - faster)
            faster = tiers[medium]
        return total

    def group_blind_hit_tokens(
        self, name: str, hashes: Sequence[ExternalBlockHash], num_tokens: int
    ) -> int:
        worker = self.workers[name]
        anywhere = {
            block_hash
            for (_, medium), held in worker.held.items()
            if medium == "GPU"
            for block_hash, copies in held.items()
            if copies > 0
        }
        blocks = 0
        limit = self._max_len(hashes, num_tokens) // self.hash_block_size
        while blocks < limit and hashes[blocks] in anywhere:
            blocks += 1
        return blocks * self.hash_block_size


# ---------------------------------------------------------------- checks of the model itself


def cached_blocks(*blocks: int) -> IsCached:
    held = set(blocks)
    return lambda block: block in held


def test_model_gpt_oss_example() -> None:
    """KV-EVENTS-FACTS: W=128, B=16 needs 8 trailing SWA blocks; 20 blocks need 12..19."""
    full = cached_blocks(*range(25))
    window = cached_blocks(*range(12, 20))
    finders: list[Finder] = [
        lambda n: find_full(full, n, 16, 16),
        lambda n: find_window(window, n, 16, 16, 128),
    ]
    assert hybrid_hit(finders, 24 * 16) == 20 * 16
    assert hybrid_hit(finders, 19 * 16) == 0  # no run of 8 ends at or before block 18


def test_model_window_needs_trailing_run_or_leading_prefix() -> None:
    assert find_window(cached_blocks(0, 1), 10 * 16, 16, 16, 128) == 2 * 16
    assert find_window(cached_blocks(*range(2, 10)), 10 * 16, 16, 16, 128) == 10 * 16
    assert find_window(cached_blocks(*range(3, 10)), 10 * 16, 16, 16, 128) == 0


def test_model_state_and_chunk_finders() -> None:
    assert find_state(cached_blocks(1, 4), 10 * 4, 4, 8) == 2 * 4  # block 4 ends unaligned
    assert find_chunk(cached_blocks(2), 15, 4, 8, 4) == 12  # vLLM's docstring example 1
    assert find_chunk(cached_blocks(), 16, 4, 8, 4) == 16  # example 2: whole chunk skipped
    # Beside a group of block size 8: 12 is not aligned, and 8 needs blocks 0 and 1.
    assert find_chunk(cached_blocks(), 13, 4, 12, 8) == 0
    assert find_chunk(cached_blocks(0, 1), 13, 4, 12, 8) == 8
