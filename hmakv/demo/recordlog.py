"""Which cache groups each engine batch reached in Kafka: the probe's map of the log.

The bridge writes one record per (batch, group) and only for the groups a batch touched, so
the index's last applied seq per group does not say by itself whether a group is complete up to
some seq ``X``: a group whose last record is older than ``X`` may simply have had nothing since,
or may still have a record on its way. The probe settles it with this map, read from the events
topic's headers (worker, group, epoch, seq; values are never decoded): the index holds exactly
the engine's state at ``X`` when every group's last applied seq is that group's last record at or
before ``X``.

The map only answers for seqs it has seen completely: ``sync()`` takes the bridge's acknowledged
seq per worker, then the topic's end offsets (every record up to that seq lies below them), and
reads up to those offsets; from then on the map is complete through that seq.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.structs import TopicPartition

from hmakv.kvlog.kafka_client import (
    KafkaSecurity,
    create_consumer,
    stop_consumer,
    wait_for_partitions,
)

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_MS = 100
_SYNC_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 30.0

LaneKey = tuple[str, int, int]
"""(worker, epoch, group)"""


class RecordLog:
    """Seqs per (worker, epoch, group) as written to ``topic``; follow it with ``run()``."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        acknowledged: Callable[[], Awaitable[dict[str, int]]],
    ) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._acknowledged = acknowledged
        self._seqs: dict[LaneKey, list[int]] = {}
        self._positions: dict[TopicPartition, int] = {}
        self._complete_through: dict[str, int] = {}
        self._consumer: Any = None
        self._progress = asyncio.Event()

    async def start(self) -> None:
        """Assign every partition of the topic from its beginning (the bridge created it)."""
        security = KafkaSecurity.from_env()
        partitions = await wait_for_partitions(
            self._bootstrap, self._topic, security, retry_s=0.2, timeout_s=_START_TIMEOUT_S
        )
        tps = [TopicPartition(self._topic, partition) for partition in sorted(partitions)]
        consumer = create_consumer(
            self._bootstrap,
            client_id="hmakv-demo-probe",
            security=security,
            fetch_max_wait_ms=_FETCH_TIMEOUT_MS,
        )
        await consumer.start()
        self._consumer = consumer
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._positions = dict.fromkeys(tps, 0)

    async def stop(self) -> None:
        if self._consumer is not None:
            await stop_consumer(self._consumer)
            self._consumer = None

    async def run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=_FETCH_TIMEOUT_MS)
            for tp, records in batches.items():
                for record in records:
                    self.note(record.headers)
                self._positions[tp] = records[-1].offset + 1
            self._progress.set()
            self._progress = asyncio.Event()

    def note(self, headers: Any) -> None:
        """Record one Kafka record's (worker, epoch, group, seq) from its headers."""
        fields = {key: value for key, value in headers or ()}
        try:
            key = (fields["worker"].decode(), int(fields["epoch"]), int(fields["group"]))
            seq = int(fields["seq"])
        except (KeyError, ValueError, UnicodeDecodeError):
            return  # not an hmakv event record; the index counts those itself
        seqs = self._seqs.setdefault(key, [])
        position = bisect.bisect_left(seqs, seq)
        if position == len(seqs) or seqs[position] != seq:  # a redelivered record is noted once
            seqs.insert(position, seq)

    def complete_through(self, worker: str) -> int:
        return self._complete_through.get(worker, -1)

    async def sync(self) -> None:
        """Read up to the log end as of now; then the map is complete up to the acked seqs."""
        acknowledged = await self._acknowledged()
        ends = await self._consumer.end_offsets(list(self._positions))
        async with asyncio.timeout(_SYNC_TIMEOUT_S):
            while any(self._positions[tp] < end for tp, end in ends.items()):
                await self._progress.wait()
        for worker, seq in acknowledged.items():
            if seq > self._complete_through.get(worker, -1):
                self._complete_through[worker] = seq

    def last_record_at_or_before(self, worker: str, epoch: int, group: int, seq: int) -> int | None:
        """The group's newest record with a seq at or before ``seq``, or None if it has none."""
        seqs = self._seqs.get((worker, epoch, group), [])
        position = bisect.bisect_right(seqs, seq)
        return seqs[position - 1] if position else None
