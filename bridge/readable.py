"""Waiting for a plain ZMQ socket in asyncio, for one registration per socket, not per wait.

``zmq.asyncio`` builds a poller, futures and a reader registration for every ``poll()``; with
many engines at moderate rates the bridge wakes once or twice per batch, and that machinery
cost more than the batch. Here the socket's FD stays registered with the event loop for the
socket's life, and a wait is an ``asyncio.Event``.

ZMQ's FD is edge-triggered and only says "look at ZMQ_EVENTS": a wait therefore checks
``EVENTS`` before sleeping, so a message that arrived before the wait is never slept through.
``readable_now`` and ``take_ready`` are that check and the non-blocking drain; the intake
(``bridge.intake``) polls its SUB sockets and takes one message of each ready one at a time.
``receive_ready`` is both with a wait, for a fetch's DEALER: one await, then every message already
there (up to a limit, for fairness) without awaiting.
"""

from __future__ import annotations

import asyncio

import zmq


def readable_now(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits; reading ``EVENTS`` also re-arms the socket's FD."""
    events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
    return bool(events & zmq.POLLIN)


def take_ready(sock: zmq.Socket[bytes], limit: int) -> list[list[bytes]]:
    """The messages the socket holds now, up to ``limit``, without waiting.

    Finding the socket empty costs a ``zmq.Again`` (4 us): callers that know a message waits,
    from a poll, take it with ``take_one``.
    """
    messages: list[list[bytes]] = []
    try:
        while len(messages) < limit:
            messages.append(take_one(sock))
    except zmq.Again:
        pass
    return messages


def take_one(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One message's parts; ``zmq.Again`` if none waits.

    Each part is received as a ``Frame``, whose ``more`` flag tells where a message ends:
    ``recv_multipart`` asks the socket for ``RCVMORE`` after every part instead, and that
    option lookup cost three times the receive itself (3.7 -> 2.4 us for a 3-part message).
    The rest of a multipart message is always there once its first part is: ZMQ delivers a
    message whole or not at all.
    """
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


def take_one_with(sock: zmq.Socket[bytes], name: str) -> list[bytes]:
    """``take_one``, the message's ZMQ property ``name`` first (ASCII): ``User-Id``, the
    sender's CURVE key (z85) as the ZAP handler admitted it, on a socket that is a CURVE
    server; ``Peer-Address``, the sender's IP address, on a TCP socket."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    origin = frame.get(name)  # a str for a string property
    parts = [str(origin).encode("ascii"), frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


class Readable:
    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._signal = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._fd: int = sock.FD
        self._loop.add_reader(self._fd, self._signal.set)

    async def wait(self, timeout: float | None = None) -> bool:
        """Until the socket has a message to read; False if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else self._loop.time() + timeout
        while not readable_now(self._sock):
            self._signal.clear()
            if deadline is None:
                await self._signal.wait()  # no wait_for: it would make a task per wait
                continue
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._signal.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def close(self) -> None:
        """Unregister; the caller closes the socket afterwards."""
        self._loop.remove_reader(self._fd)


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
