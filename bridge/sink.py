"""The Kafka side of the bridge: one bounded queue, two loops, one idempotent producer.

Sources put ``Outgoing`` items (one forwarded batch or clear each) into the queue. The submit
loop takes everything queued, up to ``max_chunk_records``, as one chunk, builds one record batch
per partition (``create_batch``/``send_batch``: no per-record future or lock, and aiokafka's
default partitioner, so keys land where any client would put them) and hands it to the
producer; the settle loop waits for each chunk's acknowledgement, in order, and only then moves
the workers' resume points. Up to ``in_flight`` chunks are unacknowledged at once. A worker's
new epoch is written to the workers topic, and acknowledged, before any record of it: a refused
announcement is sent again (after ``retry_backoff``, on a new producer) until Kafka takes it. A
worker state Kafka refuses otherwise is written again, the worker's current one, or the refused
one of a worker no longer followed. The sink idles (``wait_idle``, ``close``) only once nothing
is queued, taken and not yet handed over (a new key's partitions may take a while), in flight,
or due on the board.

Every key's order holds through failures. An idempotent producer (Apache Kafka) retries
retriable errors itself, in order, so several chunks may be in flight, and an error that still
comes back is final. Without idempotence (Tansu) one chunk is in flight, and a chunk that fails
with a retriable error is sent again before anything later is handed over. While Kafka is away
the queue fills and the sources stop receiving (``wait_for_room``) until it has room again:
what the engines publish meanwhile waits in the ZMQ queues and, past their high-water marks, in
the engines' replay rings, fetched as a gap once intake resumes. A final refusal (a record too
large for the broker, authorization) drops the item and tells its worker, whose tracker starts a
new epoch, since later records of the worker may already be in Kafka. Nothing later of the
refused epoch is acknowledged, so the worker's resume point never passes the refused batch. A
refused clear is logged and counted but starts no further epoch, or a partition that refuses
everything would start one per clear. After any final refusal nothing more is handed to that
producer: right before each hand-over (a chunk or a state write, with no await between the check
and the hand-over) it is replaced once what is in flight has settled (``replace_producer``):
aiokafka's idempotent producer numbers a batch when it takes it for sending, also one it then
expires (no partition leader for the request timeout), and from then on the broker refuses every
later batch of that partition as out of order; a new producer numbers afresh.

The queue bound applies to live intake; what a replay or a clear produces is always accepted,
which the number of concurrent replays bounds in turn. A worker that leaves the bridge (retired,
or released to another) is forgotten (``forget``): the partitions of its keys are kept only while
it is followed, or llm-d's pod churn would grow them for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.producer.message_accumulator import BatchBuilder

from hmakv.bridge.board import WorkerBoard
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.outbox import KafkaRecord, Outgoing
from hmakv.kvlog import records
from hmakv.kvlog.kafka_client import partition_for
from hmakv.kvlog.records import DeadLetter, Topics, WorkerState

log = logging.getLogger(__name__)

RefusalHandler = Callable[[int, int], None]  # (epoch, seq) of the refused item
# Given the producer that saw a refusal: a started new one in its place (the old one closed).
ProducerReplacer = Callable[[AIOKafkaProducer], Awaitable[AIOKafkaProducer]]
Target = tuple[str, int]  # (topic, partition)
_RETRY_LOG_INTERVAL_S = 10.0
_FULL_REPORT_S = 1.0  # how often a full queue adds its time to queue_full_seconds


@dataclass
class _Chunk:
    """Records handed to the producer together, and accounted for together, in order."""

    items: list[Outgoing]
    records: list[KafkaRecord]  # the items' records, then one per state
    states: list[WorkerState]  # written again should Kafka refuse them
    targets: dict[Target, list[int]]  # record indexes by partition
    started: float
    deliveries: list[tuple[Target, asyncio.Future[object]]] = field(default_factory=list)
    refused: dict[Target, BaseException] = field(default_factory=dict)


class KafkaSink:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        topics: Topics,
        board: WorkerBoard,
        metrics: BridgeMetrics,
        *,
        max_queued: int,
        in_flight: int,
        max_chunk_records: int = 4096,
        linger: float = 0.0,
        retry_backoff: float = 0.5,
        state_interval: float = 1.0,
        replace_producer: ProducerReplacer | None = None,
    ) -> None:
        self._producer = producer
        self._replace_producer = replace_producer
        self._producer_refused = False  # a final refusal since the producer was made
        self._topics = topics
        self._board = board
        self._metrics = metrics
        self._max_queued = max_queued
        self._in_flight = in_flight
        self._max_chunk_records = max_chunk_records
        self._linger = linger
        self._retry_backoff = retry_backoff
        self._state_interval = state_interval
        self._queue: deque[Outgoing] = deque()
        self._queued_records = 0
        self._oldest_put = 0.0  # monotonic time the oldest queued item was put, or earlier
        self._work = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._full_since: float | None = None  # monotonic time the queue became full
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots = asyncio.Semaphore(in_flight)
        self._flights: asyncio.Queue[_Chunk] = asyncio.Queue()
        self._settled = asyncio.Event()  # set whenever no chunk is unaccounted for
        self._settled.set()
        self._unsettled = 0  # chunks handed to the producer, not yet accounted for
        self._taken = 0  # items out of the queue, in a chunk not yet accounted for
        self._preparing = False  # a chunk taken (items, states due) and not yet handed over
        self._refused_epoch: dict[str, int] = {}  # per worker: its newest epoch with a refusal
        self._partitions: dict[tuple[str, bytes], int] = {}  # of the workers followed
        self._tasks: list[asyncio.Task[None]] = []
        self._last_retry_log = float("-inf")
        self.refusal_handlers: dict[str, RefusalHandler] = {}
        metrics.queue_depth.set_function(lambda: len(self._queue))  # read when scraped
        self.last_delivery: float = float("-inf")  # monotonic time of the last acknowledgement

    # --- intake ----------------------------------------------------------------------------------

    def has_room(self) -> bool:
        return len(self._queue) < self._max_queued

    def put(self, item: Outgoing) -> None:
        if not self._queue:
            self._oldest_put = time.monotonic()
        self._queue.append(item)
        self._queued_records += len(item.records)
        self._idle.clear()
        self._work.set()

    def put_dead_letter(self, letter: DeadLetter) -> bool:
        """Queue a dead letter if there is room; False (and counted) when there is none."""
        if not self.has_room():
            self._metrics.dead_letters_dropped.inc()
            return False
        record = KafkaRecord(
            self._topics.deadletter,
            letter.source.encode(),
            records.encode(letter),
            letter.headers(),
        )
        self.put(Outgoing(None, 0, -1, letter.ts, [record], False))
        return True

    async def wait_for_room(self) -> None:
        """Until the queue has room; the time it is full counts in ``queue_full_seconds``, every
        second while it lasts, so that an outage shows while it goes on."""
        while not self.has_room():
            if self._full_since is None:
                self._full_since = time.monotonic()
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), _FULL_REPORT_S)
            self._count_full()

    async def wait_idle(self) -> None:
        """Until everything queued is acknowledged (or refused) and every due state written."""
        await self._idle.wait()

    def state_changed(self) -> None:
        """A worker's health, epoch or groups changed: write its state without waiting."""
        self._idle.clear()
        self._work.set()

    def forget(self, worker: str) -> None:
        """The worker left this bridge (retired, or released to another): drop what the sink
        keeps of it, or llm-d's pods, coming and going under new names, grow it for good. Its
        records still queued look their partition up again (and do not keep it)."""
        self._refused_epoch.pop(worker, None)
        name = worker.encode()
        for kept in [kept for kept in self._partitions if self._key_worker(*kept) == name]:
            del self._partitions[kept]

    def _followed(self, topic: str, key: bytes) -> bool:
        if topic == self._topics.deadletter:
            return False
        return self._key_worker(topic, key).decode() in self._board.views

    def _key_worker(self, topic: str, key: bytes) -> bytes:
        """Whose a kept key is: the workers topic's is the worker's name, the events topic's
        ``<worker>/<group>``."""
        return key if topic == self._topics.workers else key.rpartition(b"/")[0]

    # --- the delivery loops ----------------------------------------------------------------------

    def start(self) -> list[asyncio.Task[None]]:
        """Start the delivery loops; they run until ``close`` and end early only through a bug,
        which the caller must watch for (the returned tasks), since nothing is delivered after."""
        self._tasks = [
            asyncio.create_task(self._submit_forever(), name="hmakv-bridge-sink-submit"),
            asyncio.create_task(self._settle_forever(), name="hmakv-bridge-sink-settle"),
        ]
        return list(self._tasks)

    async def close(self, timeout: float) -> int:
        """Deliver what is queued within ``timeout`` seconds, write every worker's state, stop.

        Returns the number of items left undelivered, queued or unacknowledged (logged by the
        caller). After a loop failed (a bug) nothing more is written.
        """
        with contextlib.suppress(TimeoutError):  # what is left is counted below
            await asyncio.wait_for(self.wait_idle(), timeout)
        failed = any(task.done() and not task.cancelled() for task in self._tasks)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = len(self._queue) + self._taken
        if not left and not failed:
            try:
                await asyncio.wait_for(self._write_states_until_taken(flush=True), timeout)
            except TimeoutError:
                log.error("worker states not written within %.1f s of shutdown", timeout)
        return left

    async def _submit_forever(self) -> None:
        """Hand chunks to the producer in queue order, at most ``in_flight`` unacknowledged."""
        while True:
            with contextlib.suppress(TimeoutError):  # no traffic: write what states are due
                await asyncio.wait_for(self._work.wait(), self._state_interval)
            # A slot first, then the chunk: what arrives while all slots wait for Kafka joins
            # this chunk instead of making small ones.
            await self._slots.acquire()
            await self._let_chunk_grow()
            self._work.clear()
            if self._queue and self._opens_epoch(self._queue[0]):
                await self._announce_epoch(self._queue[0])
            await self._hand_over_next()
            if self._queue or self._board.dirty:
                self._work.set()
            self._note_idle()

    async def _hand_over_next(self) -> None:
        """Take the next chunk (its slot is held) and hand it to the producer; the slot back if
        there is nothing to send.

        From the take until the hand-over the chunk is neither queued nor in flight (a new key's
        partitions may take a while): ``_preparing`` keeps ``close`` from taking that for idle.
        """
        self._preparing = True
        items = self._take()
        self._taken += len(items)
        chunk = await self._prepare(items, flush_states=False)
        if chunk is None:
            self._preparing = False
            self._slots.release()
            return
        await self._renew_if_refused()  # no await from here to the hand-over
        self._unsettled += 1
        self._settled.clear()
        self._preparing = False
        await self._submit(chunk, list(chunk.targets))
        self._flights.put_nowait(chunk)

    def _opens_epoch(self, item: Outgoing) -> bool:
        return self._board.opens_epoch(item.worker, item.epoch)

    async def _announce_epoch(self, first: Outgoing) -> None:
        """Write the worker's new epoch to the workers topic, acknowledged, before any record of
        it is handed over: a bridge restarted in between would otherwise resume the older epoch,
        whose records consumers then ignore as older than what they have seen."""
        assert first.worker is not None
        await self._settled.wait()  # what came before is accounted for, the resume point too
        self._board.begin_epoch(first.worker, first.epoch, new_life=first.seq < 0)
        await self._write_states_until_taken(flush=False)

    async def _renew_if_refused(self) -> None:
        """Replace the producer if it saw a final refusal; called right before each hand-over,
        with no await between its last check and the hand-over, so that a refusal settled
        meanwhile (while a chunk grew, an epoch was announced, partitions were looked up) is
        never followed by another batch on that producer, which the broker would refuse as out
        of order."""
        while self._producer_refused and self._replace_producer is not None:
            await self._renew_producer(self._replace_producer)

    async def _renew_producer(self, replace: ProducerReplacer) -> None:
        """A new producer in place of one that saw a refusal, once nothing is in flight on it."""
        await self._settled.wait()
        log.warning("replacing the Kafka producer after a refusal")
        self._producer = await replace(self._producer)
        self._producer_refused = False
        self._metrics.producer_replacements.inc()

    async def _let_chunk_grow(self) -> None:
        """While a chunk is in flight, wait until the oldest queued item is ``linger`` seconds
        old, a full chunk is queued, or nothing is in flight any more.

        A produce request costs the event loop about as much as a hundred records whatever its
        size, so at moderate rates a few milliseconds of waiting make far fewer, fuller requests
        (Kafka's own producers wait 5 ms by default since Kafka 4.0; the bridge, 2). With nothing
        in flight the producer is idle, so waiting would only make the records older (issue 18:
        2 ms of the demo's 7 ms engine-to-Kafka p50): a chunk then goes at once, and what arrives
        while it is acknowledged makes the next one.
        """
        while self._unsettled and self._queue and self._queued_records < self._max_chunk_records:
            delay = self._oldest_put + self._linger - time.monotonic()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    async def _settle_forever(self) -> None:
        """Wait for each chunk's acknowledgement, in submission order, and account for it."""
        while True:
            chunk = await self._flights.get()
            refused = await self._complete(chunk)
            self._settle(chunk, refused)
            self._taken -= len(chunk.items)
            self._unsettled -= 1
            if not self._unsettled:
                self._settled.set()
            self._slots.release()
            self._note_idle()

    async def _write_states_until_taken(self, *, flush: bool) -> None:
        """Write the worker states due until Kafka takes them all: a new epoch must be in the
        workers topic before any record of it, and at shutdown every state must be. A refusal
        is retried, as a send is, on a new producer (the board writes the refused states again).
        """
        while refused := await self._write_states_now(flush=flush):
            self._note_retry(*next(iter(refused.items())))
            await asyncio.sleep(self._retry_backoff)

    async def _write_states_now(self, *, flush: bool) -> dict[Target, BaseException]:
        """Write the worker states due (every pending one with ``flush``) and wait for Kafka;
        what it refused, by partition."""
        chunk = await self._prepare([], flush_states=flush)
        if chunk is None:
            return {}
        await self._renew_if_refused()  # no await from here to the hand-over
        await self._submit(chunk, list(chunk.targets))
        self._settle(chunk, await self._complete(chunk))
        return chunk.refused

    def _note_idle(self) -> None:
        """Idle: nothing queued, being handed over or in flight, and no state due."""
        if (
            not self._queue
            and not self._preparing
            and self._unsettled == 0
            and not self._board.dirty
        ):
            self._idle.set()

    def _take(self) -> list[Outgoing]:
        items: list[Outgoing] = []
        count = 0
        while self._queue and (not items or count < self._max_chunk_records):
            if items and self._opens_epoch(self._queue[0]):
                break  # its epoch goes to the workers topic first, with nothing else in flight
            item = self._queue.popleft()
            items.append(item)
            count += len(item.records)
        self._queued_records -= count
        if self.has_room():
            self._room.set()
            self._count_full()
        return items

    def _count_full(self) -> None:
        """Add the time the queue has been full until now; from now on if it still is."""
        if self._full_since is None:
            return
        now = time.monotonic()
        self._metrics.queue_full.inc(now - self._full_since)
        self._full_since = None if self.has_room() else now

    async def _prepare(self, items: list[Outgoing], *, flush_states: bool) -> _Chunk | None:
        """The items' records and the worker states due, grouped by partition; None if none."""
        states = self._board.due(time.time(), flush=flush_states)
        if not states and not items:
            return None
        chunk_records = [record for item in items for record in item.records]
        chunk_records += [self._state_record(state) for state in states]
        targets: dict[Target, list[int]] = defaultdict(list)
        known = self._partitions
        for index, record in enumerate(chunk_records):
            partition = known.get((record.topic, record.key))
            if partition is None:
                partition = await self._partition(record.topic, record.key)
            targets[(record.topic, partition)].append(index)
        return _Chunk(items, chunk_records, states, dict(targets), time.monotonic())

    def _state_record(self, state: WorkerState) -> KafkaRecord:
        return KafkaRecord(self._topics.workers, state.key(), records.encode(state), [])

    # --- sending ---------------------------------------------------------------------------------

    async def _submit(self, chunk: _Chunk, targets: list[Target]) -> None:
        """Hand each partition's records to the producer; a full producer buffer is waited out
        (nothing later is submitted meanwhile), a refusal is noted in the chunk."""
        for target in targets:
            topic, partition = target
            for builder in self._builders([chunk.records[i] for i in chunk.targets[target]]):
                while True:
                    try:
                        future = await self._producer.send_batch(
                            builder, topic, partition=partition
                        )
                    except KafkaError as error:
                        if not _retriable(error):
                            chunk.refused[target] = error
                            break
                        self._note_retry(target, error)
                        await asyncio.sleep(self._retry_backoff)
                        continue
                    chunk.deliveries.append((target, future))
                    break

    async def _complete(self, chunk: _Chunk) -> set[int]:
        """Wait until Kafka has every record of the chunk or refused it; the refused indexes.

        With one chunk in flight, a retriable failure is sent again before anything later, unless
        a later record batch of the same partition got through (sent again, the failed one would
        land after it, and consumers would skip its seqs as old). With several (an idempotent
        producer, which retries those itself, in order), a failure that still comes back is final.
        """
        while True:
            outcomes = await asyncio.gather(
                *(future for _, future in chunk.deliveries), return_exceptions=True
            )
            failed: dict[Target, BaseException] = {}
            overtaken: set[Target] = set()
            for (target, _), outcome in zip(chunk.deliveries, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    failed.setdefault(target, outcome)
                elif target in failed:
                    overtaken.add(target)
            retry = [
                t
                for t, e in failed.items()
                if _retriable(e) and self._in_flight == 1 and t not in overtaken
            ]
            for target, error in failed.items():
                if target not in retry:
                    chunk.refused[target] = error
            if not retry:
                return {i for target in chunk.refused for i in chunk.targets[target]}
            self._note_retry(retry[0], failed[retry[0]])
            await asyncio.sleep(self._retry_backoff)
            chunk.deliveries = [(t, f) for t, f in chunk.deliveries if t not in retry]
            await self._submit(chunk, retry)

    def _builders(self, batch_records: list[KafkaRecord]) -> list[BatchBuilder]:
        builders = []
        builder = self._producer.create_batch()
        for record in batch_records:
            appended = builder.append(
                timestamp=None, key=record.key, value=record.value, headers=record.headers
            )
            if appended is None:  # full: the first record always fits a fresh builder
                builders.append(builder)
                builder = self._producer.create_batch()
                builder.append(
                    timestamp=None, key=record.key, value=record.value, headers=record.headers
                )
        builders.append(builder)
        for each in builders:
            each.close()  # nothing else may join it, and a closed batch does not linger
        return builders

    async def _partition(self, topic: str, key: bytes) -> int:
        """A new key's partition, where aiokafka's default partitioner puts it; kept for the
        keys of workers followed, until the sink forgets the worker (a dead letter's key is
        whatever arrived: not kept).

        Kafka's metadata may be out of reach (an outage, a leader election): the chunk waits,
        as a send would, rather than its items being lost.
        """
        while True:
            try:
                partitions = sorted(await self._producer.partitions_for(topic))
            except KafkaError as error:
                self._note_retry((topic, -1), error)
                await asyncio.sleep(self._retry_backoff)
                continue
            partition = partition_for(key, partitions)
            if self._followed(topic, key):
                self._partitions[(topic, key)] = partition
            return partition

    def _note_retry(self, target: Target, error: BaseException) -> None:
        self._metrics.send_retries.inc()
        now = time.monotonic()
        if now - self._last_retry_log >= _RETRY_LOG_INTERVAL_S:
            self._last_retry_log = now
            log.warning(
                "Kafka send failed (%r on %s[%d]); retrying every %.1f s, holding %d batches",
                error,
                *target,
                self._retry_backoff,
                len(self._queue),
            )

    # --- after the acknowledgement ---------------------------------------------------------------

    def _settle(self, chunk: _Chunk, refused: set[int]) -> None:
        acknowledged = time.monotonic()
        if len(refused) < len(chunk.records):  # Kafka took something: it is there
            self.last_delivery = acknowledged
        self._metrics.send_latency.observe(acknowledged - chunk.started)
        for target, error in chunk.refused.items():
            log.error("Kafka refused records for %s[%d]: %r", *target, error)
        self._producer_refused |= bool(chunk.refused)
        now = time.time()
        last_seqs: dict[str, int] = {}
        index = 0
        for item in chunk.items:
            item_indexes = range(index, index + len(item.records))
            index += len(item.records)
            if item.worker is None:
                continue
            if refused and any(i in refused for i in item_indexes):
                self._refuse(item)
                continue
            if item.epoch <= self._refused_epoch.get(item.worker, -1):
                continue  # after a refused batch of its epoch: not a point to resume from
            self._board.acknowledged(
                item.worker,
                item.epoch,
                item.seq,
                item.ts,
                resumable=item.engine_batch and item.resumable,
            )
            if item.engine_batch:
                self._metrics.end_to_end_age.observe(max(0.0, now - item.ts))
                last_seqs[item.worker] = item.seq
        for worker, seq in last_seqs.items():
            if worker in self._board.views:  # a worker gone since has its series removed
                self._metrics.worker_last_seq.labels(worker).set(seq)
        self._settle_states(chunk, refused)
        self._count_produced(chunk.records, refused)

    def _settle_states(self, chunk: _Chunk, refused: set[int]) -> None:
        """Tell the board how the chunk's states settled: it writes refused ones again (it
        marked them written when the chunk took them, and a lost ``retired`` or ``degraded``
        would never be), with the next chunk or within the state interval, so that a partition
        refusing everything is not retried in a busy loop."""
        first = len(chunk.records) - len(chunk.states)
        for index, state in enumerate(chunk.states, first):
            self._board.settled(state, refused=index in refused)

    def _refuse(self, item: Outgoing) -> None:
        worker = item.worker
        assert worker is not None
        if worker in self._board.views:
            self._metrics.delivery_failures.labels(worker).inc()
        if not item.engine_batch:
            # Any later record of the epoch in that group makes consumers drop the old view too.
            log.error(
                "%s: Kafka refused a clear of epoch %d; consumers of the refused groups keep the "
                "previous epoch's view until the worker's next record there",
                worker,
                item.epoch,
            )
            return
        self._refused_epoch[worker] = max(item.epoch, self._refused_epoch.get(worker, -1))
        handler = self.refusal_handlers.get(worker)
        if handler is not None:
            handler(item.epoch, item.seq)

    def _count_produced(self, all_records: list[KafkaRecord], refused: set[int]) -> None:
        counts: dict[str, int] = defaultdict(int)
        for index, record in enumerate(all_records):
            if index not in refused:
                counts[record.topic] += 1
        kinds = {
            self._topics.events: "events",
            self._topics.workers: "workers",
            self._topics.deadletter: "deadletter",
        }
        for topic, count in counts.items():
            self._metrics.records_produced.labels(kinds.get(topic, topic)).inc(count)


def _retriable(error: BaseException) -> bool:
    return isinstance(error, KafkaError) and bool(error.retriable)
