"""The sink's rules for a partition whose record batches fail, without a broker.

Which of a partition's record batches a broker fails, and which it then takes, cannot be chosen
with a real broker (it takes a batch expiring after 40 s without a partition leader, for
instance), so a stand-in producer answers each ``send_batch`` as scripted. Everything else is the
real sink, board and metrics, and aiokafka's own ``BatchBuilder``.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import NotLeaderForPartitionError
from aiokafka.producer.message_accumulator import BatchBuilder

from bridge.board import WorkerBoard, WorkerView
from bridge.metrics import BridgeMetrics
from bridge.outbox import KafkaRecord, Outgoing
from bridge.records import Topics
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
