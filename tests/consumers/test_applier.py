"""The Applier, rule by rule: what each record does to the index and the books, no broker."""

from __future__ import annotations

import pytest
from follower_kit import FULL, SWA, cleared, record, removed, stored, worker_state

from hmakv.consumers.applier import (
    Applier,
    BadRecord,
    EventOutcome,
    EventTaken,
    KeyBook,
    KeylessTombstone,
    StateIgnored,
    StateOutcome,
    StateTaken,
    WorkerForgotten,
    WorkerRetired,
)
from hmakv.consumers.index import ApplyOutcome, KVIndex, WorkerInfo
from hmakv.kvlog.records import (
    EventRecord,
    Health,
    WorkerState,
    decode_event_record,
    encode,
    event_key,
)

BLOCK_SIZE = 16


def new_applier() -> Applier:
    return Applier(KVIndex(hash_block_size=BLOCK_SIZE))


def read_event(applier: Applier, event: EventRecord, partition: int = 0) -> EventOutcome:
    key = event_key(event.worker, event.group_idx)
    return applier.apply_event(key, encode(event), partition)


def read_state(applier: Applier, state: WorkerState, *, replayed: bool = False) -> StateOutcome:
    return applier.apply_worker_state(state.key(), encode(state), replayed=replayed)


def info(applier: Applier, worker: str) -> WorkerInfo | None:
    return next((each for each in applier.index.workers() if each.name == worker), None)


def resident(applier: Applier, worker: str) -> dict[int, dict[str, int]]:
    found = info(applier, worker)
    assert found is not None, f"{worker} is not in the index"
    return found.resident


def taken(event: EventRecord, outcome: ApplyOutcome) -> EventTaken:
    """The record as the applier reads it: its stores' token ids left undecoded."""
    return EventTaken(decode_event_record(encode(event), token_ids=False), outcome)


# ------------------------------------------------------------------------------ keys and values

GOOD = record("w", 0, [stored([1])])


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (b"w/0", None, "empty"),
        (b"no-group", encode(GOOD), "bad_key"),
        ("w/\N{SUPERSCRIPT TWO}".encode(), encode(GOOD), "bad_key"),
        (None, encode(GOOD), "bad_key"),
        (b"w/0", b"\xc1 not msgpack", "undecodable"),
        (b"other/0", encode(GOOD), "key_mismatch"),
        (b"w/1", encode(GOOD), "key_mismatch"),
    ],
)
def test_an_event_record_whose_key_is_not_its_worker_and_group_changes_nothing(
    key: bytes | None, value: bytes | None, reason: str
) -> None:
    applier = new_applier()
    outcome = applier.apply_event(key, value, 0)
    assert isinstance(outcome, BadRecord)
    assert outcome.reason == reason
    assert applier.index.workers() == []
    assert applier.keys.entries() == []


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (b"w", b"\x93garbage", "undecodable"),
        (b"other", encode(worker_state("w", "live")), "key_mismatch"),
        (None, encode(worker_state("w", "live")), "key_mismatch"),
    ],
)
def test_a_worker_state_whose_key_is_not_its_worker_changes_nothing(
    key: bytes | None, value: bytes, reason: str
) -> None:
    applier = new_applier()
    outcome = applier.apply_worker_state(key, value, replayed=False)
    assert isinstance(outcome, BadRecord)
    assert outcome.reason == reason
    assert applier.index.workers() == []
    assert applier.worker_state("w") is None


# ------------------------------------------------------------------------------ event records


def test_a_record_applies_once_and_its_key_is_booked_where_it_was_applied() -> None:
    applier = new_applier()
    first = record("w", 0, [stored([1, 2])])
    assert read_event(applier, first, partition=2) == taken(first, ApplyOutcome.APPLIED)
    # Delivered again, read elsewhere: the index has it, and the book keeps where it applied.
    assert read_event(applier, first, partition=1) == taken(first, ApplyOutcome.DUPLICATE)
    assert resident(applier, "w") == {0: {"GPU": 2}}
    assert applier.keys.entries() == [("w", 0, 2)]


def test_a_record_of_an_older_life_changes_nothing() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1])], epoch=1))
    late = record("w", 1, [removed([1])], epoch=0)
    assert read_event(applier, late) == taken(late, ApplyOutcome.STALE_EPOCH)
    assert resident(applier, "w") == {0: {"GPU": 1}}


class _FailingIndex(KVIndex):
    """An index whose ``apply`` raises ``failure`` at one seq, as a bug would."""

    def __init__(self, fail_at_seq: int, failure: BaseException) -> None:
        super().__init__(hash_block_size=BLOCK_SIZE)
        self.fail_at_seq = fail_at_seq
        self.failure = failure

    def apply(self, record: EventRecord) -> ApplyOutcome:
        if record.seq == self.fail_at_seq:
            super().apply(record)  # half applied, then the failure
            raise self.failure
        return super().apply(record)


def test_a_record_the_index_fails_on_is_bad_and_its_group_is_forgotten() -> None:
    failure = RuntimeError("boom")
    applier = Applier(_FailingIndex(fail_at_seq=1, failure=failure))
    read_event(applier, record("w", 0, [stored([1, 2])], group=0), partition=0)
    read_event(applier, record("w", 0, [stored([1, 2], group=1)], group=1), partition=0)
    outcome = read_event(applier, record("w", 1, [stored([3])], group=0), partition=0)
    assert outcome == BadRecord("apply_error", "RuntimeError: boom", failure)
    assert resident(applier, "w") == {1: {"GPU": 2}}, "only the failed group is forgotten"


def test_a_failure_that_is_no_error_is_not_taken_for_a_bad_record() -> None:
    """A cancellation (or a KeyboardInterrupt) stops the follower between two records."""

    class Interrupted(BaseException):
        pass

    applier = Applier(_FailingIndex(fail_at_seq=0, failure=Interrupted()))
    with pytest.raises(Interrupted):
        read_event(applier, record("w", 0, [stored([1])]))


# ------------------------------------------------------------------------------ worker states


def test_a_state_sets_catalog_and_health_and_says_when_health_changed() -> None:
    applier = new_applier()
    live = worker_state("w", "live", groups={0: SWA})
    assert read_state(applier, live) == StateTaken(live, health_changed=True)
    again = worker_state("w", "live", last_seq=3, groups={0: SWA})
    assert read_state(applier, again) == StateTaken(again, health_changed=False)
    degraded = worker_state("w", "degraded", last_seq=4, groups={0: FULL, 1: SWA})
    assert read_state(applier, degraded) == StateTaken(degraded, health_changed=True)
    found = info(applier, "w")
    assert found is not None
    assert (found.health, found.groups) == ("degraded", {0: FULL, 1: SWA})
    assert applier.worker_state("w") == degraded


def test_a_state_without_groups_keeps_the_catalog_learned_from_stores() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1], spec=SWA)]))
    read_state(applier, worker_state("w", "replaying", groups={}))
    found = info(applier, "w")
    assert found is not None
    assert (found.health, found.groups) == ("replaying", {0: SWA})


def test_a_newer_epochs_state_drops_the_previous_life_before_its_records() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1, 2])], epoch=0))
    newer = worker_state("w", "live", epoch=1)
    assert isinstance(read_state(applier, newer), StateTaken)
    found = info(applier, "w")
    assert found is not None
    assert (found.epoch, found.resident, found.last_seq) == (1, {}, {})
    late = record("w", 1, [stored([3])], epoch=0)
    assert read_event(applier, late) == taken(late, ApplyOutcome.STALE_EPOCH)


def test_an_older_lifes_state_changes_nothing_and_is_worth_a_warning_once_if_read_live() -> None:
    applier = new_applier()
    current = worker_state("w", "degraded", epoch=2, groups={0: FULL, 1: SWA})
    read_state(applier, current)
    older = worker_state("w", "live", epoch=1, groups={0: FULL})
    assert read_state(applier, older, replayed=True) == StateIgnored(older, "stale_epoch")
    assert read_state(applier, older) == StateIgnored(older, "stale_epoch", behind=2)
    assert read_state(applier, older) == StateIgnored(older, "stale_epoch")
    oldest = worker_state("w", "live", epoch=0)
    assert read_state(applier, oldest) == StateIgnored(oldest, "stale_epoch", behind=2)
    found = info(applier, "w")
    assert found is not None
    assert (found.epoch, found.health, found.groups) == (2, "degraded", {0: FULL, 1: SWA})
    assert applier.worker_state("w") == current


def test_a_retired_worker_is_dropped_and_its_life_stays_retired_until_a_newer_one() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1])]), partition=1)
    read_state(applier, worker_state("w", "live"))
    retired = worker_state("w", "retired")
    assert read_state(applier, retired) == WorkerRetired(retired)
    assert (info(applier, "w"), applier.worker_state("w")) == (None, None)
    assert applier.keys.entries() == []
    assert applier.index.is_retired("w", 0)

    assert read_state(applier, retired) == StateIgnored(retired, "retired")
    late_state = worker_state("w", "live", last_seq=2)
    assert read_state(applier, late_state) == StateIgnored(late_state, "retired")
    late = record("w", 1, [stored([2])])
    assert read_event(applier, late) == taken(late, ApplyOutcome.STALE_EPOCH)
    assert info(applier, "w") is None
    assert applier.index.counters.retired_ignored == 1

    back = worker_state("w", "live", epoch=1)
    assert read_state(applier, back) == StateTaken(back, health_changed=True)
    found = info(applier, "w")
    assert found is not None
    assert (found.epoch, found.resident) == (1, {})


def test_retiring_a_life_older_than_the_one_held_changes_nothing() -> None:
    """The worker came back, and its new life's records were read before the retirement."""
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1])], epoch=1))
    retired = worker_state("w", "retired", epoch=0)
    assert read_state(applier, retired) == StateIgnored(retired, "stale_epoch")
    assert resident(applier, "w") == {0: {"GPU": 1}}
    assert not applier.index.is_retired("w", 0)


def test_a_tombstone_forgets_the_worker_retired_or_not() -> None:
    applier = new_applier()
    for name in ("u", "w"):
        read_event(applier, record(name, 0, [stored([1])]), partition=1)
        read_state(applier, worker_state(name, "live"))
    read_state(applier, worker_state("u", "retired"))

    for name in ("u", "w"):
        assert applier.apply_worker_state(name.encode(), None, replayed=False) == (
            WorkerForgotten(name)
        )
        assert (info(applier, name), applier.worker_state(name)) == (None, None)
    assert applier.keys.entries() == []
    # Forgotten, a worker is no longer retired: its records are new again.
    again = record("u", 0, [stored([1])])
    assert read_event(applier, again) == taken(again, ApplyOutcome.APPLIED)


def test_a_tombstone_without_a_key_forgets_nothing() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1])]))
    for key in (None, b""):
        assert applier.apply_worker_state(key, None, replayed=False) == KeylessTombstone()
    assert resident(applier, "w") == {0: {"GPU": 1}}


class _HealthlessIndex(KVIndex):
    def set_health(self, worker: str, health: Health) -> None:
        raise ValueError(f"no health for {worker}")


def test_a_state_the_index_fails_on_is_a_bad_record() -> None:
    applier = Applier(_HealthlessIndex(hash_block_size=BLOCK_SIZE))
    outcome = read_state(applier, worker_state("w", "live"))
    assert isinstance(outcome, BadRecord)
    assert (outcome.reason, outcome.detail) == ("apply_error", "ValueError: no health for w")
    assert isinstance(outcome.error, ValueError)


# ------------------------------------------------------------------------------ lost logs


def on_partition_0(key: bytes) -> int:
    return 0


def test_a_keys_partition_is_where_it_was_read_else_where_it_would_be_placed() -> None:
    """Group 1 is known from the catalog only: it goes where the placement puts it."""
    applier = new_applier()
    read_state(applier, worker_state("w", "live", groups={0: FULL, 1: FULL}))
    read_event(applier, record("w", 0, [stored([1])], group=0), partition=1)
    assert applier.groups_on(1, on_partition_0) == {"w": [0]}
    assert applier.groups_on(0, on_partition_0) == {"w": [1]}
    assert applier.groups_on(2, on_partition_0) == {}


def test_lost_records_forget_the_groups_on_their_partition_and_keep_their_seqs() -> None:
    applier = new_applier()
    read_event(applier, record("w", 0, [stored([1, 2])], group=0), partition=0)
    read_event(applier, record("w", 0, [stored([1, 2], group=1)], group=1), partition=1)
    read_event(applier, record("v", 0, [stored([1])]), partition=0)
    assert applier.forget_lost_groups(0, on_partition_0) == {"v": [0], "w": [0]}
    assert resident(applier, "w") == {1: {"GPU": 2}}
    assert resident(applier, "v") == {}
    found = info(applier, "w")
    assert found is not None
    assert found.last_seq == {0: 0, 1: 0}, "the seqs applied stay applied"
    replayed = record("w", 0, [stored([1, 2])], group=0)
    assert read_event(applier, replayed) == taken(replayed, ApplyOutcome.DUPLICATE)


def test_a_restarted_partition_forgets_its_workers_but_keeps_their_catalog_and_health() -> None:
    applier = new_applier()
    read_state(applier, worker_state("w", "degraded", epoch=2, groups={0: SWA}))
    read_event(applier, record("w", 4, [stored([1], spec=SWA)], epoch=2), partition=0)
    read_event(applier, record("v", 0, [stored([1])]), partition=1)
    assert applier.forget_restarted_workers(0, on_partition_0) == {"w": [0]}
    found = info(applier, "w")
    assert found is not None
    assert (found.epoch, found.last_seq, found.resident) == (0, {}, {})
    assert (found.health, found.groups) == ("degraded", {0: SWA})
    assert applier.keys.entries() == [("v", 0, 1)]
    assert resident(applier, "v") == {0: {"GPU": 1}}
    # The new log's records apply, instead of being taken for replays of an older life.
    new_log = record("w", 0, [stored([2], spec=SWA)], epoch=0)
    assert read_event(applier, new_log) == taken(new_log, ApplyOutcome.APPLIED)


# ------------------------------------------------------------------------------ the books


def test_stale_groups_are_those_read_on_partitions_no_longer_assigned() -> None:
    book = KeyBook([("u", 0, 0), ("u", 1, 1), ("v", 0, 1)])
    assert book.stale_groups({0}) == {"u": {1}, "v": {0}}
    assert book.stale_groups({0, 1}) == {}
    book.note("v", 0, 0)  # read on another partition since
    assert book.stale_groups({0}) == {"u": {1}}
    book.drop("u")
    assert book.stale_groups({0}) == {}
    assert book.entries() == [("v", 0, 0)]


def test_the_books_restored_from_a_snapshot_are_the_ones_saved() -> None:
    applier = new_applier()
    read_state(applier, worker_state("w", "degraded"))
    read_event(applier, record("w", 0, [cleared()]), partition=3)
    restored = Applier(
        KVIndex.restore(applier.index.snapshot(), hash_block_size=BLOCK_SIZE),
        worker_states=applier.worker_states(),
        key_partitions=applier.keys.entries(),
    )
    assert restored.worker_state("w") == applier.worker_state("w")
    assert restored.keys.entries() == [("w", 0, 3)]
    assert restored.groups_on(3, on_partition_0) == {"w": [0]}
    # The restored index still knows the life: a replay is a duplicate.
    replay = record("w", 0, [cleared()])
    assert read_event(restored, replay) == taken(replay, ApplyOutcome.DUPLICATE)
