"""Fuzzing ``KVIndex.apply`` with arbitrary well-typed records: any worker, epoch, seq, group and
first event, and events with any value their types admit (what ``decode_event_record`` can hand
the follower), hashes from a small pool so that stores, copies and removals meet. ``apply`` never
raises, and after every record the counters account for exactly what the record did, the
residency it reports is the blocks it holds, and a snapshot restores to the same index.

The accounting is the documented one (``IndexCounters``, ``apply``): a record of an older epoch,
or one applied already (by seq, and within a seq by ``first_event``), changes nothing but its
counter; a newer epoch restarts the worker; every hash of an applied store is stored or refused,
every hash of an applied removal removed or an anomaly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from fuzz_kit import fuzz_settings, ints, removals, stores, texts
from hypothesis import event, given
from hypothesis import strategies as st

from hmakv.consumers import index_snapshot
from hmakv.consumers.index import (
    INITIAL_LANE_WIDTH,
    MAX_MEDIA,
    ApplyOutcome,
    IndexCounters,
    KVIndex,
)
from hmakv.kvlog.records import MAX_FIRST_EVENT, EventRecord
from hmakv.producer.events import (
    MAX_GROUP_IDX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    has_group_sizes,
)

WORKERS = [f"w{i}" for i in range(12)]  # more than a lane's first 8 slots: the lanes widen
MEDIA = ["GPU", "GPU", "GPU", "CPU", "STORAGE", *(f"tier-{i}" for i in range(MAX_MEDIA + 2))]
HASH_POOL = [*range(12), 2**64 - 1, -(2**63), b"\x00" * 8, b"\x01" * 32, b""]

pooled_hashes = st.sampled_from(HASH_POOL)
T = TypeVar("T")


def mostly(common: st.SearchStrategy[T], rare: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """``common`` seven times in eight: records must meet (same worker, epoch, group, medium,
    hashes) for stores, copies, removals and replays to interact."""
    return st.integers(0, 7).flatmap(lambda k: rare if k == 0 else common)


# A list is all ints or all digests, as vLLM sends them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
# is one setting for an engine's life) and as ``index._as_keys`` takes them: it looks at the
# first hash only. See README.md for what a list that mixes the two does.
pool_ints: st.SearchStrategy[ExternalBlockHash] = st.sampled_from(
    [h for h in HASH_POOL if isinstance(h, int)]
)
pool_digests: st.SearchStrategy[ExternalBlockHash] = st.sampled_from(
    [h for h in HASH_POOL if isinstance(h, bytes)]
)
any_ints: st.SearchStrategy[ExternalBlockHash] = ints
any_digests: st.SearchStrategy[ExternalBlockHash] = st.binary(max_size=32)
hash_lists = mostly(
    st.lists(pool_ints, max_size=8),
    st.one_of(
        st.lists(any_ints, max_size=8),
        st.lists(pool_digests, max_size=8),
        st.lists(any_digests, max_size=8),
    ),
)
record_media = mostly(st.sampled_from(MEDIA[:5]), st.none() | st.sampled_from(MEDIA) | texts)
record_group_idx = st.none() | st.sampled_from([0, 1, 2]) | st.integers(0, MAX_GROUP_IDX)
record_events = mostly(
    st.one_of(
        stores(hash_lists, record_media, record_group_idx),
        removals(hash_lists, record_media, record_group_idx),
    ),
    st.just(AllBlocksCleared()),  # a clear empties the group: rarer, or little else is seen
)
event_records = st.builds(
    EventRecord,
    worker=mostly(st.sampled_from(WORKERS[:3]), st.sampled_from(WORKERS) | texts),
    epoch=mostly(st.just(0), st.sampled_from([-1, 1, 2]) | ints),
    seq=mostly(st.sampled_from([-1, 0, 1, 2, 3]), st.just(-2) | ints),
    ts=st.floats(),
    group_idx=mostly(st.sampled_from([0, 1]), st.just(2) | ints),
    events=st.lists(record_events, max_size=4),
    data_parallel_rank=st.none() | ints,
    first_event=mostly(st.sampled_from([0, 0, 1, 2]), st.integers(0, MAX_FIRST_EVENT)),
)
prompts = st.lists(pooled_hashes, min_size=1, max_size=16)
NOTHING_APPLIED = -2  # a group's last seq before any record: below the -1 of an epoch's clear


@dataclass
class Expected:
    """What the docs say one worker's progress is: its epoch and, per group, the last seq applied
    and how many of that seq's events."""

    epoch: int = 0
    last_seq: dict[int, int] = field(default_factory=dict)
    next_event: dict[int, int] = field(default_factory=dict)


def expect(
    workers: dict[str, Expected], record: EventRecord
) -> tuple[ApplyOutcome, list[KVEvent], bool]:
    """The outcome, the events applied and whether the worker restarts, by the documented rules;
    ``workers`` moves on as the index should."""
    worker = workers.get(record.worker)
    if worker is None:
        if record.epoch < 0:  # a life before the first one the index may know: as if retired
            return ApplyOutcome.STALE_EPOCH, [], False
        worker = workers[record.worker] = Expected()
    if record.epoch < worker.epoch:
        return ApplyOutcome.STALE_EPOCH, [], False
    restart = record.epoch > worker.epoch
    if restart:
        workers[record.worker] = worker = Expected(record.epoch)
    group = record.group_idx
    last = worker.last_seq.get(group, NOTHING_APPLIED)
    if record.seq < last:
        return ApplyOutcome.DUPLICATE, [], restart
    new = record.events  # a newer seq: every event of it is new
    if record.seq == last:  # within a seq, events by their position among the batch's for the group
        positions = range(record.first_event, record.first_event + len(record.events))
        done = worker.next_event.get(group, 0)
        new = [e for at, e in zip(positions, record.events, strict=True) if at >= done]
        if not new:
            return ApplyOutcome.DUPLICATE, [], restart
    worker.last_seq[group] = record.seq
    worker.next_event[group] = record.first_event + len(record.events)
    return ApplyOutcome.APPLIED, new, restart


def check_counters(
    before: IndexCounters,
    after: IndexCounters,
    outcome: ApplyOutcome,
    applied: list[KVEvent],
    restart: bool,
) -> None:
    was, now = msgspec.structs.asdict(before), msgspec.structs.asdict(after)
    assert all(now[name] >= was[name] >= 0 for name in now), (was, now)  # monotonic
    delta = {name: now[name] - was[name] for name in now}
    stores = [e for e in applied if isinstance(e, BlockStored)]
    removals = [e for e in applied if isinstance(e, BlockRemoved)]
    assert delta.pop("stored") + delta.pop("blocks_refused") == sum(
        len(e.block_hashes) for e in stores
    )
    assert delta.pop("removed") + delta.pop("anomalies") == sum(
        len(e.block_hashes) for e in removals
    )
    assert delta.pop("cleared") == sum(isinstance(e, AllBlocksCleared) for e in applied)
    assert delta.pop("sizeless_stores") == sum(not has_group_sizes(e) for e in stores)
    assert delta.pop("restarts") == restart
    assert delta.pop("duplicates_ignored") == (outcome is ApplyOutcome.DUPLICATE)
    stale = outcome is ApplyOutcome.STALE_EPOCH
    assert delta.pop("stale_epoch_ignored") + delta.pop("retired_ignored") == stale
    assert delta.pop("duplicate_copies") <= sum(len(e.block_hashes) for e in stores)
    assert delta.pop("partial_evictions") <= sum(len(e.block_hashes) for e in removals)
    # apply retires no one and, with nothing speculated, settles no speculation; no medium here
    # is the index's own
    untouched = ("workers_retired", "reserved_medium_blocks", "speculated", "speculation_refused")
    settled = ("speculation_confirmed", "speculation_removed", "speculation_expired")
    assert delta == dict.fromkeys((*untouched, *settled), 0)
    assert after.removed <= after.stored, "a copy removed is a copy that was stored"


def check_residency(index: KVIndex, expected: dict[str, Expected]) -> None:
    """What ``workers()`` reports each worker holds is what its bits in the index say (read from
    the snapshot, the index's own account of every packed int), within the worker's cap."""
    saved = index_snapshot.decode(index.snapshot())
    assert len(saved.media) <= MAX_MEDIA
    held: dict[tuple[int, int, str], int] = {}  # (slot, group, medium) -> distinct hashes
    for medium in saved.media:
        assert len(set(medium.hashes)) == len(medium.hashes)
        for packed in map(index_snapshot.owners_from_wire, medium.owners):
            assert packed, "a hash nobody holds has no entry"
            for lane, group in enumerate(saved.lanes):
                for slot in range(saved.slots):
                    if packed >> (lane * saved.slots + slot) & 1:
                        key = (slot, group, medium.medium)
                        held[key] = held.get(key, 0) + 1
    slots = {worker.name: worker.slot for worker in saved.workers}
    infos = index.workers()
    assert {info.name for info in infos} == set(expected)
    for info in infos:
        resident = {
            (slots[info.name], group, medium): count
            for group, media in info.resident.items()
            for medium, count in media.items()
        }
        assert resident == {k: v for k, v in held.items() if k[0] == slots[info.name]}
        assert sum(resident.values()) <= index.max_blocks_per_worker
        assert info.epoch == expected[info.name].epoch
        assert info.last_seq == expected[info.name].last_seq


@fuzz_settings(300)
@given(
    st.lists(event_records, max_size=25),
    st.sampled_from([1, 4, 16]),
    st.sampled_from([1, 3, 8, 4 * 1024 * 1024]),
    st.lists(prompts, min_size=1, max_size=3),
)
def test_apply_never_raises_and_keeps_its_counters(
    stream: list[EventRecord],
    hash_block_size: int,
    max_blocks: int,
    prompt_list: list[list[ExternalBlockHash]],
) -> None:
    index = KVIndex(hash_block_size=hash_block_size, max_blocks_per_worker=max_blocks)
    expected: dict[str, Expected] = {}
    for record in stream:
        before = index.counters
        outcome = index.apply(record)
        event(outcome.value)
        want, applied, restart = expect(expected, record)
        assert outcome is want, record
        check_counters(before, index.counters, outcome, applied, restart)
        check_residency(index, expected)
    counters = index.counters
    for name in (
        "stored",
        "removed",
        "anomalies",
        "blocks_refused",
        "duplicate_copies",
        "restarts",
    ):
        event(f"{name} > 0", getattr(counters, name) > 0)
    event("workers past a lane's first 8 slots", len(expected) > INITIAL_LANE_WIDTH)
    for prompt in prompt_list:
        for num_tokens in (1, len(prompt) * hash_block_size + 1):
            hits = index.score(prompt, num_tokens)
            assert sorted(hit.worker for hit in hits) == sorted(expected)
            assert all(0 <= hit.hit_tokens <= num_tokens - 1 for hit in hits)
    restored = KVIndex.restore(
        index.snapshot(), hash_block_size=hash_block_size, max_blocks_per_worker=max_blocks
    )
    assert restored.snapshot() == index.snapshot()
    assert restored.workers() == index.workers()
    for prompt in prompt_list:
        assert restored.score(prompt, len(prompt) * hash_block_size + 1) == index.score(
            prompt, len(prompt) * hash_block_size + 1
        )
