"""The bridge service: the parts assembled and run, from start-up through reloads to shutdown.

``BridgeService`` owns the life cycle and nothing below it: what starts in which order, what a
reload changes, when the bridge is ready, how it stops. The parts do the work: the sink
(``bridge.sink``) writes to Kafka, the sources (``bridge.source``) receive, each worker's channel
(``bridge.channel``) carries out its relay's answers, and the roster (``bridge.roster``) says who
sent what on the bound socket. ``BridgeSettings`` and ``check_topology`` are what it is given
and whether that can run.

Start-up order matters: Kafka first (topics, producer), then the workers topic read to its end,
so that every worker's tracker starts from where the previous bridge left it, and only then the
sources, whose first act for a resumed worker is to replay from that point. The health server
runs from the very start, so an orchestrator sees "alive, not ready" while Kafka is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import zmq
from aiohttp import web
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from hmakv.bridge.board import WorkerBoard
from hmakv.bridge.catalog import GroupCatalog
from hmakv.bridge.channel import SourceSettings, WorkerChannel
from hmakv.bridge.config import ConfigError, EngineConfig, WorkerAddress
from hmakv.bridge.deadletter import DeadLetterOffice
from hmakv.bridge.frames import EventLimits
from hmakv.bridge.health import Readiness, health_app
from hmakv.bridge.intake import Intake
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.relay import WorkerRelay
from hmakv.bridge.resume import read_worker_states
from hmakv.bridge.roster import DEFAULT_JOINS_PER_MINUTE, LLMD_TOPICS, BoundRoster
from hmakv.bridge.sink import KafkaSink
from hmakv.bridge.source import BoundSource, ConnectedSource, SourceState, SubscriberDeps
from hmakv.bridge.tracking import DEFAULT_MAX_BUFFERED, ResumePoint, SequenceTracker
from hmakv.kvlog.kafka_client import (
    KafkaSecurity,
    StartedProducer,
    TopicSpec,
    check_access,
    ensure_topics,
    start_producer,
)
from hmakv.kvlog.records import DEFAULT_TOPIC_PREFIX, RETIRED, Topics, WorkerState
from hmakv.kvlog.web import serve
from hmakv.producer.curve import CurveGate, KeyPair
from hmakv.producer.events import DEFAULT_MAX_PAYLOAD_BYTES
from hmakv.producer.protocol import offset_endpoint_port

log = logging.getLogger(__name__)

_PROBE_INTERVAL_S = 2.0
_REREAD_TIMEOUT_S = 10.0
_RECORD_MARGIN_BYTES = 64 * 1024  # a record batch's own overhead around its largest record


@dataclass(frozen=True)
class BridgeSettings:
    kafka: str
    topic_prefix: str = DEFAULT_TOPIC_PREFIX
    partitions: int = 6
    replication: int = 1
    compression: str | None = None
    bind_sub: str | None = None
    # vLLM offsets each DP rank's port, connect endpoints too: ranks 0..N-1 reach N bound ports.
    bind_sub_ranks: int = 1
    listen: tuple[str, int] | None = None
    max_replays: int = 4
    replay_timeout: float = 5.0
    queue_size: int = 10_000
    rcvhwm: int = 1000
    max_buffered: int = DEFAULT_MAX_BUFFERED
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    limits: EventLimits = field(default_factory=EventLimits)
    max_record_bytes: int = 8 * 1024 * 1024
    max_workers: int = 1024
    max_joins_per_minute: int = DEFAULT_JOINS_PER_MINUTE  # per source, joins by topic
    join_by_topic: bool = False  # engines not configured may join on --bind-sub (llm-d's topics)
    state_interval: float = 1.0
    # Chunks sent before the oldest is acknowledged (idempotent producer). aiokafka keeps one
    # request per broker in flight and one batch per partition waiting: a deeper pipeline
    # only makes smaller chunks.
    in_flight: int = 2
    linger: float = 0.002  # seconds a small chunk may wait to grow before it is sent
    shutdown_timeout: float = 10.0
    kafka_retry: float = 2.0
    # A worker with a replay endpoint heard from neither live nor by a replay for this long is
    # caught up by a replay (0: never): what was lost at the end of a burst would wait for the
    # engine's next batch otherwise, however long it stays idle.
    quiet_catch_up: float = 5.0
    client_id: str = "hmakv-bridge"
    security: KafkaSecurity | None = field(default=None, repr=False)
    # CURVE (producer.curve): the bridge's key pair, every engine's public key in its config,
    # and the client keys that may join workers by topic on --bind-sub.
    curve_keys: KeyPair | None = field(default=None, repr=False)
    join_keys: frozenset[bytes] = frozenset()

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    def topic_specs(self) -> list[TopicSpec]:
        topics, parts, rf = self.topics, self.partitions, self.replication
        max_message = str(self.max_record_bytes + _RECORD_MARGIN_BYTES)
        return [
            TopicSpec(topics.events, parts, rf, {"max.message.bytes": max_message}),
            TopicSpec(topics.workers, parts, rf, {"cleanup.policy": "compact"}),
            TopicSpec(topics.deadletter, parts, rf),
        ]


class BridgeService:
    def __init__(
        self,
        settings: BridgeSettings,
        engines: list[EngineConfig],
        metrics: BridgeMetrics | None = None,
    ) -> None:
        check_topology(settings, engines)
        self.settings = settings
        self.metrics = metrics or BridgeMetrics()
        self._engines: dict[str, EngineConfig] = {engine.name: engine for engine in engines}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._board = WorkerBoard(settings.state_interval)
        self._source_settings = SourceSettings(
            max_payload_bytes=settings.max_payload_bytes,
            replay_timeout=settings.replay_timeout,
            limits=settings.limits,
            rcvhwm=settings.rcvhwm,
            curve_keys=settings.curve_keys,
        )
        self._replays = asyncio.Semaphore(settings.max_replays)
        self._channels: dict[str, WorkerChannel] = {}
        self._sources: dict[str, tuple[ConnectedSource, asyncio.Task[None]]] = {}
        self._bound: tuple[BoundSource, asyncio.Task[None]] | None = None
        self._roster = BoundRoster(
            self._channels,
            self._join,
            self._retire_joined,
            max_workers=settings.max_workers,
            convention=LLMD_TOPICS if settings.join_by_topic else None,
            join_keys=settings.join_keys if settings.curve_keys is not None else None,
            joins_per_minute=settings.max_joins_per_minute,
        )
        self._gate: CurveGate | None = None
        # The workers topic as read at start (and on reload), with the workers retired since:
        # where a worker this bridge does not follow yet would resume.
        self._known: dict[str, WorkerState] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._producer: AIOKafkaProducer | None = None
        self._sink: KafkaSink | None = None
        self._intake: Intake | None = None
        self._intake_task: asyncio.Task[None] | None = None
        self._office: DeadLetterOffice | None = None
        self._runner: web.AppRunner | None = None
        self._probe: asyncio.Task[None] | None = None
        self._quiet: asyncio.Task[None] | None = None
        self._kafka_reachable = False
        self._started = False
        self._crashed = asyncio.Event()  # a task the bridge cannot work without has ended
        # One reload at a time (each reads the workers topic), none before start has followed
        # the engines it was given: a SIGHUP may come while Kafka is not reachable yet.
        self._reloading = asyncio.Lock()
        self._stopping = False
        self._rereading: asyncio.Future[None] | None = None  # a reload's read of the workers topic

    # --- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._reloading:
            await self._start()

    async def _start(self) -> None:
        if self.settings.listen is not None:
            app = health_app(self.readiness, self.metrics.registry)
            self._runner = await serve(app, *self.settings.listen)
        started = await self._connect_kafka()
        self._producer = started.producer
        self._probe = asyncio.create_task(self._probe_kafka())
        if self.settings.quiet_catch_up > 0:
            self._quiet = asyncio.create_task(self._catch_up_quiet_workers())
        resumed = self._known = await self._read_resume_points(self._producer)
        self._sink = KafkaSink(
            self._producer,
            self.settings.topics,
            self._board,
            self.metrics,
            max_queued=self.settings.queue_size,
            # Without idempotence a failed chunk must be re-sent before anything later.
            in_flight=self.settings.in_flight if started.idempotent else 1,
            linger=self.settings.linger,
            state_interval=self.settings.state_interval,
            replace_producer=self._replace_producer,
        )
        for task in self._sink.start():
            self._watch(task)
        self._intake = Intake(self._sink.wait_for_room)
        self._intake_task = asyncio.create_task(self._intake.run(), name="hmakv-bridge-intake")
        self._watch(self._intake_task)
        self._office = DeadLetterOffice(
            self._sink, self.metrics, self._source_settings.dead_letter_max_bytes
        )
        for engine in self._engines.values():
            self._add_engine(engine, resumed)
        if self.settings.bind_sub is not None:
            endpoints = bound_endpoints(self.settings)
            if self.settings.curve_keys is not None:
                refused = self.metrics.handshakes_refused
                self._gate = CurveGate(self._ctx, self._roster.admits, refused.inc)
            bound = BoundSource(endpoints, self._roster, self._deps())
            self._bound = (bound, asyncio.create_task(bound.run()))
        self._count_sources()
        self._started = True
        log.info(
            "bridge started: %d engines, %d workers resumed, Kafka %s",
            len(self._engines),
            len(resumed),
            self.settings.kafka,
        )

    async def stop(self) -> None:
        """Stop receiving, deliver what is queued (within the shutdown timeout), close.

        A reload under way is waited for, its read of the workers topic (which waits for Kafka
        as long as it takes) cut short: it changes nothing once stopping, and none adds sources
        to a bridge that is closing them."""
        self._stopping = True
        if self._rereading is not None:
            self._rereading.cancel()
        if self._started:  # a start cut short holds no lock; one not cut short has ended
            async with self._reloading:
                await self._stop()
        else:
            await self._stop()

    async def _stop(self) -> None:
        tasks = [task for _, task in self._sources.values()]
        if self._intake_task is not None:
            tasks.append(self._intake_task)
        if self._bound is not None:
            tasks.append(self._bound[1])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
        if self._sink is not None:
            left = await self._sink.close(self.settings.shutdown_timeout)
            if left:
                log.error(
                    "%d queued batches not delivered at shutdown; the engines' replay rings "
                    "hold them for the next start",
                    left,
                )
        for loop in (self._probe, self._quiet):
            if loop is not None:
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
        if self._producer is not None:
            await self._close_producer(self._producer)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.destroy(linger=0)
        if self._runner is not None:
            await self._runner.cleanup()

    async def reload(
        self, engines: list[EngineConfig], fleet: Collection[str] | None = None
    ) -> None:
        """Follow a new engine list: removed engines stop, new ones start, changed ones restart
        from where they were (their trackers verify that by replay).

        ``fleet`` names every engine of the configuration, this bridge's or another shard's
        (None: ``engines`` is the whole fleet). A removed engine still in it has moved to another
        bridge, which resumes it from the workers topic; one that is not has left the fleet and
        its workers are retired, as is a DP rank an engine no longer has. A new engine resumes
        from the workers topic as it is now (another bridge may have followed it until a moment
        ago).
        """
        check_topology(self.settings, engines)
        async with self._reloading:
            if not self._started:  # start() was stopped before it finished: nothing to reload
                log.warning("engines not reloaded: the bridge has not started")
                return
            if self._stopping:
                log.warning("engines not reloaded: the bridge is stopping")
                return
            await self._follow(engines, fleet)

    async def _follow(self, engines: list[EngineConfig], fleet: Collection[str] | None) -> None:
        """Every await comes before the first worker is forgotten: from then on until the
        engines that stay are followed again, a refusal Kafka reports would find no channel."""
        wanted = {engine.name: engine for engine in engines}
        changed = [n for n, e in self._engines.items() if wanted.get(n) != e]
        if any(self._engines.get(name) != engine for name, engine in wanted.items()):
            self._rereading = asyncio.ensure_future(self._reread_resume_points())
            try:
                await self._rereading
            except asyncio.CancelledError:
                if not self._stopping:
                    raise
                log.warning("engines not reloaded: the bridge is stopping")
                return
            finally:
                self._rereading = None
        removed = [self._engines.pop(name) for name in changed]
        closed = await self._close_engines(removed)
        staying = {address.worker for e in engines for address in e.workers()}
        positions = {}
        for engine, channels in closed:
            moved = engine.name not in wanted and fleet is not None and engine.name in fleet
            leaving = set() if moved else {a.worker for a in engine.workers()} - staying
            for channel in channels:
                # Read once nothing more changes it: a refusal reported while channels closed
                # opened a newer epoch, in which the engine goes on should it stay.
                if (position := channel.position()) is not None:
                    positions[channel.worker] = position
                self._forget(channel, retire=channel.worker in leaving)
        for name, engine in wanted.items():
            if name not in self._engines:
                self._engines[name] = engine
                self._add_engine(engine, {**self._known, **positions})
        self._count_sources()
        log.info("engines reloaded: %s", ", ".join(sorted(wanted)) or "none")

    def readiness(self) -> Readiness:
        sources = {name: source.state.value for name, (source, _) in self._sources.items()}
        if self._bound is not None:
            sources[self._bound[0].name] = self._bound[0].state.value
        started = self._started and not self._crashed.is_set()
        return Readiness(started, self._kafka_reachable, sources)

    async def wait_crashed(self) -> None:
        """Until the intake or a delivery loop has ended early (a bug): the process should stop
        and be restarted, which resumes every worker from the workers topic."""
        await self._crashed.wait()

    def _watch(self, task: asyncio.Task[None]) -> None:
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        log.critical("%s ended (%r): nothing is forwarded any more", task.get_name(), error)
        self._crashed.set()

    # --- Kafka -----------------------------------------------------------------------------------

    async def _connect_kafka(self) -> StartedProducer:
        """Topics and producer, retried until Kafka answers: the bridge is useless without it.

        A broker refusing the security settings is no outage to wait out: ``KafkaRefusedError``
        ends the start (or, on a producer replaced later, the bridge)."""
        settings = self.settings
        while True:
            try:
                await check_access(settings.kafka, settings.security)
                await ensure_topics(
                    settings.kafka,
                    settings.topic_specs(),
                    client_id=f"{settings.client_id}-admin",
                    security=settings.security,
                )
                started = await start_producer(
                    settings.kafka,
                    client_id=settings.client_id,
                    compression=settings.compression,
                    security=settings.security,
                    linger_ms=0,
                    max_batch_size=512 * 1024,
                )
            except (KafkaError, OSError) as error:
                log.warning(
                    "Kafka at %s not usable yet (%r); retrying in %.0f s",
                    settings.kafka,
                    error,
                    settings.kafka_retry,
                )
                await asyncio.sleep(settings.kafka_retry)
                continue
            self._set_kafka_reachable(True)
            return started

    async def _read_resume_points(self, producer: AIOKafkaProducer) -> dict[str, WorkerState]:
        topic = self.settings.topics.workers
        partitions = await producer.partitions_for(topic)
        return await read_worker_states(
            self.settings.kafka, topic, partitions, security=self.settings.security
        )

    async def _reread_resume_points(self) -> None:
        """The workers topic as it is now, for engines new to this bridge, retried until Kafka
        answers: one resumed from an older state could continue an epoch consumers left behind
        (and nothing is forwarded without Kafka anyway)."""
        assert self._producer is not None
        while True:
            try:
                read = await asyncio.wait_for(
                    self._read_resume_points(self._producer), _REREAD_TIMEOUT_S
                )
            except (KafkaError, OSError, TimeoutError) as error:
                log.warning("workers topic not read (%r); new engines wait for it", error)
                await asyncio.sleep(self.settings.kafka_retry)
                continue
            self._known = _with_retired(read, self._known)
            return

    async def _replace_producer(self, old: AIOKafkaProducer) -> AIOKafkaProducer:
        await self._close_producer(old)
        self._producer = (await self._connect_kafka()).producer
        return self._producer

    async def _close_producer(self, producer: AIOKafkaProducer) -> None:
        # An idempotent producer retries an unreachable Kafka forever; closing must not.
        try:
            await asyncio.wait_for(producer.stop(), self.settings.shutdown_timeout)
        except TimeoutError:
            log.error("Kafka producer not closed within %.1f s", self.settings.shutdown_timeout)

    async def _probe_kafka(self) -> None:
        while True:
            await asyncio.sleep(_PROBE_INTERVAL_S)
            self._set_kafka_reachable(await self._kafka_answers())

    async def _catch_up_quiet_workers(self) -> None:
        """Every connected worker with a replay endpoint that has been quiet for
        ``quiet_catch_up`` seconds, while the bridge was reading (its Kafka queue had room),
        asks its engine for what follows its last seq."""
        interval = self.settings.quiet_catch_up
        reading_since = time.monotonic()  # quiet counts only while the bridge was reading
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            if self._sink is not None and not self._sink.has_room():
                reading_since = now  # the intake is paused: the engines may well be busy
                continue
            quiet_since = now - interval
            if reading_since > quiet_since:
                continue
            for worker, channel in list(self._channels.items()):
                if channel.address.replay is None or channel.last_heard > quiet_since:
                    continue
                source = self._sources.get(worker)
                if source is None or source[0].state is SourceState.CONNECTED:
                    channel.on_connected()  # bound engines' sockets count as connected

    async def _kafka_answers(self) -> bool:
        if self._sink is not None and time.monotonic() - self._sink.last_delivery < 1.0:
            return True
        assert self._producer is not None
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), _PROBE_INTERVAL_S)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True

    def _set_kafka_reachable(self, reachable: bool) -> None:
        if reachable != self._kafka_reachable:
            (log.info if reachable else log.warning)("Kafka reachable: %s", reachable)
        self._kafka_reachable = reachable
        self.metrics.kafka_reachable.set(1 if reachable else 0)

    # --- engines, workers, sources ---------------------------------------------------------------

    def _add_engine(self, engine: EngineConfig, resumed: Mapping[str, WorkerState]) -> None:
        if engine.endpoint is None:
            self._roster.add(engine)
        for address in engine.workers():
            channel = self._new_channel(address, engine, resumed.get(address.worker))
            if engine.endpoint is None:  # its messages come through the bound socket
                channel.start()
                channel.on_connected()
                continue
            source = ConnectedSource(channel, engine.topic, self._deps())
            self._sources[address.worker] = (source, asyncio.create_task(source.run()))

    async def _close_engines(
        self, engines: list[EngineConfig]
    ) -> list[tuple[EngineConfig, list[WorkerChannel]]]:
        """Stop receiving from the engines and close their workers' channels (still on the
        board and the sink, for the caller to forget)."""
        closed = []
        for engine in engines:
            self._roster.remove(engine)
            channels = []
            for address in engine.workers():
                entry = self._sources.pop(address.worker, None)
                if entry is not None:
                    entry[1].cancel()
                    await asyncio.gather(entry[1], return_exceptions=True)
                channel = self._channels.pop(address.worker, None)
                if channel is not None:
                    await channel.close()
                    channels.append(channel)
            closed.append((engine, channels))
        return closed

    def _forget(self, channel: WorkerChannel, *, retire: bool) -> None:
        """Stop following the channel's worker (retired, or released to another bridge). What
        the sink keeps of it goes; ``_known`` keeps its state, to resume it should it return."""
        assert self._sink is not None
        retired = channel.forget(retire=retire)
        self._sink.forget(channel.worker)
        if retired is not None:
            self._known[channel.worker] = retired
            self.metrics.workers_retired.inc()
            log.info(
                "worker %r retired at epoch %d: consumers drop it", channel.worker, retired.epoch
            )

    def _new_channel(
        self, address: WorkerAddress, engine: EngineConfig | None, state: WorkerState | None
    ) -> WorkerChannel:
        assert self._sink is not None and self._office is not None
        resume = None
        if state is not None and state.health == RETIRED:
            # Consumers dropped it and ignore its retired life: a new one, caught up from seq 0.
            resume = ResumePoint(state.epoch + 1, -1, 0.0)
        elif state is not None:
            degraded = state.health == "degraded"
            resume = ResumePoint(state.epoch, state.last_seq, state.ts, degraded)
        tracker = SequenceTracker(
            can_fetch=address.replay is not None,
            resume=resume,
            max_buffered=self.settings.max_buffered,
        )
        catalog = GroupCatalog(
            learned=state.groups if state else None,
            configured=engine.groups if engine else None,
        )
        relay = WorkerRelay(
            address.worker,
            tracker,
            catalog,
            topics=self.settings.topics,
            data_parallel_rank=address.data_parallel_rank,
            max_record_bytes=self.settings.max_record_bytes,
        )
        channel = WorkerChannel(
            relay,
            address,
            ctx=self._ctx,
            sink=self._sink,
            board=self._board,
            metrics=self.metrics,
            replays=self._replays,
            office=self._office,
            settings=self._source_settings,
            resumed_ts=state.ts if state else 0.0,
        )
        self._channels[address.worker] = channel
        return channel

    def _join(self, address: WorkerAddress) -> WorkerChannel:
        """The channel of a worker joining through the bound socket by its topic; it resumes
        from the workers topic too, in the epoch it had."""
        channel = self._new_channel(address, None, self._known.get(address.worker))
        channel.start()
        return channel

    def _retire_joined(self, worker: str) -> None:
        """Stop following a worker that joined by topic, retired (the roster made room)."""
        channel = self._channels.pop(worker)
        self._forget(channel, retire=True)
        closing = asyncio.create_task(channel.close())
        self._retiring.add(closing)
        closing.add_done_callback(self._retiring.discard)

    def _deps(self) -> SubscriberDeps:
        assert self._office is not None and self._intake is not None
        return SubscriberDeps(
            self._ctx,
            self._intake,
            self._office,
            self.metrics,
            self._source_settings,
            self._count_sources,
        )

    def _count_sources(self) -> None:
        states = [source.state for source, _ in self._sources.values()]
        if self._bound is not None:
            states.append(self._bound[0].state)
        self.metrics.sources.set(len(states))
        self.metrics.sources_connected.set(states.count(SourceState.CONNECTED))


def _with_retired(
    read: dict[str, WorkerState], known: Mapping[str, WorkerState]
) -> dict[str, WorkerState]:
    """The workers topic as just read, but for workers retired here whose retired state Kafka
    may not hold yet (the sink writes it with the next states)."""
    states = dict(read)
    for worker, state in known.items():
        now = read.get(worker)
        if state.health == RETIRED and (now is None or now.epoch <= state.epoch):
            states[worker] = state
    return states


def check_topology(settings: BridgeSettings, engines: list[EngineConfig]) -> None:
    """Every engine must be reachable: by its endpoint, or by its topic on the bound socket."""
    for engine in engines:
        if engine.endpoint is None and settings.bind_sub is None:
            raise ConfigError(f"engine {engine.name!r} has no endpoint and there is no --bind-sub")
    topics = [engine.topic for engine in engines if engine.endpoint is None]
    if len(topics) != len(set(topics)):
        raise ConfigError("engines reached through --bind-sub need distinct topics")
    for engine in engines:
        top = max(engine.dp_ranks or (0,))
        if engine.endpoint is None and top >= settings.bind_sub_ranks:
            raise ConfigError(
                f"engine {engine.name!r} has DP rank {top}, whose port --bind-sub does not "
                f"bind: give --bind-sub-ranks {top + 1}"
            )
    bound_endpoints(settings)  # each rank's port is one ZMQ can bind
    _check_curve(settings, engines)


def _check_curve(settings: BridgeSettings, engines: list[EngineConfig]) -> None:
    """CURVE is all or nothing: one bound socket serves every engine that connects to it, and a
    key the bridge holds for no engine would be a guard that guards nothing."""
    curve = settings.curve_keys is not None
    for engine in engines:
        if curve and engine.public_key is None:
            raise ConfigError(
                f"engine {engine.name!r} has no public_key: with --curve-secret-key every "
                "engine's key is needed, to check it by"
            )
        if not curve and engine.public_key is not None:
            raise ConfigError(
                f"engine {engine.name!r} has a public_key, but there is no --curve-secret-key"
            )
    if settings.join_keys and not (curve and settings.join_by_topic):
        raise ConfigError("--join-keys needs --curve-secret-key and --join-by-topic")


def bound_endpoints(settings: BridgeSettings) -> list[str]:
    """The endpoints of --bind-sub, one per DP rank, where vLLM's ranks connect to it."""
    if settings.bind_sub is None:
        return []
    try:
        ranks = range(settings.bind_sub_ranks)
        return [str(offset_endpoint_port(settings.bind_sub, rank)) for rank in ranks]
    except ValueError as error:
        raise ConfigError(f"--bind-sub {settings.bind_sub!r}: {error}") from error
