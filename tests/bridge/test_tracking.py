"""The SequenceTracker, scenario by scenario: each rule of ``bridge.tracking`` in isolation."""

from __future__ import annotations

import pytest

from hmakv.bridge.tracking import (
    BufferOverflow,
    CancelFetch,
    Clear,
    Duplicate,
    EpochStarted,
    Fetch,
    FetchKind,
    Forward,
    GapDetected,
    GapReplayed,
    GapUnrecoverable,
    HealthChanged,
    ResumePoint,
    SequenceTracker,
    Step,
)
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

STORES: list[KVEvent] = [BlockStored([1], None, [1, 2], 2, None, "GPU", None)]


def batch(seq: int, *, life: int = 0, clear: bool = False) -> KVEventBatch:
    events: list[KVEvent] = [AllBlocksCleared()] if clear else [BlockRemoved([seq], "GPU")]
    return KVEventBatch(1000.0 * life + seq, events, 0)


def forwards(steps: list[Step]) -> list[tuple[int, int]]:
    return [(s.epoch, s.seq) for s in steps if isinstance(s, Forward)]


def only_fetch(steps: list[Step]) -> Fetch:
    fetches = [s for s in steps if isinstance(s, Fetch)]
    assert len(fetches) == 1, steps
    return fetches[0]


def test_in_order_batches_are_forwarded_as_they_come() -> None:
    tracker = SequenceTracker(can_fetch=True)
    steps = [step for seq in range(3) for step in tracker.on_live(seq, batch(seq))]
    assert steps == [Forward(0, seq, batch(seq)) for seq in range(3)]
    assert tracker.health == "live"


def test_a_gap_is_replayed_then_held_batches_follow_without_duplicates() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    steps = tracker.on_live(3, batch(3))
    fetch = only_fetch(steps)
    # from seq 0, the last one forwarded: the engine must still have that very batch there
    assert fetch == Fetch(fetch.fetch_id, FetchKind.REPLAY, 0)
    assert GapDetected(1, 3) in steps
    assert HealthChanged("replaying") in steps
    assert tracker.on_live(4, batch(4)) == []  # held while the replay runs
    replayed = [
        s for seq in (0, 1, 2, 3) for s in tracker.on_fetched(fetch.fetch_id, seq, batch(seq))
    ]
    assert replayed[0] == Duplicate(0)
    assert forwards(replayed) == [(0, 1), (0, 2), (0, 3)]
    end = tracker.on_fetch_end(fetch.fetch_id)
    assert forwards(end) == [(0, 4)]
    assert GapReplayed(1, 3, FetchKind.REPLAY) in end
    assert HealthChanged("live") in end


def test_live_batches_a_replay_ran_ahead_of_are_duplicates() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    fetch = only_fetch(tracker.on_live(2, batch(2)))
    for seq in (1, 2, 3, 4):  # the engine had published up to 4 when it served the replay
        tracker.on_fetched(fetch.fetch_id, seq, batch(seq))
    tracker.on_fetch_end(fetch.fetch_id)
    assert tracker.on_live(3, batch(3)) == [Duplicate(3)]
    assert tracker.on_live(4, batch(4)) == [Duplicate(4)]
    assert forwards(tracker.on_live(5, batch(5))) == [(0, 5)]


def test_joining_mid_stream_replays_from_seq_zero() -> None:
    tracker = SequenceTracker(can_fetch=True)
    steps = tracker.on_live(7, batch(7))
    assert only_fetch(steps).start_seq == 0
    assert GapDetected(0, 7) in steps


def test_a_ring_that_does_not_reach_back_asks_for_a_snapshot_and_applies_it() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(5, batch(5)))
    snapshot_fetch = only_fetch(tracker.on_fetched(replay.fetch_id, 4, batch(4)))
    assert snapshot_fetch.kind is FetchKind.SNAPSHOT
    tracker.on_live(7, batch(7))
    stores: list[KVEvent] = [BlockStored([1], None, [1, 2], 2, None, "GPU", None)]
    tracker.on_fetched(snapshot_fetch.fetch_id, 6, KVEventBatch(9.0, [AllBlocksCleared()], 0))
    tracker.on_fetched(snapshot_fetch.fetch_id, 6, KVEventBatch(9.0, stores, 0))
    steps = tracker.on_fetch_end(snapshot_fetch.fetch_id)
    merged = KVEventBatch(9.0, [AllBlocksCleared(), *stores], 0)
    assert steps[0] == Forward(0, 6, merged, snapshot=True)
    assert GapReplayed(1, 5, FetchKind.SNAPSHOT) in steps
    # seq 7 was held, seq 6 is covered by the snapshot: 7 follows at once
    assert forwards(steps) == [(0, 6), (0, 7)]
    assert tracker.health == "live"


def test_without_a_snapshot_the_lost_span_is_cleared_and_the_worker_degraded() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(5, batch(5)))
    snapshot = only_fetch(tracker.on_fetched(replay.fetch_id, 3, batch(3)))
    again = only_fetch(tracker.on_fetch_end(snapshot.fetch_id))  # end marker alone: none
    assert (again.kind, again.start_seq) == (FetchKind.REPLAY, 0)
    steps = tracker.on_fetched(again.fetch_id, 3, batch(3))
    assert steps[:3] == [
        GapUnrecoverable(1, 3, "the replay ring no longer reaches back"),
        Clear(0, 2, "the replay ring no longer reaches back"),
        Forward(0, 3, batch(3)),
    ]
    tracker.on_fetched(again.fetch_id, 4, batch(4))
    tracker.on_fetched(again.fetch_id, 5, batch(5))
    tracker.on_fetch_end(again.fetch_id)
    assert tracker.next_seq == 6
    assert tracker.health == "degraded"
    # the next gap does not ask for a snapshot again: the engine has said it offers none
    replay = only_fetch(tracker.on_live(8, batch(8)))
    steps = tracker.on_fetched(replay.fetch_id, 7, batch(7))
    assert steps[0] == GapUnrecoverable(6, 7, "the replay ring no longer reaches back")
    assert not [s for s in steps if isinstance(s, Fetch)]


def test_an_engine_clear_ends_degraded_health() -> None:
    tracker = SequenceTracker(can_fetch=False)
    tracker.on_live(0, batch(0))
    tracker.on_live(2, batch(2))
    assert tracker.health == "degraded"
    steps = tracker.on_live(3, batch(3, clear=True))
    assert steps == [Forward(0, 3, batch(3, clear=True)), HealthChanged("live")]


def test_without_a_replay_endpoint_every_gap_is_lost_at_once() -> None:
    tracker = SequenceTracker(can_fetch=False)
    tracker.on_live(0, batch(0))
    cause = "the engine has no replay endpoint"
    assert tracker.on_live(4, batch(4)) == [
        GapDetected(1, 4),
        GapUnrecoverable(1, 4, cause),
        Clear(0, 3, cause),
        Forward(0, 4, batch(4)),
        HealthChanged("degraded"),
    ]


def test_a_sequence_going_backwards_is_a_restart_with_a_clear_first() -> None:
    tracker = SequenceTracker(can_fetch=True)
    for seq in range(3):
        tracker.on_live(seq, batch(seq))
    steps = tracker.on_live(0, batch(0, life=1, clear=True))
    assert steps == [
        EpochStarted(1, "the live sequence went backwards (2 -> 0)"),
        Clear(1, -1, "the live sequence went backwards (2 -> 0)"),
        Forward(1, 0, batch(0, life=1, clear=True)),
    ]


def test_a_restart_seen_mid_stream_replays_the_new_life_from_zero() -> None:
    tracker = SequenceTracker(can_fetch=True)
    for seq in range(6):
        tracker.on_live(seq, batch(seq))
    steps = tracker.on_live(2, batch(2, life=1))
    assert [type(s) for s in steps[:2]] == [EpochStarted, Clear]
    assert only_fetch(steps).start_seq == 0
    assert tracker.epoch == 1


def test_a_restart_cancels_the_replay_in_progress() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(3, batch(3)))
    steps = tracker.on_live(0, batch(0, life=1, clear=True))
    assert steps[0] == CancelFetch(replay.fetch_id)
    assert forwards(steps) == [(1, 0)]
    assert tracker.on_fetched(replay.fetch_id, 1, batch(1)) == []  # late replies are ignored


def test_a_leading_clear_at_seq_zero_after_later_seqs_is_a_restart() -> None:
    # A resumed worker whose first replay showed a new life: the live seq 0 of yet another life
    # is not below any live seq seen, but its leading clear gives the restart away.
    tracker = SequenceTracker(can_fetch=True, resume=ResumePoint(0, 4, 4.0))
    verify = only_fetch(tracker.start())
    restart = tracker.on_fetched(verify.fetch_id, 4, batch(4, life=1))
    replay = only_fetch(restart)
    tracker.on_fetched(replay.fetch_id, 0, batch(0, life=1, clear=True))
    tracker.on_fetched(replay.fetch_id, 1, batch(1, life=1))
    tracker.on_fetch_end(replay.fetch_id)
    steps = tracker.on_live(0, batch(0, life=2, clear=True))
    assert isinstance(steps[0], EpochStarted) and steps[0].cause.startswith("seq 0 opened")
    assert tracker.epoch == 2


def test_a_live_batch_unlike_the_one_replayed_at_its_seq_is_a_restart() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(2, batch(2)))
    for seq in (1, 2, 3):
        tracker.on_fetched(replay.fetch_id, seq, batch(seq))
    tracker.on_fetch_end(replay.fetch_id)
    # seq 3 of the first life was only replayed; a different seq 3 is another life
    steps = tracker.on_live(3, batch(3, life=1))
    assert isinstance(steps[0], EpochStarted)
    assert "not the batch replayed" in steps[0].cause


def test_a_resumed_position_is_verified_and_replay_continues_after_it() -> None:
    tracker = SequenceTracker(can_fetch=True, resume=ResumePoint(3, 9, batch(9).ts))
    verify = only_fetch(tracker.start())
    assert verify.start_seq == 9
    assert tracker.on_fetched(verify.fetch_id, 9, batch(9)) == [Duplicate(9)]
    assert forwards(tracker.on_fetched(verify.fetch_id, 10, batch(10))) == [(3, 10)]
    tracker.on_fetch_end(verify.fetch_id)
    # seq 9 was published by the life the bridge resumed: live again, it is a new life
    assert tracker.on_live(9, batch(9, life=1))[0] == EpochStarted(
        4, "the live sequence went backwards (9 -> 9)"
    )


def test_a_resumed_position_from_another_life_starts_a_new_epoch_and_replays_from_zero() -> None:
    tracker = SequenceTracker(can_fetch=True, resume=ResumePoint(3, 9, 9.0))
    verify = only_fetch(tracker.start())
    steps = tracker.on_fetched(verify.fetch_id, 9, batch(9, life=1))
    assert [type(s) for s in steps[:3]] == [CancelFetch, EpochStarted, Clear]
    assert steps[2] == Clear(4, -1, steps[1].cause)  # type: ignore[union-attr]
    assert only_fetch(steps).start_seq == 0


def test_a_gap_published_after_the_replay_request_is_replayed_not_lost() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    # learn that the engine offers no snapshot, losing seq 1 on the way
    first = only_fetch(tracker.on_live(2, batch(2)))
    snapshot = only_fetch(tracker.on_fetched(first.fetch_id, 2, batch(2)))
    again = only_fetch(tracker.on_fetch_end(snapshot.fetch_id))
    tracker.on_fetched(again.fetch_id, 2, batch(2))
    tracker.on_fetch_end(again.fetch_id)
    # seqs 3 and 4 got lost live and are seen missing at 5; 6 is lost live during the replay
    replay = only_fetch(tracker.on_live(5, batch(5)))
    assert tracker.on_live(7, batch(7)) == []  # held until the replay ends
    # the ring had lost 2, 3 and 4 already: the reply starts at its oldest, 5
    steps = tracker.on_fetched(replay.fetch_id, 5, batch(5))
    steps += tracker.on_fetch_end(replay.fetch_id)
    assert GapUnrecoverable(3, 5, "the replay ring no longer reaches back") in steps
    assert [s.seq for s in steps if isinstance(s, Forward)] == [5]
    # 6 may well be in the ring: ask, from seq 5 (the last batch forwarded, to verify)
    assert GapDetected(6, 7) in steps
    assert only_fetch(steps).start_seq == 5
    assert tracker.next_seq == 6


def test_the_live_buffer_is_bounded_and_overflow_is_replayed_later() -> None:
    tracker = SequenceTracker(can_fetch=True, max_buffered=2)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(2, batch(2)))
    tracker.on_live(3, batch(3))
    assert tracker.on_live(4, batch(4)) == [BufferOverflow(4)]
    assert tracker.buffered == 2
    for seq in (1, 2):  # what the engine had published when it served the request
        tracker.on_fetched(replay.fetch_id, seq, batch(seq))
    steps = tracker.on_fetch_end(replay.fetch_id)
    assert forwards(steps) == [(0, 3)]
    assert only_fetch(steps).start_seq == 3


def test_an_undecodable_batch_is_lost_and_degrades_the_worker() -> None:
    tracker = SequenceTracker(can_fetch=False)
    tracker.on_live(0, batch(0))
    steps = tracker.on_undecodable(1)
    assert steps[:2] == [
        GapUnrecoverable(1, 2, "the batch could not be decoded"),
        Clear(0, 1, "the batch could not be decoded"),
    ]
    assert forwards(tracker.on_live(2, batch(2))) == [(0, 2)]
    assert tracker.health == "degraded"


def test_an_undecodable_batch_is_recovered_by_a_snapshot_when_offered() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    snapshot = only_fetch(tracker.on_undecodable(1))
    assert snapshot.kind is FetchKind.SNAPSHOT
    tracker.on_fetched(snapshot.fetch_id, 1, batch(1, clear=True))
    assert forwards(tracker.on_fetch_end(snapshot.fetch_id)) == [(0, 1)]
    assert tracker.health == "live"


def test_a_replay_that_times_out_loses_its_gap() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(3, batch(3)))
    steps = tracker.on_fetch_failed(replay.fetch_id, "no reply within 5 s")
    assert steps[0] == GapUnrecoverable(1, 3, "replay failed: no reply within 5 s")
    assert forwards(steps) == [(0, 3)]
    assert tracker.health == "degraded"


def test_a_refused_delivery_opens_a_new_epoch_with_a_clear_and_asks_for_a_snapshot() -> None:
    tracker = SequenceTracker(can_fetch=True)
    for seq in range(3):
        tracker.on_live(seq, batch(seq))
    steps = tracker.on_delivery_failed(0, 1)
    assert steps[:2] == [
        EpochStarted(1, "Kafka refused seq 1 of epoch 0"),
        Clear(1, 2, "Kafka refused seq 1 of epoch 0"),
    ]
    assert only_fetch(steps).kind is FetchKind.SNAPSHOT
    assert tracker.on_delivery_failed(0, 2) == []  # an older epoch's failures change nothing


def test_an_idle_engines_snapshot_after_a_refusal_rebuilds_the_cleared_view() -> None:
    """An idle engine's snapshot is at its last seq, the seq of the refusal's clear: it is the
    view to rebuild, not one older than what was forwarded."""
    tracker = SequenceTracker(can_fetch=True)
    for seq in range(3):
        tracker.on_live(seq, batch(seq))
    snapshot = only_fetch(tracker.on_delivery_failed(0, 1))
    snapshot_batch = KVEventBatch(9.0, [AllBlocksCleared(), *STORES], 0)
    tracker.on_fetched(snapshot.fetch_id, 2, snapshot_batch)
    steps = tracker.on_fetch_end(snapshot.fetch_id)
    assert steps == [
        Forward(1, 2, snapshot_batch, snapshot=True),
        HealthChanged("live"),
    ]
    assert forwards(tracker.on_live(3, batch(3))) == [(1, 3)]
    # once taken, that seq is not taken again by a later snapshot
    gap = only_fetch(tracker.on_live(6, batch(6)))
    again = only_fetch(tracker.on_fetched(gap.fetch_id, 5, batch(5)))  # the ring lost 3 and 4
    tracker.on_fetched(again.fetch_id, 2, snapshot_batch)
    assert forwards(tracker.on_fetch_end(again.fetch_id)) == []


def test_a_refusal_during_a_replay_asks_for_a_snapshot_in_its_place() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(3, batch(3)))  # seqs 1..2 missing
    steps = tracker.on_delivery_failed(0, 0)
    assert CancelFetch(replay.fetch_id) in steps
    snapshot = only_fetch(steps)
    assert snapshot.kind is FetchKind.SNAPSHOT
    snapshot_batch = KVEventBatch(9.0, [AllBlocksCleared(), *STORES], 0)
    tracker.on_fetched(snapshot.fetch_id, 2, snapshot_batch)
    end = tracker.on_fetch_end(snapshot.fetch_id)
    assert forwards(end) == [(1, 2), (1, 3)]  # the snapshot, then the live batch held
    assert tracker.health == "live"


def test_a_live_batch_a_catch_up_replay_brought_first_is_overlap_even_at_seq_zero() -> None:
    """The project's publisher opens every life with a clear at seq 0: the same batch arriving
    live after a replay forwarded it is not a new life."""
    tracker = SequenceTracker(can_fetch=True)
    catch_up = only_fetch(tracker.on_connected())
    first = batch(0, clear=True)
    tracker.on_fetched(catch_up.fetch_id, 0, first)
    tracker.on_fetched(catch_up.fetch_id, 1, batch(1))
    tracker.on_fetch_end(catch_up.fetch_id)
    assert tracker.on_live(0, first) == [Duplicate(0)]
    assert tracker.epoch == 0
    assert isinstance(tracker.on_live(0, batch(0, life=1, clear=True))[0], EpochStarted)


def test_a_reconnect_while_a_fetch_runs_catches_up_once_it_ends() -> None:
    """The running replay may have been served before the connection dropped: what was
    published while it was down only a replay asked after the reconnect shows."""
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(2, batch(2)))
    assert tracker.on_connected() == []
    for seq in (0, 1, 2):
        tracker.on_fetched(replay.fetch_id, seq, batch(seq))
    catch_up = only_fetch(tracker.on_fetch_end(replay.fetch_id))
    assert (catch_up.kind, catch_up.start_seq) == (FetchKind.REPLAY, 2)
    tracker.on_fetched(catch_up.fetch_id, 2, batch(2))
    tracker.on_fetched(catch_up.fetch_id, 3, batch(3))  # published while disconnected
    end = tracker.on_fetch_end(catch_up.fetch_id)
    assert GapReplayed(3, 4, FetchKind.REPLAY) in end
    assert tracker.next_seq == 4


def test_a_fetch_asked_after_a_reconnect_is_its_catch_up() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    only_fetch(tracker.on_live(2, batch(2)))
    assert tracker.on_connected() == []
    snapshot = only_fetch(tracker.on_delivery_failed(0, 0))  # reaches the engine's head
    tracker.on_fetched(snapshot.fetch_id, 2, KVEventBatch(9.0, [AllBlocksCleared()], 0))
    end = tracker.on_fetch_end(snapshot.fetch_id)
    assert [s for s in end if isinstance(s, Fetch)] == []


def test_stale_fetch_replies_are_ignored() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    replay = only_fetch(tracker.on_live(2, batch(2)))
    stale = replay.fetch_id + 100
    assert tracker.on_fetched(stale, 1, batch(1)) == []
    assert tracker.on_fetch_end(stale) == []
    assert tracker.on_fetch_failed(stale, "x") == []


def test_max_buffered_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_buffered"):
        SequenceTracker(can_fetch=True, max_buffered=0)


def test_live_batches_held_when_a_resumed_position_proves_a_restart_belong_to_the_new_life() -> (
    None
):
    tracker = SequenceTracker(can_fetch=True, resume=ResumePoint(0, 4, 4.0))
    verify = only_fetch(tracker.start())
    tracker.on_live(6, batch(6, life=1))  # held: a replay is running
    replay = only_fetch(tracker.on_fetched(verify.fetch_id, 4, batch(4, life=1)))
    assert (replay.start_seq, tracker.live_high, tracker.buffered) == (0, 6, 1)
    # the new life's ring no longer has seqs 0..5, although the engine published them before
    # the request: that is a loss to repair by snapshot, not a reason to ask again
    assert only_fetch(tracker.on_fetch_end(replay.fetch_id)).kind is FetchKind.SNAPSHOT


def test_a_connection_catches_up_from_the_first_seq_never_seen() -> None:
    tracker = SequenceTracker(can_fetch=True)
    replay = only_fetch(tracker.on_connected())
    assert (replay.kind, replay.start_seq) == (FetchKind.REPLAY, 0)
    steps = [s for seq in (0, 1) for s in tracker.on_fetched(replay.fetch_id, seq, batch(seq))]
    assert forwards(steps) == [(0, 0), (0, 1)]
    end = tracker.on_fetch_end(replay.fetch_id)
    assert end[:2] == [GapDetected(0, 2), GapReplayed(0, 2, FetchKind.REPLAY)]
    again = only_fetch(tracker.on_connected())  # a reconnect: verify seq 1, then what follows
    assert again.start_seq == 1
    assert tracker.on_connected() == []  # a replay already runs
    assert SequenceTracker(can_fetch=False).on_connected() == []


def test_a_new_life_that_outran_the_old_one_is_caught_by_the_replay_that_verifies() -> None:
    tracker = SequenceTracker(can_fetch=True)
    for seq in range(3):
        tracker.on_live(seq, batch(seq))
    # disconnected while the engine restarted and published past seq 2: live looks like a gap
    replay = only_fetch(tracker.on_live(9, batch(9, life=1)))
    assert replay.start_seq == 2
    steps = tracker.on_fetched(replay.fetch_id, 2, batch(2, life=1))
    assert [type(s) for s in steps[:3]] == [CancelFetch, EpochStarted, Clear]
    assert only_fetch(steps).start_seq == 0
    assert tracker.buffered == 1  # live seq 9 is of the new life: kept


def test_a_reply_that_stops_short_of_a_batch_held_from_live_comes_from_another_life() -> None:
    tracker = SequenceTracker(can_fetch=True)
    replay = only_fetch(tracker.on_live(2, batch(2)))
    # the life that sent seq 2 would replay 0..2: its ring had them all when it served the
    # request; this reply stops at 0, so a newer life of the engine answered
    tracker.on_fetched(replay.fetch_id, 0, batch(0, life=1))
    steps = tracker.on_fetch_end(replay.fetch_id)
    assert isinstance(steps[0], EpochStarted)
    assert "another life replied" in steps[0].cause
    assert only_fetch(steps).start_seq == 0
    assert tracker.buffered == 0  # the held batch was of the life that is gone


def test_a_replay_after_a_loss_verifies_the_last_batch_forwarded_before_it() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    snapshot = only_fetch(tracker.on_undecodable(1))
    replay = only_fetch(tracker.on_fetch_end(snapshot.fetch_id))  # no snapshot offered
    tracker.on_fetched(replay.fetch_id, 0, batch(0))
    tracker.on_fetched(replay.fetch_id, 1, None)  # the same bad bytes: seq 1 is lost
    tracker.on_fetch_end(replay.fetch_id)
    assert (tracker.next_seq, tracker.health) == (2, "degraded")
    replay = only_fetch(tracker.on_live(3, batch(3)))
    assert replay.start_seq == 0  # nothing was forwarded at seq 1: verify seq 0
    # a successor engine answers: its seq 0 is not the one forwarded, whatever follows it
    steps = tracker.on_fetched(replay.fetch_id, 0, batch(0, life=1))
    assert isinstance(steps[1], EpochStarted)


def test_an_empty_answer_to_a_verifying_replay_is_probed_from_0_and_finds_a_new_life() -> None:
    """A restarted engine left idle: its new seq 0 went out before the bridge's subscription
    arrived, and the catch-up from the old life's last batch comes back empty (tests/faults
    found it: the index kept the old life's blocks). The life that published that batch holds
    at least it, so a ring with batches but not it is another life's."""
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    tracker.on_live(1, batch(1))
    catch_up = only_fetch(tracker.on_connected())
    assert catch_up.start_seq == 1  # verifying the last batch forwarded
    probe = only_fetch(tracker.on_fetch_end(catch_up.fetch_id))  # nothing at all
    assert probe.start_seq == 0
    new_life = KVEventBatch(ts=100.0, events=[AllBlocksCleared()])
    steps = tracker.on_fetched(probe.fetch_id, 0, new_life)
    assert any(isinstance(step, EpochStarted) for step in steps)
    assert any(isinstance(step, Clear) for step in steps)
    again = only_fetch(steps)
    assert again.start_seq == 0 and tracker.epoch == 1
    steps = tracker.on_fetched(again.fetch_id, 0, new_life)
    steps += tracker.on_fetch_end(again.fetch_id)
    assert [(s.epoch, s.seq) for s in steps if isinstance(s, Forward)] == [(1, 0)]


def test_an_empty_ring_answers_the_probe_empty_too_and_nothing_restarts() -> None:
    tracker = SequenceTracker(can_fetch=True)
    tracker.on_live(0, batch(0))
    catch_up = only_fetch(tracker.on_connected())
    probe = only_fetch(tracker.on_fetch_end(catch_up.fetch_id))
    steps = tracker.on_fetch_end(probe.fetch_id)
    assert not any(isinstance(step, (EpochStarted, Clear, Fetch)) for step in steps)
    assert (tracker.epoch, tracker.next_seq) == (0, 1)
