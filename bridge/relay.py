"""One worker's path from its inputs to Kafka records, without I/O.

The tracker decides what to forward; the relay turns each decision into encoded records (after
letting the group catalog learn from the batch, so that a clear reaches groups first seen in the
same batch) and tells its shell what else to do: fetches to start or cancel, and what happened,
for metrics and logs. A group's record that would exceed Kafka's size limit is split over parts
(an engine's snapshot of a large cache); a batch with one event too large for any record cannot
be written: the relay asks the tracker to count it as lost, which clears and degrades the worker.

The relay is the only door to its ``SequenceTracker``. Every input (a live or fetched batch, a
fetch's end or failure, a refusal) goes in through it and comes back as a ``Handled``: a step
the shell took from the tracker itself would skip the encoding, and a batch lost on the way
(too large to write) changes the tracker's answer after the fact. What the shell says of the
worker (epoch, health, position) it asks here too, so the tracker stays the one owner of the
worker's epoch; the board only says which epoch the workers topic announces.
"""

from __future__ import annotations

from hmakv.bridge.catalog import GroupCatalog
from hmakv.bridge.fanout import clear_records, fan_out, split_to_fit
from hmakv.bridge.outbox import KafkaRecord, Outgoing
from hmakv.bridge.tracking import (
    CancelFetch,
    Clear,
    Fetch,
    Forward,
    HealthChanged,
    SequenceTracker,
    Step,
)
from hmakv.kvlog import records
from hmakv.kvlog.records import EventRecord, Health, Topics
from hmakv.producer.events import AllBlocksCleared, KVEventBatch


class Handled:
    """What the shell must do for some steps. One is made per engine batch, so it is a plain
    class whose lists are literals, not a dataclass calling a default factory for each."""

    __slots__ = ("cancelled", "catalog_changed", "events", "fetches", "outgoing")

    def __init__(self) -> None:
        self.outgoing: list[Outgoing] = []
        self.fetches: list[Fetch] = []
        self.cancelled: list[int] = []
        self.events: list[Step] = []  # every step, for metrics and logs
        self.catalog_changed = False


class WorkerRelay:
    """One worker's tracker, catalog and record encoding; each input returns what to do.

    ``now`` (the bridge's clock) is the timestamp of the clears an input may cause.
    """

    def __init__(
        self,
        worker: str,
        tracker: SequenceTracker,
        catalog: GroupCatalog,
        *,
        topics: Topics,
        data_parallel_rank: int | None,
        max_record_bytes: int,
    ) -> None:
        self.worker = worker
        self._tracker = tracker
        self.catalog = catalog
        self._topic = topics.events
        self._rank = data_parallel_rank
        self._max_record_bytes = max_record_bytes
        self._keys: dict[int, bytes] = {}  # by group: the key never changes
        self._headers = records.EventHeaders(worker)

    # --- what the worker is ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The worker's epoch: the newest its tracker opened, which the workers topic may not
        announce yet (the records opening it still queued)."""
        return self._tracker.epoch

    @property
    def health(self) -> Health:
        return self._tracker.health

    @property
    def last_seq(self) -> int:
        """The last seq forwarded (or resumed from); -1 before any."""
        return self._tracker.next_seq - 1

    # --- inputs: the tracker's protocol (see ``bridge.tracking``), each answer handled -----------

    def start(self, now: float) -> Handled:
        return self.handle(self._tracker.start(), now)

    def on_connected(self, now: float) -> Handled:
        return self.handle(self._tracker.on_connected(), now)

    def on_live(self, seq: int, batch: KVEventBatch, now: float) -> Handled:
        return self.handle(self._tracker.on_live(seq, batch), now)

    def on_undecodable(self, seq: int, now: float) -> Handled:
        return self.handle(self._tracker.on_undecodable(seq), now)

    def on_fetched(
        self, fetch_id: int, seq: int, batch: KVEventBatch | None, now: float
    ) -> Handled:
        return self.handle(self._tracker.on_fetched(fetch_id, seq, batch), now)

    def on_fetch_end(self, fetch_id: int, now: float) -> Handled:
        return self.handle(self._tracker.on_fetch_end(fetch_id), now)

    def on_fetch_failed(self, fetch_id: int, cause: str, now: float) -> Handled:
        return self.handle(self._tracker.on_fetch_failed(fetch_id, cause), now)

    def on_delivery_failed(self, epoch: int, seq: int, now: float) -> Handled:
        return self.handle(self._tracker.on_delivery_failed(epoch, seq), now)

    # --- steps into records ----------------------------------------------------------------------

    def handle(self, steps: list[Step], now: float) -> Handled:
        """Everything the shell must do for these steps, in order.

        A batch that cannot be written is lost after the tracker made these steps: its answer
        goes in the batch's place, and the health the steps end with no longer holds, so the
        shell is told the tracker's health once more, last.
        """
        handled = Handled()
        lost = False
        for index, step in enumerate(steps):
            if type(step) is Forward:
                handled.events.append(step)
                if not self._forward(step, handled):
                    lost = True
                    cleared_later = _clears_after(steps, index)
                    limit = self._max_record_bytes
                    for answer in self._tracker.on_unwritable(step.seq, limit, cleared_later):
                        self._handle(answer, handled, now)
            else:
                self._handle(step, handled, now)
        if lost:
            handled.events = [e for e in handled.events if type(e) is not HealthChanged]
            handled.events.append(HealthChanged(self._tracker.health))
        return handled

    def _handle(self, step: Step, handled: Handled, now: float) -> None:
        handled.events.append(step)
        if isinstance(step, Clear):
            handled.outgoing.append(self._clear(step, now))
        elif isinstance(step, Fetch):
            handled.fetches.append(step)
        elif isinstance(step, CancelFetch):
            handled.cancelled.append(step.fetch_id)

    def _forward(self, step: Forward, handled: Handled) -> bool:
        """Queue the batch's records; False if one of its events is too large to write."""
        batch = step.batch
        handled.catalog_changed |= self.catalog.learn(batch.events)
        encoded = []
        for record in fan_out(self.worker, step.epoch, step.seq, batch, self.catalog.groups):
            kafka_record = self._encode(record)
            if len(kafka_record.value) <= self._max_record_bytes:
                encoded.append(kafka_record)
                continue
            parts = split_to_fit(record, self._max_record_bytes)
            if parts is None:
                return False
            encoded += [self._encode(part) for part in parts]
        handled.outgoing.append(
            Outgoing(self.worker, step.epoch, step.seq, batch.ts, encoded, True, not step.snapshot)
        )
        return True

    def _clear(self, step: Clear, now: float) -> Outgoing:
        groups = self.catalog.groups
        cleared = clear_records(self.worker, step.epoch, step.seq, now, groups, self._rank)
        encoded = [self._encode(record) for record in cleared]
        return Outgoing(self.worker, step.epoch, step.seq, now, encoded, False)

    def _encode(self, record: EventRecord) -> KafkaRecord:
        key = self._keys.get(record.group_idx)
        if key is None:
            key = self._keys[record.group_idx] = records.event_key(self.worker, record.group_idx)
        return KafkaRecord(self._topic, key, records.encode(record), self._headers.of(record))


def _clears_after(steps: list[Step], index: int) -> bool:
    """Whether a batch forwarded after ``steps[index]`` holds the engine's own clear."""
    return any(
        type(step) is Forward and any(type(e) is AllBlocksCleared for e in step.batch.events)
        for step in steps[index + 1 :]
    )
