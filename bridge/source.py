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
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from hmakv.bridge.channel import SourceSettings, WorkerChannel
from hmakv.bridge.deadletter import DeadLetterOffice
from hmakv.bridge.frames import Rejected, decode_payload, split_live
from hmakv.bridge.intake import Intake, Take
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.readable import Readable, take_one, take_one_with
from hmakv.bridge.roster import BoundRoster, Refusal
from hmakv.kvlog.logs import RateLimitedLog
from hmakv.producer.curve import connect_to, serve
from hmakv.producer.protocol import SeqFrames

log = logging.getLogger(__name__)
incidents = RateLimitedLog(log)

_SUBSCRIPTION_DELAY_S = 0.2
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_WATCHED_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES


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

    async def _receive_forever(self, sub: zmq.Socket[bytes], take: Take = take_one) -> None:
        """The intake receives from ``sub`` with ``take`` for as long as this source runs."""
        self._intake.add(sub, self._on_messages, take)
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
        address = self.channel.address
        assert address.endpoint is not None
        endpoint = address.endpoint
        sub = self._socket()
        keys = self._settings.curve_keys
        if keys is not None and address.public_key is not None:  # check_topology: both or none
            connect_to(sub, keys, address.public_key)
        # The monitor first: on loopback the connection is made before connect() returns.
        monitor = sub.get_monitor_socket(_WATCHED_EVENTS)
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

        Connected means the handshake succeeded: with CURVE a TCP connection to someone without
        the engine's key pair (or who refuses the bridge's key) fails there, again at each retry.
        The catch-up waits a moment: the subscription reaches the engine one round trip after
        the connection, and a replay served before it would miss what is sent in between.
        """
        readable = Readable(monitor)
        try:
            while True:
                await readable.wait()
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._set_state(SourceState.CONNECTED)
                    await asyncio.sleep(_SUBSCRIPTION_DELAY_S)
                    self.channel.on_connected()
                elif event == zmq.EVENT_DISCONNECTED:
                    self._set_state(SourceState.CONNECTING)
                else:
                    self._handshake_failed(event)
        finally:
            readable.close()

    def _handshake_failed(self, event: int) -> None:
        self._metrics.handshakes_failed.inc()
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            cause = "the engine refused the bridge's key"
        else:
            cause = "the peer proved no key the bridge holds for this engine, or spoke no CURVE"
        incidents.warning(
            f"handshake:{self.name}",
            "%s: handshake with %s failed: %s",
            self.name,
            self.channel.address.endpoint,
            cause,
            worker=self.name,
        )

    def _flush_counts(self) -> None:
        self.channel.flush_counts()

    def _on_message(self, frames: list[bytes]) -> None:
        message = split_live(frames, self._topic)
        if isinstance(message, Rejected):
            self._office.reject(self.name, message)
            return
        decoded = decode_payload(
            message, frames, self._settings.max_payload_bytes, self._settings.limits
        )
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
        keys = self._settings.curve_keys
        if keys is not None:  # the service runs the ZAP handler that admits the clients
            serve(sub, keys)
        if not all(self._attach(sub, bind=endpoint) for endpoint in self.endpoints):
            return
        sub.subscribe(b"")
        self._set_state(SourceState.CONNECTED)
        try:
            await self._receive_forever(sub, self._take())
        finally:
            sub.close(linger=0)

    def _take(self) -> Take:
        """How a message is taken: with CURVE its sender's key first, which the roster checks
        against its topic; else, where workers join by topic, its sender's address first, the
        source of a join; else alone."""
        if self._settings.curve_keys is not None:
            return functools.partial(take_one_with, name="User-Id")
        if self._roster.joins_by_topic:
            return functools.partial(take_one_with, name="Peer-Address")
        return take_one

    def _flush_counts(self) -> None:
        for channel in self._touched:
            channel.flush_counts()
        self._touched.clear()

    def _on_message(self, frames: list[bytes]) -> None:
        sender = peer = None
        if self._settings.curve_keys is not None:
            sender, frames = frames[0], frames[1:]
        elif self._roster.joins_by_topic:
            peer, frames = frames[0], frames[1:]
        message = split_live(frames, None)
        if isinstance(message, Rejected):
            self._office.reject(self.name, message)
            return
        decoded = decode_payload(
            message, frames, self._settings.max_payload_bytes, self._settings.limits
        )
        if isinstance(decoded, Rejected):
            self._office.reject(_topic_name(message), decoded)
            sole = self._roster.sole_channel(message.topic, sender)
            if sole is not None:  # its loss now, not when (if ever) its next batch comes
                self._touched.add(sole)
                sole.on_undecodable(message.seq)
            return
        rank = decoded.batch.data_parallel_rank
        channel = self._roster.route(message.topic, rank, sender, peer)
        if isinstance(channel, Refusal):
            refused = Rejected(channel.reason, channel.detail, frames, message.seq)
            self._office.reject(_topic_name(message), refused)
            return
        self._touched.add(channel)
        channel.on_live(message.seq, decoded, frames)


def _topic_name(message: SeqFrames) -> str:
    return f"topic {message.topic.decode('utf-8', 'replace')!r}"
