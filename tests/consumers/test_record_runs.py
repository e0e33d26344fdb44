"""A record's events as runs: the specification (``py_record_runs``) on hand-worked records, and
the native reader (``hmakv_native.RecordRuns``) against it on random ones, garbage included.
That a record applies as its runs the same as event by event is
test_index_properties.py's ``test_a_record_applies_as_its_events_would_one_record_each``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.consumers import record_runs
from hmakv.consumers.record_runs import KnownSpec, py_record_runs
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

FULL: KnownSpec = ("full_attention", 16, None)


def stored(hashes: list[Any], medium: str | None = "GPU", **fields: Any) -> BlockStored:
    store = BlockStored(
        hashes, None, [], 16, None, medium, None, kv_cache_spec_kind="full_attention"
    )
    return msgspec.structs.replace(store, **fields)


def removed(hashes: list[Any], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(hashes, medium)


def test_consecutive_stores_or_removals_on_one_medium_are_one_run() -> None:
    events: list[KVEvent] = [
        removed([1]),
        removed([2, 3], None),  # no medium is the GPU's
        stored([4]),
        stored([], ""),  # a store of no blocks is still part of its run
        stored([5, 6]),
        stored([7], "CPU"),
        removed([8], "CPU"),
        removed([9], "CPU"),
    ]
    assert py_record_runs(events, FULL, 0) == [
        (False, "GPU", [1, 2, 3]),
        (True, "GPU", [4, 5, 6]),
        (True, "CPU", [7]),
        (False, "CPU", [8, 9]),
    ]
    assert py_record_runs([], FULL, 0) == []


def test_digests_become_vllms_ints_and_other_hashes_need_the_index() -> None:
    digest = bytes(24) + (2**63 + 5).to_bytes(8, "big")
    assert py_record_runs([stored([digest, 7])], FULL, 0) == [(True, "GPU", [2**63 + 5, 7])]
    assert py_record_runs([stored([7, digest])], FULL, 0) == [(True, "GPU", [7, digest])]
    assert py_record_runs([removed([digest, "7"])], FULL, 0) is None


def test_a_record_that_teaches_the_index_is_left_to_it() -> None:
    """A clear, a first store of the group, another spec, sizes no group has, or a GPU store
    of blocks with another lookahead; a kindless store or a CPU store teaches nothing."""
    window = ("sliding_window", 16, 64)
    teaching = [
        ([removed([1]), AllBlocksCleared()], FULL, 0),
        ([stored([1])], None, 0),
        (
            [stored([1], kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64)],
            FULL,
            0,
        ),
        ([stored([1], kv_cache_spec_sliding_window=32)], window, 0),
        ([stored([1], block_size=32)], FULL, 0),
        ([stored([1], kv_cache_spec_kind=None, block_size=0)], FULL, 0),
        ([stored([1], lookahead_token_ids=[[3, 4]])], FULL, 0),
        ([stored([1])], FULL, 2),
    ]
    for events, known, lookahead in teaching:
        assert py_record_runs(events, known, lookahead) is None, events
    quiet = [
        ([stored([1], kv_cache_spec_kind=None)], FULL, 0),
        ([stored([1], lookahead_token_ids=[[3, 4]])], FULL, 2),
        ([stored([1], "CPU")], FULL, 2),
        ([stored([], "GPU")], FULL, 2),
        (
            [stored([1], kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64)],
            window,
            0,
        ),
    ]
    for events, known, lookahead in quiet:
        assert py_record_runs(events, known, lookahead) is not None, events


INTS = st.lists(st.integers(0, 9), max_size=4)
HASH = st.one_of(
    st.integers(2**63, 2**64 - 1),
    st.binary(min_size=0, max_size=34),
    st.sampled_from([True, "x", None, 2**70, -1]),
)
HASHES = st.one_of(INTS, INTS, INTS, st.lists(st.binary(min_size=8, max_size=8)), st.lists(HASH))
MEDIUM = st.sampled_from([None, "", "GPU", "GPU", "CPU", "cpu"])
# Mostly the known spec's, as in vLLM.
SIZE = st.sampled_from([16, 16, 16, 32, 0, -16])
WINDOW = st.sampled_from([None, None, None, 64, 0])
KIND = st.sampled_from(["full_attention", "full_attention", None, "sliding_window"])
LOOKAHEAD_IDS = st.sampled_from([None, None, [], [[]], [[1]], [[1, 2]], [[1, 2], [3]]])

STORE = st.builds(
    lambda hashes, medium, kind, size, window, ids: stored(
        hashes,
        medium,
        kv_cache_spec_kind=kind,
        block_size=size,
        kv_cache_spec_sliding_window=window,
        lookahead_token_ids=ids,
    ),
    HASHES,
    MEDIUM,
    KIND,
    SIZE,
    WINDOW,
    LOOKAHEAD_IDS,
)
# Mostly what vLLM sends (stores of the known spec, ints), so that most records have runs.
QUIET_STORE = st.builds(
    lambda hashes, medium, ids: stored(hashes, medium, lookahead_token_ids=ids),
    INTS,
    MEDIUM,
    LOOKAHEAD_IDS,
)
EVENT = st.one_of(
    *[QUIET_STORE] * 6,
    *[st.builds(removed, INTS, MEDIUM)] * 3,
    STORE,
    st.builds(removed, HASHES, MEDIUM),
    st.just(AllBlocksCleared()),
)
KNOWN = st.one_of(
    st.just(FULL), st.just(FULL), st.none(), st.tuples(KIND.filter(bool), SIZE, WINDOW)
)


@pytest.mark.skipif(not record_runs.NATIVE_RECORD_RUNS, reason="hmakv_native is not installed")
@settings(max_examples=1000, deadline=None)
@given(st.lists(EVENT, max_size=6), KNOWN, st.integers(0, 2), st.booleans())
def test_the_native_reader_answers_as_the_specification(
    events: list[KVEvent], known: KnownSpec | None, lookahead: int, as_tuple: bool
) -> None:
    native = record_runs._NATIVE
    assert native is not None
    sequence = tuple(events) if as_tuple else events
    assert native(sequence, known, lookahead) == py_record_runs(sequence, known, lookahead)
