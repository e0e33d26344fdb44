"""The follower against a real Kafka broker, fed records exactly as the bridge writes them."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from aiokafka.structs import TopicPartition
from follower_kit import (
    SWA,
    LogWriter,
    cleared,
    committed_offsets,
    follower_config,
    fresh_topics,
    hit_tokens,
    record,
    removed,
    resident,
    running,
    stored,
    wait_until,
    worker_state,
)

from bridge.records import EventRecord, encode, event_key
from consumers.follower import Follower
from consumers.index import ApplyOutcome, KVIndex

pytestmark = pytest.mark.kafka


def events_consumed(follower: Follower) -> int:
    return follower.stats.consumed.get(follower.config.topics.events, 0)


async def test_records_apply_in_order_and_replays_or_older_epochs_change_nothing(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.events(
            record("w", 0, [stored([1, 2, 3])]),
            record("w", 1, [removed([3])]),
            record("w", 1, [stored([3])]),  # seq 1 again: a replay, whatever it carries
            record("w", 2, [stored([4])]),
        )
        await wait_until(lambda: events_consumed(follower) == 4, "4 records consumed")
        # In order: 3 was stored, then removed; the replayed store of 3 was ignored.
        assert hit_tokens(follower, "w", [1, 2, 3, 4]) == 32
        assert resident(follower, "w") == 3

        await log.events(
            record("w", 0, [stored([7])], epoch=1),  # the engine restarted
            record("w", 3, [stored([1, 2, 3])], epoch=0),  # a late record of its previous life
        )
        await wait_until(lambda: events_consumed(follower) == 6, "6 records consumed")
        assert hit_tokens(follower, "w", [1, 2, 3]) == 0
        assert resident(follower, "w") == 1
        [info] = follower.index.workers()
        assert (info.epoch, info.last_seq) == (1, {0: 0})
        counters = follower.index.counters
        assert (counters.duplicates_ignored, counters.stale_epoch_ignored) == (1, 1)
        assert follower.stats.events_applied == 4


async def test_clears_catalogs_and_degraded_workers_take_effect_at_once(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.events(record("w", 0, [stored([1, 2])]))
        await log.state(worker_state("w", "degraded", last_seq=0, groups={0: SWA}))
        await wait_until(lambda: follower.index.workers()[0].health == "degraded", "degraded")
        [info] = follower.index.workers()
        assert info.groups == {0: SWA}
        assert follower.worker_state("w") is not None

        await log.state(worker_state("w", "live", last_seq=1))
        await log.events(record("w", 1, [cleared()]))
        await wait_until(lambda: events_consumed(follower) == 2, "the clear consumed")
        assert follower.index.workers()[0].health == "live"
        assert resident(follower, "w") == 0


async def test_bad_records_are_counted_by_reason_logged_and_skipped(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    good = record("w", 0, [stored([1])])
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        with caplog.at_level(logging.WARNING, logger="consumers.follower"):
            await log.raw(topics.events, b"w/0", b"\xc1 not msgpack")
            await log.raw(topics.events, b"w/0", b"\xc1 again")
            await log.raw(topics.events, b"no-group", encode(good))
            await log.raw(topics.events, event_key("other", 0), encode(good))
            await log.raw(topics.events, b"w/0", None)
            await log.raw(topics.workers, b"w", b"\x93garbage")
            await log.events(good)
            await wait_until(lambda: follower.stats.events_applied == 1, "the good record")
            await wait_until(lambda: sum(follower.stats.bad_records.values()) == 6, "all bad")
        assert follower.stats.bad_records == {
            (topics.events, "undecodable"): 2,
            (topics.events, "bad_key"): 1,
            (topics.events, "key_mismatch"): 1,
            (topics.events, "empty"): 1,
            (topics.workers, "undecodable"): 1,
        }
        assert resident(follower, "w") == 1
        warnings = [r.getMessage() for r in caplog.records if "skipped a" in r.getMessage()]
        # The second undecodable event record is counted, not logged again.
        assert len(warnings) == 5, warnings


async def test_replica_mode_reads_every_partition_in_every_follower(kafka_bootstrap: str) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=3)
    workers = [f"w{n}" for n in range(8)]
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record(w, 0, [stored([n + 1])]) for n, w in enumerate(workers)))
        for name in ("replica-a", "replica-b"):
            config = follower_config(kafka_bootstrap, topics, follower_id=name)
            async with running(Follower(config)) as follower:
                await wait_until(lambda: follower.ready, f"{name} ready")
                assert [info.name for info in follower.index.workers()] == workers
                assert {
                    tp.partition for tp in follower.positions() if tp.topic == topics.events
                } == {
                    0,
                    1,
                    2,
                }


class _FailingIndex(KVIndex):
    """An index whose apply fails at one seq, as a bug would: the follower must stop there."""

    def __init__(self, fail_at_seq: int) -> None:
        super().__init__(hash_block_size=16)
        self.fail_at_seq = fail_at_seq

    def apply(self, record: EventRecord) -> ApplyOutcome:
        if record.seq == self.fail_at_seq:
            raise RuntimeError(f"apply failed at seq {record.seq}")
        return super().apply(record)


async def test_group_mode_commits_only_what_was_applied(kafka_bootstrap: str) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    tp = TopicPartition(topics.events, 0)
    config = follower_config(kafka_bootstrap, topics, mode="group", group_id=topics.prefix)
    async with LogWriter(kafka_bootstrap, topics) as log:
        offsets = await log.events(*(record("w", seq, [stored([seq + 1])]) for seq in range(10)))
        async with running(Follower(config)) as follower:
            await wait_until(lambda: follower.stats.events_applied == 10, "10 applied")
            await wait_until(lambda: follower.positions()[tp] == offsets[-1] + 1, "positioned")
        committed = await committed_offsets(kafka_bootstrap, topics.prefix, topics.events, 1)
        assert committed == {0: offsets[-1] + 1}

        # Small fetches, so that commits happen between the batches before the failing one.
        failing = Follower(dataclasses.replace(config, max_records_per_fetch=2))
        failing.index = _FailingIndex(fail_at_seq=15)
        offsets = await log.events(
            *(record("w", seq, [stored([seq + 1])]) for seq in range(10, 20))
        )
        await failing.start()
        with pytest.raises(RuntimeError, match="seq 15"):
            await failing.run()
        await failing.stop(final_snapshot=False)
    after_failure = await committed_offsets(kafka_bootstrap, topics.prefix, topics.events, 1)
    assert after_failure[0] is not None
    assert after_failure[0] <= offsets[5], "an offset was committed for a record never applied"
    assert after_failure[0] >= offsets[3], "applied batches before the failure were not committed"


async def test_group_rebalance_commits_revoked_partitions_and_marks_their_groups_stale(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=2)
    keys = [(worker, group) for worker in ("u", "v", "w") for group in (0, 1)]

    def member(name: str) -> Follower:
        return Follower(
            follower_config(
                kafka_bootstrap, topics, mode="group", group_id=topics.prefix, follower_id=name
            )
        )

    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record(w, 0, [stored([9])], group=g) for w, g in keys))
        async with running(member("first")) as first:
            await wait_until(lambda: first.stats.events_applied == len(keys), "all applied")
            assert all(not first.stale_groups(worker) for worker, _ in keys)
            async with running(member("second")) as second:
                await wait_until(
                    lambda: second.ready and len(first.assigned_partitions()) == 1,
                    "the partitions split between the members",
                )
                [taken] = second.assigned_partitions()
                assert taken not in first.assigned_partitions()
                committed = await committed_offsets(
                    kafka_bootstrap, topics.prefix, topics.events, 2
                )
                # The revoked partition was committed at what the first member had applied.
                assert committed[taken.partition] == first.positions()[taken]
                moved = {(w, g) for w, g in keys if g in first.stale_groups(w)}
                assert moved, "some worker group lives in the moved partition"
                for worker, group in keys:
                    assert resident(second, worker, group) == (1 if (worker, group) in moved else 0)
                    assert not second.stale_groups(worker)
