"""The bridge's SUB sockets: each live message into its worker's channel.

* ``ConnectedSource``: a SUB socket connected to one engine's PUB endpoint (one DP rank), feeding
  its one channel; after every (re)connect it tells the channel, whose tracker then replays what
  the connection missed.
* ``BoundSource``: one SUB socket bound by the bridge that many engines connect to; the roster
  (``bridge.roster``) names each message's channel from its topic and DP rank.

Both only split and decode frames and hand them on: what a batch means is the channel's (and its
relay's) business, and what cannot be used goes to the ``DeadLetterOffice``. They do not receive
themselves: the ``Intake`` (one task for every SUB socket, see ``bridge.intake``) hands each its
messages.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from hmakv.bridge.channel import SourceSettings, WorkerChannel
from hmakv.bridge.deadletter import DeadLetterOffice
from hmakv.bridge.frames import Rejected, RejectReason, decode_payload, split_live
from hmakv.bridge.intake import Intake
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.readable import Readable
from hmakv.bridge.roster import BoundRoster
from hmakv.producer.protocol import SeqFrames

log = logging.getLogger(__name__)

_SUBSCRIPTION_DELAY_S = 0.2


class SourceState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILED = "failed"


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
    """One SUB socket the bridge binds; the roster names each message's channel, or why none.

    A message's DP rank is in its payload, so an undecodable one reaches a worker only through
    the roster's ``sole_channel``: the channel of a topic that names one worker, whatever the rank.
    """

    def __init__(
        self, endpoints: list[str], roster: BoundRoster[WorkerChannel], deps: SubscriberDeps
    ) -> None:
        super().__init__(f"bind {' '.join(endpoints)}", deps)
        self.endpoints = endpoints  # one per DP rank
        self._roster = roster
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
            sole = self._roster.sole_channel(message.topic)
            if sole is not None:  # its loss now, not when (if ever) its next batch comes
                self._touched.add(sole)
                sole.on_undecodable(message.seq)
            return
        channel = self._roster.route(message.topic, decoded.batch.data_parallel_rank)
        if isinstance(channel, str):
            unknown = Rejected(RejectReason.WORKER_UNKNOWN, channel, frames, message.seq)
            self._office.reject(_topic_name(message), unknown)
            return
        self._touched.add(channel)
        channel.on_live(message.seq, decoded, frames)


def _topic_name(message: SeqFrames) -> str:
    return f"topic {message.topic.decode('utf-8', 'replace')!r}"
