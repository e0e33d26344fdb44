"""The sink's rules for failed record batches and new epochs, without a broker.

Which of a partition's record batches a broker fails, and which it then takes, cannot be chosen
with a real broker (it takes a batch expiring after 40 s without a partition leader, for
instance), and the order of hand-overs and acknowledgements across topics cannot be observed
from outside one; so a stand-in producer answers each ``send_batch`` as scripted and keeps what
it was handed. Everything else is the real sink, board and metrics, and aiokafka's own
``BatchBuilder``. (End to end, with Apache Kafka: tests/bridge/test_bridge_delivery.py.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.errors import NotLeaderForPartitionError
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from prometheus_client import generate_latest

from hmakv.bridge.board import BoardEntry, WorkerBoard
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.outbox import KafkaRecord, Outgoing
from hmakv.bridge.sink import KafkaSink
from hmakv.kvlog.records import DeadLetter, Topics, WorkerState, decode_worker_state, event_key

TOPICS = Topics("t")
BATCH_BYTES = 400  # a few of the records below per record batch


class ScriptedProducer:
    """Answers the n-th ``send_batch`` with ``failures[n]`` if there is one, else success."""

    def __init__(self, failures: dict[int, Exception]) -> None:
        self.failures = failures
        self.sent: list[tuple[str, int]] = []  # (topic, records) of each batch sent, in order

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(BATCH_BYTES, 0)

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failure = self.failures.get(len(self.sent))
        self.sent.append((topic, batch.record_count()))
        if failure is None:
            outcome.set_result(None)
        else:
            outcome.set_exception(failure)
        return outcome


def values_of(batch: BatchBuilder) -> list[bytes]:
    built = MemoryRecords(bytes(batch._build())).next_batch()
    return [bytes(record.value or b"") for record in built or ()]


def item(seq: int) -> Outgoing:
    record = KafkaRecord(TOPICS.events, b"w/0", bytes(100), [])
    return Outgoing("w", 0, seq, float(seq), [record], True)


def sink_for(
    producer: object, board: WorkerBoard | None = None, **options: object
) -> tuple[WorkerBoard, KafkaSink]:
    """The real sink on a stand-in producer; the board follows worker "w" unless given."""
    if board is None:
        board = WorkerBoard()
        board.add("w", BoardEntry())
    settings: dict[str, object] = {"max_queued": 100, "in_flight": 2, **options}
    sink = KafkaSink(producer, TOPICS, board, BridgeMetrics(), **settings)  # type: ignore[arg-type]
    return board, sink


async def delivered(failures: dict[int, Exception]) -> tuple[list[int], list[int]]:
    """Six batches through a sink with one chunk in flight (a producer without idempotence): the
    events' record batches sent (records in each), and the seqs refused. The events' two record
    batches are the first two sends."""
    producer = ScriptedProducer(failures)
    _, sink = sink_for(producer, in_flight=1, retry_backoff=0.0)
    refused: list[int] = []
    sink.refusal_handlers["w"] = lambda epoch, seq: refused.append(seq)
    sink.start()
    for seq in range(1, 7):
        sink.put(item(seq))
    await asyncio.wait_for(sink.close(5.0), 10)
    return [count for topic, count in producer.sent if topic == TOPICS.events], refused


async def test_a_failed_record_batch_is_sent_again_when_nothing_later_got_through() -> None:
    sent, refused = await delivered({1: NotLeaderForPartitionError()})
    assert sent == [3, 3, 3, 3]  # the partition's records again, in order
    assert refused == []


async def test_a_failed_record_batch_overtaken_by_a_later_one_is_refused_not_sent_again() -> None:
    """Sent again, the failed batch would land after the later one, and consumers would skip
    its seqs as older than what they applied: the partition's records in the chunk are refused
    instead (the first refusal starts the worker's new epoch)."""
    sent, refused = await delivered({0: NotLeaderForPartitionError()})
    assert sent == [3, 3]
    assert refused == [1, 2, 3, 4, 5, 6]


class SlowProducer(ScriptedProducer):
    """Acknowledges each record batch 20 ms after it is handed over; keeps what each held."""

    def __init__(self) -> None:
        super().__init__({})
        self.log: list[tuple[str, list[bytes]]] = []  # (event, values): "sent", then "acked"

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        values = values_of(batch)
        self.log.append((f"sent {topic}", values))
        acknowledged: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def acknowledge() -> None:
            self.log.append((f"acked {topic}", values))
            acknowledged.set_result(None)

        asyncio.get_running_loop().call_later(0.02, acknowledge)
        return acknowledged


async def test_a_new_epoch_is_in_the_workers_topic_before_any_record_of_it() -> None:
    """Were it not, a bridge restarted in between would resume the older epoch, whose records
    consumers then ignore as older than the new epoch's they have seen."""
    producer = SlowProducer()
    board, sink = sink_for(producer)
    sink.start()

    def put(epoch: int, seq: int, engine_batch: bool = True) -> None:
        value = f"{epoch}/{seq}".encode()
        record = KafkaRecord(TOPICS.events, b"w/0", value, [])
        sink.put(Outgoing("w", epoch, seq, 1.0, [record], engine_batch))

    for seq in range(1, 4):
        put(0, seq)
    put(1, -1, engine_batch=False)  # the clear that opens the engine's next life
    for seq in range(3):
        put(1, seq)
    await asyncio.wait_for(sink.close(5.0), 10)

    def epochs(values: list[bytes]) -> set[int]:
        return {decode_worker_state(v).epoch for v in values}

    announced = next(
        i
        for i, (event, values) in enumerate(producer.log)
        if event == f"acked {TOPICS.workers}" and 1 in epochs(values)
    )
    first_of_epoch_1 = next(
        i
        for i, (event, values) in enumerate(producer.log)
        if event == f"sent {TOPICS.events}" and any(v.startswith(b"1/") for v in values)
    )
    assert announced < first_of_epoch_1
    view = board.views["w"]
    assert (view.epoch, view.last_seq) == (1, 2)


class SlowMetadataProducer(SlowProducer):
    """As ``SlowProducer``; the dead-letter topic's partitions take 100 ms to look up (aiokafka's
    first look-up of a topic is a metadata round trip)."""

    async def partitions_for(self, topic: str) -> set[int]:
        if topic == TOPICS.deadletter:
            await asyncio.sleep(0.1)
        return {0}


async def test_close_delivers_a_chunk_taken_while_it_waits_for_partitions() -> None:
    """A chunk taken from the queue is neither queued nor in flight while its new key's
    partitions are looked up; were the sink idle once the chunk before it settled, close would
    stop the loops right then and count the chunk as left undelivered."""
    producer = SlowMetadataProducer()
    _, sink = sink_for(producer)
    sink.start()
    sink.put(item(0))
    await asyncio.sleep(0.005)  # the first chunk handed over, acknowledged at 20 ms
    assert sink.put_dead_letter(DeadLetter("x", "frame_count", "d", [b"a"], 0.0))
    await asyncio.sleep(0.005)  # the second taken, waiting for the dead-letter topic's partitions
    assert await asyncio.wait_for(sink.close(5.0), 10) == 0
    assert f"sent {TOPICS.deadletter}" in [event for event, _ in producer.log]


class StatesProducer(ScriptedProducer):
    """Fails the n-th record batch of the workers topic for each n in ``refused`` (for good: with
    two chunks in flight, an idempotent producer's error is final, e.g. one expired without a
    partition leader) and takes the rest at once; keeps, in order, what each batch held and
    whether Kafka took it."""

    def __init__(self, refused: set[int], log: list[tuple[str, list[bytes]]]) -> None:
        super().__init__({})
        self.refused = refused
        self.workers_batches = 0
        self.log = log  # ("took <topic>" or "refused <topic>", values)

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fails = topic == TOPICS.workers and self.workers_batches in self.refused
        self.workers_batches += topic == TOPICS.workers
        self.log.append((f"{'refused' if fails else 'took'} {topic}", values_of(batch)))
        if fails:
            outcome.set_exception(NotLeaderForPartitionError())
        else:
            outcome.set_result(None)
        return outcome

    def states(self) -> list[WorkerState]:
        """Each state Kafka took, in order."""
        return [
            decode_worker_state(value)
            for event, values in self.log
            if event == f"took {TOPICS.workers}"
            for value in values
        ]

    def states_taken(self) -> list[tuple[int, str]]:
        """(epoch, health) of each state Kafka took, in order."""
        return [(state.epoch, state.health) for state in self.states()]


def states_sink(producer: ScriptedProducer, **options: object) -> tuple[WorkerBoard, KafkaSink]:
    return sink_for(producer, state_interval=0.05, retry_backoff=0.01, **options)


async def first_state_taken(producer: StatesProducer) -> tuple[WorkerBoard, KafkaSink]:
    """A started sink once the worker's first (live) state has been handed over."""
    board, sink = states_sink(producer)
    sink.start()
    sink.state_changed()
    await asyncio.sleep(0.1)
    return board, sink


async def test_a_snapshots_position_is_no_resume_point() -> None:
    """A restarted bridge checks its resume point against the engine's batch at that seq: a
    snapshot's timestamp is its own, so an engine that stays idle after one resumes from the
    last batch before it (the relay marks a snapshot not ``resumable``)."""
    producer = StatesProducer(set(), [])
    _, sink = states_sink(producer)
    sink.start()
    sink.put(item(5))
    sink.put(item(8)._replace(ts=99.0, resumable=False))  # the engine's snapshot at seq 8
    await asyncio.wait_for(sink.close(5.0), 10)
    last = producer.states()[-1]
    assert (last.last_seq, last.ts) == (5, 5.0)


async def test_a_refused_retired_state_is_written_again() -> None:
    """The board marks a state written when a chunk takes it: were a refused one not handed
    back, consumers would never learn that the worker left and would serve its cache on."""
    producer = StatesProducer({1}, [])  # the worker's first state is taken, the retired refused
    board, sink = await first_state_taken(producer)
    board.retire("w", 0, time.time())
    sink.state_changed()
    await asyncio.sleep(0.2)
    await asyncio.wait_for(sink.close(5.0), 10)
    assert producer.states_taken() == [(0, "live"), (0, "retired")]


class LateStatesProducer(StatesProducer):
    """Settles each record batch 30 ms after the hand-over, so that two are in flight."""

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        answered = await super().send_batch(batch, topic, partition=partition)
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        error = answered.exception()  # type: ignore[attr-defined]
        settle = outcome.set_exception if error else outcome.set_result
        asyncio.get_running_loop().call_later(0.03, settle, error)
        return outcome


async def test_of_two_refused_states_of_a_retired_worker_the_newer_is_written_again() -> None:
    """Refused chunks settle oldest first: the ``degraded`` state, then the ``retired`` one.
    Putting back the first and then skipping the second as "one waits already" lost the
    retirement, and writing an older state after the newer one would take its place in the
    compacted topic."""
    producer = LateStatesProducer({1, 2}, [])  # the 2nd and 3rd state batches are refused
    board, sink = await first_state_taken(producer)
    board.set_health("w", "degraded")
    sink.state_changed()
    await asyncio.sleep(0.005)  # handed over, refused at 30 ms
    board.retire("w", 0, time.time())
    sink.state_changed()
    await asyncio.sleep(0.005)  # handed over too (two chunks in flight), refused at 30 ms
    await asyncio.sleep(0.3)
    await asyncio.wait_for(sink.close(5.0), 10)
    assert producer.workers_batches >= 4
    assert producer.states_taken() == [(0, "live"), (0, "retired")]


async def test_a_refused_health_is_written_again() -> None:
    """A ``degraded`` worker that Kafka never shows as such is served as complete."""
    producer = StatesProducer({1}, [])
    board, sink = await first_state_taken(producer)
    board.set_health("w", "degraded")
    sink.state_changed()
    await asyncio.sleep(0.2)
    await asyncio.wait_for(sink.close(5.0), 10)
    assert producer.states_taken()[-1] == (0, "degraded")


async def test_a_refused_new_epoch_is_written_again_before_any_record_of_it() -> None:
    """A refused announcement is sent again, on a new producer (the old one numbered the refused
    batch), until Kafka takes it; records of the epoch handed over before that would resume the
    older epoch after a restart, whose records consumers then ignore."""
    log: list[tuple[str, list[bytes]]] = []
    producers = [StatesProducer({1}, log)]  # the worker's first state taken, then epoch 1 refused

    async def replace(old: object) -> StatesProducer:
        producers.append(StatesProducer(set(), log))
        return producers[-1]

    board, sink = states_sink(producers[0], replace_producer=replace)
    sink.start()

    def put(epoch: int, seq: int) -> None:
        record = KafkaRecord(TOPICS.events, b"w/0", f"{epoch}/{seq}".encode(), [])
        sink.put(Outgoing("w", epoch, seq, 1.0, [record], seq >= 0))

    put(0, 0)
    await asyncio.sleep(0.05)
    put(1, -1)  # the clear that opens the engine's next life
    put(1, 0)
    await asyncio.wait_for(sink.close(5.0), 10)
    announced = next(
        i
        for i, (event, values) in enumerate(log)
        if event == f"took {TOPICS.workers}" and decode_worker_state(values[0]).epoch == 1
    )
    first_of_epoch_1 = next(
        i for i, (_, values) in enumerate(log) if any(v.startswith(b"1/") for v in values)
    )
    assert announced < first_of_epoch_1
    assert len(producers) == 2 and producers[0].workers_batches == 2  # the retry on the new one
    assert (board.views["w"].epoch, board.views["w"].last_seq) == (1, 0)


class NamedProducer(ScriptedProducer):
    """Refuses its first record batch 20 ms after the hand-over (``refuse_first``: expired, say)
    and acknowledges the others after 20 ms; logs each hand-over with its own name."""

    def __init__(self, name: str, refuse_first: bool, log: list[str]) -> None:
        super().__init__({})
        self.name, self.refuse_first, self.log = name, refuse_first, log

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[None] = loop.create_future()
        if self.refuse_first and not self.sent:
            loop.call_later(0.02, outcome.set_exception, NotLeaderForPartitionError())
        else:
            loop.call_later(0.02, outcome.set_result, None)
        self.sent.append((topic, batch.record_count()))
        self.log.append(f"{self.name} {topic}")
        return outcome


async def test_nothing_is_handed_to_a_producer_after_its_refusal() -> None:
    """aiokafka's idempotent producer numbered the refused batch, so the broker refuses every
    later batch of the partition on it as out of order. A refusal that settles while the next
    chunk grows (or an epoch is announced, or partitions are looked up) must still be seen
    before that chunk is handed over, and before the states written at close."""
    log: list[str] = []
    board = WorkerBoard()
    board.add("a", BoardEntry(changed=False))
    board.add("b", BoardEntry(changed=False))

    async def replace(old: object) -> NamedProducer:
        log.append("replaced")
        return NamedProducer("new", False, log)

    _, sink = sink_for(
        NamedProducer("old", True, log), board, linger=0.05, replace_producer=replace
    )
    sink.start()
    a = [KafkaRecord(TOPICS.events, b"a/0", b"x", [])]
    sink.put(Outgoing("a", 0, 0, 1.0, a, True))  # handed over at 50 ms, refused at 70 ms
    await asyncio.sleep(0.055)
    sink.put(Outgoing("b", 0, 0, 1.0, [KafkaRecord(TOPICS.events, b"b/0", b"y", [])], True))
    await asyncio.sleep(0.005)  # the next chunk holds its slot, grows until 105 ms
    sink.put(Outgoing("a", 0, 1, 1.0, a, True))
    await asyncio.wait_for(sink.close(5.0), 10)
    assert log[:2] == [f"old {TOPICS.events}", "replaced"]
    assert all(not entry.startswith("old") for entry in log[1:])


class RefusingEvents(StatesProducer):
    """Refuses every record batch of the events topic for good; takes the workers topic's."""

    def __init__(self, refused: set[int], log: list[tuple[str, list[bytes]]]) -> None:
        super().__init__(refused, log)
        self.events_refused = 0

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> object:
        if topic != TOPICS.events:
            return await super().send_batch(batch, topic, partition=partition)
        self.events_refused += 1
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outcome.set_exception(NotLeaderForPartitionError())
        return outcome


async def test_a_worker_that_left_leaves_nothing_behind_in_the_sink() -> None:
    """llm-d pods come and go under new names: were each one's partitions and refused epoch
    kept after it left, the bridge's memory would grow with the churn."""
    producer = RefusingEvents(set(), [])
    board, sink = sink_for(producer, WorkerBoard())
    sink.start()
    for n in range(50):  # each pod retired when the next takes its place, as the service does
        pod = f"pod-{n}"
        board.add(pod, BoardEntry())
        record = KafkaRecord(TOPICS.events, event_key(pod, 0), b"x", [])
        sink.put(Outgoing(pod, 0, 0, 1.0, [record], True))
        await sink.wait_idle()
        board.retire(pod, 0, time.time())
        sink.forget(pod)
        sink.state_changed()
        await sink.wait_idle()
    await asyncio.wait_for(sink.close(5.0), 10)
    assert producer.events_refused == 50  # each pod had a refused epoch to forget
    assert sink._partitions == {} and sink._refused_epoch == {}


@pytest.mark.parametrize("kafka", ["takes", "refuses"])
async def test_a_worker_that_left_gets_no_series_back_from_its_last_batch(kafka: str) -> None:
    """A reload removes a busy engine: its series are removed, and the acknowledgement or the
    refusal of a batch still queued must not bring one back (a series per gone pod)."""
    producer = ScriptedProducer({}) if kafka == "takes" else RefusingEvents(set(), [])
    board, sink = sink_for(producer)
    metrics = sink._metrics
    metrics.start_worker("w")
    sink.put(item(1))
    board.release("w", time.time())  # what forgetting a worker does, its batch still queued
    sink.forget("w")
    metrics.forget_worker("w")
    sink.start()
    await asyncio.wait_for(sink.close(5.0), 10)
    if isinstance(producer, RefusingEvents):
        assert producer.events_refused == 1
    else:
        assert (TOPICS.events, 1) in producer.sent
    assert 'worker="w"' not in generate_latest(metrics.registry).decode()
