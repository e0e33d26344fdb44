"""Fan-out of a batch into per-group records, and the group catalog learned from events."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from hmakv.bridge.catalog import GroupCatalog
from hmakv.bridge.fanout import clear_records, fan_out, split_to_fit
from hmakv.kvlog import records
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVEvent,
    KVEventBatch,
)


def store(group: int | None, *, kind: str | None = None, window: int | None = None) -> BlockStored:
    return BlockStored(
        [1],
        None,
        list(range(16)),
        16,
        None,
        "GPU",
        None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def removal(group: int | None, block_hash: int = 1) -> BlockRemoved:
    return BlockRemoved([block_hash], "GPU", group_idx=group)


def test_one_record_per_group_in_group_order_with_the_engine_order_inside() -> None:
    events: list[KVEvent] = [removal(1, 10), store(0), removal(None, 11), removal(1, 12)]
    records = fan_out("w", 2, 7, KVEventBatch(5.0, events, 3), groups=(0, 1))
    assert records == [
        EventRecord("w", 2, 7, 5.0, 0, [store(0), removal(None, 11)], 3),
        EventRecord("w", 2, 7, 5.0, 1, [removal(1, 10), removal(1, 12)], 3),
    ]


def test_a_clear_reaches_every_known_group_at_its_place() -> None:
    events: list[KVEvent] = [removal(0), AllBlocksCleared(), store(1)]
    records = fan_out("w", 0, 1, KVEventBatch(1.0, events), groups=(0, 1, 2))
    assert [(r.group_idx, r.events) for r in records] == [
        (0, [removal(0), AllBlocksCleared()]),
        (1, [AllBlocksCleared(), store(1)]),
        (2, [AllBlocksCleared()]),
    ]


def test_an_empty_batch_has_no_records() -> None:
    assert fan_out("w", 0, 1, KVEventBatch(1.0, []), groups=(0,)) == []


def test_clear_records_cover_every_group() -> None:
    assert clear_records("w", 1, -1, 2.0, (0, 3), 1) == [
        EventRecord("w", 1, -1, 2.0, 0, [AllBlocksCleared()], 1),
        EventRecord("w", 1, -1, 2.0, 3, [AllBlocksCleared()], 1),
    ]


events_strategy = st.lists(
    st.one_of(
        st.builds(store, st.sampled_from([None, 0, 1, 2, 5])),
        st.builds(removal, st.sampled_from([None, 0, 1, 2, 5]), st.integers(0, 2**64 - 1)),
        st.just(AllBlocksCleared()),
    ),
    max_size=30,
)


@given(events=events_strategy, known=st.sets(st.integers(0, 6), min_size=1))
def test_fan_out_loses_and_invents_nothing(events: list[KVEvent], known: set[int]) -> None:
    groups = tuple(sorted(known))
    records = fan_out("w", 0, 9, KVEventBatch(1.0, events), groups)
    assert [r.group_idx for r in records] == sorted({r.group_idx for r in records})
    for record in records:
        # exactly the batch's events of this group, clears included, in batch order
        expected = [
            e
            for e in events
            if (isinstance(e, AllBlocksCleared) and record.group_idx in known)
            or (not isinstance(e, AllBlocksCleared) and (e.group_idx or 0) == record.group_idx)
        ]
        assert record.events == expected
    total = sum(len(r.events) for r in records)
    clears = sum(isinstance(e, AllBlocksCleared) for e in events)
    assert total == len(events) - clears + clears * len(known)


@given(
    events=st.lists(
        st.one_of(
            st.builds(store, st.just(0)),
            st.builds(removal, st.just(0), st.integers(0, 2**64 - 1)),
            st.just(AllBlocksCleared()),
        ),
        max_size=200,
    ),
    max_bytes=st.integers(300, 3000),
)
def test_split_to_fit_keeps_every_event_in_order_in_parts_that_fit(
    events: list[KVEvent], max_bytes: int
) -> None:
    record = EventRecord("worker-with-a-long-name-dp3", 12, 2**40, 1.5, 0, events, 3)
    parts = split_to_fit(record, max_bytes)
    assert parts is not None  # every event here fits a record of 300 bytes
    sizes = [len(p.events) for p in parts[:-1]]
    assert [p.first_event for p in parts] == list(itertools.accumulate(sizes, initial=0))
    assert [e for p in parts for e in p.events] == events
    assert all(len(records.encode(p)) <= max_bytes for p in parts)
    assert {(p.worker, p.epoch, p.seq, p.ts, p.group_idx, p.data_parallel_rank) for p in parts} == {
        ("worker-with-a-long-name-dp3", 12, 2**40, 1.5, 0, 3)
    }
    # Parts are sized for the largest first_event and list header: up to 8 bytes to spare.
    if len(records.encode(record)) + 8 <= max_bytes:
        assert parts == [record]
    for part, after in itertools.pairwise(parts):  # each part as full as it may be
        grown = msgspec.structs.replace(part, events=[*part.events, after.events[0]])
        assert len(records.encode(grown)) + 8 > max_bytes


def test_split_to_fit_gives_up_on_an_event_no_record_can_hold() -> None:
    hashes = [2**63 + i for i in range(100)]
    huge = BlockStored(hashes, None, [], 16, None, "GPU", None, group_idx=0)
    record = EventRecord("w", 0, 1, 1.0, 0, [store(0), huge, store(0)])
    assert split_to_fit(record, 400) is None
    assert split_to_fit(record, 2000) == [record]


def test_the_catalog_learns_specs_from_stores_and_groups_from_removals() -> None:
    catalog = GroupCatalog()
    assert catalog.groups == (0,)
    assert catalog.learn([store(None, kind="full_attention")])
    assert catalog.learn([store(1, kind="sliding_window", window=128), removal(3)])
    assert not catalog.learn([store(1, kind="sliding_window", window=128), removal(3)])
    assert list(catalog.groups) == [0, 1, 3]
    assert catalog.specs == {
        0: GroupSpec("full_attention", 16),
        1: GroupSpec("sliding_window", 16, 128),
    }


def test_an_engine_that_reports_no_kind_gets_unknown_or_the_configured_kind() -> None:
    configured = {1: GroupSpec("chunked_local_attention", 16, chunk_size=512)}
    catalog = GroupCatalog(configured=configured)
    assert catalog.groups == (1,)
    catalog.learn([store(0), store(1)])
    assert catalog.specs == {
        0: GroupSpec("unknown", 16),
        1: GroupSpec("chunked_local_attention", 16, chunk_size=512),
    }


def test_a_changed_spec_replaces_the_learned_one() -> None:
    catalog = GroupCatalog(learned={0: GroupSpec("unknown", 16)})
    assert catalog.groups == (0,)
    assert catalog.learn([store(0, kind="full_attention")])
    assert catalog.specs == {0: GroupSpec("full_attention", 16)}


def test_a_spec_that_changes_back_is_learned_again() -> None:
    """An engine restarted with another configuration for a group, then with its former one
    (a rollback): the former spec's stores must not be skipped as already learned."""
    catalog = GroupCatalog()
    window_128 = store(1, kind="sliding_window", window=128)
    assert catalog.learn([window_128])
    assert catalog.learn([store(1, kind="full_attention")])
    assert catalog.specs[1] == GroupSpec("full_attention", 16)
    assert catalog.learn([window_128])
    assert catalog.specs[1] == GroupSpec("sliding_window", 16, 128)
