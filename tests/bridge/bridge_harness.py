"""Real parts for the bridge's integration tests: engines on loopback, the Kafka log, the bridge.

* ``EngineThread``: the project's ``ZmqEventPublisher`` driven from its own thread, as an engine
  drives it (snapshots are taken on that thread), publishing typical two-group steps and keeping
  the resident blocks a snapshot reports.
* ``KafkaLog``: everything the bridge wrote, read back from Kafka from the beginning.
* ``running_bridge``: a ``BridgeService`` in the test's event loop, stopped afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer

from hmakv.bridge.config import EngineConfig
from hmakv.bridge.fanout import fan_out
from hmakv.bridge.service import BridgeService, BridgeSettings
from hmakv.kafka import unique_topic
from hmakv.kafka.process import free_port
from hmakv.kvlog.kafka_client import create_consumer
from hmakv.kvlog.records import (
    DeadLetter,
    EventRecord,
    Topics,
    WorkerState,
    decode_dead_letter,
    decode_event_record,
    decode_worker_state,
)
from hmakv.producer.curve import CurveSettings
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from hmakv.producer.publisher import ZmqEventPublisher

WAIT_S = 30.0  # bound on every wait for a condition; tests never sleep for a fixed time
GROUPS = (0, 1)
TOPIC = "kv-events"


def free_port_pair() -> int:
    """A free port whose successor is free too: DP rank 1 binds the base port + 1, as in vLLM."""
    return free_port(consecutive=2)


def shape(records: list[EventRecord]) -> list[tuple[int, int, int, list[KVEvent]]]:
    """What a consumer applies from each record, leaving out the timestamp."""
    return [(r.epoch, r.seq, r.group_idx, r.events) for r in records]


def step_batch(seq: int, rank: int = 0) -> KVEventBatch:
    """A step in two groups (full attention, sliding window): stores, then an older removal."""
    events: list[KVEvent] = []
    for group, kind, window in ((0, "full_attention", None), (1, "sliding_window", 64)):
        events.append(
            BlockStored(
                [seq * 10 + group],
                None,
                list(range(4)),
                4,
                None,
                "GPU",
                None,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
        )
    if seq > 3:
        events += [BlockRemoved([(seq - 3) * 10 + g], "GPU", group_idx=g) for g in GROUPS]
    return KVEventBatch(time.time(), events, rank)


def publish_steps(publishers: list[ZmqEventPublisher], steps: int, first: int = 1) -> None:
    """Steps ``first`` on, a few milliseconds apart, from publishers that connect to a bridge."""
    for step in range(first, first + steps):
        for publisher in publishers:
            publisher.publish(step_batch(step))
        time.sleep(0.005)


class EngineThread:
    """A stand-in engine publishing through ``ZmqEventPublisher`` from one thread of its own."""

    def __init__(
        self,
        name: str,
        *,
        buffer_steps: int = 10_000,
        snapshots: bool = False,
        pub_port: int | None = None,
        replay_port: int | None = None,
        rank: int = 0,
        topic: str = TOPIC,
        replay: bool = True,
        make_batch: Callable[[int, int], KVEventBatch] = step_batch,
        curve: CurveSettings | None = None,
    ) -> None:
        self.name = name
        self.curve = curve
        self._make_batch = make_batch  # (seq, rank) -> the step's batch
        self.rank = rank
        self.topic = topic
        self.pub_port = pub_port or free_port()
        self.replay_port = (replay_port or free_port()) if replay else None
        self.published: dict[int, KVEventBatch] = {}  # seq -> batch (seq 0: the leading clear)
        self.resident: dict[int, dict[int, BlockStored]] = defaultdict(dict)
        self._buffer_steps = buffer_steps
        self._snapshots = snapshots
        self._commands: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    @property
    def config(self) -> EngineConfig:
        replay = None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"
        key = None if self.curve is None else self.curve.keys.public
        endpoint = f"tcp://127.0.0.1:{self.pub_port}"
        return EngineConfig(self.name, endpoint, replay, topic=self.topic, public_key=key)

    @property
    def last_seq(self) -> int:
        return max(self.published)

    def publish(self, steps: int, interval: float = 0.0) -> None:
        """Queue ``steps`` batches, ``interval`` seconds apart; ``wait_idle`` waits for them."""
        self._idle.clear()
        self._commands.put((steps, interval))

    def wait_idle(self, timeout: float = WAIT_S) -> None:
        assert self._idle.wait(timeout), f"engine {self.name} did not finish publishing"

    async def published_all(self, steps: int, interval: float = 0.0) -> None:
        self.publish(steps, interval)
        await asyncio.to_thread(self.wait_idle)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(WAIT_S)

    def _run(self) -> None:
        replay = None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"
        publisher = ZmqEventPublisher(
            self.rank,
            f"tcp://*:{self.pub_port}",
            replay,
            buffer_steps=self._buffer_steps,
            topic=self.topic,
            snapshot_provider=self._snapshot if self._snapshots else None,
            curve=self.curve,
        )
        self.published[0] = KVEventBatch(0.0, [AllBlocksCleared()], self.rank)
        self._idle.set()
        self._started.set()
        try:
            while True:
                try:
                    command = self._commands.get(timeout=0.005)
                except queue.Empty:
                    publisher.service_snapshot_requests()
                    continue
                if command is None:
                    return
                self._publish(publisher, *command)
                self._idle.set()
        finally:
            publisher.shutdown()

    def _publish(self, publisher: ZmqEventPublisher, steps: int, interval: float) -> None:
        for _ in range(steps):
            seq = self.last_seq + 1
            batch = self._make_batch(seq, self.rank)
            self._apply(batch)
            self.published[seq] = batch
            publisher.publish(batch)
            if interval:
                time.sleep(interval)

    def _apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.resident[event.group_idx or 0][int(event.block_hashes[0])] = event
            elif isinstance(event, BlockRemoved):
                self.resident[event.group_idx or 0].pop(int(event.block_hashes[0]), None)

    def _snapshot(self) -> list[KVEvent]:
        return [store for group in GROUPS for store in self.resident[group].values()]


@dataclass
class KafkaLog:
    """What the bridge wrote under one topic prefix, read from the beginning of each topic."""

    bootstrap: str
    topics: Topics
    events: list[EventRecord] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    headers: list[dict[str, bytes]] = field(default_factory=list)
    states: list[WorkerState] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    dead_letter_headers: list[dict[str, bytes]] = field(default_factory=list)

    async def wait_for(
        self, condition: Callable[[KafkaLog], bool], what: str, timeout: float = WAIT_S
    ) -> None:
        topics = (self.topics.events, self.topics.workers, self.topics.deadletter)
        consumer = create_consumer(self.bootstrap, *topics, client_id="test-kafka-log")
        await consumer.start()
        try:
            self._clear()
            deadline = time.monotonic() + timeout
            while not condition(self):
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await self._read(consumer)
            # The condition saw some partitions; the others are read at their own pace (a state
            # can arrive before the records it covers). Read every partition to where it ended
            # once the condition held, so the test asserts on all that was written by then.
            ends = await consumer.end_offsets(list(consumer.assignment()))
            deadline = time.monotonic() + timeout
            for tp, end in ends.items():
                while await consumer.position(tp) < end:
                    assert time.monotonic() < deadline, f"timed out reading up to {what}"
                    await self._read(consumer)
        finally:
            await consumer.stop()

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        for tp, records in (await consumer.getmany(timeout_ms=200)).items():
            for record in records:
                self._take(tp.topic, record.key, record.value, record.headers)

    def _clear(self) -> None:
        """Each wait reads the topics from their beginning again."""
        for records in (
            self.events,
            self.keys,
            self.headers,
            self.states,
            self.dead_letters,
            self.dead_letter_headers,
        ):
            records.clear()

    def _take(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        if topic == self.topics.events:
            self.events.append(decode_event_record(value))
            self.keys.append(key)
            self.headers.append(dict(headers))
        elif topic == self.topics.workers:
            self.states.append(decode_worker_state(value))
        else:
            self.dead_letters.append(decode_dead_letter(value))
            self.dead_letter_headers.append(dict(headers))

    def state(self, worker: str) -> WorkerState | None:
        return next((s for s in reversed(self.states) if s.worker == worker), None)

    def records_of(self, worker: str) -> list[EventRecord]:
        return [record for record in self.events if record.worker == worker]

    def applied(self, worker: str) -> dict[int, list[EventRecord]]:
        """Per group, the records a consumer applies: newest epoch, each seq (and each part of a
        split one) once, in order."""
        applied: dict[int, list[EventRecord]] = defaultdict(list)
        for record in self.records_of(worker):
            kept = applied[record.group_idx]
            position = (record.epoch, record.seq, record.first_event)
            if kept and position <= (kept[-1].epoch, kept[-1].seq, kept[-1].first_event):
                continue
            kept.append(record)
        return dict(applied)

    def has_seq(self, worker: str, seq: int, groups: tuple[int, ...] = GROUPS) -> bool:
        """Whether every group's records reached ``seq`` (partitions are read independently)."""
        reached = {r.group_idx for r in self.records_of(worker) if r.seq >= seq}
        return reached >= set(groups)


def expected_records(
    worker: str, epoch: int, engine: EngineThread, first: int = 1
) -> list[EventRecord]:
    """The records the engine's steps from seq ``first`` on must become, in order."""
    return [
        record
        for seq in range(first, engine.last_seq + 1)
        for record in fan_out(worker, epoch, seq, engine.published[seq], GROUPS)
    ]


def by_group(records: list[EventRecord]) -> dict[int, list[EventRecord]]:
    grouped: dict[int, list[EventRecord]] = defaultdict(list)
    for record in records:
        grouped[record.group_idx].append(record)
    return dict(grouped)


def settings_for(bootstrap: str, **overrides: object) -> BridgeSettings:
    values: dict[str, object] = {
        "kafka": bootstrap,
        "topic_prefix": unique_topic("bridge"),
        "partitions": 3,
        "replay_timeout": 2.0,
        "state_interval": 0.2,
        "shutdown_timeout": 10.0,
    }
    values.update(overrides)
    return BridgeSettings(**values)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_bridge(
    settings: BridgeSettings, engines: list[EngineConfig]
) -> AsyncIterator[BridgeService]:
    service = BridgeService(settings, engines)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@contextlib.contextmanager
def engines_running(*engines: EngineThread) -> Iterator[None]:
    try:
        yield
    finally:
        for engine in engines:
            engine.stop()


def metric(service: BridgeService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def metric_reaches(
    service: BridgeService, name: str, least: float, timeout: float = WAIT_S, **labels: str
) -> None:
    """Until the metric is at least ``least``: the sink counts after Kafka's acknowledgement,
    which a consumer may see first."""
    deadline = asyncio.get_running_loop().time() + timeout
    while metric(service, name, **labels) < least:
        assert asyncio.get_running_loop().time() < deadline, f"{name}{labels} never reached {least}"
        await asyncio.sleep(0.02)
