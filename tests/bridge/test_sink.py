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

from aiokafka.errors import NotLeaderForPartitionError
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from bridge.board import WorkerBoard, WorkerView
from bridge.metrics import BridgeMetrics
from bridge.outbox import KafkaRecord, Outgoing
from bridge.records import Topics, decode_worker_state
from bridge.sink import KafkaSink

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


def item(seq: int) -> Outgoing:
    record = KafkaRecord(TOPICS.events, b"w/0", bytes(100), [])
    return Outgoing("w", 0, seq, float(seq), [record], True)


async def delivered(failures: dict[int, Exception]) -> tuple[list[int], list[int]]:
    """Six batches through a sink with one chunk in flight (a producer without idempotence): the
    events' record batches sent (records in each), and the seqs refused. The events' two record
    batches are the first two sends."""
    producer = ScriptedProducer(failures)
    board = WorkerBoard()
    board.add("w", WorkerView())
    sink = KafkaSink(
        producer,  # type: ignore[arg-type]
        TOPICS,
        board,
        BridgeMetrics(),
        max_queued=100,
        in_flight=1,
        retry_backoff=0.0,
    )
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
        built = MemoryRecords(bytes(batch._build())).next_batch()
        values = [bytes(record.value or b"") for record in built or ()]
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
    board = WorkerBoard()
    board.add("w", WorkerView())
    sink = KafkaSink(producer, TOPICS, board, BridgeMetrics(), max_queued=100, in_flight=2)  # type: ignore[arg-type]
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
