"""One worker inside the bridge: its relay's answers carried out.

A ``WorkerChannel`` hands its worker's inputs to the relay (live batches from its SUB socket,
replies to its fetches, refusals from the sink) and carries out the ``Handled`` that comes back:
records into the sink, fetches run over a fresh DEALER each (so that a superseded reply can never
leak into the next), the catalog and health onto the board, and every step into metrics and logs.
It holds no sequence state of its own: the relay (its tracker) does, so whatever the channel says
of the worker (epoch, health, position) it asks the relay.

Live messages reach it from the sources (``bridge.source``), through the one intake task; replies
to a fetch are read here, draining the DEALER per wake-up (``readable.receive_ready``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq
from prometheus_client import Counter as MetricCounter

from hmakv.bridge.board import BoardEntry, WorkerBoard
from hmakv.bridge.config import WorkerAddress
from hmakv.bridge.deadletter import DeadLetterOffice
from hmakv.bridge.frames import EventLimits, Rejected, RejectReason, decode_payload, split_reply
from hmakv.bridge.metrics import KNOWN_EVENT_CLASSES, UNKNOWN_EVENT_TYPE, BridgeMetrics
from hmakv.bridge.readable import Readable, receive_ready
from hmakv.bridge.relay import Handled, WorkerRelay
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
from hmakv.kvlog.records import WorkerState
from hmakv.producer.curve import KeyPair, connect_to
from hmakv.producer.events import DecodedBatch
from hmakv.producer.protocol import SNAPSHOT_REQUEST, ReplyEnd, replay_request

log = logging.getLogger(__name__)
incidents = RateLimitedLog(log)


@dataclass(frozen=True)
class SourceSettings:
    """What the ZMQ side is given: the channels' fetches and the sources' SUB sockets share it."""

    max_payload_bytes: int
    replay_timeout: float
    limits: EventLimits = field(default_factory=EventLimits)
    # Reply messages one fetch may hand over per turn of the event loop: with many replays at
    # once, more would starve the sink's loops until the queue is full.
    receive_limit: int = 64
    rcvhwm: int = 1000
    dead_letter_max_bytes: int = 512 * 1024
    # CURVE: the bridge's key pair. A connected engine's sockets must then prove its key; the
    # bound socket admits configured engines' keys (and --join-keys).
    curve_keys: KeyPair | None = field(default=None, repr=False)


class WorkerChannel:
    """One worker's relay, fetches, metrics, logs and board entry; see the module docstring."""

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
        self._relay = relay
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
        self._intake_ages: list[float] = []  # each live batch's age on arrival, observed per flush
        self._intake_age = metrics.intake_age
        self.last_heard = time.monotonic()  # a live batch, a (re)connect or a quiet catch-up
        board.add(
            self.worker,
            BoardEntry(
                health=relay.health,
                groups=relay.catalog.specs,
                data_parallel_rank=address.data_parallel_rank,
                endpoint=address.endpoint,
                epoch=relay.epoch,
                last_seq=relay.last_seq,
                last_ts=resumed_ts,
            ),
        )
        sink.refusal_handlers[self.worker] = self.on_refused
        metrics.start_worker(self.worker)
        metrics.set_health(self.worker, relay.health)
        metrics.worker_epoch.labels(self.worker).set(relay.epoch)

    # --- inputs ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._apply(self._relay.start(time.time()))

    def on_connected(self) -> None:
        """The live stream (re)connected, or has been quiet a while: replay from the next seq.

        vLLM's wire never says a stream ended, so batches lost on the way at the end of a burst
        would wait for the engine's next batch; an idle engine's last evictions with them.
        """
        self.last_heard = time.monotonic()
        self._apply(self._relay.on_connected(time.time()))

    def on_live(self, seq: int, decoded: DecodedBatch, frames: list[bytes]) -> None:
        batch = decoded.batch
        self._received_batches += 1
        self._received_types.extend(map(type, batch.events))
        if decoded.unknown_event_types:
            self._unknown_events(seq, decoded, frames)
        self.last_heard = time.monotonic()
        now = time.time()
        self._intake_ages.append(now - batch.ts)
        self._apply(self._relay.on_live(seq, batch, now))

    def flush_counts(self) -> None:
        """Add what was received since the last call to the metrics: once per wake-up, not per
        batch, since every increment of a Prometheus counter takes a lock. The event classes
        are counted here too, in one pass in C: a ``Counter.update`` per batch cost 0.8 us, the
        ``extend`` 0.2."""
        for age in self._intake_ages:
            self._intake_age.observe(max(0.0, age))
        self._intake_ages.clear()
        if self._received_batches:
            self._batches.inc(self._received_batches)
            for cls, count in Counter(self._received_types).items():
                self._events.get(cls, self._unknown_typed).inc(count)
            self._received_batches = 0
            self._received_types.clear()

    def on_undecodable(self, seq: int) -> None:
        self._apply(self._relay.on_undecodable(seq, time.time()))

    def on_refused(self, epoch: int, seq: int) -> None:
        self._apply(self._relay.on_delivery_failed(epoch, seq, time.time()))

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
            retired = self._board.retire(self.worker, self._relay.epoch, time.time())
        else:
            self._board.release(self.worker, time.time())
        self._sink.state_changed()
        self._sink.refusal_handlers.pop(self.worker, None)
        self._metrics.forget_worker(self.worker)
        return retired

    def position(self) -> WorkerState | None:
        """Where the worker stands, as a resume point for its engine restarting on reload; None
        once forgotten.

        The epoch is the relay's, which may be newer than the board's (a restart or a refusal
        just seen, its clear still queued): the reloaded engine goes on in that epoch, since the
        queued records of it still reach consumers, who would ignore the older one's after them.
        The rest is the board's: what Kafka has acknowledged.
        """
        view = self._board.views.get(self.worker)
        if view is None:
            return None
        epoch, seq = self._relay.epoch, view.last_seq
        return WorkerState(self.worker, epoch, seq, view.health, view.groups, view.last_ts)

    # --- carrying out steps ----------------------------------------------------------------------

    def _apply(self, handled: Handled) -> None:
        for item in handled.outgoing:
            self._sink.put(item)
        if handled.catalog_changed:
            self._board.set_groups(self.worker, self._relay.catalog.specs)
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
        keys, server_key = self._settings.curve_keys, self.address.public_key
        if keys is not None and server_key is not None:
            connect_to(dealer, keys, server_key)
        readable = Readable(dealer)
        try:
            try:
                dealer.connect(self.address.replay)
            except zmq.ZMQError as error:  # an endpoint ZMQ cannot use: no reply will ever come
                cause = f"replay endpoint {self.address.replay!r} refused by ZMQ ({error})"
                self._apply(self._relay.on_fetch_failed(fetch.fetch_id, cause, time.time()))
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
                    self._apply(self._relay.on_fetch_failed(fetch.fetch_id, cause, time.time()))
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
        """Feed one reply message to the relay; True at the end marker."""
        relay = self._relay
        source = f"{self.worker} replay"
        reply = split_reply(frames)
        if isinstance(reply, Rejected):
            self._office.reject(source, reply)
            return False
        if isinstance(reply, ReplyEnd):
            self._apply(relay.on_fetch_end(fetch_id, time.time()))
            return True
        settings = self._settings
        decoded = decode_payload(reply, frames, settings.max_payload_bytes, settings.limits)
        if isinstance(decoded, Rejected):
            self._office.reject(source, decoded)
            self._apply(relay.on_fetched(fetch_id, reply.seq, None, time.time()))
            return False
        if decoded.unknown_event_types:
            self._unknown_events(reply.seq, decoded, frames)
        self._apply(relay.on_fetched(fetch_id, reply.seq, decoded.batch, time.time()))
        return False
