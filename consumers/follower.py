"""The index follower: Kafka records in, the pure ``KVIndex`` kept up to date, snapshots out.

What a record does to the index (decoding, the key check, epochs, retirements, tombstones) is
``applier.py``'s, which knows nothing of Kafka so that its rules are tested without a broker.
What is left here needs one: where records come from and how far the log has been applied
(positions, assignment, the gaps and restarts that only offsets show, commits, snapshots).

Two consumers feed one index on one event loop, so applying, scoring, scraping and snapshotting
never run at the same time and need no lock:

- ``<prefix>.events``: in ``replica`` mode every follower reads every partition (manual
  assignment, no group): each one can answer score queries alone, so there is no single point of
  failure. In ``group`` mode a consumer group splits the partitions, to scale metrics and
  analytics; a member then knows only some groups of some workers, and its score answers are
  partial.
- ``<prefix>.workers`` (compacted, small): always every partition, so every follower knows every
  worker's catalog and health whichever event partitions it holds.

A topic read by manual assignment is watched for partitions added while the follower runs (the
bridge looks a new key's partition up, so new workers land on them): they are assigned too and
read from their beginning. A position past a partition's end (the topic was recreated, or an
unclean leader election truncated it) means the log is not the one the index applied: its
workers are forgotten and the partition read again from its beginning.

Positions are the follower's own: the next offset of each partition whose records the index
contains. They are saved with each snapshot and are where a restart resumes (the group's
committed offsets only report progress to the group's tools: state lives in this process, so a
position is worth nothing without the snapshot that holds it). In group mode they are committed
after the records are applied, and on revocation (a commit that fails is retried at the next
interval); a revoked partition's state is kept, marked stale (``stale_groups``; the exporter
leaves it out, the score API never names such a worker best) and resumed from its position if it
comes back, since forgetting it would make a later re-read of the same seqs look like replays.

Kafka's silence is the follower's to watch: a fetch that brings nothing looks the same whether
the topic is idle or the broker gone, so it asks for the workers topic's log ends about once a
second, and ``freshness`` reads how long ago Kafka last answered beside every worker's lag
(``freshness.py``: the rules; here only the asking).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from hmakv.consumers.applier import (
    Applier,
    BadRecord,
    IgnoredState,
    KeylessTombstone,
    Placement,
    StateIgnored,
    StateTaken,
    WorkerForgotten,
    WorkerRetired,
)
from hmakv.consumers.freshness import (
    BrokerContact,
    Clock,
    Freshness,
    FreshnessLimits,
    lag_seqs,
)
from hmakv.consumers.index import (
    DEFAULT_HASH_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS_PER_WORKER,
    ApplyOutcome,
    KVIndex,
)
from hmakv.consumers.snapshots import (
    SNAPSHOT_FORMAT,
    PartitionOffset,
    Snapshot,
    SnapshotError,
    SnapshotStore,
    check_follower_id,
    pack,
    unpack,
)
from hmakv.consumers.speculation import SpeculationTtl
from hmakv.consumers.stats import EVENT_AGE_BUCKETS, Buckets
from hmakv.kvlog.kafka_client import (
    KafkaSecurity,
    create_consumer,
    partition_for,
    stop_consumer,
    topic_partitions,
    wait_for_partitions,
)
from hmakv.kvlog.logs import RateLimitedLog
from hmakv.kvlog.records import Topics, WorkerState
from hmakv.producer.events import ExternalBlockHash

log = logging.getLogger(__name__)

Mode = Literal["replica", "group"]
MODES: tuple[Mode, ...] = ("replica", "group")

_FETCH_TIMEOUT_MS = 500
_TOPIC_WAIT_S = 2.0
_BAD_RECORD_LOG_INTERVAL_S = 60.0
_COMMIT_FAILURE_LOG_INTERVAL_S = 60.0
_IGNORED_STATE_LOG_INTERVAL_S = 60.0
_BROKER_CHECK_INTERVAL_S = 1.0
_SPECULATION_EXPIRY_INTERVAL_S = 1.0


@dataclass(frozen=True)
class FollowerConfig:
    """How one follower reads the log and keeps its snapshots.

    ``ready_max_lag``: ready once the positions reached the log ends seen at assignment, or as
    soon as the records left over all assigned partitions are at most this many.
    ``partition_check_interval_s``: how often the clients refresh the topics' metadata, and so
    how soon partitions added to a topic are read.
    ``freshness``: how long Kafka may be silent, and a worker behind, before the index says so.
    ``speculative_ttl_s``: how long a routed prompt's blocks stay speculatively held; None
    follows the measured event lag (``speculation.SpeculationTtl``).
    ``fetch_max_wait_s``: how long a fetch may wait at the broker for records. Apache Kafka
    answers as soon as one arrives; Tansu only when this passes, so it bounds how stale the index
    gets there (aiokafka's 500 ms default made the embedded broker's event age p50 ~150 ms). An
    idle follower then sends a fetch per partition leader this often.
    ``speculative_prefill_chunk_tokens``: the engines' ``max_num_batched_tokens``, so that a
    routed prompt's mamba states are also held where its prefill's chunks stop (None: only the
    last aligned state).
    """

    bootstrap: str
    topics: Topics = field(default_factory=Topics)
    mode: Mode = "replica"
    group_id: str = "hmakv-index"
    follower_id: str = field(default_factory=socket.gethostname)
    security: KafkaSecurity | None = None
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    tier_weights: Mapping[str, float] | None = None
    max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER
    snapshot_interval_s: float = 60.0
    commit_interval_s: float = 1.0
    ready_max_lag: int = 1000
    max_records_per_fetch: int = 5000
    partition_check_interval_s: float = 5.0
    freshness: FreshnessLimits = field(default_factory=FreshnessLimits)
    speculative_ttl_s: float | None = None
    speculative_prefill_chunk_tokens: int | None = None
    fetch_max_wait_s: float = 0.01

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.partition_check_interval_s > 0:
            raise ValueError(
                f"partition_check_interval_s must be positive: {self.partition_check_interval_s}"
            )
        check_follower_id(self.follower_id)

    def new_index(self) -> KVIndex:
        return KVIndex(
            hash_block_size=self.hash_block_size,
            tier_weights=self.tier_weights,
            max_blocks_per_worker=self.max_blocks_per_worker,
        )


@dataclass
class FollowerStats:
    """Counts since this process started, read by the exporter and the tests."""

    consumed: dict[str, int] = field(default_factory=dict)
    events_applied: int = 0
    worker_states_applied: int = 0
    worker_states_ignored: dict[IgnoredState, int] = field(default_factory=dict)
    bad_records: dict[tuple[str, str], int] = field(default_factory=dict)  # (topic, reason)
    records_lost: int = 0
    # Per topic: partitions whose log restarted below this follower's position.
    log_restarts: dict[str, int] = field(default_factory=dict)
    # Per topic: partitions added while this follower ran (manual assignment).
    partitions_added: dict[str, int] = field(default_factory=dict)
    commits_failed: int = 0
    event_age: Buckets = field(default_factory=lambda: Buckets(EVENT_AGE_BUCKETS))
    fetch_age: Buckets = field(default_factory=lambda: Buckets(EVENT_AGE_BUCKETS))
    """Events topic: from the record's Kafka timestamp (the bridge handing it to its producer) to
    this follower fetching it."""
    start_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    restored_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    snapshots_written: int = 0
    snapshots_failed: int = 0
    last_snapshot_at: float | None = None
    last_snapshot_duration_s: float = 0.0
    last_snapshot_bytes: int = 0


class Follower:
    """Applies ``hmakv.events`` and ``hmakv.workers`` to an index; see the module docstring."""

    def __init__(
        self,
        config: FollowerConfig,
        store: SnapshotStore | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self._applier = Applier(config.new_index(), max_worker_lag=config.freshness.max_worker_lag)
        self._contact = BrokerContact(clock)
        self._clock = clock
        self.speculation_ttl = SpeculationTtl(config.speculative_ttl_s)
        self._silence_reported = False
        self.stats = FollowerStats()
        self._positions: dict[TopicPartition, int] = {}
        self._ready_targets: dict[TopicPartition, int] = {}
        self._events: Any = None
        self._workers: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        # Group mode: a member has an assignment (maybe an empty one) once the group balanced and
        # it positioned every partition it got.
        self._joined = config.mode == "replica"
        # Until the snapshot is restored the index is empty: saving it would destroy the snapshot.
        self._restored = False
        self._last_commit = 0.0
        self._next_partition_check: dict[str, float] = {}
        self._snapshot_lock = asyncio.Lock()
        self._bad_log = RateLimitedLog(log, _BAD_RECORD_LOG_INTERVAL_S)
        self._commit_log = RateLimitedLog(log, _COMMIT_FAILURE_LOG_INTERVAL_S)
        # Ignored states are mostly history read while catching up: counted, noted at info.
        self._ignored_log = RateLimitedLog(log, _IGNORED_STATE_LOG_INTERVAL_S, level=logging.INFO)

    @property
    def index(self) -> KVIndex:
        """The index the records are applied to, which the score API and the exporter read."""
        return self._applier.index

    @index.setter
    def index(self, index: KVIndex) -> None:
        self._applier.index = index

    # ------------------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Restore the newest snapshot, then start consuming from its offsets."""
        await self._restore()
        self._restored = True
        topics = self.config.topics
        self._workers = self._consumer(group_id=None)
        await self._workers.start()
        await self._assign_all(self._workers, topics.workers)
        if self.config.mode == "group":
            self._events = self._consumer(group_id=self.config.group_id)
            await self._events.start()
            self._events.subscribe([topics.events], listener=_Rebalance(self))
        else:
            self._events = self._consumer(group_id=None)
            await self._events.start()
            await self._assign_all(self._events, topics.events)
        manual_events = topics.events if self.config.mode == "replica" else None
        self._tasks = [
            asyncio.create_task(
                self._consume(self._workers, self._apply_worker_state, topics.workers),
                name=f"consume {topics.workers}",
            ),
            asyncio.create_task(
                self._consume(self._events, self._apply_event, manual_events),
                name=f"consume {topics.events}",
            ),
            asyncio.create_task(self._watch_broker(), name="broker contact"),
            asyncio.create_task(self._expire_periodically(), name="speculation expiry"),
        ]
        if self.store is not None and self.config.snapshot_interval_s > 0:
            self._tasks.append(
                asyncio.create_task(self._snapshot_periodically(), name="periodic snapshots")
            )
        self._contact.heard()  # the consumers were just positioned: Kafka answered
        self._started = True

    async def run(self) -> None:
        """Wait until one of the follower's tasks ends, and raise its error.

        The tasks loop until ``stop``, so one that ends has failed. Cancelling ``run`` (as the
        service does on SIGTERM) leaves them running: ``stop`` cancels them once a snapshot being
        written has finished. ``gather`` would pass the cancellation down and cut that snapshot
        short while its thread (or a Kafka store's chunks) went on beside the final one.
        """
        tasks = list(self._tasks)
        if not tasks:
            return
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # its exception, or CancelledError if it was cancelled
        raise RuntimeError(f"a follower task ended without an error: {_task_names(done)}")

    async def stop(self, *, final_snapshot: bool = True) -> None:
        """Stop consuming; commit what was applied (group mode), snapshot, close the clients.

        ``final_snapshot=False`` is what a crash leaves behind, for tests of restarting.
        """
        self._started = False
        # A snapshot being written finishes first: cancelled, its write would go on in its
        # thread (or stop between a Kafka store's chunks) while the final one is written.
        async with self._snapshot_lock:
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            if self.config.mode == "group" and self._events is not None:
                await self._commit(self._events.assignment())
            if final_snapshot and self.store is not None:
                await self.snapshot_now()
        finally:
            for consumer in (self._events, self._workers):
                if consumer is not None:
                    await stop_consumer(consumer)
            self._events = self._workers = None
            if self.store is not None:
                await self.store.close()

    def _consumer(self, group_id: str | None) -> Any:
        name = f"hmakv-index-{self.config.follower_id}"
        return create_consumer(
            self.config.bootstrap,
            client_id=name,
            group_id=group_id,
            security=self.config.security,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            metadata_max_age_ms=int(self.config.partition_check_interval_s * 1000),
            fetch_max_wait_ms=round(self.config.fetch_max_wait_s * 1000),
        )

    async def _assign_all(self, consumer: Any, topic: str) -> None:
        """Every partition of the topic, each at its saved position or at the beginning."""
        partitions = await wait_for_partitions(
            self.config.bootstrap, topic, self.config.security, retry_s=_TOPIC_WAIT_S
        )
        tps = [TopicPartition(topic, partition) for partition in sorted(partitions)]
        consumer.assign(tps)
        await self._position_assigned(consumer, tps)

    async def _position_assigned(self, consumer: Any, tps: list[TopicPartition]) -> None:
        """Seek newly assigned partitions and note the log ends that readiness waits for."""
        beginnings = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            position = await self._start_position(consumer, tp, beginnings[tp], ends[tp])
            consumer.seek(tp, position)
            self._positions[tp] = position
            self.stats.start_offsets[tp] = position
            if ends[tp] > position:
                self._ready_targets[tp] = ends[tp]

    async def _start_position(
        self, consumer: Any, tp: TopicPartition, beginning: int, end: int
    ) -> int:
        """The saved position when the log still holds what follows it, else the beginning.

        Behind the beginning, retention deleted records the index never applied; past the end,
        the log is not the one the index applied (aiokafka would go back to the beginning
        without a word, and the new log's seqs would be taken for replays).
        """
        saved = self._positions.get(tp)
        if saved is None:
            return beginning
        if saved > end:
            await self._log_restarted(consumer, tp, saved, f"it ends at {end}")
            return beginning
        if saved < beginning:
            await self._records_lost(consumer, tp, saved, beginning)
        return max(saved, beginning)

    async def _assign_new_partitions(self, consumer: Any, topic: str) -> None:
        """Assign the partitions added to ``topic`` since it was assigned, from their beginning.

        The bridge looks a new key's partition up, so new workers land on added partitions: unread,
        they would be missing from the index, and from lag and readiness too. The clients refresh
        metadata every ``partition_check_interval_s``; this reads it at most as often.
        """
        now = time.monotonic()
        if now < self._next_partition_check.get(topic, 0.0):
            return
        self._next_partition_check[topic] = now + self.config.partition_check_interval_s
        assigned = set(consumer.assignment())
        known = consumer.partitions_for_topic(topic) or set()
        added = sorted({TopicPartition(topic, p) for p in known} - assigned)
        if not added:
            return
        # ``assign`` replaces the assignment and forgets every position: every record before
        # ``_positions`` is applied, so the partitions read so far go on from there.
        consumer.assign(sorted(assigned | set(added)))
        for tp in assigned:
            consumer.seek(tp, self._positions[tp])
        await self._position_assigned(consumer, added)
        counts = self.stats.partitions_added
        counts[topic] = counts.get(topic, 0) + len(added)
        log.info(
            "%s now has %d partitions: reading the new ones from their start: %s",
            topic,
            len(known),
            _names(added, self._positions),
        )

    async def _records_lost(self, consumer: Any, tp: TopicPartition, start: int, end: int) -> None:
        """Records ``start``..``end - 1`` of ``tp`` were deleted (retention) before this
        follower applied them: counted, logged, and their groups forgotten (events topic)."""
        log.error(
            "%s[%d]: records %d..%d were deleted by retention before this follower applied them",
            tp.topic,
            tp.partition,
            start,
            end - 1,
        )
        self.stats.records_lost += end - start
        await self._forget_keys_on(
            consumer,
            tp,
            self._applier.forget_lost_groups,
            "what these workers hold in these groups, whose records the deleted ones were",
        )

    async def _forget_keys_on(
        self,
        consumer: Any,
        tp: TopicPartition,
        forget: Callable[[int, Placement], dict[str, list[int]]],
        what: str,
    ) -> None:
        """On the events topic: ``forget`` what the index holds for the keys on ``tp``'s
        partition, and log ``what`` it forgot, by worker."""
        if tp.topic != self.config.topics.events:
            return
        place = await self._placement(consumer, tp.topic)
        forgotten = forget(tp.partition, place)
        log.error(
            "%s[%d]: the index forgot %s: %s",
            tp.topic,
            tp.partition,
            what,
            _worker_groups(forgotten),
        )

    async def _placement(self, consumer: Any, topic: str) -> Placement:
        """Where the bridge's producer would put a key now: aiokafka's default partitioner over
        the topic's partitions (for the keys this follower has not read yet)."""
        partitions = consumer.partitions_for_topic(topic) or await topic_partitions(
            self.config.bootstrap, topic, self.config.security
        )
        return lambda key: partition_for(key, partitions)

    async def _log_restarted(
        self, consumer: Any, tp: TopicPartition, position: int, found: str
    ) -> None:
        """``tp``'s log is below ``position``, up to which this follower read it: the topic was
        recreated, or an unclean leader election truncated it. Counted and logged; on the events
        topic, every worker with a key there is forgotten, seqs and epoch too, so that the new
        log's records apply instead of being taken for replays or an older life."""
        counts = self.stats.log_restarts
        counts[tp.topic] = counts.get(tp.topic, 0) + 1
        log.error(
            "%s[%d]: this follower's position %d is past the log (%s): the topic was recreated "
            "or truncated; reading it again from its beginning",
            tp.topic,
            tp.partition,
            position,
            found,
        )
        await self._forget_keys_on(
            consumer,
            tp,
            self._applier.forget_restarted_workers,
            "these workers (blocks, seqs, epoch), which had these groups there",
        )

    # ------------------------------------------------------------------------------ applying

    async def _consume(
        self,
        consumer: Any,
        apply: Callable[[TopicPartition, Any], None],
        assigned_topic: str | None,
    ) -> None:
        """Apply what ``consumer`` fetches; ``assigned_topic``: the topic it reads by manual
        assignment, watched for added partitions (None for a group member)."""
        while True:
            batches = await consumer.getmany(
                timeout_ms=_FETCH_TIMEOUT_MS, max_records=self.config.max_records_per_fetch
            )
            fetched = time.time()
            for tp, records in batches.items():
                await self._check_continuity(consumer, tp, records[0].offset)
                if consumer is self._events:
                    self._observe_fetch_ages(records, fetched)
                for record in records:
                    apply(tp, record)
                self._positions[tp] = records[-1].offset + 1
                consumed = self.stats.consumed
                consumed[tp.topic] = consumed.get(tp.topic, 0) + len(records)
            self._note_progress(batches)
            if assigned_topic is not None:
                await self._assign_new_partitions(consumer, assigned_topic)
            elif consumer is self._events:
                await self._commit_periodically()

    def _observe_fetch_ages(self, records: Sequence[Any], fetched: float) -> None:
        ages = self.stats.fetch_age
        for record in records:
            ages.observe(max(0.0, fetched - record.timestamp / 1000))

    async def _check_continuity(self, consumer: Any, tp: TopicPartition, first: int) -> None:
        """A fetch starts at the position, unless aiokafka moved the consumer without a word.

        Below it, the log restarted (aiokafka resets to the beginning of a log that ends before
        the position). Past it on the events topic, whose offsets have no holes, retention deleted
        records while this follower was behind. The workers topic is compacted: holes are normal.
        """
        expected = self._positions.get(tp, first)
        if first < expected:
            await self._log_restarted(consumer, tp, expected, f"a fetch began at {first}")
            # Ready again once this log's end, as the fetch saw it, is reached.
            self._ready_targets[tp] = consumer.highwater(tp) or 0
        elif consumer is self._events and expected < first:
            await self._records_lost(consumer, tp, expected, first)

    def _apply_event(self, tp: TopicPartition, message: Any) -> None:
        taken = self._applier.apply_event(message.key, message.value, tp.partition)
        if isinstance(taken, BadRecord):
            self._count_bad(taken, tp, message)
        elif taken.outcome is ApplyOutcome.APPLIED:
            self.stats.events_applied += 1
            age = time.time() - taken.record.ts
            self.stats.event_age.observe(max(0.0, age))
            self.speculation_ttl.observe(age)

    def _apply_worker_state(self, tp: TopicPartition, message: Any) -> None:
        replayed = message.offset < self._ready_targets.get(tp, 0)
        outcome = self._applier.apply_worker_state(message.key, message.value, replayed=replayed)
        match outcome:
            case BadRecord():
                self._count_bad(outcome, tp, message)
            case StateIgnored():
                self._count_ignored_state(outcome, tp, message)
            case StateTaken(state, health_changed):
                self.stats.worker_states_applied += 1
                if health_changed:
                    _log_health(state)
            case WorkerRetired(state):
                self.stats.worker_states_applied += 1
                log.info("worker %s retired at epoch %d: dropped", state.worker, state.epoch)
            case WorkerForgotten(worker):
                topic = self.config.topics.workers
                log.info("worker %s forgotten (tombstone on %s)", worker, topic)
            case KeylessTombstone():
                pass  # no worker to forget

    def _count_ignored_state(self, ignored: StateIgnored, tp: TopicPartition, message: Any) -> None:
        """A state that changed nothing is counted by reason, apart from the applied ones, and
        noted (at info: while catching up, older and retired lives are history)."""
        state, reason = ignored.state, ignored.reason
        if ignored.behind is not None:
            log.warning(
                "worker %s: the bridge says epoch %d but the index has applied epoch %d; the "
                "bridge may have lost its resume point, and records of epoch %d are ignored",
                state.worker,
                state.epoch,
                ignored.behind,
                state.epoch,
            )
        counts = self.stats.worker_states_ignored
        counts[reason] = counts.get(reason, 0) + 1
        self._ignored_log.warning(
            f"worker_state/{reason}",
            "ignored a state of worker %s (%s, epoch %d, %s) at %s[%d]@%d",
            state.worker,
            state.health,
            state.epoch,
            reason,
            tp.topic,
            tp.partition,
            message.offset,
        )

    def _count_bad(self, bad: BadRecord, tp: TopicPartition, message: Any) -> None:
        """A record skipped: counted by topic and reason, logged once per interval and kind
        (an ``apply_error`` with its traceback)."""
        counts = self.stats.bad_records
        kind = (tp.topic, bad.reason)
        counts[kind] = counts.get(kind, 0) + 1
        self._bad_log.warning(
            f"{tp.topic}/{bad.reason}",
            "skipped a record (%s) at %s[%d]@%d: %s",
            bad.reason,
            tp.topic,
            tp.partition,
            message.offset,
            bad.detail,
            error=bad.error,
        )

    # ------------------------------------------------------------------------------ progress

    def _note_progress(self, batches: Mapping[TopicPartition, object]) -> None:
        for tp in batches:
            target = self._ready_targets.get(tp)
            if target is not None and self._positions[tp] >= target:
                del self._ready_targets[tp]

    @property
    def ready(self) -> bool:
        """Caught up: the log ends seen at assignment reached, or little left to read."""
        if not (self._started and self._joined):
            return False
        return not self._ready_targets or self.lag() <= self.config.ready_max_lag

    def _assigned_events(self) -> set[TopicPartition]:
        return set(self._events.assignment()) if self._events is not None else set()

    def assigned_partitions(self) -> set[TopicPartition]:
        """The event partitions this follower reads now: all of them in replica mode."""
        return self._assigned_events()

    def lag_by_topic(self) -> dict[str, int]:
        """Records between the applied positions and the newest known log ends."""
        lag: dict[str, int] = {}
        for consumer in (self._events, self._workers):
            if consumer is None:
                continue
            for tp in consumer.assignment():
                end = consumer.highwater(tp) or self._ready_targets.get(tp, 0)
                behind = max(0, end - self._positions.get(tp, 0))
                lag[tp.topic] = lag.get(tp.topic, 0) + behind
        return lag

    def lag(self) -> int:
        return sum(self.lag_by_topic().values())

    def positions(self) -> dict[TopicPartition, int]:
        return dict(self._positions)

    def worker_state(self, worker: str) -> WorkerState | None:
        """The bridge's latest view of the worker, from the workers topic."""
        return self._applier.worker_state(worker)

    def stale_groups(self, worker: str) -> set[int]:
        """The worker's groups whose partition this follower no longer reads (group mode)."""
        return set(self.stale_groups_by_worker().get(worker, ()))

    def stale_groups_by_worker(self) -> Mapping[str, set[int]]:
        """``stale_groups`` of every worker that has some, for a score call or a scrape.

        Worked out once per assignment and set of known keys, not once per worker and request.
        """
        if self.config.mode != "group":
            return {}
        return self._applier.keys.stale_groups({tp.partition for tp in self._assigned_events()})

    def applied_ts(self, worker: str) -> float | None:
        """The engine's timestamp of the newest record applied for the worker by this process."""
        return self._applier.applied_ts(worker)

    # ------------------------------------------------------------------------------ speculation

    def speculate(
        self,
        worker: str,
        block_hashes: Sequence[ExternalBlockHash],
        num_tokens: int,
        ttl_s: float | None = None,
    ) -> tuple[int, float]:
        """A prompt routed to ``worker``: its blocks held speculatively for the TTL (``ttl_s``
        capped, or the measured one); the blocks newly held and the TTL. Raises
        ``UnknownWorker``."""
        ttl = self.speculation_ttl.for_request(ttl_s)
        now = self.expire_speculation()
        blocks = self.index.speculate(
            worker,
            block_hashes,
            num_tokens,
            expires_at=now + ttl,
            prefill_chunk_tokens=self.config.speculative_prefill_chunk_tokens,
        )
        return blocks, ttl

    def expire_speculation(self) -> float:
        """Drop what expired by now, on the follower's clock; the time it read."""
        now = self._clock()
        self.index.expire_speculation(now)
        return now

    async def _expire_periodically(self) -> None:
        """Expired entries go within a second even when nothing is scored or routed."""
        while True:
            self.expire_speculation()
            await asyncio.sleep(_SPECULATION_EXPIRY_INTERVAL_S)

    # ------------------------------------------------------------------------------ freshness

    def freshness(self) -> Freshness:
        """Kafka's silence and every known worker's lag behind the bridge, read now: one reading
        per request or scrape, so that all its answers agree."""
        lags = {
            worker: lag_seqs(self._applier.worker_state(worker), epoch, applied)
            for worker, (epoch, applied) in self.index.progress().items()
        }
        return Freshness(self._contact.silence_s(), lags, self.config.freshness)

    def stale_workers(self) -> set[str]:
        """``freshness().stale_workers()`` for a score call, without reading every worker's lag:
        the workers the applier found behind, or every worker while Kafka is silent."""
        if self.config.freshness.silent(self._contact.silence_s()):
            return set(self.index.progress())
        return self._applier.lagging

    async def _watch_broker(self) -> None:
        """Ask Kafka for the workers topic's log ends, again and again, to hear that it answers.

        Asked at least twice per ``max_broker_silence_s``, so that a healthy Kafka never looks
        silent between two answers. An answer may take up to the limit (a paused or overloaded
        broker keeps the request open), past which it is asked anew; the silence is read when
        wanted (``freshness``), not when an answer fails, so it shows as it grows.
        """
        limit = self.config.freshness.max_broker_silence_s
        interval = min(_BROKER_CHECK_INTERVAL_S, limit / 2)
        while True:
            answered = await self._broker_answers(limit)
            self._note_contact(answered)
            await asyncio.sleep(interval)

    async def _broker_answers(self, timeout_s: float) -> bool:
        """Whether the leaders of the workers topic answer, which is assigned whole from start
        (never empty: with no partition to ask about, aiokafka would answer without asking).

        ``asyncio.timeout``, not ``wait_for``: Python 3.11's ``wait_for`` returns the answer when
        a cancellation arrives with it, and ``stop`` would then wait for this loop forever.
        """
        partitions = list(self._workers.assignment())
        try:
            async with asyncio.timeout(timeout_s):
                await self._workers.end_offsets(partitions)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True

    def _note_contact(self, answered: bool) -> None:
        """Keep the answer's time; say once when the silence passes the limit, and when it ends."""
        silence = self._contact.silence_s()
        if answered:
            self._contact.heard()
            if self._silence_reported:
                self._silence_reported = False
                log.info("Kafka answers again after %.1f s of silence", silence)
        elif not self._silence_reported and silence > self.config.freshness.max_broker_silence_s:
            self._silence_reported = True
            log.warning(
                "Kafka has not answered for %.1f s: /readyz answers 503 and every worker is "
                "stale until it does",
                silence,
            )

    # ------------------------------------------------------------------------------ commits

    async def _commit_periodically(self) -> None:
        now = time.monotonic()
        if now - self._last_commit >= self.config.commit_interval_s:
            self._last_commit = now
            await self._commit(self._events.assignment())

    async def _commit(self, tps: Iterable[TopicPartition]) -> None:
        """Commit the applied positions: every record before them is in the index.

        A commit only reports progress (positions live in the snapshot), so one that fails, as
        commits do while the group rebalances, is counted and logged and tried again at the next
        interval, never fatal.
        """
        offsets = {tp: self._positions[tp] for tp in tps if tp in self._positions}
        if not offsets:
            return
        try:
            await self._events.commit(offsets)
        except KafkaError as error:
            self.stats.commits_failed += 1
            self._commit_log.warning(
                f"commit/{type(error).__name__}",
                "committing %s failed (%s: %s); the next commit will carry them",
                _names(offsets, offsets),
                type(error).__name__,
                error,
            )

    async def _on_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        revoked = list(revoked)
        self._joined = False  # not ready while the group rebalances
        await self._commit(revoked)
        for tp in revoked:
            self._ready_targets.pop(tp, None)
        if revoked:
            log.info(
                "partitions revoked: %s; their workers' groups are kept as stale state",
                _names(revoked),
            )

    async def _on_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        assigned = list(assigned)
        if assigned:
            await self._position_assigned(self._events, assigned)
            log.info("partitions assigned: %s", _names(assigned))
        # Only now: readiness needs the log ends of what was assigned.
        self._joined = True

    # ------------------------------------------------------------------------------ snapshots

    async def _restore(self) -> None:
        """Restore the newest snapshot; an unusable one is logged and the log is read instead."""
        if self.store is None:
            return
        started = time.monotonic()
        try:
            blob = await self.store.load()
            if blob is None:
                log.info("no snapshot in %s: reading the log from the start", self.store.describe())
                return
            snapshot, index = await asyncio.to_thread(self._unpack, blob)
        except (SnapshotError, ValueError) as exc:
            log.error(
                "cannot restore from %s (%s): reading the log from the start",
                self.store.describe(),
                exc,
            )
            return
        self._applier = Applier(
            index,
            worker_states=snapshot.worker_states,
            key_partitions=snapshot.key_partitions,
            max_worker_lag=self.config.freshness.max_worker_lag,
        )
        for saved in snapshot.offsets:
            self._positions[TopicPartition(saved.topic, saved.partition)] = saved.offset
        self.stats.restored_offsets = dict(self._positions)
        self.stats.last_snapshot_at = snapshot.created
        self.stats.last_snapshot_bytes = len(blob)
        log.info(
            "restored the snapshot of %s from %s in %.2f s: %d workers, offsets %s",
            time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(snapshot.created)),
            self.store.describe(),
            time.monotonic() - started,
            len(snapshot.worker_states),
            _names(self._positions, self._positions),
        )

    def _unpack(self, blob: bytes) -> tuple[Snapshot, KVIndex]:
        snapshot = unpack(blob)
        index = KVIndex.restore(
            snapshot.index,
            hash_block_size=self.config.hash_block_size,
            tier_weights=self.config.tier_weights,
            max_blocks_per_worker=self.config.max_blocks_per_worker,
        )
        return snapshot, index

    def capture(self) -> Snapshot:
        """Index and positions together: nothing is applied between the two reads."""
        return Snapshot(
            format=SNAPSHOT_FORMAT,
            follower_id=self.config.follower_id,
            created=time.time(),
            offsets=[
                PartitionOffset(tp.topic, tp.partition, offset)
                for tp, offset in sorted(self._positions.items())
            ],
            worker_states=self._applier.worker_states(),
            index=self.index.snapshot(),
            key_partitions=self._applier.keys.entries(),
        )

    async def snapshot_now(self) -> Snapshot | None:
        """Write a snapshot now; failures are counted and logged, never raised."""
        if self.store is None or not self._restored:
            return None
        async with self._snapshot_lock:
            started = time.monotonic()
            snapshot = self.capture()
            try:
                blob = await asyncio.to_thread(pack, snapshot)
                await self.store.save(blob)
            except Exception:
                self.stats.snapshots_failed += 1
                log.exception("snapshot to %s failed", self.store.describe())
                return None
            stats = self.stats
            stats.snapshots_written += 1
            stats.last_snapshot_at = snapshot.created
            stats.last_snapshot_duration_s = time.monotonic() - started
            stats.last_snapshot_bytes = len(blob)
            log.info(
                "snapshot to %s: %d bytes in %.2f s",
                self.store.describe(),
                len(blob),
                stats.last_snapshot_duration_s,
            )
            return snapshot

    async def _snapshot_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_interval_s)
            await self.snapshot_now()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Group mode: commit what was applied before giving partitions up; seek what comes in."""

    def __init__(self, follower: Follower) -> None:
        self._follower = follower

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._follower._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._follower._on_assigned(assigned)


def _names(
    tps: Iterable[TopicPartition], offsets: Mapping[TopicPartition, int] | None = None
) -> str:
    parts = []
    for tp in sorted(tps):
        suffix = f"@{offsets[tp]}" if offsets is not None else ""
        parts.append(f"{tp.topic}[{tp.partition}]{suffix}")
    return ", ".join(parts) or "none"


def _worker_groups(groups: Mapping[str, list[int]]) -> str:
    return ", ".join(f"{worker} {each}" for worker, each in sorted(groups.items())) or "none"


def _log_health(state: WorkerState) -> None:
    level = logging.WARNING if state.health == "degraded" else logging.INFO
    log.log(
        level,
        "worker %s is %s (epoch %d, bridge's last seq %d)",
        state.worker,
        state.health,
        state.epoch,
        state.last_seq,
    )


def _task_names(tasks: Iterable[asyncio.Task[None]]) -> str:
    return ", ".join(sorted(task.get_name() for task in tasks))
