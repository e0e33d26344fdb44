"""The engine's events are enough to know its cache: replay them and you hold what it holds.

A seeded chat-like workload (shared system prompts, repeated prompts, chunked prefill, decode,
finishes) runs on a pool small enough to evict all the time. After every step, a consumer-side
index fed only the step's batches must hold exactly the engine's cached copies per group, and
the hit rule over that index must give the hit the engine itself would grant.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from engine_replay import CountingIndex, probe_hashes, resident_counts

from hmakv.producer.engine import PROFILES, HybridCacheManager, ModelProfile, get_profile
from hmakv.producer.engine.hit_rule import alignment_tokens, find_longest_cache_hit
from hmakv.producer.events import BlockRemoved, BlockStored, KVEvent
from hmakv.producer.recorder import EventRecorder


def prompt_scale(profile: ModelProfile) -> int:
    """Prompts long enough to leave every window behind and to span several aligned segments."""
    reach = max((g.sliding_window or g.chunk_size or 0) for g in profile.groups)
    return max(2 * alignment_tokens(profile.groups), reach + 32)


@dataclass
class Coverage:
    """What the workload exercised, so a passing run cannot be a vacuous one."""

    removals: int = 0
    duplicate_copies: int = 0
    removed_while_other_group_holds: int = 0
    probes_with_hits: int = 0


@dataclass
class ChatWorkload:
    profile: ModelProfile
    rng: random.Random
    scale: int
    prefixes: list[list[int]] = field(default_factory=list)
    past_prompts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefixes = [
            self.tokens(self.rng.randint(self.scale // 2, 2 * self.scale)) for _ in range(3)
        ]

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(1000) for _ in range(count)]

    def prompt(self) -> list[int]:
        if self.past_prompts and self.rng.random() < 0.25:
            return list(self.rng.choice(self.past_prompts))  # same prompt again: duplicate blocks
        prompt = self.rng.choice(self.prefixes) + self.tokens(self.rng.randint(1, self.scale))
        self.past_prompts.append(prompt)
        return prompt

    def probe(self) -> list[int]:
        source = self.rng.choice(self.past_prompts or self.prefixes)
        return source[: self.rng.randint(1, len(source))] + self.tokens(self.rng.randint(0, 20))


def pressured(profile: ModelProfile, scale: int) -> ModelProfile:
    """A pool holding about two of the longest requests: every few steps something is evicted."""
    per_request = len(profile.groups) * (3 * scale // 16 + 2)
    return dataclasses.replace(profile, num_blocks=2 * per_request + 1)


def run_chat_workload(name: str, seed: int, steps: int) -> Coverage:
    base = get_profile(name)
    scale = prompt_scale(base)
    profile = pressured(base, scale)
    manager = HybridCacheManager(profile, EventRecorder(profile.groups))
    index = CountingIndex(len(profile.groups))
    rng = random.Random(seed)
    workload = ChatWorkload(profile, rng, scale)
    coverage = Coverage()
    running: dict[str, int] = {}  # request id -> decode tokens left
    for step in range(steps):
        budget = rng.choice([None, scale // 2 + 16])
        for request_id in list(running):  # running requests first, as vLLM's scheduler does
            if manager.schedule(request_id, token_budget=budget) is None:
                manager.finish(request_id)  # out of blocks: the scheduler drops (preempts) it
                del running[request_id]
        for arrival in range(rng.randint(0, 2) if len(running) < 4 else 0):
            request_id = f"s{step}-{arrival}"
            if manager.admit(request_id, workload.prompt(), token_budget=budget) is not None:
                running[request_id] = rng.choice([0, 1, 3, 8, 20])  # decode tokens
        batch = manager.end_step()
        events: list[KVEvent] = batch.events if batch is not None else []
        index.apply(events)
        tally(coverage, events, index)
        check_replay_matches_engine(manager, index, profile, workload, coverage)
        sample_and_finish(manager, running, rng)
    return coverage


def sample_and_finish(
    manager: HybridCacheManager, running: dict[str, int], rng: random.Random
) -> None:
    for request_id, left in list(running.items()):
        progress = manager.progress(request_id)
        if progress.num_computed_tokens < progress.num_tokens:
            continue  # still in prefill
        if left == 0:
            manager.finish(request_id)
            del running[request_id]
        else:
            manager.append_tokens(request_id, [rng.randrange(1000)])
            running[request_id] = left - 1


def tally(coverage: Coverage, events: list[KVEvent], index: CountingIndex) -> None:
    for event in events:
        if isinstance(event, BlockRemoved):
            coverage.removals += 1
            group = event.group_idx or 0
            if any(
                index.is_cached(other, event.block_hashes[0])
                for other in range(len(index.counts))
                if other != group
            ):
                coverage.removed_while_other_group_holds += 1
    coverage.duplicate_copies += sum(
        1 for counts in index.counts for copies in counts.values() if copies > 1
    )


def check_replay_matches_engine(
    manager: HybridCacheManager,
    index: CountingIndex,
    profile: ModelProfile,
    workload: ChatWorkload,
    coverage: Coverage,
) -> None:
    assert index.unknown_removals == 0
    assert index.counts == resident_counts(manager)
    snapshot = CountingIndex(len(profile.groups))
    for group_events in manager.resident_blocks():
        snapshot.apply(group_events)
    assert snapshot.counts == index.counts
    for _ in range(3):
        probe = workload.probe()
        engine_hit = manager.lookup(probe)
        index_hit = find_longest_cache_hit(
            profile.groups, probe_hashes(profile, probe), len(probe) - 1, index.is_cached
        )
        assert index_hit == engine_hit
        coverage.probes_with_hits += engine_hit > 0


STEPS = {"gemma3-like": 30}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_replayed_events_reproduce_the_engine_cache_at_every_step(name: str) -> None:
    coverage = run_chat_workload(name, seed=1, steps=STEPS.get(name, 60))
    assert coverage.removals > 0
    assert coverage.duplicate_copies > 0
    assert coverage.removed_while_other_group_holds > 0
    assert coverage.probes_with_hits > 0


def test_snapshot_events_carry_the_group_catalog() -> None:
    profile = get_profile("swa-small")
    manager = HybridCacheManager(profile, EventRecorder(profile.groups))
    manager.admit("a", list(range(100)))
    for group, events in enumerate(manager.resident_blocks()):
        assert all(isinstance(e, BlockStored) for e in events)
        assert Counter(e.group_idx for e in events) == Counter({group: 6})
        assert {e.kv_cache_spec_sliding_window for e in events} == {
            profile.groups[group].sliding_window
        }
