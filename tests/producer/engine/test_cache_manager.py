"""Hand-worked cases of the hybrid cache manager: tables, events and hits, block by block."""

from __future__ import annotations

import dataclasses
from collections import Counter

from engine_replay import CountingIndex, probe_hashes, resident_counts

from hmakv.producer.engine import Admission, HybridCacheManager, ModelProfile, get_profile
from hmakv.producer.engine.hit_rule import find_longest_cache_hit
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from hmakv.producer.recorder import EventRecorder


def make(name: str, num_blocks: int | None = None) -> tuple[HybridCacheManager, ModelProfile]:
    profile = get_profile(name)
    if num_blocks is not None:
        profile = dataclasses.replace(profile, num_blocks=num_blocks)
    return HybridCacheManager(profile, EventRecorder(profile.groups)), profile


def events_of(batch: KVEventBatch | None) -> list[KVEvent]:
    assert batch is not None, "the step recorded no event"
    return batch.events


def stores(
    events: list[KVEvent],
) -> list[tuple[int | None, list[ExternalBlockHash], ExternalBlockHash | None]]:
    return [
        (e.group_idx, e.block_hashes, e.parent_block_hash)
        for e in events
        if isinstance(e, BlockStored)
    ]


def removals(events: list[KVEvent]) -> list[tuple[int | None, list[ExternalBlockHash]]]:
    return [(e.group_idx, e.block_hashes) for e in events if isinstance(e, BlockRemoved)]


def test_gpt_oss_window_frees_sliding_blocks_whose_eviction_keeps_the_full_copies() -> None:
    manager, profile = make("gpt-oss-like", num_blocks=47)
    prompt = list(range(1000, 1321))  # 20 full blocks and one token
    hashes = probe_hashes(profile, prompt)
    assert manager.admit("a", prompt) == Admission(num_cached_tokens=0, num_scheduled_tokens=321)
    events = events_of(manager.end_step())
    assert stores(events) == [(0, hashes, None), (1, hashes, None)]
    full, sliding = events
    assert isinstance(full, BlockStored) and isinstance(sliding, BlockStored)
    assert full.token_ids == prompt[:320] and full.extra_keys == [None] * 20
    assert (full.block_size, full.kv_cache_spec_kind) == (16, "full_attention")
    assert (sliding.kv_cache_spec_kind, sliding.kv_cache_spec_sliding_window) == (
        "sliding_window",
        128,
    )
    assert manager.block_table("a") == (tuple(range(1, 22)), tuple(range(22, 43)))

    # One decode step: token 322's window no longer reaches sliding blocks 0..11. They are
    # freed, keep their hashes and announce nothing.
    manager.append_tokens("a", [7])
    assert manager.schedule("a") == 1
    assert manager.end_step() is None
    assert manager.block_table("a")[1] == (0,) * 12 + tuple(range(34, 43))
    assert manager.num_free_blocks == 4 + 12
    assert manager.lookup(prompt) == 320

    # B uses the 4 never-used blocks, then the freed sliding blocks, the rightmost first.
    assert manager.admit("b", list(range(5000, 5040))) is not None
    events = events_of(manager.end_step())
    assert removals(events) == [(1, [hashes[11]]), (1, [hashes[10]])]
    assert manager.block_table("b") == ((43, 44, 45), (46, 33, 32))
    # The full copies of blocks 10 and 11 stay, and a 20-block hit reads only sliding 12..19.
    assert manager.lookup(prompt) == 320
    # A 12-block prefix needs sliding 4..11; without 10 and 11 the window must end at block 10.
    assert manager.lookup(prompt[:193]) == 160


def test_reset_clears_every_group_only_once_nothing_is_held() -> None:
    manager, _ = make("gpt-oss-like")
    prompt = list(range(100))
    manager.admit("a", prompt)
    manager.end_step()
    assert manager.reset() is False
    assert manager.end_step() is None
    manager.finish("a")
    assert manager.reset() is True
    assert events_of(manager.end_step()) == [AllBlocksCleared()]
    assert manager.resident_blocks() == ([], [])
    assert manager.lookup(prompt) == 0


def test_two_requests_computing_one_block_hold_two_copies_announced_and_removed_apart() -> None:
    manager, profile = make("gpt-oss-like", num_blocks=7)
    prompt = list(range(32))
    h0, h1 = probe_hashes(profile, prompt)
    index = CountingIndex(len(profile.groups))

    assert manager.admit("a", prompt) == Admission(0, 32)
    # The last token is always recomputed, so b hits block 0 only and computes block 1 again.
    assert manager.admit("b", prompt) == Admission(16, 16)
    events = events_of(manager.end_step())
    index.apply(events)
    assert stores(events) == [
        (0, [h0, h1], None),
        (1, [h0, h1], None),
        (0, [h1], h0),
        (1, [h1], h0),
    ]
    assert resident_counts(manager) == [Counter({h0: 1, h1: 2})] * 2 == index.counts

    manager.finish("a")
    manager.finish("b")
    # The oldest free blocks are a's copies of h1 (a finished first, tail first).
    manager.admit("c", list(range(100, 116)))
    events = events_of(manager.end_step())
    index.apply(events)
    assert removals(events) == [(0, [h1]), (1, [h1])]
    # b's copies still serve a 2-block hit; a set-based index would have dropped h1 already.
    probe = [*prompt, 999]
    assert manager.lookup(probe) == 32
    assert (
        find_longest_cache_hit(profile.groups, probe_hashes(profile, probe), 32, index.is_cached)
        == 32
    )

    manager.admit("d", list(range(200, 216)))
    events = events_of(manager.end_step())
    index.apply(events)
    assert removals(events) == [(0, [h1]), (0, [h0])]
    assert index.counts == resident_counts(manager)
    assert not index.is_cached(0, h1) and index.is_cached(1, h1)
    assert index.unknown_removals == 0


def test_mamba_prefill_stops_on_state_boundaries_and_caches_those_states() -> None:
    manager, profile = make("mamba-hybrid-like")
    prompt = list(range(300))
    hashes = probe_hashes(profile, prompt)  # 16-token hashes; state block i is hashes[4i + 3]
    assert manager.admit("a", prompt) == Admission(0, 256)
    # A state cached in this step cannot be hit before the next one: vLLM defers the request.
    assert manager.admit("b", prompt) is None
    events = events_of(manager.end_step())
    assert stores(events) == [(0, hashes[:16], None), (1, [hashes[15]], hashes[11])]
    state = events[1]
    assert isinstance(state, BlockStored) and state.token_ids == prompt[192:256]
    assert (state.block_size, state.kv_cache_spec_kind) == (64, "mamba")
    state_block = manager.block_table("a")[1][3]
    assert manager.block_table("a")[1] == (0, 0, 0, state_block)

    assert manager.admit("b", prompt) == Admission(256, 44)
    assert manager.block_table("b")[1][:4] == (0, 0, 0, state_block)
    assert manager.schedule("a") == 44
    manager.append_tokens("a", [1])
    assert manager.schedule("a") == 1
    # Once the next state is written, a's old state block is released but stays cached.
    assert manager.block_table("a")[1][:4] == (0, 0, 0, 0)
    assert manager.lookup(prompt) == 256


def test_chunked_local_attention_frees_past_chunks_and_hits_without_them() -> None:
    manager, profile = make("chunked-local-like", num_blocks=15)
    prompt = list(range(100))
    hashes = probe_hashes(profile, prompt)
    manager.admit("a", prompt)
    manager.end_step()
    manager.append_tokens("a", [1])
    assert manager.schedule("a") == 1
    # Token 101 attends to its chunk (64..127) only: blocks 0..3 are freed.
    assert manager.block_table("a")[1][:4] == (0, 0, 0, 0)
    assert manager.end_step() is None

    manager.admit("b", list(range(500, 532)))
    events = events_of(manager.end_step())
    assert removals(events) == [
        (1, [hashes[3]]),
        (1, [hashes[2]]),
        (1, [hashes[1]]),
        (1, [hashes[0]]),
    ]
    # A hit inside the second chunk reads only that chunk's blocks.
    assert manager.lookup(prompt) == 96
    assert manager.lookup(prompt[:70]) == 64


def test_unequal_block_sizes_cache_only_the_sliding_blocks_a_hit_can_read() -> None:
    manager, profile = make("mixed-block-like")  # full: 64-token blocks; sliding 32, 16-token
    prompt = list(range(257))
    hashes = probe_hashes(profile, prompt)
    manager.admit("a", prompt)
    events = events_of(manager.end_step())
    # Hits end on 64-token boundaries and a 32-token window reads the 2 blocks before one.
    assert stores(events) == [
        (0, hashes[3::4], None),
        (1, hashes[2:4], hashes[1]),
        (1, hashes[6:8], hashes[5]),
        (1, hashes[10:12], hashes[9]),
        (1, hashes[14:16], hashes[13]),
    ]
    full, first_run = events[:2]
    assert isinstance(full, BlockStored) and isinstance(first_run, BlockStored)
    assert (full.block_size, len(full.token_ids), full.extra_keys) == (64, 256, [None] * 4)
    assert (first_run.block_size, first_run.token_ids) == (16, prompt[32:64])
    assert manager.lookup(prompt) == 256


def test_lora_and_salt_keys_travel_on_stores_and_separate_hits() -> None:
    manager, _ = make("gpt-oss-like")
    prompt = list(range(64))
    manager.admit("a", prompt, lora_name="adapter", cache_salt="tenant-1")
    stored = events_of(manager.end_step())[0]
    assert isinstance(stored, BlockStored) and stored.lora_name == "adapter"
    assert stored.extra_keys == [("adapter", "tenant-1"), ("adapter",), ("adapter",), ("adapter",)]
    assert manager.lookup(prompt) == 0
    assert manager.lookup(prompt, lora_name="adapter") == 0
    assert manager.lookup(prompt, lora_name="adapter", cache_salt="tenant-1") == 48


def test_raw_digest_mode_announces_whole_digests() -> None:
    profile = get_profile("gpt-oss-like")
    manager = HybridCacheManager(profile, EventRecorder(profile.groups), int_hashes=False)
    manager.admit("a", list(range(40)))
    stored = events_of(manager.end_step())[0]
    assert isinstance(stored, BlockStored)
    assert [len(h) for h in stored.block_hashes if isinstance(h, bytes)] == [32, 32]


def test_out_of_blocks_admission_holds_nothing_and_running_requests_report_it() -> None:
    manager, _ = make("gpt-oss-like", num_blocks=9)  # 8 usable blocks: 4 per group
    assert manager.admit("big", list(range(100))) is None  # needs 7 per group
    assert manager.num_free_blocks == 8 and manager.end_step() is None
    manager.admit("a", list(range(64)))  # 4 blocks per group
    manager.append_tokens("a", [1])
    assert manager.schedule("a") is None  # token 65 needs a fifth block per group
    assert manager.progress("a").num_computed_tokens == 64
