"""Test helpers: what a consumer sees of the engine, built from its events alone."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from hmakv.producer.engine import HybridCacheManager, ModelProfile
from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)
from hmakv.producer.hashing import BlockHasher, external


class CountingIndex:
    """Per group, hash -> resident copies: +1 per store, -1 per removal (KV-EVENTS-FACTS 3b)."""

    def __init__(self, num_groups: int) -> None:
        self.counts: list[Counter[ExternalBlockHash]] = [Counter() for _ in range(num_groups)]
        self.unknown_removals = 0

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.counts[event.group_idx or 0].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(event.group_idx or 0, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for counts in self.counts:
                    counts.clear()

    def is_cached(self, group: int, block_hash: ExternalBlockHash) -> bool:
        return self.counts[group][block_hash] > 0

    def _remove(self, group: int, block_hashes: Sequence[ExternalBlockHash]) -> None:
        counts = self.counts[group]
        for block_hash in block_hashes:
            if counts[block_hash] <= 0:
                self.unknown_removals += 1
                continue
            counts[block_hash] -= 1
            if counts[block_hash] == 0:
                del counts[block_hash]


def resident_counts(manager: HybridCacheManager) -> list[Counter[ExternalBlockHash]]:
    """The engine's own view: copies of each hash per group, from its snapshot."""
    return [
        Counter(event.block_hashes[0] for event in group) for group in manager.resident_blocks()
    ]


def probe_hashes(profile: ModelProfile, token_ids: Sequence[int]) -> list[int]:
    """A router's block hashes for a prompt: recomputed from tokens, as vLLM's wire ints."""
    hasher = BlockHasher(profile.hash_fn, profile.hash_seed)
    size = hash_block_size(profile.groups)
    return [external(h) for h in hasher.block_hashes(token_ids, size)]
