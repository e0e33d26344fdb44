"""Every SUB socket of the bridge drained by one task, once per tick while traffic flows.

Engines publish one batch per scheduler step, so at fleet scale messages trickle in on many
sockets at once, a few per socket per millisecond. A task per socket would wake for nearly every
message, and each wake-up (the event loop's poll, a task step, ZMQ's ``EVENTS`` check, the
metrics) cost more than the batch itself. Here one task takes whatever every socket holds, then
sleeps one ``tick`` (2 ms by default) so that the next round finds several messages per socket:
the wait adds at most a tick to a batch's latency and divides the wake-ups by the fleet's size.
An idle bridge sleeps on the sockets' file descriptors instead, so an idle fleet costs nothing.

Traffic flows when a message woke the intake within a tick of its going idle: then a tick
gathers more. Sparser traffic (a small fleet, a quiet hour) gains nothing from the tick, which
would only delay each batch by up to 2 ms: after such a wake-up's round the intake goes idle at
once, and the next message wakes it as it arrives.

A full Kafka queue stops the whole intake before anything is received: what the engines send
meanwhile waits in the ZMQ queues and, past their high-water marks, in the engines' replay rings.

ZMQ's FD only says "look at ``EVENTS``", and stays readable until someone does: each FD is
watched only while the intake is idle, and dropped from the event loop as soon as it fires, or
the loop would spin on it through every tick. A round reads every socket's ``EVENTS`` before the
intake goes idle again, so a message is never slept through.

A round is passes of one ``zmq_poll`` (which reads ``EVENTS``) and one message from each socket
it found ready, the next pass polling only those, until none has more, ``round_limit`` passes
are done or the round holds ``round_messages``: a round's handling blocks the event loop, and
without a bound on the whole round it would grow with the fleet (a backlog on 256 sockets, 64
passes each, is 16,384 batches, ~400 ms in which Kafka's acknowledgements wait unread).
Draining each socket until it is empty would end every socket's turn with a ``zmq.Again``
(4 us), as much as the one or two batches a socket holds at a moderate rate; asking each
socket's ``EVENTS`` cost 2.2 us, a poll of 16 sockets 10 us.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import zmq

from hmakv.bridge.readable import take_one

log = logging.getLogger(__name__)

Handler = Callable[[list[list[bytes]]], None]  # the messages one socket had, in order
_Sub = zmq.Socket[bytes]
Take = Callable[[_Sub], list[bytes]]  # one message's parts, as ``readable.take_one``

DEFAULT_TICK_S = 0.002
# Passes of a round, so messages one socket may hand over per round: beyond it the next round
# starts at once, after the event loop has run everything else once (the sink's loops, fetches,
# the health server).
# A batch costs ~25 us, so with 16 busy engines a round stays near 25 ms; at 1024 a backlog
# made rounds of ~400 ms in which Kafka's acknowledgements waited unread (max rate 17.0k ->
# 18.4k batches/s with 64).
DEFAULT_ROUND_LIMIT = 64
# Messages a round may take over all sockets: what 16 busy engines fill with 64 passes, ~25 ms.
DEFAULT_ROUND_MESSAGES = 1024


@dataclass(frozen=True, slots=True)
class _Registration:
    fd: int
    handler: Handler
    take: Take


class Intake:
    """``wait_for_room`` returns once the Kafka queue has room (``KafkaSink.wait_for_room``)."""

    def __init__(
        self,
        wait_for_room: Callable[[], Awaitable[None]],
        *,
        tick: float = DEFAULT_TICK_S,
        round_limit: int = DEFAULT_ROUND_LIMIT,
        round_messages: int = DEFAULT_ROUND_MESSAGES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wait_for_room = wait_for_room
        self._tick = tick
        self._clock = clock
        self._round_limit = round_limit
        self._round_messages = round_messages
        self._sockets: dict[_Sub, _Registration] = {}
        self._poll_items: list[tuple[_Sub, int]] = []
        self._watched: set[int] = set()  # FDs the event loop watches for the intake now
        self._signal = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def add(self, sock: zmq.Socket[bytes], handler: Handler, take: Take = take_one) -> None:
        """Receive from ``sock`` until ``remove``; the handler gets its messages, each as
        ``take`` reads it, in order."""
        fd: int = sock.FD
        self._sockets[sock] = _Registration(fd, handler, take)
        self._poll_items = [(each, zmq.POLLIN) for each in self._sockets]
        self._watch(fd)
        self._signal.set()  # messages may be waiting already: the FD only tells of new ones

    def remove(self, sock: zmq.Socket[bytes]) -> None:
        """Stop receiving from ``sock`` (before the caller closes it)."""
        registration = self._sockets.pop(sock, None)
        self._poll_items = [(each, zmq.POLLIN) for each in self._sockets]
        if registration is not None and registration.fd in self._watched:
            self._watched.discard(registration.fd)
            self._loop.remove_reader(registration.fd)

    async def run(self) -> None:
        idle_since = -self._tick  # the first message finds traffic sparse
        while True:
            for registration in self._sockets.values():
                if registration.fd not in self._watched:
                    self._watch(registration.fd)
            await self._signal.wait()
            self._signal.clear()
            flowing = self._clock() - idle_since < self._tick
            while True:
                await self._wait_for_room()
                received, more = self._round()
                if not received or not (more or flowing):
                    break
                # Let the next messages gather, unless a socket had more than a round's worth.
                await asyncio.sleep(0 if more else self._tick)
            idle_since = self._clock()

    def _watch(self, fd: int) -> None:
        self._watched.add(fd)
        self._loop.add_reader(fd, self._fired, fd)

    def _fired(self, fd: int) -> None:
        self._watched.discard(fd)
        self._loop.remove_reader(fd)
        self._signal.set()

    def _round(self) -> tuple[bool, bool]:
        """Take what every socket holds; (anything received, some socket has more)."""
        taken: dict[_Sub, list[list[bytes]]] = {}
        sockets = self._sockets
        polled = self._poll_items
        count = 0
        for _ in range(self._round_limit):
            if not polled or count >= self._round_messages:
                break
            # zmq_poll hands back the very sockets it was given
            ready = [cast(_Sub, sock) for sock, _ in zmq.zmq_poll(polled, 0)]
            polled = []
            for sock in ready:
                try:
                    message = sockets[sock].take(sock)
                except zmq.Again:  # the poll said ready; should ZMQ disagree, poll it next round
                    continue
                taken.setdefault(sock, []).append(message)
                polled.append((sock, zmq.POLLIN))
            count += len(polled)
        for sock, messages in taken.items():
            registration = self._sockets.get(sock)
            if registration is None:  # a handler removed it this round
                continue
            try:
                registration.handler(messages)
            except Exception:  # a bug for one source must not stop every other one
                log.exception("intake: a handler failed; its messages are dropped")
        return bool(taken), bool(polled)
