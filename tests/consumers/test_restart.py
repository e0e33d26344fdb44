"""Snapshots: a follower killed without a final snapshot restarts from its last one, gives the
same answers, and reads only what came after it, from a file or from the compacted topic."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition
from follower_kit import (
    SWA,
    LogWriter,
    add_partitions,
    cleared,
    delete_records,
    follower_config,
    fresh_topics,
    partition_of,
    record,
    recreate_topic,
    removed,
    stored,
    wait_until,
    worker_state,
)
from prometheus_client import generate_latest

from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.service import IndexService, ServiceConfig
from hmakv.consumers.snapshots import FileSnapshotStore, KafkaSnapshotStore, SnapshotStore, unpack
from hmakv.consumers.stats import ScoreStats
from hmakv.kafka import unique_topic
from hmakv.kvlog.kafka_client import TopicSpec, create_consumer
from hmakv.kvlog.records import EventRecord, Topics
from hmakv.producer.events import KVEvent

pytestmark = pytest.mark.kafka

WORKERS = ("a", "b", "c")
PROMPTS = [list(range(1, n)) for n in (3, 6, 9, 12)]


def history(seqs: range) -> list[EventRecord]:
    """Each worker stores a growing prefix in groups 0 (full) and 1 (window), evicts some.

    A window block is evicted at least three seqs after its full-attention copy was stored, so
    partial evictions count the same however the two groups' partitions interleave.
    """
    records = []
    for seq in seqs:
        for n, worker in enumerate(WORKERS):
            hashes = list(range(1, seq + n + 2))
            records.append(record(worker, seq, [stored(hashes[-2:])], group=0))
            window: list[KVEvent] = [
                stored(hashes[-2:], group=1, spec=SWA),
                removed(hashes[:-3], group=1),
            ]
            records.append(record(worker, seq, window, group=1))
    return records


def store_for(target: str, bootstrap: str, topics: Topics, tmp_path: Path) -> SnapshotStore:
    if target == "file":
        return FileSnapshotStore(tmp_path / "index.snapshot")
    # Tiny chunks: every snapshot spans many records.
    return KafkaSnapshotStore(bootstrap, topics.snapshots, "restart-test", chunk_bytes=256)


def answers(follower: Follower) -> list[object]:
    """What routers get (the counters are Prometheus counters: each process counts its own)."""
    index = follower.index
    scores = [index.score(prompt, len(prompt) * 16 + 1) for prompt in PROMPTS]
    return [index.workers(), scores]


def events_consumed(follower: Follower) -> int:
    return follower.stats.consumed.get(follower.config.topics.events, 0)


async def applied_everything(follower: Follower, count: int) -> None:
    await wait_until(lambda: events_consumed(follower) == count, f"{count} records consumed")


@pytest.mark.parametrize("target", ["file", "kafka"])
async def test_restart_resumes_from_the_snapshot_with_the_same_answers(
    kafka_bootstrap: str, tmp_path: Path, target: str
) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=2)
    config = follower_config(kafka_bootstrap, topics)
    before, after = (
        [*history(range(0, 12)), record("d", 0, [stored([1, 2])])],
        # "d" has one group: its clear cannot race another partition's records of "d", so the
        # answers do not depend on how the two partitions' records interleave.
        [*history(range(12, 15)), record("d", 1, [cleared()])],
    )
    async with LogWriter(kafka_bootstrap, topics) as log:
        first = Follower(config, store_for(target, kafka_bootstrap, topics, tmp_path))
        await first.start()
        await log.events(*before)
        await applied_everything(first, len(before))
        snapshot = await first.snapshot_now()
        assert snapshot is not None
        await log.events(*after)
        await applied_everything(first, len(before) + len(after))
        expected = answers(first)
        await first.stop(final_snapshot=False)  # what a crash leaves: the older snapshot

        second = Follower(config, store_for(target, kafka_bootstrap, topics, tmp_path))
        await second.start()
        try:
            await wait_until(lambda: second.ready, "the restarted follower ready")
            await applied_everything(second, len(after))
            assert answers(second) == expected
            saved = {TopicPartition(o.topic, o.partition): o.offset for o in snapshot.offsets}
            assert second.stats.restored_offsets == saved
            assert second.stats.start_offsets == saved, "it resumed where the snapshot was taken"
            assert sum(saved.values()) == len(before), "the snapshot reflects what was applied"
        finally:
            await second.stop()


class SlowDisk:
    """A store whose save takes 0.3 s in a thread, as a large snapshot's file write does; it
    notes whether two saves ever ran at once."""

    def __init__(self) -> None:
        self.first_started = threading.Event()
        self.saving = 0
        self.overlapped = False
        self.saved: list[bytes] = []

    def describe(self) -> str:
        return "slow disk"

    async def save(self, blob: bytes) -> None:
        await asyncio.to_thread(self._write, blob)

    def _write(self, blob: bytes) -> None:
        self.saving += 1
        self.overlapped |= self.saving > 1
        self.first_started.set()
        time.sleep(0.3)
        self.saved.append(blob)
        self.saving -= 1

    async def load(self) -> bytes | None:
        return self.saved[-1] if self.saved else None

    async def close(self) -> None:
        return None


async def test_stop_lets_a_periodic_snapshot_finish_before_the_final_one(
    kafka_bootstrap: str,
) -> None:
    """Cancelled mid-save, a periodic snapshot's write goes on in its thread while the final
    one is written: two writes of one file at once (or a Kafka store's chunks cut short)."""
    topics = await fresh_topics(kafka_bootstrap)
    disk = SlowDisk()
    follower = Follower(follower_config(kafka_bootstrap, topics, snapshot_interval_s=0.05), disk)
    await follower.start()
    await asyncio.to_thread(disk.first_started.wait, 10)
    await follower.stop(final_snapshot=True)
    assert not disk.overlapped
    assert follower.stats.snapshots_failed == 0
    assert unpack(disk.saved[-1]).created == follower.stats.last_snapshot_at


async def test_sigterm_during_a_periodic_snapshot_lets_it_finish_before_the_final_one(
    kafka_bootstrap: str,
) -> None:
    """``hmakv index`` on SIGTERM: ``run_until`` cancels the task following the follower. That
    cancellation must not reach a periodic snapshot being written, or its write goes on in its
    thread beside the final one (a file store writes one ``.partial`` twice at once)."""
    topics = await fresh_topics(kafka_bootstrap)
    config = follower_config(kafka_bootstrap, topics, snapshot_interval_s=0.05)
    service = IndexService(ServiceConfig(follower=config, port=0, snapshot_to="none"))
    disk = service.follower.store = SlowDisk()
    sigterm = asyncio.Event()
    serving = asyncio.create_task(service.run_until(sigterm))
    await asyncio.to_thread(disk.first_started.wait, 30)  # a periodic save is in its thread
    sigterm.set()
    await serving
    assert not disk.overlapped
    assert len(disk.saved) == 2, "the periodic snapshot and the final one"
    stats = service.follower.stats
    assert (stats.snapshots_written, stats.snapshots_failed) == (2, 0)
    assert unpack(disk.saved[-1]).created == stats.last_snapshot_at


async def test_kafka_store_keeps_only_the_newest_snapshot(kafka_bootstrap: str) -> None:
    topic = unique_topic("hmakv-snapshots")
    writer = KafkaSnapshotStore(kafka_bootstrap, topic, "keeper", chunk_bytes=100)
    try:
        assert await writer.load() is None
        await writer.save(b"old" * 200)
        await writer.save(b"new" * 150)
    finally:
        await writer.close()
    reader = KafkaSnapshotStore(kafka_bootstrap, topic, "keeper")
    assert await reader.load() == b"new" * 150
    latest = await _latest_values(kafka_bootstrap, topic)
    live_chunks = {key for key, value in latest.items() if b"/" in key and value is not None}
    deleted = {key for key, value in latest.items() if b"/" in key and value is None}
    assert len(live_chunks) == 5 and len(deleted) == 6  # 450 / 100 bytes, 600 / 100 bytes
    assert latest[b"keeper"] is not None


async def _latest_values(bootstrap: str, topic: str) -> dict[bytes, bytes | None]:
    consumer = create_consumer(bootstrap, topic, client_id="test-snapshot-reader")
    await consumer.start()
    latest: dict[bytes, bytes | None] = {}
    try:
        tp = TopicPartition(topic, 0)
        end = (await consumer.end_offsets([tp]))[tp]
        while not latest or await consumer.position(tp) < end:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                latest.update((r.key, r.value) for r in records)
    finally:
        await consumer.stop()
    return latest


async def test_an_unreadable_snapshot_means_reading_the_log_from_the_start(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    path = tmp_path / "index.snapshot"
    path.write_bytes(b"not a snapshot")
    records = history(range(3))
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*records)
    follower = Follower(follower_config(kafka_bootstrap, topics), FileSnapshotStore(path))
    with caplog.at_level(logging.ERROR, logger="hmakv.consumers.follower"):
        await follower.start()
    try:
        await applied_everything(follower, len(records))
        assert "cannot restore" in caplog.text
    finally:
        await follower.stop()
    assert path.read_bytes() != b"not a snapshot", "the final snapshot replaced it"


async def test_records_deleted_before_the_snapshot_caught_up_are_counted_as_lost(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    config: FollowerConfig = follower_config(kafka_bootstrap, topics)
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record("a", seq, [stored([seq])]) for seq in range(10)))
        first = Follower(config, FileSnapshotStore(tmp_path / "index.snapshot"))
        await first.start()
        await applied_everything(first, 10)
        await first.stop()  # snapshot at offset 10
        offsets = await log.events(*(record("a", seq, [stored([seq])]) for seq in range(10, 15)))
    await delete_records(kafka_bootstrap, TopicPartition(topics.events, 0), offsets[3])
    second = Follower(config, FileSnapshotStore(tmp_path / "index.snapshot"))
    await second.start()
    try:
        await applied_everything(second, 2)
        assert second.stats.records_lost == 3
    finally:
        await second.stop()


async def test_groups_whose_records_were_lost_are_forgotten_not_served_as_live(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost record may have removed blocks the index still holds: every (worker, group) whose
    key maps to the partition that lost records under-reports until new records, rather than
    report hits its worker may not have. Groups on other partitions keep their state."""
    topics = await fresh_topics(kafka_bootstrap, partitions=2)
    names = [f"w{n}" for n in range(64)]
    # "lost" has group 0 on partition 0 and group 1 on partition 1; "kept" has group 0 on 1.
    lost = next(w for w in names if (partition_of(w, 0, 2), partition_of(w, 1, 2)) == (0, 1))
    kept = next(w for w in names if partition_of(w, 0, 2) == 1)
    config = follower_config(kafka_bootstrap, topics)
    path = tmp_path / "index.snapshot"
    async with LogWriter(kafka_bootstrap, topics) as log:
        before = [
            record(lost, 0, [stored([1, 2, 3])]),
            record(lost, 0, [stored([1, 2, 3], group=1)], group=1),
            record(kept, 0, [stored([1, 2, 3])]),
        ]
        await log.events(*before)
        first = Follower(config, FileSnapshotStore(path))
        await first.start()
        await applied_everything(first, len(before))
        await first.stop()  # the snapshot holds blocks 1..3 in both of lost's groups
        removal, after = await log.events(
            record(lost, 1, [removed([1, 2, 3])]), record(lost, 2, [stored([7])])
        )
    # retention deletes the removal before the follower reads it
    second = await restarted_after_retention(kafka_bootstrap, config, path, after, caplog)
    try:
        await applied_everything(second, 1)
        assert second.stats.records_lost == after - removal
        hits = {s.worker: s for s in second.index.score([1, 2, 3], 3 * 16 + 1)}
        assert hits[lost].group_hit_tokens == {0: 0, 1: 48}
        assert (hits[lost].hit_tokens, hits[kept].hit_tokens) == (0, 48)
        assert {info.name: info.resident for info in second.index.workers()} == {
            lost: {0: {"GPU": 1}, 1: {"GPU": 3}},
            kept: {0: {"GPU": 3}},
        }
        assert f"{lost} [0]" in caplog.text
    finally:
        await second.stop()


async def restarted_after_retention(
    bootstrap: str,
    config: FollowerConfig,
    path: Path,
    deleted_before: int,
    caplog: pytest.LogCaptureFixture,
) -> Follower:
    """Retention deletes the events' partition 0 up to ``deleted_before`` while the follower is
    down; it starts again from its snapshot at ``path``, its errors captured."""
    await delete_records(bootstrap, TopicPartition(config.topics.events, 0), deleted_before)
    follower = Follower(config, FileSnapshotStore(path))
    with caplog.at_level(logging.ERROR, logger="hmakv.consumers.follower"):
        await follower.start()
    return follower


async def test_records_deleted_while_a_running_follower_is_behind_are_noticed(
    kafka_bootstrap: str,
) -> None:
    """Retention can also overtake a running follower; aiokafka then moves it to the log start
    without a word, and the follower must notice the jump itself. Falling behind is made
    certain by pausing the follower's consumer (aiokafka's own pause) while records come and go."""
    topics = await fresh_topics(kafka_bootstrap, partitions=1)
    follower = Follower(follower_config(kafka_bootstrap, topics))
    await follower.start()
    try:
        async with LogWriter(kafka_bootstrap, topics) as log:
            await log.events(record("w", 0, [stored([1, 2, 3])]))
            await applied_everything(follower, 1)
            tp = TopicPartition(topics.events, 0)
            follower._events.pause(tp)
            [removal] = await log.events(record("w", 1, [removed([1, 2, 3])]))
            await delete_records(kafka_bootstrap, tp, removal + 1)
            await log.events(record("w", 2, [stored([9])]))
            follower._events.resume(tp)
            await wait_until(lambda: follower.stats.records_lost == 1, "the deleted record noticed")
        await applied_everything(follower, 2)
        # The removal was lost: blocks 1..3 are forgotten, not served as still held.
        assert follower.index.score([1, 2, 3], 3 * 16 + 1)[0].hit_tokens == 0
    finally:
        await follower.stop()


async def test_lost_records_forget_groups_where_they_were_read_not_where_keys_map_now(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bridge keeps the partition of a worker it follows when partitions are added, so a
    key's records can be on a partition other than the one the default partitioner names now:
    the groups forgotten for lost records are those read on the partition that lost them."""
    topics = await fresh_topics(kafka_bootstrap, partitions=1)
    moved = next(w for w in (f"w{n}" for n in range(64)) if partition_of(w, 0, 2) == 1)
    config = follower_config(kafka_bootstrap, topics)
    path = tmp_path / "index.snapshot"
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(record(moved, 0, [stored([1, 2, 3])]))
        first = Follower(config, FileSnapshotStore(path))
        await first.start()
        await applied_everything(first, 1)
        await first.stop()  # the snapshot: moved's group 0 read on partition 0
    await add_partitions(kafka_bootstrap, topics.events, 2)
    async with LogWriter(kafka_bootstrap, topics) as log:  # the bridge keeps partition 0
        _, after = await log.events(
            record(moved, 1, [removed([1, 2, 3])]), record(moved, 2, [stored([7])]), partition=0
        )
    # retention deletes the removal before the follower reads it
    second = await restarted_after_retention(kafka_bootstrap, config, path, after, caplog)
    try:
        await applied_everything(second, 1)
        assert second.stats.records_lost == 1
        assert second.index.score([1, 2, 3], 3 * 16 + 1)[0].hit_tokens == 0
        assert [info.resident for info in second.index.workers()] == [{0: {"GPU": 1}}]
        assert f"{moved} [0]" in caplog.text
    finally:
        await second.stop()


async def test_a_snapshot_past_the_end_of_a_recreated_topic_reads_it_again_from_the_start(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The events topic was recreated (or truncated by an unclean leader election) while the
    snapshot survived: its position is past the new log's end. aiokafka would go back to the
    beginning without a word, and the old life's seqs and epoch would make the new log's
    records look like replays. The restart is counted and logged, the workers with keys there
    forgotten (their catalog and health, from the workers topic, kept), and the log read
    again from its beginning."""
    topics = await fresh_topics(kafka_bootstrap)
    config = follower_config(kafka_bootstrap, topics)
    path = tmp_path / "index.snapshot"
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.state(worker_state("w", "degraded", epoch=2, groups={0: SWA}))
        await log.events(
            *(record("w", seq, [stored([seq + 1], spec=SWA)], epoch=2) for seq in range(5))
        )
        first = Follower(config, FileSnapshotStore(path))
        await first.start()
        await applied_everything(first, 5)
        await wait_until(lambda: first.stats.worker_states_applied == 1, "w's state")
        await first.stop()  # the snapshot: events partition 0 read up to offset 5
    await recreate_topic(kafka_bootstrap, TopicSpec(topics.events))
    async with LogWriter(kafka_bootstrap, topics) as log:  # a bridge without its resume point
        await log.events(record("w", 0, [stored([100], spec=SWA)], epoch=0))
    second = Follower(config, FileSnapshotStore(path))
    with caplog.at_level(logging.ERROR, logger="hmakv.consumers.follower"):
        await second.start()
    try:
        await applied_everything(second, 1)
        tp = TopicPartition(topics.events, 0)
        assert (second.stats.restored_offsets[tp], second.stats.start_offsets[tp]) == (5, 0)
        assert second.stats.log_restarts == {topics.events: 1}
        assert second.stats.events_applied == 1, "the new log's record applied, not a replay"
        [info] = second.index.workers()
        assert (info.epoch, info.last_seq, info.resident) == (0, {0: 0}, {0: {"GPU": 1}})
        assert (info.health, info.groups) == ("degraded", {0: SWA})
        assert "position 5 is past the log (it ends at 1)" in caplog.text
        forgotten = "forgot these workers (blocks, seqs, epoch), which had these groups there"
        assert f"{forgotten}: w [0]" in caplog.text
        page = generate_latest(index_registry(second, ScoreStats())).decode()
        assert f'hmakv_index_log_restarts_total{{topic="{topics.events}"}} 1.0' in page
    finally:
        await second.stop()


async def test_a_log_restarted_under_a_running_follower_is_read_again_from_the_start(
    kafka_bootstrap: str,
) -> None:
    """The same, noticed while running: aiokafka moves the consumer back to the beginning of a
    log that ends before its position, and the first fetch starts below it."""
    topics = await fresh_topics(kafka_bootstrap)
    follower = Follower(follower_config(kafka_bootstrap, topics))
    await follower.start()
    try:
        async with LogWriter(kafka_bootstrap, topics) as log:
            await log.events(*(record("w", seq, [stored([seq + 1])], epoch=1) for seq in range(5)))
        await applied_everything(follower, 5)
        await recreate_topic(kafka_bootstrap, TopicSpec(topics.events))
        async with LogWriter(kafka_bootstrap, topics) as log:
            await log.events(record("w", 0, [stored([100])], epoch=0))
        await wait_until(lambda: follower.stats.events_applied == 6, "the new log's record")
        assert follower.stats.log_restarts == {topics.events: 1}
        [info] = follower.index.workers()
        assert (info.epoch, info.resident) == (0, {0: {"GPU": 1}})
        await wait_until(lambda: follower.ready and follower.lag() == 0, "ready again")
    finally:
        await follower.stop()
