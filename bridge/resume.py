"""Where the previous bridge left each worker: the compacted workers topic, read to its end.

Reading it whole (not from a committed offset) is what compaction is for: the topic holds the
latest ``WorkerState`` per worker, and the bridge needs all of them before it follows any engine.
"""

from __future__ import annotations

import logging

from aiokafka import TopicPartition

from hmakv.kvlog.kafka_client import KafkaSecurity, create_consumer, stop_consumer
from hmakv.kvlog.records import RecordDecodeError, WorkerState, decode_worker_state

log = logging.getLogger(__name__)

_POLL_MS = 500


async def read_worker_states(
    bootstrap: str,
    topic: str,
    partitions: set[int],
    *,
    security: KafkaSecurity | None = None,
) -> dict[str, WorkerState]:
    """The latest state of every worker in ``topic``; a record that does not decode is skipped."""
    consumer = create_consumer(bootstrap, client_id="hmakv-bridge-resume", security=security)
    try:  # stopped even when start fails: it holds a client and its connections
        await consumer.start()
        assigned = [TopicPartition(topic, partition) for partition in sorted(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        ends = await consumer.end_offsets(assigned)
        states: dict[str, WorkerState] = {}
        while [tp for tp in assigned if await consumer.position(tp) < ends[tp]]:
            fetched = await consumer.getmany(*assigned, timeout_ms=_POLL_MS)
            for batch in fetched.values():
                for record in batch:
                    _take(states, record.key, record.value)
        return states
    finally:
        await stop_consumer(consumer)


def _take(states: dict[str, WorkerState], key: bytes | None, value: bytes | None) -> None:
    worker = (key or b"").decode("utf-8", "replace")
    if value is None:
        states.pop(worker, None)  # a tombstone: the worker was forgotten
        return
    try:
        states[worker] = decode_worker_state(value)
    except RecordDecodeError as error:
        log.warning("workers topic: skipping the state of %r: %s", worker, error)
