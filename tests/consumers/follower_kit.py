"""Test helpers: a fresh set of hmakv topics on the real broker, records written as the bridge
writes them, and bounded waits (tests never sleep for a fixed time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, RecordsToDelete
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.kafka import unique_topic
from hmakv.kvlog.kafka_client import (
    TopicSpec,
    create_consumer,
    ensure_topics,
    start_producer,
    topic_partitions,
)
from hmakv.kvlog.records import EventRecord, Health, Retired, Topics, WorkerState, encode, event_key
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

WAIT_S = 60.0
BLOCK_SIZE = 16
FULL = GroupSpec(kind="full_attention", block_size=BLOCK_SIZE)
SWA = GroupSpec(kind="sliding_window", block_size=BLOCK_SIZE, sliding_window=32)


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` (plain or async) until true; fail after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        answer = condition()
        if not isinstance(answer, bool):
            answer = await answer
        if answer:
            return
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def fresh_topics(bootstrap: str, *, partitions: int = 1) -> Topics:
    """Events with ``partitions`` partitions and a compacted workers topic, as the bridge makes."""
    topics = Topics(unique_topic("hmakv"))
    await ensure_topics(
        bootstrap,
        [
            TopicSpec(topics.events, partitions=partitions),
            TopicSpec(topics.workers, config={"cleanup.policy": "compact"}),
        ],
    )
    return topics


async def add_partitions(bootstrap: str, topic: str, total: int) -> None:
    """Grow ``topic`` to ``total`` partitions, as an operator does, and wait until the broker's
    metadata says so (a producer started before that would not see them)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_partitions({topic: NewPartitions(total_count=total)})
    finally:
        await admin.close()

    async def grown() -> bool:
        return len(await topic_partitions(bootstrap, topic)) == total

    await wait_until(grown, f"{topic} has {total} partitions")


async def delete_records(bootstrap: str, tp: TopicPartition, before: int) -> None:
    """What retention does: the partition's records before offset ``before`` are gone."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(before)})
    finally:
        await admin.close()


async def recreate_topic(bootstrap: str, spec: TopicSpec) -> None:
    """Delete the topic and create it again, empty, as an operator resetting Kafka would.

    A running consumer's metadata requests may have the broker create it first (topics are
    created on demand): either way, it is back once it exists with nothing in it."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([spec.name])
    finally:
        await admin.close()

    async def empty_again() -> bool:
        await ensure_topics(bootstrap, [spec])  # "already exists" until the deletion completed
        return await _log_ends(bootstrap, spec.name) == {0}

    await wait_until(empty_again, f"{spec.name} created again")


async def _log_ends(bootstrap: str, topic: str) -> set[int]:
    partitions = await topic_partitions(bootstrap, topic)
    if not partitions:
        return set()
    consumer = create_consumer(bootstrap, client_id="test-log-ends")
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
    finally:
        await consumer.stop()
    return set(ends.values())


def follower_config(bootstrap: str, topics: Topics, **overrides: Any) -> FollowerConfig:
    settings: dict[str, Any] = {
        "bootstrap": bootstrap,
        "topics": topics,
        "follower_id": "test-follower",
        "hash_block_size": BLOCK_SIZE,
        "snapshot_interval_s": 0,
        "commit_interval_s": 0,
        "ready_max_lag": 0,
    }
    return FollowerConfig(**(settings | overrides))


@asynccontextmanager
async def running(follower: Follower) -> AsyncIterator[Follower]:
    """Started, and stopped (with its final snapshot) however the test ends."""
    await follower.start()
    try:
        yield follower
    finally:
        await follower.stop()


class LogWriter:
    """Writes records exactly as the bridge does: key, headers and msgpack value."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self._bootstrap = bootstrap
        self.topics = topics
        self._producer: Any = None

    async def __aenter__(self) -> LogWriter:
        self._producer = (await start_producer(self._bootstrap, client_id="test-writer")).producer
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    async def events(self, *records: EventRecord, partition: int | None = None) -> list[int]:
        """Send in order (per key, as Kafka keeps it); the offset each record got.

        ``partition``: where the bridge keeps a followed worker's keys after partitions were
        added (by default, where the producer's partitioner puts them now)."""
        deliveries = [
            await self._producer.send(
                self.topics.events,
                encode(record),
                key=event_key(record.worker, record.group_idx),
                headers=record.headers(),
                partition=partition,
            )
            for record in records
        ]
        return [(await delivery).offset for delivery in deliveries]

    async def state(self, state: WorkerState) -> None:
        await self._producer.send_and_wait(self.topics.workers, encode(state), key=state.key())

    async def raw(self, topic: str, key: bytes | None, value: bytes | None) -> int:
        metadata = await self._producer.send_and_wait(topic, value, key=key)
        offset: int = metadata.offset
        return offset


def record(
    worker: str, seq: int, events: Sequence[KVEvent], *, group: int = 0, epoch: int = 0
) -> EventRecord:
    return EventRecord(worker, epoch, seq, time.time(), group, list(events))


def stored(
    hashes: Sequence[ExternalBlockHash], *, group: int = 0, spec: GroupSpec = FULL
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=spec.block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )


def removed(hashes: Sequence[ExternalBlockHash], *, group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=group)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def worker_state(
    worker: str,
    health: Health | Retired,
    *,
    epoch: int = 0,
    last_seq: int = -1,
    groups: dict[int, GroupSpec] | None = None,
) -> WorkerState:
    return WorkerState(
        worker=worker,
        epoch=epoch,
        last_seq=last_seq,
        health=health,
        groups=groups if groups is not None else {0: FULL},
        ts=time.time(),
    )


async def committed_offsets(
    bootstrap: str, group_id: str, topic: str, partitions: int
) -> dict[int, int | None]:
    """What the group committed, read by a consumer that does not join the group."""
    consumer = create_consumer(bootstrap, client_id="test-committed", group_id=group_id)
    await consumer.start()
    try:
        return {
            partition: await consumer.committed(TopicPartition(topic, partition))
            for partition in range(partitions)
        }
    finally:
        await consumer.stop()


def resident(follower: Follower, worker: str, group: int = 0, medium: str = "GPU") -> int:
    for info in follower.index.workers():
        if info.name == worker:
            return info.resident.get(group, {}).get(medium, 0)
    return 0


def hit_tokens(follower: Follower, worker: str, hashes: Sequence[ExternalBlockHash]) -> int:
    num_tokens = len(hashes) * BLOCK_SIZE + 1
    for score in follower.index.score(list(hashes), num_tokens):
        if score.worker == worker:
            return score.hit_tokens
    raise AssertionError(f"{worker} is not in the index")


def partition_of(worker: str, group: int, partitions: int) -> int:
    """The events partition of a worker's group: where the bridge's producer puts its key."""
    every = list(range(partitions))
    return int(DefaultPartitioner()(event_key(worker, group), every, every))
