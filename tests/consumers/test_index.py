"""The index on hand-worked cases: the hit rule per group kind, counting, idempotency, clears,
tiers, health and snapshots. The random and vLLM-trace checks are in test_index_*.py."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
from test_index_model import ReferenceIndex

from hmakv.consumers.index import MAX_MEDIA, ApplyOutcome, IndexCounters, KVIndex
from hmakv.kvlog.answers import WorkerHit
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

B = 16
FULL = GroupSpec("full_attention", B)
SWA_128 = GroupSpec("sliding_window", B, sliding_window=128)


def stored(
    hashes: Sequence[ExternalBlockHash],
    group: int,
    spec: GroupSpec = FULL,
    medium: str | None = "GPU",
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=spec.block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )


def removed(hashes: Sequence[ExternalBlockHash], group: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group)


def record(
    seq: int, group: int, *events: KVEvent, worker: str = "w0", epoch: int = 0
) -> EventRecord:
    return EventRecord(worker, epoch, seq, 0.0, group, list(events))


def only(scores: list[WorkerHit], worker: str = "w0") -> WorkerHit:
    return next(s for s in scores if s.worker == worker)


PROMPT = list(range(100, 125))  # 25 blocks of 16 tokens


def gpt_oss_like() -> KVIndex:
    """Full attention holds blocks 0..24, the 128-token window group only blocks 12..19."""
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored(PROMPT, 0)))
    index.apply(record(0, 1, stored(PROMPT[12:20], 1, SWA_128)))
    return index


def test_gpt_oss_hit_needs_full_prefix_and_the_trailing_window_blocks() -> None:
    """KV-EVENTS-FACTS: W=128, B=16 -> 8 trailing SWA blocks; a 20-block hit needs 12..19."""
    score = only(gpt_oss_like().score(PROMPT, len(PROMPT) * B))
    assert (score.hit_tokens, score.hit_blocks) == (20 * B, 20)
    assert score.group_hit_tokens == {0: 24 * B, 1: 20 * B}  # at most num_tokens - 1
    # Ignoring groups, every block is "cached" somewhere: the blind answer over-reports.
    assert score.group_blind_hit_tokens == 24 * B


def test_sliding_window_removal_keeps_the_full_attention_copy() -> None:
    index = gpt_oss_like()
    index.apply(record(1, 1, removed([PROMPT[12]], 1)))
    score = only(index.score(PROMPT, len(PROMPT) * B))
    assert score.hit_tokens == 0  # no run of 8 window blocks left, block 0 not in the window
    assert score.group_hit_tokens[0] == 24 * B
    assert index.counters.partial_evictions == 1
    assert index.workers()[0].resident == {0: {"GPU": 25}, 1: {"GPU": 7}}


def test_hit_stops_one_token_short_of_the_prompt() -> None:
    index = gpt_oss_like()
    assert only(index.score(PROMPT[:20], 20 * B + 1)).hit_tokens == 20 * B
    assert only(index.score(PROMPT[:20], 20 * B)).hit_tokens == 0  # 19 blocks: window 11..18


def test_duplicate_copies_stay_resident_until_the_last_removal() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1, 2], 0), stored([1], 0)))
    index.apply(record(1, 0, removed([1], 0)))
    assert only(index.score([1, 2], 3 * B)).hit_tokens == 2 * B
    index.apply(record(2, 0, removed([1, 1], 0)))
    assert only(index.score([1, 2], 3 * B)).hit_tokens == 0
    counters = index.counters
    assert (counters.stored, counters.duplicate_copies) == (3, 1)
    assert (counters.removed, counters.anomalies) == (2, 1)  # the third removal held nothing


def test_replayed_records_change_nothing() -> None:
    index = KVIndex(hash_block_size=B)
    records = [record(seq, 0, stored([seq], 0)) for seq in range(4)]
    records += [record(4, 0, removed([0], 0))]
    for each in records:
        assert index.apply(each) is ApplyOutcome.APPLIED
    before = index.snapshot()
    # The bridge delivers at least once: an overlap of already applied records comes again.
    assert {index.apply(each) for each in records[1:]} == {ApplyOutcome.DUPLICATE}
    assert index.counters.duplicates_ignored == 4
    assert KVIndex.restore(index.snapshot()).workers() == KVIndex.restore(before).workers()
    assert only(index.score([0, 1], 3 * B)).hit_tokens == 0


def test_seqs_are_tracked_per_group() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(7, 1, stored([1], 1, SWA_128)))
    assert index.apply(record(3, 0, stored([1], 0))) is ApplyOutcome.APPLIED
    assert index.workers()[0].last_seq == {0: 3, 1: 7}


def split(seq: int, group: int, events: list[KVEvent], *sizes: int) -> list[EventRecord]:
    """The batch's records for one group as the bridge splits them, parts of these sizes."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        msgspec.structs.replace(
            record(seq, group, *events[start : start + size]), first_event=start
        )
        for start, size in zip(starts, sizes, strict=True)
    ]


def test_a_split_seq_is_applied_part_by_part_each_event_once() -> None:
    """A group's events split over parts (a snapshot too large for one Kafka record), sent
    again after a bridge restart, split the same way or elsewhere (another size limit)."""
    events: list[KVEvent] = [stored([n], 0) for n in range(6)]
    index = KVIndex(hash_block_size=B)
    first_send = split(4, 0, events, 2, 2, 2)
    assert [index.apply(p) for p in first_send[:2]] == [ApplyOutcome.APPLIED] * 2
    assert only(index.score(list(range(6)), 7 * B)).hit_tokens == 4 * B
    restored = KVIndex.restore(index.snapshot())
    for each in (index, restored):
        # the bridge died before the last part; another limit splits the batch 3 + 3 now
        outcomes = [each.apply(p) for p in split(4, 0, events, 3, 3)]
        assert outcomes == [ApplyOutcome.DUPLICATE, ApplyOutcome.APPLIED]
        assert each.counters.duplicate_copies == 0  # events 2 and 3 were not stored twice
        assert only(each.score(list(range(6)), 7 * B)).hit_tokens == 6 * B
        assert {each.apply(p) for p in first_send} == {ApplyOutcome.DUPLICATE}
        assert each.apply(record(4, 0, removed([0], 0))) is ApplyOutcome.DUPLICATE
        assert each.apply(record(5, 0, removed([0], 0))) is ApplyOutcome.APPLIED
        assert only(each.score(list(range(6)), 7 * B)).hit_tokens == 0


def test_a_snapshot_saved_before_records_were_split_restores() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(4, 0, stored([1], 0)))
    saved = msgspec.msgpack.decode(index.snapshot())
    for worker in saved["workers"]:
        del worker[-1]  # next_event, the one field such a snapshot lacks
    restored = KVIndex.restore(msgspec.msgpack.encode(saved))
    assert restored.workers() == index.workers()
    assert restored.apply(record(4, 0, removed([1], 0))) is ApplyOutcome.DUPLICATE
    assert restored.apply(record(5, 0, removed([1], 0))) is ApplyOutcome.APPLIED


def test_a_snapshot_that_kept_whole_digests_restores_them_as_ints() -> None:
    """Snapshots from before the index kept every hash as an int hold an engine's whole digests
    as they came: restored, they are the ints that hashed prompts and later removals use."""
    index = KVIndex(hash_block_size=B)
    ints = [2**63 + i for i in range(3)]
    index.apply(record(0, 0, stored(ints, 0), stored(ints[:1], 0)))  # block 0 held twice
    data = index.snapshot()
    old = msgspec.msgpack.decode(data)  # media: [medium, hashes, owners, copies]
    whole = {h: bytes(24) + h.to_bytes(8, "big") for h in ints}
    for medium in old["media"]:
        medium[1] = [whole[h] for h in medium[1]]
        medium[3] = [[g, slot, whole[h], extra] for g, slot, h, extra in medium[3]]
    restored = KVIndex.restore(msgspec.msgpack.encode(old))
    assert restored.snapshot() == data
    assert only(restored.score(ints, 3 * B + 1)).hit_tokens == 3 * B


def test_older_epoch_is_ignored_and_newer_epoch_clears_the_worker() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1, 2, 3], 0)))
    index.apply(record(0, 0, stored([9], 0), epoch=1))  # engine restarted: seq starts again
    assert only(index.score([1, 2, 3], 4 * B)).hit_tokens == 0
    assert index.apply(record(5, 0, stored([1, 2, 3], 0))) is ApplyOutcome.STALE_EPOCH
    assert only(index.score([1, 2, 3], 4 * B)).hit_tokens == 0
    assert only(index.score([9], 2 * B)).hit_tokens == B
    counters = index.counters
    assert (counters.restarts, counters.stale_epoch_ignored) == (1, 1)
    assert index.workers()[0].epoch == 1


def test_a_newer_epoch_named_by_the_workers_topic_drops_the_old_life_before_its_records() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(5, 0, stored([1, 2, 3], 0), epoch=1))
    assert index.start_epoch("w0", 1) == 1  # the same epoch: nothing changes
    assert index.start_epoch("w0", 0) == 1  # an older one: nothing changes, the index is past it
    assert only(index.score([1, 2, 3], 4 * B)).hit_tokens == 3 * B
    assert index.start_epoch("w0", 2) == 2
    assert only(index.score([1, 2, 3], 4 * B)).hit_tokens == 0
    assert index.workers()[0].resident == {}
    assert index.counters.restarts == 2  # epoch 0 to 1 by a record, 1 to 2 by the workers topic
    # The new life's records apply from its first seq; the old life's are stale.
    assert index.apply(record(0, 0, stored([1, 2], 0), epoch=2)) is ApplyOutcome.APPLIED
    assert index.apply(record(6, 0, stored([1, 2, 3], 0), epoch=1)) is ApplyOutcome.STALE_EPOCH
    assert only(index.score([1, 2, 3], 4 * B)).hit_tokens == 2 * B
    # A worker first named by the workers topic starts in that epoch.
    assert index.start_epoch("new", 3) == 3


def test_dropping_a_group_forgets_its_blocks_on_every_medium_and_keeps_its_seqs() -> None:
    index = gpt_oss_like()
    index.apply(record(1, 0, stored(PROMPT[:2], 0, medium="CPU")))
    index.apply(record(0, 0, stored(PROMPT[:4], 0), worker="w1"))
    index.drop_group("w0", 0)
    index.drop_group("gone", 0)  # an unknown worker: nothing to forget
    w0, w1 = index.workers()
    assert w0.resident == {1: {"GPU": 8}}
    assert w1.resident == {0: {"GPU": 4}}
    assert only(index.score(PROMPT, len(PROMPT) * B)).tier_hit_tokens["STORAGE"] == 0
    assert only(index.score(PROMPT[:4], 5 * B), "w1").hit_tokens == 4 * B
    assert w0.last_seq == {0: 1, 1: 0}
    assert index.apply(record(1, 0, stored(PROMPT, 0))) is ApplyOutcome.DUPLICATE


@pytest.mark.parametrize(
    "spec",
    [
        GroupSpec("full_attention", 0),
        GroupSpec("full_attention", -16),
        GroupSpec("sliding_window", B, sliding_window=0),
        GroupSpec("chunked_local_attention", B, chunk_size=-64),
    ],
    ids=["block-0", "block-negative", "window-0", "chunk-negative"],
)
def test_a_catalog_with_a_size_that_is_not_positive_is_refused_and_changes_nothing(
    spec: GroupSpec,
) -> None:
    index = gpt_oss_like()
    before = index.score(PROMPT, len(PROMPT) * B)
    with pytest.raises(ValueError, match=r"group 1: .*Expected `int` >= 1"):
        index.set_catalog("w0", {0: FULL, 1: spec})
    assert index.workers()[0].groups == {0: FULL, 1: SWA_128}
    assert index.score(PROMPT, len(PROMPT) * B) == before


def test_stores_without_a_usable_block_size_keep_their_blocks_but_teach_no_spec() -> None:
    """vLLM's CPU-offloading stores carry block size 0; a negative size or window is garbage.
    Learning either made every score divide by zero, or hit blocks the worker cannot have."""
    index, model = KVIndex(hash_block_size=B), ReferenceIndex(B)
    sizeless = [
        msgspec.structs.replace(stored([1, 2], 0, medium="CPU"), block_size=0),
        msgspec.structs.replace(stored([1, 2], 0), block_size=-B),
        msgspec.structs.replace(stored([1, 2], 0, SWA_128), kv_cache_spec_sliding_window=-1),
    ]
    for each in (
        record(0, 0, *sizeless, worker="unsized"),
        record(0, 0, stored([1, 2], 0), worker="sized"),
        record(1, 0, sizeless[0], worker="sized"),
    ):
        assert index.apply(each) == model.apply(each)
    scores = {s.worker: s for s in index.score([1, 2], 3 * B)}
    assert {name: (s.hit_tokens, s.tier_hit_tokens) for name, s in scores.items()} == {
        name: (model.hit_tokens(name, [1, 2], 3 * B), model.tier_hit_tokens(name, [1, 2], 3 * B))
        for name in model.workers
    }
    assert (scores["sized"].hit_tokens, scores["sized"].tier_hit_tokens["CPU"]) == (2 * B, 2 * B)
    assert (scores["unsized"].hit_tokens, scores["unsized"].catalog_ok) == (0, False)
    sized, unsized = index.workers()
    assert (sized.name, sized.groups) == ("sized", {0: FULL})
    assert sized.resident == {0: {"GPU": 2, "CPU": 2}}
    assert (unsized.name, unsized.groups) == ("unsized", {})
    assert index.counters.sizeless_stores == model.counters.sizeless_stores == 4


def test_blocks_from_before_a_clear_are_never_hits() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1, 2], 0), stored([1, 2], 0, medium="CPU")))
    index.apply(record(1, 0, AllBlocksCleared(), stored([1], 0)))
    score = only(index.score([1, 2], 3 * B))
    assert score.hit_tokens == B
    assert score.tier_hit_tokens == {"GPU": B, "CPU": B, "STORAGE": B}  # CPU copies went too
    index.apply(record(2, 0, removed([2], 0)))  # the engine evicts what it no longer has
    assert index.counters.anomalies == 1
    assert index.counters.cleared == 1


def test_mamba_needs_only_the_aligned_state_block() -> None:
    """Mamba blocks of 32 tokens over 16-token hashes: block j goes by hash 2j+1."""
    mamba = GroupSpec("mamba", 2 * B)
    index = KVIndex(hash_block_size=B)
    prompt = list(range(8))
    index.apply(record(0, 0, stored(prompt, 0)))
    index.apply(record(0, 1, stored([prompt[3], prompt[7]], 1, mamba)))
    assert only(index.score(prompt, 8 * B + 1)).hit_tokens == 8 * B
    index.apply(record(1, 1, removed([prompt[7]], 1)))
    assert only(index.score(prompt, 8 * B + 1)).hit_tokens == 4 * B
    # The hit is a multiple of the 32-token alignment: 7 blocks of full attention give 6.
    assert only(index.score(prompt, 7 * B + 1)).hit_tokens == 4 * B


def test_chunked_local_attention_skips_blocks_before_the_current_chunk() -> None:
    chunked = GroupSpec("chunked_local_attention", B, chunk_size=4 * B)
    index = KVIndex(hash_block_size=B)
    index.set_catalog("w0", {0: FULL, 1: chunked})
    prompt = list(range(8))
    index.apply(record(0, 0, stored(prompt, 0)))
    index.apply(record(0, 1, stored(prompt[4:6], 1, chunked)))
    # The store does not carry the chunk size; the configured one is kept.
    assert index.workers()[0].groups[1] == chunked
    # 128 tokens start a new chunk: nothing of the chunked group is needed.
    assert only(index.score(prompt, 8 * B + 1)).hit_tokens == 8 * B
    # 112 tokens need chunk blocks 4..6; block 6 is missing, 96 needs only 4..5.
    assert only(index.score(prompt, 7 * B + 1)).hit_tokens == 6 * B


def test_an_empty_fastest_tier_still_answers_for_a_new_chunk() -> None:
    """A chunked-local group needs no block at a chunk boundary, on any tier, even an empty one."""
    chunked = GroupSpec("chunked_local_attention", B, chunk_size=4 * B)
    index = KVIndex(hash_block_size=B, tier_weights={"CPU": 1.0, "GPU": 0.5})
    index.set_catalog("w0", {0: chunked})
    index.apply(record(0, 0, stored([1], 0, chunked)))
    score = only(index.score(list(range(8)), 8 * B + 1))
    assert score.tier_hit_tokens == {"CPU": 8 * B, "GPU": 8 * B}


def test_tier_weighted_score_counts_each_stretch_at_its_slowest_tier() -> None:
    index = KVIndex(hash_block_size=B)
    prompt = list(range(12))
    index.apply(record(0, 0, stored(prompt[:4], 0), stored(prompt[4:8], 0, medium="CPU")))
    index.apply(record(1, 0, stored(prompt[8:], 0, medium="STORAGE")))
    score = only(index.score(prompt, 12 * B + 1))
    assert score.hit_tokens == 4 * B
    assert score.tier_hit_tokens == {"GPU": 4 * B, "CPU": 8 * B, "STORAGE": 12 * B}
    assert score.weighted_tokens == pytest.approx(4 * B * 1.0 + 4 * B * 0.8 + 4 * B * 0.5)
    custom = KVIndex.restore(index.snapshot(), tier_weights={"GPU": 1.0, "CPU": 0.25})
    score = only(custom.score(prompt, 12 * B + 1))
    assert score.tier_hit_tokens == {"GPU": 4 * B, "CPU": 8 * B}
    assert score.weighted_tokens == pytest.approx(4 * B + 4 * B * 0.25)


def test_scores_come_best_first_and_flag_health_and_unusable_catalogs() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1], 0), worker="short"))
    index.apply(record(0, 0, stored([1, 2], 0), worker="long"))
    index.apply(record(0, 0, stored([1, 2], 0, GroupSpec("full_attention", 24)), worker="odd"))
    index.set_health("long", "degraded")
    scores = index.score([1, 2], 3 * B)
    assert [(s.worker, s.hit_tokens, s.health) for s in scores] == [
        ("long", 2 * B, "degraded"),
        ("short", B, "live"),
        ("odd", 0, "live"),
    ]
    # 24-token blocks cannot be looked up with 16-token hashes: a 0 that is not an answer.
    assert [s.catalog_ok for s in scores] == [True, True, False]
    with pytest.raises(ValueError, match="health"):
        index.set_health("long", "asleep")  # type: ignore[arg-type]


def test_groups_are_learned_from_stores_and_bytes_hashes_work() -> None:
    index = KVIndex(hash_block_size=B)
    digests = [bytes([i]) * 32 for i in range(3)]
    index.apply(record(0, 0, stored(digests, 0)))
    index.apply(record(0, 1, stored(digests, 1, SWA_128)))
    assert index.workers()[0].groups == {0: FULL, 1: SWA_128}
    assert only(index.score(digests, 3 * B + 1)).hit_tokens == 3 * B
    index.apply(record(1, 1, removed([digests[0]], 1)))
    # Blocks 1..2 are not the 8 trailing blocks a 128-token window needs, nor a run from 0.
    assert only(index.score(digests, 3 * B + 1)).hit_tokens == 0


def test_a_store_with_another_spec_teaches_it_even_mid_record() -> None:
    """Each of kind, block size and window differing from the known spec is learned, also from
    the second store of a record whose first matched it; a store without a kind keeps it."""
    swa_64 = GroupSpec("sliding_window", B, sliding_window=64)
    chunked = GroupSpec("chunked_local_attention", B, sliding_window=64)
    wider = GroupSpec("chunked_local_attention", 2 * B, sliding_window=64)
    kindless = msgspec.structs.replace(stored([9], 1, wider), kv_cache_spec_kind=None)
    index = KVIndex(hash_block_size=B)
    for seq, second in enumerate((swa_64, chunked, wider)):
        index.apply(record(seq, 1, stored([seq], 1, SWA_128), stored([10 + seq], 1, second)))
        assert index.workers()[0].groups == {1: second}
    index.apply(record(3, 1, stored([3], 1, wider), kindless))
    assert index.workers()[0].groups == {1: wider}
    assert index.counters.sizeless_stores == 0


def test_whole_digests_and_their_ints_are_one_block() -> None:
    """vLLM sends a digest whole (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) or as the int of its
    last 8 bytes: a prompt hashed to ints finds the first engine's blocks, and the other way."""
    index = KVIndex(hash_block_size=B)
    digests = [bytes([i]) * 24 + (2**63 + i).to_bytes(8, "big") for i in range(3)]
    ints = [2**63 + i for i in range(3)]
    index.apply(record(0, 0, stored(digests, 0), worker="whole"))
    index.apply(record(0, 0, stored(ints, 0), worker="ints"))
    for prompt in (digests, ints):
        scores = index.score(prompt, 3 * B + 1)
        assert {(s.worker, s.hit_tokens) for s in scores} == {("whole", 3 * B), ("ints", 3 * B)}
    index.apply(record(1, 0, removed(ints[2:], 0), worker="whole"))  # removed as an int
    assert {s.worker: s.hit_tokens for s in index.score(digests, 3 * B + 1)}["whole"] == 2 * B


def test_a_forgotten_workers_slot_is_reused_without_its_blocks() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1, 2], 0), worker="gone"))
    index.forget_worker("gone")
    index.apply(record(0, 0, stored([7], 0), worker="new"))
    assert [(s.worker, s.hit_tokens) for s in index.score([1, 2], 3 * B)] == [("new", 0)]


def test_a_retired_worker_is_dropped_and_its_late_records_never_bring_it_back() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1, 2], 0), epoch=1))
    index.apply(record(0, 0, stored([1], 0), worker="stays"))
    assert index.retire_worker("w0", 1)
    assert [info.name for info in index.workers()] == ["stays"]
    # Its groups' partitions lag the workers topic: records of the retired life come late.
    assert index.apply(record(1, 0, stored([3], 0), epoch=1)) is ApplyOutcome.STALE_EPOCH
    assert index.apply(record(9, 0, stored([3], 0), epoch=0)) is ApplyOutcome.STALE_EPOCH
    assert index.start_epoch("w0", 1) == 2  # a state of the retired life names a later one
    assert [(s.worker, s.hit_tokens) for s in index.score([1, 2], 3 * B)] == [("stays", B)]
    assert not index.retire_worker("w0", 1)  # read again: changes nothing, counted once
    counters = index.counters
    assert (counters.workers_retired, counters.retired_ignored) == (1, 2)


def test_a_retired_worker_comes_back_empty_in_a_later_epoch() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(4, 0, stored([1, 2], 0)))
    index.retire_worker("w0", 0)
    assert index.apply(record(0, 0, stored([5], 0), epoch=1)) is ApplyOutcome.APPLIED
    [info] = index.workers()
    assert (info.epoch, info.resident, info.last_seq) == (1, {0: {"GPU": 1}}, {0: 0})
    assert only(index.score([1, 2], 3 * B)).hit_tokens == 0
    # Its new life's records were read before the retirement of the old one: it stays.
    assert not index.retire_worker("w0", 0)
    assert only(index.score([5], 2 * B)).hit_tokens == B


def test_a_tombstone_forgets_a_retired_worker_entirely() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1], 0)))
    index.retire_worker("w0", 0)
    index.forget_worker("w0")
    assert not index.is_retired("w0", 0)
    assert index.apply(record(1, 0, stored([1], 0))) is ApplyOutcome.APPLIED


def test_retirements_survive_a_snapshot_and_old_snapshots_have_none() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored([1], 0), epoch=2))
    index.retire_worker("w0", 2)
    restored = KVIndex.restore(index.snapshot())
    assert restored.is_retired("w0", 2) and not restored.is_retired("w0", 3)
    assert restored.apply(record(1, 0, stored([1], 0), epoch=2)) is ApplyOutcome.STALE_EPOCH
    saved = msgspec.msgpack.decode(index.snapshot())
    del saved["retired"]
    assert not KVIndex.restore(msgspec.msgpack.encode(saved)).is_retired("w0", 2)


def test_scores_only_the_workers_asked_for() -> None:
    index = gpt_oss_like()
    index.apply(record(0, 0, stored(PROMPT[:3], 0), worker="w1"))
    index.apply(record(0, 0, stored(PROMPT[:2], 0), worker="w2"))
    whole = index.score(PROMPT, len(PROMPT) * B)
    asked = index.score(PROMPT, len(PROMPT) * B, workers=["w2", "gone", "w0"])
    assert asked == [score for score in whole if score.worker in {"w0", "w2"}]
    assert index.score(PROMPT, len(PROMPT) * B, workers=[]) == []


def test_hits_only_skip_the_breakdown_but_not_the_hit() -> None:
    index = gpt_oss_like()
    index.apply(record(0, 0, stored(PROMPT[:3], 0), worker="w1"))
    index.set_health("w1", "degraded")
    full = index.score(PROMPT, len(PROMPT) * B)
    hits = index.score(PROMPT, len(PROMPT) * B, details=False)
    assert [(s.worker, s.hit_tokens, s.hit_blocks, s.health, s.catalog_ok) for s in hits] == [
        (s.worker, s.hit_tokens, s.hit_blocks, s.health, s.catalog_ok) for s in full
    ]
    assert [s.weighted_tokens for s in hits] == [float(s.hit_tokens) for s in hits]  # GPU: 1.0
    assert {
        (s.group_blind_hit_tokens, len(s.group_hit_tokens), len(s.tier_hit_tokens)) for s in hits
    } == {(0, 0, 0)}


def test_lanes_widen_as_the_fleet_grows_past_them() -> None:
    """Twenty workers outgrow 8 and 16 slots per lane while holding shared and own blocks."""
    index, model = KVIndex(hash_block_size=B), ReferenceIndex(B)
    for w in range(20):
        held = PROMPT[: 5 + w] + [1000 * w + i for i in range(3)]
        for each in (
            record(0, 0, stored(held, 0), worker=f"w{w}"),
            record(0, 1, stored(held[w // 2 :], 1, SWA_128), worker=f"w{w}"),
            record(1, 1, removed(held[-2:], 1), worker=f"w{w}"),
        ):
            assert index.apply(each) == model.apply(each)
    for prompt in (PROMPT, PROMPT[:9] + [1000 * 7 + i for i in range(3)]):
        tokens = len(prompt) * B
        for score in index.score(prompt, tokens):
            name = score.worker
            assert score.hit_tokens == model.hit_tokens(name, prompt, tokens), name
            assert score.group_hit_tokens == model.group_hit_tokens(name, prompt, tokens)
            assert score.group_blind_hit_tokens == model.group_blind_hit_tokens(
                name, prompt, tokens
            )
    assert {info.name: info.resident for info in index.workers()} == {
        name: model.resident(name) for name in model.workers
    }


HIGH = 1 << 63  # vLLM's external hashes are uint64: msgpack needs 9 bytes for most


def fleet(workers: int, hashes: int) -> KVIndex:
    index = KVIndex(hash_block_size=B)
    blocks: list[ExternalBlockHash] = [HIGH + i for i in range(hashes)]
    for w in range(workers):
        name = f"w{w}"
        index.apply(record(0, 0, stored(blocks, 0), worker=name))
        index.apply(record(0, 1, stored(blocks, 1, SWA_128), worker=name))
        index.apply(record(1, 1, removed(blocks[:w], 1), worker=name))
    index.apply(record(2, 1, stored([HIGH + 5], 1, SWA_128)))  # a second copy for w0
    return index


@pytest.mark.parametrize("workers", [8, 70])  # 70 slots overflow a 64-bit msgpack int
def test_snapshot_round_trips_the_whole_state_compactly(workers: int) -> None:
    index = fleet(workers, 1000)
    data = index.snapshot()
    restored = KVIndex.restore(data)
    assert restored.snapshot() == data
    assert restored.workers() == index.workers()
    assert restored.counters == IndexCounters()  # Prometheus counters: zero in each process
    prompt: list[ExternalBlockHash] = [HIGH + i for i in range(20)]
    assert restored.score(prompt, 321) == index.score(prompt, 321)
    # Seqs came along: a replayed record is still a duplicate after restore.
    assert restored.apply(record(1, 1, removed([HIGH], 1))) is ApplyOutcome.DUPLICATE
    # Per distinct hash: 9 bytes, then both groups' bitsets packed in one int's header and bytes.
    per_hash = 9 + 2 + (2 * workers + 7) // 8
    assert len(data) < 1000 * per_hash + 200 * workers  # + each worker's catalog and seqs
    # The duplicate copy survived the round trip: two removals to drop it.
    restored.apply(record(3, 1, removed([HIGH + 5], 1)))
    restored.apply(record(4, 1, removed([HIGH + 5], 1)))
    assert restored.counters.anomalies == 0
    assert restored.workers()[0].resident[1]["GPU"] == 999


def test_a_snapshot_of_another_format_is_refused() -> None:
    """Format 1 kept a dict per group and medium: the follower reads the log instead."""
    old = msgspec.msgpack.encode({"format": 1, "workers": [], "lanes": [], "counters": {}})
    with pytest.raises(ValueError, match="format 1"):
        KVIndex.restore(old)


# --- vLLM 0.33.0's lookahead hashing -----------------------------------------------------------

CLASSIC: list[ExternalBlockHash] = [1000 + i for i in range(5)]  # a prompt's hashes: 5 blocks
LOOKAHEAD_1: list[ExternalBlockHash] = [2000 + i for i in range(4)]  # with 1 lookahead: 4 blocks


def lookahead_stored(
    hashes: Sequence[ExternalBlockHash], tokens: int, medium: str = "GPU"
) -> BlockStored:
    return msgspec.structs.replace(
        stored(hashes, 0, medium=medium),
        lookahead_token_ids=[list(range(tokens)) for _ in hashes],
    )


def lookahead_fleet() -> KVIndex:
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored(CLASSIC, 0), worker="classic"))
    index.apply(record(0, 0, lookahead_stored(LOOKAHEAD_1, 1), worker="eagle"))
    return index


def test_a_lookahead_worker_is_scored_with_the_prompts_lookahead_hashes() -> None:
    index = lookahead_fleet()
    asked: list[int] = []

    def rehash(lookahead: int) -> list[ExternalBlockHash]:
        asked.append(lookahead)
        return {1: LOOKAHEAD_1}[lookahead]

    scores = index.score(CLASSIC, 5 * B + 1, lookahead_hashes=rehash)
    assert asked == [1]
    assert {(s.worker, s.hit_tokens, s.hash_lookahead) for s in scores} == {
        ("classic", 5 * B, 0),
        ("eagle", 4 * B, 1),
    }
    assert only(scores, "eagle").group_blind_hit_tokens == 4 * B
    assert [s.worker for s in scores] == ["classic", "eagle"]  # best first across hashings
    hits_only = index.score(CLASSIC, 5 * B + 1, details=False, lookahead_hashes=rehash)
    assert {(s.worker, s.hit_tokens, s.hash_lookahead) for s in hits_only} == {
        ("classic", 5 * B, 0),
        ("eagle", 4 * B, 1),
    }


def test_without_lookahead_hashes_every_worker_takes_the_given_ones_and_says_how_it_hashes() -> (
    None
):
    scores = lookahead_fleet().score(CLASSIC, 5 * B + 1)
    assert {(s.worker, s.hit_tokens, s.hash_lookahead) for s in scores} == {
        ("classic", 5 * B, 0),
        ("eagle", 0, 1),
    }


def test_a_fleet_without_lookahead_workers_never_asks_for_lookahead_hashes() -> None:
    def refuse(lookahead: int) -> list[ExternalBlockHash]:
        raise AssertionError(f"asked for lookahead {lookahead}")

    index = gpt_oss_like()
    assert only(index.score(PROMPT, len(PROMPT) * B, lookahead_hashes=refuse)).hit_tokens == 20 * B
    # Scoring only the classic worker of a mixed fleet does not ask either.
    scores = lookahead_fleet().score(
        CLASSIC, 5 * B + 1, workers=["classic"], lookahead_hashes=refuse
    )
    assert [(s.worker, s.hit_tokens) for s in scores] == [("classic", 5 * B)]


def test_a_workers_lookahead_is_learned_from_its_gpu_stores_of_blocks() -> None:
    index = KVIndex(hash_block_size=B)

    def lookahead() -> int:
        return index.workers()[0].hash_lookahead

    index.apply(record(0, 0, lookahead_stored([1], 3)))
    assert lookahead() == 3
    # A window group's step that kept no block has no list to send; offloading never sends one.
    index.apply(record(1, 0, lookahead_stored([], 3), stored([2], 0, medium="CPU")))
    assert lookahead() == 3
    index.apply(record(2, 0, stored([3], 0)))  # hashes without lists: classic hashing again
    assert lookahead() == 0
    scores = index.score([1, 2, 3], 3 * B + 1, lookahead_hashes=lambda k: [])
    assert only(scores).hash_lookahead == 0


def test_lookahead_survives_a_snapshot_and_leaves_with_a_forgotten_worker() -> None:
    index = lookahead_fleet()
    restored = KVIndex.restore(index.snapshot())
    assert restored.workers() == index.workers()
    assert {w.name: w.hash_lookahead for w in restored.workers()} == {"classic": 0, "eagle": 1}
    restored.forget_worker("eagle")
    restored.apply(record(0, 0, stored(LOOKAHEAD_1, 0), worker="newcomer"))  # eagle's old slot

    def refuse(lookahead: int) -> list[ExternalBlockHash]:
        raise AssertionError(f"asked for lookahead {lookahead}")

    scores = restored.score(LOOKAHEAD_1, 4 * B + 1, lookahead_hashes=refuse)
    assert {(s.worker, s.hash_lookahead) for s in scores} == {("classic", 0), ("newcomer", 0)}


# --- Window-group stores as real vLLM sends them -----------------------------------------------

SWA_32 = GroupSpec("sliding_window", B, sliding_window=32)  # hits need the 2 trailing blocks


def test_window_stores_with_fewer_or_no_hashes_than_token_blocks_count_only_their_hashes() -> None:
    """A window group lists only the blocks it keeps: one hash with 9 or 10 blocks of token
    ids, then a step that keeps none (token ids and a parent only). Only the listed hashes are
    held, the parent is not, and nothing fails or is counted as odd."""
    index = KVIndex(hash_block_size=B)
    index.apply(record(0, 0, stored(PROMPT[:11], 0)))
    window = [
        msgspec.structs.replace(stored([PROMPT[8]], 1, SWA_32), token_ids=list(range(9 * B))),
        msgspec.structs.replace(
            stored([PROMPT[9]], 1, SWA_32), parent_block_hash=PROMPT[8], token_ids=list(range(160))
        ),
        msgspec.structs.replace(
            stored([], 1, SWA_32), parent_block_hash=PROMPT[9], token_ids=list(range(160, 176))
        ),
    ]
    index.apply(record(0, 1, *window))
    [info] = index.workers()
    assert info.resident == {0: {"GPU": 11}, 1: {"GPU": 2}}
    assert info.groups == {0: FULL, 1: SWA_32}
    counters = index.counters
    assert (counters.stored, counters.anomalies, counters.sizeless_stores) == (13, 0, 0)
    # The 11-block hit would need window blocks 9 and 10: the hit is the 10 blocks 8..9 allow.
    assert only(index.score(PROMPT[:11], 11 * B + 1)).hit_tokens == 10 * B
    index.apply(record(1, 1, removed([PROMPT[7]], 1)))  # block 7 was never stored in the window
    assert index.counters.anomalies == 1
    assert only(index.score(PROMPT[:11], 11 * B + 1)).hit_tokens == 10 * B


def test_a_worker_past_its_block_bound_is_refused_and_counted_and_others_are_not() -> None:
    """Every block a worker claims is a dict entry (issue 16: a 28.8 MB batch grew the index
    12x its size): past ``max_blocks_per_worker`` its stores are refused, and the index knows
    less than the engine holds, never more; removals make room again."""
    index = KVIndex(hash_block_size=B, max_blocks_per_worker=10)
    index.apply(record(0, 0, stored(range(8), 0)))
    index.apply(record(1, 0, stored([*range(6), *range(100, 106)], 0)))  # 6 held, 6 new
    index.apply(record(0, 0, stored(range(50, 60), 0), worker="w1"))
    w0, w1 = index.workers()
    assert w0.resident == {0: {"GPU": 10}} and w1.resident == {0: {"GPU": 10}}
    assert index.counters.blocks_refused == 4  # 102..105: 100 and 101 took the last room
    assert index.counters.stored == 8 + 12 + 10 - 4
    index.apply(record(2, 0, removed([0, 1], 0)))
    index.apply(record(3, 0, stored([104, 105], 0)))
    assert index.workers()[0].resident == {0: {"GPU": 10}}


def test_media_past_the_index_limit_are_refused_not_kept() -> None:
    index = KVIndex(hash_block_size=B)
    for seq in range(MAX_MEDIA + 4):
        index.apply(record(seq, 0, stored([seq], 0, medium=f"tier-{seq}")))
    kept = index.workers()[0].resident[0]
    assert len(kept) == MAX_MEDIA and index.counters.blocks_refused == 4
    assert "tier-0" in kept and f"tier-{MAX_MEDIA}" not in kept


def test_a_record_at_the_seq_before_any_applies_instead_of_raising() -> None:
    """Found by tests/fuzz: seq -2, the sentinel of a group with nothing applied, raised
    KeyError; no bridge writes it, but anyone who writes the log can."""
    index = KVIndex(hash_block_size=B)
    assert index.apply(record(-2, 0, stored(PROMPT[:2], 0))) is ApplyOutcome.APPLIED
    assert index.counters.stored == 2
    assert index.apply(record(-2, 0, stored(PROMPT[:2], 0))) is ApplyOutcome.DUPLICATE


def test_an_empty_record_of_the_last_seq_is_a_duplicate() -> None:
    index = KVIndex(hash_block_size=B)
    index.apply(record(3, 0, stored(PROMPT[:2], 0)))
    empty = msgspec.structs.replace(record(3, 0), first_event=5)
    assert index.apply(empty) is ApplyOutcome.DUPLICATE
    # It moved nothing on: the seq's next events still apply (they were skipped as applied).
    rest = msgspec.structs.replace(record(3, 0, stored([7], 0), stored([8], 0)), first_event=1)
    assert index.apply(rest) is ApplyOutcome.APPLIED
    assert index.counters.stored == 4
