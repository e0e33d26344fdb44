"""The prefix estimates under study, each against what it claims to model, and against the
reference engine's own hit: hmakv's is exact; the group-blind ones miss valid paths and take
invalid ones once sliding-window blocks are evicted while the full-attention blocks stay."""

from __future__ import annotations

import dataclasses

from hmakv.consumers.speculation import SpeculationTtl
from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.engine.profiles import get_profile
from hmakv.producer.engine.scheduler import Scheduler, SyntheticSampler
from hmakv.producer.engine.workloads import ChatWorkload
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVEventBatch,
)
from hmakv.producer.recorder import EventRecorder
from hmakv.routing.cluster import PromptHasher
from hmakv.routing.estimates import (
    HashSetEstimate,
    HmaIndexEstimate,
    Prompt,
    RoutingHistory,
    every_group,
    full_attention,
)

GROUPS = (
    GroupSpec(kind="full_attention", block_size=16),
    GroupSpec(kind="sliding_window", block_size=16, sliding_window=32),
)


def store(hashes: list[int], group: int) -> BlockStored:
    spec = GROUPS[group]
    return BlockStored(
        list(hashes),
        None,
        [],
        16,
        None,
        "GPU",
        None,
        group_idx=group,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )


def remove(hashes: list[int], group: int) -> BlockRemoved:
    return BlockRemoved(list(hashes), "GPU", group_idx=group)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


PROMPT = Prompt(num_tokens=81, block_hashes=(1, 2, 3, 4, 5))  # 5 full blocks; 80 tokens hit


def test_removal_means_gone_drops_a_hash_that_any_group_removes() -> None:
    estimate = HashSetEstimate(2, GROUPS, 16, keep=every_group)
    estimate.observe(0, batch(store([1, 2, 3, 4, 5], 0), store([1, 2, 3, 4, 5], 1)), 0.0)
    assert estimate.hits(PROMPT, 0.0) == [80, 0]
    estimate.observe(0, batch(remove([2], 1)), 0.0)  # a window block's eviction
    assert estimate.hits(PROMPT, 0.0) == [16, 0]


def test_full_attention_only_ignores_every_other_group() -> None:
    estimate = HashSetEstimate(1, GROUPS, 16, keep=full_attention)
    estimate.observe(0, batch(store([1, 2, 3], 1)), 0.0)
    assert estimate.hits(PROMPT, 0.0) == [0]
    estimate.observe(0, batch(store([1, 2, 3, 4, 5], 0), remove([4, 5], 1)), 0.0)
    assert estimate.hits(PROMPT, 0.0) == [80]
    estimate.observe(0, batch(remove([3], 0)), 0.0)
    assert estimate.hits(PROMPT, 0.0) == [32]
    estimate.observe(0, batch(AllBlocksCleared()), 0.0)
    assert estimate.hits(PROMPT, 0.0) == [0]


def test_a_hit_is_whole_blocks_below_the_last_token() -> None:
    estimate = HashSetEstimate(1, GROUPS, 16, keep=every_group)
    estimate.observe(0, batch(store([1, 2, 3, 4, 5], 0)), 0.0)
    assert estimate.hits(Prompt(80, (1, 2, 3, 4, 5)), 0.0) == [64]  # the 80th token is computed


def test_routing_history_holds_what_was_routed_until_its_ttl() -> None:
    history = RoutingHistory(3, 16, ttl=10.0)
    history.routed(1, Prompt(49, (7, 8, 9)), now=5.0)
    assert history.hits(PROMPT, 5.0) == [0, 0, 0]
    assert history.hits(Prompt(65, (7, 8, 9, 10)), 5.0) == [0, 48, 0]
    assert history.hits(Prompt(65, (7, 8, 9, 10)), 15.0) == [0, 0, 0]  # expired
    history.observe(1, batch(remove([7], 0)), 0.0)  # events change nothing
    history.routed(1, Prompt(49, (7, 8, 9)), now=14.0)
    assert history.hits(Prompt(65, (7, 8, 9, 10)), 15.0) == [0, 48, 0]


def test_hmakv_counts_a_window_removal_against_the_window_only() -> None:
    estimate = HmaIndexEstimate(2, GROUPS, 16)
    estimate.observe(0, batch(store([1, 2, 3, 4, 5], 0), store([1, 2, 3, 4, 5], 1)), 0.0)
    estimate.observe(0, batch(remove([1, 2, 3], 1)), 0.0)  # out of window at the end: still a hit
    assert estimate.hits(PROMPT, 0.0) == [80, 0]
    estimate.observe(0, batch(remove([4], 1)), 0.0)  # the window before token 80 is gone
    assert estimate.hits(PROMPT, 0.0) == [0, 0]


def test_against_the_engine_hmakv_is_exact_and_the_group_blind_indexes_err_both_ways() -> None:
    """One reference engine under cache pressure serving chat; after every step each estimate,
    fed the step's events, predicts each conversation's next turn's hit, which the engine's own
    lookup gives. Window blocks are evicted while full-attention blocks stay: removal means gone
    then misses valid paths, full attention only takes paths whose window is gone."""
    profile = dataclasses.replace(get_profile("gpt-oss-like"), num_blocks=160)
    recorder = EventRecorder(profile.groups)
    manager = HybridCacheManager(profile, recorder)
    scheduler = Scheduler(manager, SyntheticSampler(profile.dims.vocab_size), token_budget=256)
    workload = ChatWorkload(seed=5, vocab_size=profile.dims.vocab_size, context_tokens=1024)
    size = hash_block_size(profile.groups)
    hasher = PromptHasher(profile, size)
    estimates = {
        "hmakv": HmaIndexEstimate(1, profile.groups, size),
        "removal": HashSetEstimate(1, profile.groups, size, keep=every_group),
        "full": HashSetEstimate(1, profile.groups, size, keep=full_attention),
    }
    probes: list[tuple[int, ...]] = []
    compared = 0
    errors = {name: {"under": 0, "over": 0} for name in estimates}
    for request in range(160):
        spec = workload.next_request()
        scheduler.add_request(spec.request_id, spec.prompt_token_ids, spec.max_tokens)
        probes = [*probes[-15:], (*spec.prompt_token_ids, 1, 2, 3)]
        for _ in range(4):
            result = scheduler.step()
            for finished in result.finished:
                workload.finished(finished.request_id, finished.output_token_ids)
            for estimate in estimates.values():
                if result.batch is not None:
                    estimate.observe(0, result.batch, 0.0)
            for tokens in probes:
                real = manager.lookup(tokens)
                prompt = hasher.prompt(tokens)
                compared += 1
                for name, estimate in estimates.items():
                    (predicted,) = estimate.hits(prompt, 0.0)
                    if name == "hmakv":
                        assert predicted == real, (request, tokens[:4])
                    elif predicted < real:
                        errors[name]["under"] += 1
                    elif predicted > real:
                        errors[name]["over"] += 1
    assert compared > 2000
    assert errors["removal"]["under"] > 0, errors  # valid paths missed
    assert errors["full"]["over"] > 0, errors  # invalid paths taken


def test_with_speculation_a_routed_prompt_is_held_until_its_ttl() -> None:
    estimate = HmaIndexEstimate(2, GROUPS, 16, speculation=SpeculationTtl(fixed_s=2.0))
    estimate.routed(1, PROMPT, now=10.0)
    assert estimate.hits(PROMPT, 10.5) == [0, 80]  # before any event: the burst stays together
    assert estimate.hits(PROMPT, 12.0) == [0, 0]  # nothing confirmed it
    plain = HmaIndexEstimate(2, GROUPS, 16)
    plain.routed(1, PROMPT, now=10.0)
    assert plain.hits(PROMPT, 10.5) == [0, 0]
