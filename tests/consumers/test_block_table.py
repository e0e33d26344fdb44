"""The native block table (``hmakv_native.BlockTable``) against its specification
(``consumers.block_table.PyBlockTable``): the same operations leave the same entries and answer
the same, and an index on every native path (tables, record runs and the hit scan) answers as
one on the Python specification. Skipped without ``hmakv_native``, the one thing scripts/setup
may leave out (a machine without cargo); CI builds it."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.bridge.fanout import fan_out
from hmakv.consumers import block_table, hit_rule, record_runs
from hmakv.consumers.block_table import PyBlockTable, Table
from hmakv.consumers.index import KVIndex
from hmakv.fleet.engines import GROUPS, group_store
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, KVEvent, KVEventBatch

pytestmark = pytest.mark.skipif(
    not block_table.NATIVE_TABLE, reason="hmakv_native is not installed: run scripts/setup"
)

# A few hashes, so that runs share holders and removals find what stores left; and some that
# are no u64 int (never stored by either table; True is 1 to a lookup, as to a dict).
HASHES = st.one_of(
    st.integers(0, 11), st.sampled_from([2**64 - 1, 2**63]), st.sampled_from([-1, 2**64, True])
)
BITS = st.integers(1, 2**70)  # wider than a machine word, as a large fleet's packed ints are


def derive_with(bit: int, stamp: int):  # type: ignore[no-untyped-def]
    return lambda held: None if held & bit else held | stamp


def classify_with(bit: int, keep: int):  # type: ignore[no-untyped-def]
    return lambda held: (bool(held & bit), bool(held & keep), held & ~bit)


def packed(keys: Sequence[object]) -> array[int]:
    """The u64 keys as the hasher packs a prompt's hashes (``ExternalHashes``)."""
    return array("Q", [key for key in keys if type(key) is int and 0 <= key < 2**64])


def native(items: list[tuple[int, int]] | None = None) -> Table:
    from hmakv_native import BlockTable

    return BlockTable(items)


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(HASHES, max_size=12), st.integers(0, 8), BITS, BITS),
        st.tuples(st.just("remove"), st.lists(HASHES, max_size=12), BITS, BITS, st.booleans()),
        st.tuples(st.just("set"), HASHES, BITS),
        st.tuples(st.just("del"), HASHES),
        st.tuples(st.just("map"), BITS),
        st.tuples(
            st.just("runs"), st.lists(HASHES, max_size=20), st.integers(1, 3), st.integers(0, 9)
        ),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_both_tables_agree_on_every_operation(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    spec, fast = PyBlockTable(), native()
    extras: tuple[dict[int, int], dict[int, int]] = ({3: 2, 5: 1}, {3: 2, 5: 1})
    for op, *args in operations:
        if op == "store":
            hashes, room, bit, stamp = args
            derive = derive_with(bit, stamp)
            assert spec.store(hashes, room, derive) == fast.store(hashes, room, derive)
        elif op == "remove":
            hashes, bit, keep, with_extra = args
            classify = classify_with(bit, keep)
            spec_extra, fast_extra = extras if with_extra else (None, None)
            assert spec.remove(hashes, classify, spec_extra) == fast.remove(
                hashes, classify, fast_extra
            )
            assert extras[0] == extras[1]
        elif op == "set" and 0 <= args[0] < 2**64:
            spec[args[0]] = fast[args[0]] = args[1]
        elif op == "del" and args[0] in spec:
            del spec[args[0]], fast[args[0]]
        elif op == "map":
            spec.map_values(args[0].__xor__)
            fast.map_values(args[0].__xor__)
        elif op == "runs":  # a list, any other sequence, and packed keys read in place
            keys, step, count = args
            assert spec.runs(*args) == fast.runs(*args)
            assert spec.runs(tuple(keys), step, count) == fast.runs(tuple(keys), step, count)
            assert spec.runs(packed(keys), step, count) == fast.runs(packed(keys), step, count)
        assert sorted(spec.items()) == sorted(fast.items())
        probe = [0, 3, 2**64 - 1, -1, 2**64]
        assert spec.get_many(probe, 0) == fast.get_many(probe, 0)
        assert spec.get_many(packed(probe), 0) == fast.get_many(packed(probe), 0)
        assert [spec.get(h, 7) for h in probe] == [fast.get(h, 7) for h in probe]
        assert len(spec) == len(fast) and sorted(spec) == sorted(fast)


def test_the_native_table_is_a_mapping_of_u64s() -> None:
    table = native([(1, 10), (2**64 - 1, 20)])
    table[5] = 7
    assert (len(table), table[5], table.get(9, 0), table.get(-1, 0)) == (3, 7, 0, 0)
    assert 5 in table and -1 not in table and "x" not in table
    del table[5]
    with pytest.raises(KeyError):
        del table[5]
    with pytest.raises(KeyError):
        table[-1]
    assert sorted(table.items()) == [(1, 10), (2**64 - 1, 20)]
    assert sorted(table) == sorted(table.keys()) and sorted(table.values()) == [10, 20]
    assert len(native()) == 0 and not native()


@contextmanager
def python_specification() -> Iterator[None]:
    """Tables made, records read and prompts scanned in Python while it lasts."""
    saved = block_table._NATIVE, hit_rule._NATIVE, record_runs._NATIVE
    block_table._NATIVE, hit_rule._NATIVE, record_runs._NATIVE = None, None, None
    try:
        yield
    finally:
        block_table._NATIVE, hit_rule._NATIVE, record_runs._NATIVE = saved


EVENTS = st.lists(
    st.tuples(
        st.integers(0, 2),  # worker
        st.sampled_from(["store", "remove", "clear"]),
        st.integers(0, 1),  # group
        st.lists(st.integers(0, 15), min_size=1, max_size=8),
        st.sampled_from(["GPU", "CPU"]),
    ),
    max_size=40,
)


def _apply(index: KVIndex, events: list[tuple[int, str, int, list[int], str]]) -> None:
    for seq, (worker, kind, group, hashes, medium) in enumerate(events):
        event: KVEvent
        if kind == "store":
            event = group_store(list(hashes), GROUPS[group])
            event.medium = medium  # type: ignore[misc]
        elif kind == "remove":
            event = BlockRemoved(list(hashes), medium, group_idx=group)
        else:
            event = AllBlocksCleared()
        batch = KVEventBatch(0.0, [event], 0)
        for record in fan_out(f"w{worker}", 0, seq, batch, [group]):
            index.apply(record)


@settings(max_examples=150, deadline=None)
@given(EVENTS, st.lists(st.integers(0, 15), min_size=1, max_size=10))
def test_an_index_on_the_native_paths_answers_as_the_specification(
    events: list[tuple[int, str, int, list[int], str]], prompt: list[int]
) -> None:
    fast = KVIndex(hash_block_size=16)
    _apply(fast, events)
    with python_specification():
        spec = KVIndex(hash_block_size=16)
        _apply(spec, events)
    assert fast.workers() == spec.workers()
    assert fast.counters == spec.counters
    tokens = 16 * len(prompt) + 1
    for details in (True, False):
        answer = fast.score(prompt, tokens, details=details)
        with python_specification():
            assert answer == spec.score(prompt, tokens, details=details)
    assert KVIndex.restore(fast.snapshot()).workers() == spec.workers()
    assert fast.snapshot() == spec.snapshot()
