"""The ZMQ side of the bridge: sockets in, tracker inputs out, tracker steps carried out.

* ``WorkerChannel``: one worker inside the bridge. It feeds its relay (tracker, catalog, fan-out)
  with live and fetched batches, runs the fetches the tracker asks for over a fresh DEALER each
  (so a superseded reply can never leak into the next), puts records into the sink, and turns
  every step into metrics, logs and the worker's entry on the board.
* ``ConnectedSource``: a SUB socket connected to one engine's PUB endpoint (one DP rank).
* ``BoundSource``: one SUB socket bound by the bridge that many engines connect to; each message
  goes to the worker its topic and DP rank name.

Live messages come from the ``Intake`` (one task for every SUB socket, see ``bridge.intake``);
replies to a fetch are read here, draining the DEALER per wake-up: one await, then every message
already there (up to a limit, for fairness) without awaiting.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from prometheus_client import Counter as MetricCounter
from zmq.utils.monitor import parse_monitor_message

from hmakv.bridge.board import WorkerBoard, WorkerView
from hmakv.bridge.config import WorkerAddress
from hmakv.bridge.frames import Rejected, RejectReason, decode_payload, split_live, split_reply
from hmakv.bridge.intake import Intake
from hmakv.bridge.metrics import KNOWN_EVENT_CLASSES, UNKNOWN_EVENT_TYPE, BridgeMetrics
from hmakv.bridge.readable import Readable, take_ready
from hmakv.bridge.relay import WorkerRelay
from hmakv.bridge.sink import KafkaSink
from hmakv.bridge.tracking import (
    BufferOverflow,
    Duplicate,
    EpochStarted,
    Fetch,
    FetchKind,
    Forward,
    GapDetected,
    GapReplayed,
    GapUnrecoverable,
    HealthChanged,
    Step,
)
from hmakv.kvlog.logs import RateLimitedLog
from hmakv.kvlog.records import DeadLetter, WorkerState
from hmakv.producer.events import DecodedBatch
from hmakv.producer.protocol import SNAPSHOT_REQUEST, ReplyEnd, SeqFrames, replay_request

log = logging.getLogger(__name__)
incidents = RateLimitedLog(log)

_SUBSCRIPTION_DELAY_S = 0.2

Route = Callable[[bytes, "int | None"], "WorkerChannel | str"]
SoleChannel = Callable[[bytes], "WorkerChannel | None"]


@dataclass(frozen=True)
class SourceSettings:
    max_payload_bytes: int
    replay_timeout: float
    # Reply messages one fetch may hand over per turn of the event loop: with many replays at
    # once, more would starve the sink's loops until the queue is full.
    receive_limit: int = 64
    rcvhwm: int = 1000
    dead_letter_max_bytes: int = 512 * 1024


class SourceState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILED = "failed"


async def receive_ready(
    sock: zmq.Socket[bytes], readable: Readable, limit: int, timeout: float | None = None
) -> list[list[bytes]] | None:
    """Every message the socket has ready (up to ``limit``), awaiting only when there is none.

    None when ``timeout`` seconds passed without a message.
    """
    while True:
        messages = take_ready(sock, limit)
        if messages:
            return messages
        if not await readable.wait(timeout):
            return None


class DeadLetterOffice:
    """Counts, logs (rate-limited) and dead-letters every message the bridge cannot use."""

    def __init__(self, sink: KafkaSink, metrics: BridgeMetrics, max_bytes: int) -> None:
        self._sink = sink
        self._metrics = metrics
        self._max_bytes = max_bytes

    def reject(self, source: str, rejected: Rejected) -> None:
        reason = rejected.reason.value
        self._metrics.frames_rejected.labels(reason).inc()
        incidents.warning(
            f"rejected:{reason}",
            "%s: message rejected (%s): %s",
            source,
            reason,
            rejected.detail,
            source=source,
            reason=reason,
            seq=rejected.seq,
        )
        frames, detail = self._bounded(rejected.frames, rejected.detail)
        self._sink.put_dead_letter(DeadLetter(source, reason, detail, frames, time.time()))

    def _bounded(self, frames: list[bytes], detail: str) -> tuple[list[bytes], str]:
        """Frames that fit a Kafka record: an oversize payload keeps its first bytes only."""
        if sum(map(len, frames)) <= self._max_bytes:
            return frames, detail
        budget = self._max_bytes
        kept = []
        for frame in frames:
            kept.append(frame[: max(0, budget)])
            budget -= len(kept[-1])
        sizes = ", ".join(str(len(frame)) for frame in frames)
        return kept, f"{detail} [frames truncated to {self._max_bytes} bytes; sizes {sizes}]"


class WorkerChannel:
    def __init__(
        self,
        relay: WorkerRelay,
        address: WorkerAddress,
        *,
        ctx: zmq.Context[zmq.Socket[bytes]],
        sink: KafkaSink,
        board: WorkerBoard,
        metrics: BridgeMetrics,
        replays: asyncio.Semaphore,
        office: DeadLetterOffice,
        settings: SourceSettings,
        resumed_ts: float = 0.0,
    ) -> None:
        self.relay = relay
        self.address = address
        self.worker = relay.worker
        self._ctx = ctx
        self._sink = sink
        self._board = board
        self._metrics = metrics
        self._replays = replays
        self._office = office
        self._settings = settings
        self._fetches: dict[int, asyncio.Task[None]] = {}
        self._closed = False  # no fetch starts once closing began
        self._batches = metrics.batches_received.labels(self.worker)
        self._events: dict[type, MetricCounter] = {
            cls: metrics.events_received.labels(self.worker, cls.__name__)
            for cls in KNOWN_EVENT_CLASSES
        }
        self._unknown_typed = metrics.events_received.labels(self.worker, UNKNOWN_EVENT_TYPE)
        self._duplicates = metrics.duplicates.labels(self.worker)
        self._received_batches = 0
        self._received_types: list[type] = []  # each received event's class, counted per flush
        tracker = relay.tracker
        board.add(
            self.worker,
            WorkerView(
                health=tracker.health,
                groups=relay.catalog.specs,
                data_parallel_rank=address.data_parallel_rank,
                endpoint=address.endpoint,
                epoch=tracker.epoch,
                last_seq=tracker.next_seq - 1,
                last_ts=resumed_ts,
            ),
        )
        sink.refusal_handlers[self.worker] = self.on_refused
        metrics.start_worker(self.worker)
        metrics.set_health(self.worker, tracker.health)
        metrics.worker_epoch.labels(self.worker).set(tracker.epoch)

    # --- inputs ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._apply(self.relay.tracker.start())

    def on_connected(self) -> None:
        self._apply(self.relay.tracker.on_connected())

    def on_live(self, seq: int, decoded: DecodedBatch, frames: list[bytes]) -> None:
        batch = decoded.batch
        self._received_batches += 1
        self._received_types.extend(map(type, batch.events))
        if decoded.unknown_event_types:
            self._unknown_events(seq, decoded, frames)
        self._apply(self.relay.tracker.on_live(seq, batch))

    def flush_counts(self) -> None:
        """Add what was received since the last call to the metrics: once per wake-up, not per
        batch, since every increment of a Prometheus counter takes a lock. The event classes
        are counted here too, in one pass in C: a ``Counter.update`` per batch cost 0.8 us, the
        ``extend`` 0.2."""
        if self._received_batches:
            self._batches.inc(self._received_batches)
            for cls, count in Counter(self._received_types).items():
                self._events.get(cls, self._unknown_typed).inc(count)
            self._received_batches = 0
            self._received_types.clear()

    def on_undecodable(self, seq: int) -> None:
        self._apply(self.relay.tracker.on_undecodable(seq))

    def on_refused(self, epoch: int, seq: int) -> None:
        self._apply(self.relay.tracker.on_delivery_failed(epoch, seq))

    async def close(self) -> None:
        """Stop the fetches; a refusal Kafka reports meanwhile starts none (it would run on for
        a worker this channel no longer follows)."""
        self._closed = True
        tasks = [*self._fetches.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fetches.clear()

    def forget(self, *, retire: bool = False) -> WorkerState | None:
        """This bridge stops following the worker: its last state is written, then its board
        entry, handler and series go.

        ``retire``: the worker left the fleet, and no other bridge takes it over; its state is
        written ``retired``, so that consumers drop it. That state is returned.
        """
        retired = None
        if retire:
            retired = self._board.retire(self.worker, self.relay.tracker.epoch, time.time())
        else:
            self._board.release(self.worker, time.time())
        self._sink.state_changed()
        self._sink.refusal_handlers.pop(self.worker, None)
        self._metrics.forget_worker(self.worker)
        return retired

    # --- carrying out steps ----------------------------------------------------------------------

    def _apply(self, steps: list[Step]) -> None:
        if not steps:
            return
        handled = self.relay.handle(steps, time.time())
        for item in handled.outgoing:
            self._sink.put(item)
        if handled.catalog_changed:
            self._board.set_groups(self.worker, self.relay.catalog.specs)
            self._sink.state_changed()
        for fetch_id in handled.cancelled:
            self._cancel(fetch_id)
        for fetch in handled.fetches if not self._closed else ():
            self._fetches[fetch.fetch_id] = asyncio.create_task(self._fetch(fetch))
        for step in handled.events:
            self._observe(step)

    def _observe(self, step: Step) -> None:
        if type(step) is Forward:  # the common case: nothing to count
            return
        worker, metrics = self.worker, self._metrics
        if isinstance(step, Duplicate):
            self._duplicates.inc()
        elif isinstance(step, GapDetected):
            metrics.gaps_detected.labels(worker).inc()
            incidents.warning(
                f"gap:{worker}",
                "%s: gap, seqs %d..%d missing",
                worker,
                step.start,
                step.end - 1,
                worker=worker,
            )
        elif isinstance(step, GapReplayed):
            metrics.gaps_replayed.labels(worker, step.by.value).inc()
        elif isinstance(step, GapUnrecoverable):
            metrics.gaps_unrecoverable.labels(worker).inc()
            metrics.batches_lost.labels(worker).inc(step.end - step.start)
            incidents.warning(
                f"lost:{worker}",
                "%s: seqs %d..%d lost for good (%s); worker cleared, degraded",
                worker,
                step.start,
                step.end - 1,
                step.cause,
                worker=worker,
            )
        elif isinstance(step, EpochStarted):
            metrics.epochs_started.labels(worker).inc()
            metrics.worker_epoch.labels(worker).set(step.epoch)
            log.warning(
                "%s: epoch %d starts: %s",
                worker,
                step.epoch,
                step.cause,
                extra={"worker": worker, "epoch": step.epoch},
            )
        elif isinstance(step, HealthChanged):
            metrics.set_health(worker, step.health)
            self._board.set_health(worker, step.health)
            self._sink.state_changed()
            level = logging.WARNING if step.health == "degraded" else logging.INFO
            log.log(level, "%s: health %s", worker, step.health, extra={"worker": worker})
        elif isinstance(step, BufferOverflow):
            metrics.batches_not_kept.labels(worker, "buffer_full").inc()

    def _unknown_events(self, seq: int, decoded: DecodedBatch, frames: list[bytes]) -> None:
        """Known events go on; the raw batch is kept too, for the events this code skipped."""
        self._metrics.unknown_events.labels(self.worker).inc(len(decoded.unknown_event_types))
        self._unknown_typed.inc(len(decoded.unknown_event_types))
        types = ", ".join(sorted(set(decoded.unknown_event_types)))
        detail = f"unknown event types skipped, known events forwarded: {types}"
        self._office.reject(
            self.worker, Rejected(RejectReason.UNKNOWN_EVENT_TYPE, detail, frames, seq)
        )

    # --- fetches ---------------------------------------------------------------------------------

    def _cancel(self, fetch_id: int) -> None:
        task = self._fetches.pop(fetch_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _fetch(self, fetch: Fetch) -> None:
        kind = fetch.kind.value
        outcome = "cancelled"
        try:
            async with self._replays:
                await self._sink.wait_for_room()
                started = time.monotonic()
                outcome = await self._exchange(fetch)
                if outcome == "ended":
                    self._metrics.replay_duration.labels(kind).observe(time.monotonic() - started)
        finally:
            self._metrics.replays.labels(kind, outcome).inc()
            if self._fetches.get(fetch.fetch_id) is asyncio.current_task():
                del self._fetches[fetch.fetch_id]

    async def _exchange(self, fetch: Fetch) -> str:
        """Request, then read the reply until its end marker, a stall, or a cancel."""
        assert self.address.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        readable = Readable(dealer)
        try:
            try:
                dealer.connect(self.address.replay)
            except zmq.ZMQError as error:  # an endpoint ZMQ cannot use: no reply will ever come
                cause = f"replay endpoint {self.address.replay!r} refused by ZMQ ({error})"
                self._apply(self.relay.tracker.on_fetch_failed(fetch.fetch_id, cause))
                return "failed"
            start = SNAPSHOT_REQUEST if fetch.kind is FetchKind.SNAPSHOT else fetch.start_seq
            dealer.send_multipart(replay_request(start))  # queued until connected
            timeout = self._settings.replay_timeout
            while fetch.fetch_id in self._fetches:
                replies = await receive_ready(
                    dealer, readable, self._settings.receive_limit, timeout
                )
                if replies is None:
                    cause = f"no reply from {self.address.replay} for {timeout:g} s"
                    self._apply(self.relay.tracker.on_fetch_failed(fetch.fetch_id, cause))
                    return "failed"
                for frames in replies:
                    if fetch.fetch_id not in self._fetches:
                        break
                    if self._on_reply(fetch.fetch_id, frames):
                        return "ended"
            return "cancelled"
        finally:
            readable.close()
            dealer.close(linger=0)

    def _on_reply(self, fetch_id: int, frames: list[bytes]) -> bool:
        """Feed one reply message to the tracker; True at the end marker."""
        tracker = self.relay.tracker
        source = f"{self.worker} replay"
        reply = split_reply(frames)
        if isinstance(reply, Rejected):
            self._office.reject(source, reply)
            return False
        if isinstance(reply, ReplyEnd):
            self._apply(tracker.on_fetch_end(fetch_id))
            return True
        decoded = decode_payload(reply, frames, self._settings.max_payload_bytes)
        if isinstance(decoded, Rejected):
            self._office.reject(source, decoded)
            self._apply(tracker.on_fetched(fetch_id, reply.seq, None))
            return False
        if decoded.unknown_event_types:
            self._unknown_events(reply.seq, decoded, frames)
        self._apply(tracker.on_fetched(fetch_id, reply.seq, decoded.batch))
        return False


@dataclass(frozen=True)
class SubscriberDeps:
    """What every source needs from the service; ``on_state`` hears of connection changes."""

    ctx: zmq.Context[zmq.Socket[bytes]]
    intake: Intake
    office: DeadLetterOffice
    metrics: BridgeMetrics
    settings: SourceSettings
    on_state: Callable[[], None]


class _Subscriber(ABC):
    """What both kinds of source share: the SUB socket's receive loop and its state."""

    def __init__(self, name: str, deps: SubscriberDeps) -> None:
        self.name = name
        self.state = SourceState.CONNECTING
        self._ctx = deps.ctx
        self._intake = deps.intake
        self._office = deps.office
        self._metrics = deps.metrics
        self._settings = deps.settings
        self._on_state = deps.on_state

    def _set_state(self, state: SourceState) -> None:
        if state is not self.state:
            self.state = state
            self._on_state()

    async def _receive_forever(self, sub: zmq.Socket[bytes]) -> None:
        """The intake receives from ``sub`` for as long as this source runs."""
        self._intake.add(sub, self._on_messages)
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._intake.remove(sub)

    def _on_messages(self, messages: list[list[bytes]]) -> None:
        self._metrics.messages_per_wakeup.observe(len(messages))
        for frames in messages:
            self._on_message(frames)
        self._flush_counts()

    @abstractmethod
    def _on_message(self, frames: list[bytes]) -> None: ...

    @abstractmethod
    def _flush_counts(self) -> None: ...

    def _socket(self) -> zmq.Socket[bytes]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._settings.rcvhwm)
        return sub

    def _attach(self, sub: zmq.Socket[bytes], *, connect: str = "", bind: str = "") -> bool:
        """Connect or bind; on failure the source is marked failed (readiness says so)."""
        try:
            if connect:
                sub.connect(connect)
            if bind:
                sub.bind(bind)
        except zmq.ZMQError as error:
            sub.close(linger=0)
            self._set_state(SourceState.FAILED)
            log.error("%s: cannot open %s: %s", self.name, connect or bind, error)
            return False
        return True


class ConnectedSource(_Subscriber):
    """A SUB socket connected to one engine rank's PUB endpoint, feeding its one channel."""

    def __init__(self, channel: WorkerChannel, topic: str, deps: SubscriberDeps) -> None:
        super().__init__(channel.worker, deps)
        self.channel = channel
        self._topic = topic.encode()

    async def run(self) -> None:
        endpoint = self.channel.address.endpoint
        assert endpoint is not None
        sub = self._socket()
        # The monitor first: on loopback the connection is made before connect() returns.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        if not self._attach(sub, connect=endpoint):
            monitor.close(linger=0)
            return
        watcher = asyncio.create_task(self._watch(monitor))
        sub.subscribe(self._topic)
        self.channel.start()
        try:
            await self._receive_forever(sub)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch(self, monitor: zmq.Socket[bytes]) -> None:
        """Track the connection; after each (re)connect, catch up on what it missed.

        The catch-up waits a moment: the subscription reaches the engine one round trip after
        the connection, and a replay served before it would miss what is sent in between.
        """
        readable = Readable(monitor)
        try:
            while True:
                await readable.wait()
                event = parse_monitor_message(monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    self._set_state(SourceState.CONNECTED)
                    await asyncio.sleep(_SUBSCRIPTION_DELAY_S)
                    self.channel.on_connected()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._set_state(SourceState.CONNECTING)
        finally:
            readable.close()

    def _flush_counts(self) -> None:
        self.channel.flush_counts()

    def _on_message(self, frames: list[bytes]) -> None:
        message = split_live(frames, self._topic)
        if isinstance(message, Rejected):
            self._office.reject(self.name, message)
            return
        decoded = decode_payload(message, frames, self._settings.max_payload_bytes)
        if isinstance(decoded, Rejected):
            self._office.reject(self.name, decoded)
            self.channel.on_undecodable(message.seq)
            return
        self.channel.on_live(message.seq, decoded, frames)


class BoundSource(_Subscriber):
    """One SUB socket the bridge binds; ``route`` names each message's channel, or why none.

    A message's DP rank is in its payload, so an undecodable one reaches a worker only through
    ``sole_channel``: the channel of a topic that names one worker, whatever the rank.
    """

    def __init__(
        self, endpoints: list[str], route: Route, sole_channel: SoleChannel, deps: SubscriberDeps
    ) -> None:
        super().__init__(f"bind {' '.join(endpoints)}", deps)
        self.endpoints = endpoints  # one per DP rank
        self._route = route
        self._sole_channel = sole_channel
        self._touched: set[WorkerChannel] = set()  # channels with counts to flush

    async def run(self) -> None:
        sub = self._socket()
        if not all(self._attach(sub, bind=endpoint) for endpoint in self.endpoints):
            return
        sub.subscribe(b"")
        self._set_state(SourceState.CONNECTED)
        try:
            await self._receive_forever(sub)
        finally:
            sub.close(linger=0)

    def _flush_counts(self) -> None:
        for channel in self._touched:
            channel.flush_counts()
        self._touched.clear()

    def _on_message(self, frames: list[bytes]) -> None:
        message = split_live(frames, None)
        if isinstance(message, Rejected):
            self._office.reject(self.name, message)
            return
        decoded = decode_payload(message, frames, self._settings.max_payload_bytes)
        if isinstance(decoded, Rejected):
            self._office.reject(_topic_name(message), decoded)
            sole = self._sole_channel(message.topic)
            if sole is not None:  # its loss now, not when (if ever) its next batch comes
                self._touched.add(sole)
                sole.on_undecodable(message.seq)
            return
        channel = self._route(message.topic, decoded.batch.data_parallel_rank)
        if isinstance(channel, str):
            unknown = Rejected(RejectReason.WORKER_UNKNOWN, channel, frames, message.seq)
            self._office.reject(_topic_name(message), unknown)
            return
        self._touched.add(channel)
        channel.on_live(message.seq, decoded, frames)


def _topic_name(message: SeqFrames) -> str:
    return f"topic {message.topic.decode('utf-8', 'replace')!r}"
