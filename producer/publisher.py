"""A drop-in for vLLM's ZMQ KV-event publisher that never blocks the engine thread.

The wire protocol is vLLM's, unchanged (``producer.protocol``): a PUB socket sends one message
per batch, and an optional ROUTER replays the batches still in the replay ring from a requested
seq, then sends the end marker. The ring keeps the last ``buffer_steps`` sequence numbers; a
replay that asks for more simply starts at the oldest kept seq, so the client sees the first
replayed seq jump.

What this publisher adds, all of it invisible to a client written for vLLM:

* The first batch (seq 0) is ``[AllBlocksCleared]``, so every subscriber sees an engine restart
  as an explicit clear and not only as a sequence reset.
* ``publish()`` only assigns the seq and appends to a bounded queue: encoding and sending happen
  on the publisher's own thread. When the queue is full the batch is dropped but keeps its seq,
  so subscribers see the loss as a gap (vLLM's ``publish()`` blocks the scheduler instead).
  ``publish()`` does not wake the publisher thread while it is busy, since waking a sleeping
  thread costs the caller several microseconds; the thread looks at the queue every
  ``flush_interval_ms`` (1 ms) and sends without pause while there is work, so a batch leaves
  within about a millisecond, plus however long the engine thread holds the GIL. After 50 ms
  with nothing to do the thread dozes (100 ms polls, so an idle engine costs no CPU), and the
  first ``publish()`` then wakes it: one wake per idle spell.
* Replies go out without blocking, a bounded number of messages per client per loop turn,
  interleaved with live batches; a client that stops reading is abandoned after
  ``replay_timeout`` seconds without progress (vLLM's ROUTER silently drops such replies).
* Snapshots: a replay request whose start_seq is ``SNAPSHOT_REQUEST`` (2**64 - 1) asks for the
  engine's resident blocks. The reply is one or more batches that all carry the same seq S,
  the first starting with ``AllBlocksCleared`` and the rest ``BlockStored`` events (at most
  ``snapshot_chunk_events`` events per batch), then the end marker. The snapshot is the cache
  state after batch S: apply it, then apply live or replayed batches with seq > S. No batch
  before the end marker means no snapshot is offered (no provider, the provider failed, or the
  engine did not get to it in time); vLLM's publisher answers the same request that way too,
  since no seq is that high.

  Snapshots need no lock because the ``snapshot_provider`` always runs on the engine thread: a
  request only raises a flag, and the engine thread's next ``publish()`` (after assigning its
  seq S) or ``service_snapshot_requests()`` (S = the last seq assigned) calls the provider and
  hands its events to the publisher thread, which encodes and sends them. An engine loop that
  can sit idle should call ``service_snapshot_requests()`` each step, at a point where every
  change to its blocks has been published; it costs one attribute read when nothing is pending.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgspec
import zmq

from hmakv.producer.curve import CurveGate, CurveSettings, connect_to, serve
from hmakv.producer.events import AllBlocksCleared, KVEvent, KVEventBatch
from hmakv.producer.protocol import (
    END_MARKER,
    SNAPSHOT_REQUEST,
    Malformed,
    encode_seq,
    offset_endpoint_port,
    parse_replay_request,
    should_bind,
)

logger = logging.getLogger(__name__)

_DOZE_AFTER_S = 0.05  # idle this long, the publisher thread polls every _DOZE_MS instead
_DOZE_MS = 100
_LIVE_CHUNK = 64  # live batches per loop turn, so replay requests are read between chunks
_REQUESTS_PER_TURN = 64  # replay requests read per loop turn, so live batches go between them
_LOG_INTERVAL_S = 10.0  # at most one line per kind of trouble per interval

SnapshotProvider = Callable[[], Sequence[KVEvent]]


class EventBatchLike(Protocol):
    """What ``publish()`` accepts: any msgspec struct shaped like ``KVEventBatch`` (vLLM's too)."""

    @property
    def ts(self) -> float: ...

    @property
    def events(self) -> Sequence[Any]: ...

    data_parallel_rank: int | None


@dataclass
class PublisherStats:
    """Counters of one publisher. Once the queue is drained, ``published == sent +
    dropped_queue_full + encode_errors + dropped_at_shutdown``: every seq is accounted for
    (a batch that cannot be encoded goes out as an ``AllBlocksCleared``, counted in
    ``encode_errors`` only)."""

    published: int = 0
    """Sequence numbers assigned, the leading clear included."""
    sent: int = 0
    dropped_queue_full: int = 0
    encode_errors: int = 0
    dropped_at_shutdown: int = 0
    replay_requests: int = 0
    replay_requests_invalid: int = 0
    replay_requests_refused: int = 0
    """Requests (replays and snapshots) ignored while ``max_replies`` were in progress."""
    replay_batches_sent: int = 0
    replays_completed: int = 0
    replays_abandoned: int = 0
    """Replies (replays and snapshots) given up: the client left or stopped reading."""
    snapshot_requests: int = 0
    snapshot_batches_sent: int = 0
    snapshots_sent: int = 0
    snapshots_unavailable: int = 0
    """Snapshot requests answered with the end marker alone."""
    snapshot_events_unencodable: int = 0
    """Snapshot events left out because msgspec cannot encode them (the snapshot goes out without
    them: consumers then know less than the engine holds, never more)."""
    clients_refused: int = 0
    """CURVE handshakes refused on the sockets this publisher serves: keys it does not admit."""


class _Handoff:
    """What the engine thread and the publisher thread share. No lock: the GIL makes each deque
    operation and attribute write atomic. Live batches are picked up by polling; only the rare
    events (a snapshot taken, shutdown) wake the publisher thread through ``wake_fd``."""

    __slots__ = ("abort", "closing", "dozing", "queue", "snapshot_wanted", "snapshots", "wake_fd")

    def __init__(self) -> None:
        self.queue: deque[tuple[int, EventBatchLike]] = deque()
        self.snapshots: deque[tuple[int, tuple[KVEvent, ...] | None]] = deque()
        self.snapshot_wanted = False
        self.closing = False
        self.abort = False
        self.dozing = False
        """Raised by the publisher thread before a long poll: the next publish must wake it."""
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        os.eventfd_write(self.wake_fd, 1)


class _ReplyKind(enum.Enum):
    REPLAY = enum.auto()
    SNAPSHOT = enum.auto()
    NO_SNAPSHOT = enum.auto()


class _ReplyStream:
    """One client's reply in progress: the frames still to send, and when it last progressed."""

    __slots__ = ("frames", "identity", "kind", "last_progress", "pending")

    def __init__(
        self, identity: bytes, kind: _ReplyKind, frames: Iterator[tuple[bytes, ...]], now: float
    ) -> None:
        self.identity = identity
        self.kind = kind
        self.frames = itertools.chain(frames, (END_MARKER,))
        self.pending: tuple[bytes, ...] | None = None  # refused by a full pipe, sent next
        self.last_progress = now


# What msgspec raises for a value it cannot write (a wrong type, an int beyond 64 bits, a string
# with a lone surrogate): one batch or snapshot, never the publisher thread.
_UNENCODABLE = (TypeError, ValueError, OverflowError, msgspec.EncodeError)


class _StreamState(enum.Enum):
    DONE = enum.auto()
    MORE = enum.auto()  # budget spent, can send more right away
    STALLED = enum.auto()  # the client's pipe is full
    GONE = enum.auto()  # the client disconnected


class _Snapshot:
    """One provider result for every client waiting on it; chunks are encoded on first use, so a
    big snapshot never holds up live batches for longer than one chunk."""

    def __init__(
        self,
        seq: int,
        events: tuple[KVEvent, ...],
        *,
        chunk_events: int,
        topic: bytes,
        data_parallel_rank: int,
        encode: Callable[[Any], bytes],
        on_unencodable: Callable[[int], None],
    ) -> None:
        self._seq_frame = encode_seq(seq)
        self._events: list[KVEvent] = [AllBlocksCleared(), *events]
        self._chunk_events = chunk_events
        self._topic = topic
        self._rank = data_parallel_rank
        self._encode = encode
        self._on_unencodable = on_unencodable
        self._payloads: list[bytes] = []
        self._ts = time.time()

    def frames(self) -> Iterator[tuple[bytes, ...]]:
        for index, start in enumerate(range(0, len(self._events), self._chunk_events)):
            if index == len(self._payloads):
                chunk = self._events[start : start + self._chunk_events]
                self._payloads.append(self._encode_chunk(chunk))
            yield (self._topic, self._seq_frame, self._payloads[index])

    def _encode_chunk(self, chunk: list[KVEvent]) -> bytes:
        """The chunk's batch; should an event not encode, the batch of the others (each event
        is tried alone only then)."""
        try:
            return self._encode(KVEventBatch(self._ts, chunk, self._rank))
        except _UNENCODABLE:
            kept = [event for event in chunk if self._encodes(event)]
            self._on_unencodable(len(chunk) - len(kept))
            return self._encode(KVEventBatch(self._ts, kept, self._rank))

    def _encodes(self, event: KVEvent) -> bool:
        try:
            self._encode(event)
        except _UNENCODABLE:
            return False
        return True


class _ReplayRing:
    """The payloads of the last ``steps`` seqs, kept in buffers that are reused as the ring turns.

    Encoding into a buffer that already has the room saves the publisher thread an allocation
    and a free of a cold block per batch: about 1 of the 5 us a typical batch costs it here, the
    whole price of keeping a ring. An empty buffer is a seq without a payload (dropped before it
    was encoded, or not encodable).
    """

    def __init__(self, steps: int) -> None:
        self._steps = steps
        self._slots = [bytearray() for _ in range(max(steps, 1))]  # one scratch slot at 0 steps
        self.end = 0  # the seq the next batch will have

    @property
    def first(self) -> int:
        """The oldest seq still kept."""
        return max(0, self.end - self._steps)

    def skip_to(self, seq: int) -> None:
        """Move past seqs that will never have a payload: they replay as gaps."""
        slots = self._slots
        for skipped in range(max(self.end, seq - len(slots)), seq):
            slots[skipped % len(slots)].clear()
        self.end = seq

    def next_slot(self) -> bytearray:
        """The buffer for seq ``end``, which becomes kept."""
        slot = self._slots[self.end % len(self._slots)]
        self.end += 1
        return slot

    def payload(self, seq: int) -> bytes | None:
        """A copy of a kept seq's payload, so that later turns of the ring cannot change it."""
        slot = self._slots[seq % len(self._slots)]
        return bytes(slot) if slot else None


@dataclass(frozen=True)
class _LoopSettings:
    flush_interval_ms: int
    reply_budget: int
    reply_timeout: float
    snapshot_chunk_events: int
    has_provider: bool
    max_replies: int


class _PublisherLoop:
    """Everything the publisher thread owns: the sockets, the replay ring, replies in progress."""

    def __init__(
        self,
        handoff: _Handoff,
        pub: zmq.Socket[bytes],
        router: zmq.Socket[bytes] | None,
        *,
        topic: bytes,
        data_parallel_rank: int,
        buffer_steps: int,
        settings: _LoopSettings,
    ) -> None:
        self._handoff = handoff
        self._pub = pub
        self._router = router
        self._topic = topic
        self._rank = data_parallel_rank
        self._settings = settings
        self._encoder = msgspec.msgpack.Encoder()
        self._ring = _ReplayRing(buffer_steps)
        self._streams: list[_ReplyStream] = []
        self._snapshot_waiters: list[tuple[bytes, float]] = []
        self._last_logged: dict[str, float] = {}
        self._poller = zmq.Poller()
        self._poller.register(handoff.wake_fd, zmq.POLLIN)
        if router is not None:
            self._poller.register(router, zmq.POLLIN)
        self.stats = PublisherStats()
        self.flush_deadline = 0.0  # monotonic time until which closing may flush the PUB socket
        self._idle_since = time.monotonic()  # the end of the last work done

    def run(self) -> None:
        try:
            while not self._handoff.abort:
                busy = bool(self._handoff.queue)
                self._send_live()
                if self._handoff.closing and not self._handoff.queue:
                    break
                replies_pending = self._serve_replies()
                if busy or replies_pending or self._streams or self._snapshot_waiters:
                    self._idle_since = time.monotonic()
                if not (replies_pending or self._handoff.queue):
                    self._wait()
        except Exception:
            logger.exception("KV-event publisher thread failed; no further batches are sent")
        finally:
            self._close()

    # --- live batches -------------------------------------------------------------------------

    def _send_live(self) -> None:
        """Send a chunk of queued batches. This loop is the publisher's throughput: it keeps
        what it uses in locals, and sends the three frames with three ``send`` calls, which take
        half as long as one ``send_multipart``. A PUB socket never blocks or refuses: at its
        high-water mark it drops, as vLLM's does."""
        queue, ring, stats = self._handoff.queue, self._ring, self.stats
        encode_into, send, topic = self._encoder.encode_into, self._pub.send, self._topic
        seq_frame = encode_seq
        for _ in range(min(_LIVE_CHUNK, len(queue))):
            seq, batch = queue.popleft()
            if seq != ring.end:
                self._log_dropped(ring.end, seq)
                ring.skip_to(seq)
            payload = ring.next_slot()
            try:
                encode_into(batch, payload)
                stats.sent += 1
            except _UNENCODABLE:
                stats.encode_errors += 1  # sent as a clear, counted here and not in ``sent``
                logger.exception(
                    "KV-event batch seq %d cannot be encoded; an AllBlocksCleared goes out in "
                    "its place",
                    seq,
                )
                encode_into(self._clear_in_place_of_unencodable(), payload)
            send(topic, zmq.SNDMORE)
            send(seq_frame(seq), zmq.SNDMORE)
            send(payload)

    def _clear_in_place_of_unencodable(self) -> KVEventBatch:
        """What is sent at the seq of a batch that cannot be encoded. A gap there could never
        be replayed (the ring has nothing to replay) and would leave the worker degraded for
        good; a clear makes consumers forget the engine's blocks instead, so that they then know
        less than the engine holds, never more, and follow it again from the next batch."""
        return KVEventBatch(time.time(), [AllBlocksCleared()], self._rank)

    def _log_dropped(self, first: int, stop: int) -> None:
        self._warn(
            "dropped",
            "KV-event queue full: dropped seq %d..%d; the publisher thread cannot keep up "
            "with publish() (stats().dropped_queue_full has the total)",
            first,
            stop - 1,
        )

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """A misbehaving engine or client can cause the same trouble thousands of times a
        second: the first line of each kind, then one per interval (the stats count them all)."""
        now = time.monotonic()
        if now - self._last_logged.get(kind, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S:
            self._last_logged[kind] = now
            logger.warning(message, *args)

    # --- replay and snapshot replies ----------------------------------------------------------

    def _serve_replies(self) -> bool:
        """Advance every reply; True when one could send more right away."""
        if self._router is None:
            return False
        now = time.monotonic()
        self._receive_requests(now)
        self._start_snapshot_replies(now)
        self._expire_snapshot_waiters(now)
        states = [self._advance(stream, now) for stream in self._streams]
        self._streams = [
            stream
            for stream, state in zip(self._streams, states, strict=True)
            if self._keeps(stream, state, now)
        ]
        return _StreamState.MORE in states

    def _receive_requests(self, now: float) -> None:
        router = self._router
        assert router is not None
        # A bounded number per loop turn: a client that sends without pause must not keep the
        # thread from live batches, or from seeing shutdown. The rest wait in the socket.
        for _ in range(_REQUESTS_PER_TURN):
            if self._handoff.abort or not router.poll(0, zmq.POLLIN):
                return
            frames = router.recv_multipart(zmq.NOBLOCK)
            start_seq = parse_replay_request(frames[1:])  # after the client's identity
            if isinstance(start_seq, Malformed):
                self.stats.replay_requests_invalid += 1
                self._warn("invalid", "invalid replay request ignored: %s", start_seq.detail)
                continue
            if len(self._streams) + len(self._snapshot_waiters) >= self._settings.max_replies:
                # Unanswered, as a ROUTER past its high-water mark leaves it: the client's
                # deadline ends it. Answering would cost what the cap is there to bound.
                self.stats.replay_requests_refused += 1
                limit = self._settings.max_replies
                self._warn("refused", "replay request ignored: %d replies in progress", limit)
                continue
            identity = frames[0]
            if start_seq == SNAPSHOT_REQUEST:
                self._request_snapshot(identity, now)
            else:
                self.stats.replay_requests += 1
                frames_iter = self._ring_frames(start_seq, self._ring.end)
                self._streams.append(_ReplyStream(identity, _ReplyKind.REPLAY, frames_iter, now))

    def _ring_frames(self, start_seq: int, end_seq: int) -> Iterator[tuple[bytes, ...]]:
        """Replay ring entries lazily, so a slow reply skips entries evicted meanwhile."""
        seq = start_seq
        while seq < end_seq:
            seq = max(seq, self._ring.first)
            if seq >= end_seq:
                return
            payload = self._ring.payload(seq)
            if payload is not None:
                yield (self._topic, encode_seq(seq), payload)
            seq += 1

    def _request_snapshot(self, identity: bytes, now: float) -> None:
        self.stats.snapshot_requests += 1
        if not self._settings.has_provider:
            self._reply_no_snapshot(identity, now, "this publisher has no snapshot provider")
            return
        self._snapshot_waiters.append((identity, now))
        self._handoff.snapshot_wanted = True

    def _reply_no_snapshot(self, identity: bytes, now: float, cause: str) -> None:
        self.stats.snapshots_unavailable += 1
        logger.warning("snapshot request answered without a snapshot: %s", cause)
        self._streams.append(_ReplyStream(identity, _ReplyKind.NO_SNAPSHOT, iter(()), now))

    def _start_snapshot_replies(self, now: float) -> None:
        """Every waiting client gets the newest snapshot: any consistent one will do."""
        while self._handoff.snapshots:
            seq, events = self._handoff.snapshots.popleft()
            waiters, self._snapshot_waiters = self._snapshot_waiters, []
            if events is None:
                for identity, _ in waiters:
                    self._reply_no_snapshot(identity, now, "the snapshot provider failed")
                continue
            snapshot = _Snapshot(
                seq,
                events,
                chunk_events=self._settings.snapshot_chunk_events,
                topic=self._topic,
                data_parallel_rank=self._rank,
                encode=self._encoder.encode,
                on_unencodable=self._count_unencodable_snapshot_events,
            )
            for identity, _ in waiters:
                stream = _ReplyStream(identity, _ReplyKind.SNAPSHOT, snapshot.frames(), now)
                self._streams.append(stream)

    def _count_unencodable_snapshot_events(self, count: int) -> None:
        self.stats.snapshot_events_unencodable += count
        self._warn(
            "unencodable snapshot events",
            "%d snapshot events cannot be encoded; the snapshot goes out without them",
            count,
        )

    def _expire_snapshot_waiters(self, now: float) -> None:
        deadline = now - self._settings.reply_timeout
        while self._snapshot_waiters and self._snapshot_waiters[0][1] <= deadline:
            identity, _ = self._snapshot_waiters.pop(0)
            cause = "the engine called neither publish() nor service_snapshot_requests() in time"
            self._reply_no_snapshot(identity, now, cause)
            if not self._snapshot_waiters:  # spare the engine a snapshot nobody waits for
                self._handoff.snapshot_wanted = False

    def _advance(self, stream: _ReplyStream, now: float) -> _StreamState:
        router = self._router
        assert router is not None
        for _ in range(self._settings.reply_budget):
            frames = stream.pending or next(stream.frames)
            try:
                router.send_multipart((stream.identity, b"", *frames), zmq.NOBLOCK)
            except zmq.Again:
                stream.pending = frames
                return _StreamState.STALLED
            except zmq.ZMQError as error:
                if error.errno == zmq.EHOSTUNREACH:
                    return _StreamState.GONE
                raise
            stream.pending = None
            stream.last_progress = now
            if frames is END_MARKER:
                return _StreamState.DONE
            self._count_batch_sent(stream.kind)
        return _StreamState.MORE

    def _count_batch_sent(self, kind: _ReplyKind) -> None:
        if kind is _ReplyKind.REPLAY:
            self.stats.replay_batches_sent += 1
        else:
            self.stats.snapshot_batches_sent += 1

    def _keeps(self, stream: _ReplyStream, state: _StreamState, now: float) -> bool:
        """Account for a finished or hopeless reply; True while the reply goes on."""
        if state is _StreamState.DONE:
            if stream.kind is _ReplyKind.REPLAY:
                self.stats.replays_completed += 1
            elif stream.kind is _ReplyKind.SNAPSHOT:
                self.stats.snapshots_sent += 1
            return False
        if state is _StreamState.GONE:
            self._abandon(stream, "the client disconnected")
            return False
        if (
            state is _StreamState.STALLED
            and now - stream.last_progress > self._settings.reply_timeout
        ):
            self._abandon(stream, f"the client read nothing for {self._settings.reply_timeout:g} s")
            return False
        return True

    def _abandon(self, stream: _ReplyStream, cause: str) -> None:
        self.stats.replays_abandoned += 1
        logger.warning("%s reply abandoned: %s", stream.kind.name.lower(), cause)

    # --- waiting and closing ------------------------------------------------------------------

    def _wait(self) -> None:
        """Sleep one flush interval, or less if a client writes or the engine wakes the thread;
        after ``_DOZE_AFTER_S`` idle, doze: the flag goes up before the queue is looked at
        again, so a ``publish()`` either is seen here or sees the flag and wakes the thread."""
        handoff, timeout = self._handoff, self._settings.flush_interval_ms
        if time.monotonic() - self._idle_since >= _DOZE_AFTER_S:
            handoff.dozing = True
            if not (handoff.queue or handoff.closing or handoff.snapshots):
                timeout = _DOZE_MS
        ready = dict(self._poller.poll(timeout))
        handoff.dozing = False
        if handoff.wake_fd in ready:
            os.eventfd_read(handoff.wake_fd)

    def _close(self) -> None:
        if self._streams or self._snapshot_waiters:
            logger.warning(
                "publisher closing with %d replies unfinished",
                len(self._streams) + len(self._snapshot_waiters),
            )
        self.stats.dropped_at_shutdown = len(self._handoff.queue)
        linger_ms = int(max(0.0, self.flush_deadline - time.monotonic()) * 1000)
        self._pub.close(linger=linger_ms)
        if self._router is not None:
            self._router.close(linger=0)


class ZmqEventPublisher:
    """Drop-in for vLLM's ``ZmqEventPublisher`` that never blocks the engine thread.

    The positional-or-keyword arguments are vLLM's, with vLLM's defaults. hmakv's own options are
    keyword-only: ``snapshot_provider`` (see the module docstring), ``snapshot_chunk_events``,
    ``replay_budget`` (messages per reply per loop turn), ``replay_timeout`` (seconds a reply may
    make no progress), ``max_replies`` (replies and snapshot requests in progress at once; more
    requests are ignored, so a client that floods the ROUTER costs bounded work),
    ``replay_hwm`` (ROUTER send high-water mark), ``bind`` (bind the PUB endpoint even where
    it names a host, such as ``tcp://127.0.0.1:5557``, to serve loopback or one interface instead
    of all; otherwise vLLM's rule, ``protocol.should_bind``), ``curve`` (CURVE on both
    sockets, see ``producer.curve``: the publisher serves what it binds, admitting
    ``curve.clients``, and a PUB endpoint it connects to is a server with ``curve.server_key``;
    its ZAP handler runs on the publisher's context, which allows one such publisher per
    context), ``flush_interval_ms`` (how often an idle publisher thread looks for batches and
    requests), ``shutdown_timeout`` and ``context`` (defaults to a private one, terminated on
    shutdown so queued batches are flushed; pass a shared one to reach ``inproc://`` endpoints
    from other sockets).
    """

    def __init__(
        self,
        data_parallel_rank: int,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        snapshot_provider: SnapshotProvider | None = None,
        snapshot_chunk_events: int = 1024,
        replay_budget: int = 64,
        replay_timeout: float = 5.0,
        max_replies: int = 64,
        replay_hwm: int = 1000,
        bind: bool = False,
        curve: CurveSettings | None = None,
        flush_interval_ms: int = 1,
        shutdown_timeout: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        counts = (max_queue_size, snapshot_chunk_events, replay_budget, max_replies)
        if min(*counts, flush_interval_ms) < 1:
            raise ValueError(
                "max_queue_size, snapshot_chunk_events, replay_budget, max_replies and "
                "flush_interval_ms must be at least 1"
            )
        if buffer_steps < 0:
            raise ValueError("buffer_steps must not be negative")
        self._data_parallel_rank = data_parallel_rank
        self._max_queue_size = max_queue_size
        self._snapshot_provider = snapshot_provider
        self._shutdown_timeout = shutdown_timeout
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        binds = bind or should_bind(self.endpoint)
        if curve is not None and not binds and curve.server_key is None:
            raise ValueError(
                f"the publisher connects to {self.endpoint}: CURVE needs that server's public "
                "key (server_key)"
            )
        self._curve = curve
        self._gate: CurveGate | None = None
        self._owns_context = context is None
        self._ctx = zmq.Context() if context is None else context
        pub, router = self._open_sockets(hwm, replay_hwm, binds)
        self._handoff = _Handoff()
        self._loop = _PublisherLoop(
            self._handoff,
            pub,
            router,
            topic=topic.encode("utf-8"),
            data_parallel_rank=data_parallel_rank,
            buffer_steps=buffer_steps,
            settings=_LoopSettings(
                flush_interval_ms=flush_interval_ms,
                reply_budget=replay_budget,
                reply_timeout=replay_timeout,
                snapshot_chunk_events=snapshot_chunk_events,
                has_provider=snapshot_provider is not None,
                max_replies=max_replies,
            ),
        )
        self._next_seq = 0
        self._dropped_queue_full = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._loop.run, name="hmakv-kv-event-publisher", daemon=True
        )
        self._thread.start()
        self.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))

    @property
    def endpoint(self) -> str:
        """The PUB endpoint after the DP-rank offset."""
        assert self._endpoint is not None
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER endpoint after the DP-rank offset, if replay is enabled."""
        return self._replay_endpoint

    def publish(self, events: EventBatchLike) -> None:
        """Assign the next seq and queue the batch; drops it (seq kept) when the queue is full.

        Named ``events`` like vLLM's parameter. The batch must not be changed after this call: it
        is encoded later, on the publisher thread.
        """
        if self._closed:
            raise RuntimeError("Publisher is closed")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        seq = self._next_seq
        self._next_seq = seq + 1
        handoff = self._handoff
        if len(handoff.queue) < self._max_queue_size:
            handoff.queue.append((seq, events))
        else:
            self._dropped_queue_full += 1
        if handoff.dozing:
            handoff.dozing = False
            handoff.wake()
        if handoff.snapshot_wanted:
            self._take_snapshot(seq)

    def service_snapshot_requests(self) -> None:
        """Serve a pending snapshot request at the last assigned seq; call from the engine thread
        once per idle step, where every change to the blocks has been published."""
        if self._handoff.snapshot_wanted and not self._closed:
            self._take_snapshot(self._next_seq - 1)

    def stats(self) -> PublisherStats:
        """A copy of the counters, readable from any thread."""
        return replace(
            self._loop.stats,
            published=self._next_seq,
            dropped_queue_full=self._dropped_queue_full,
            clients_refused=0 if self._gate is None else self._gate.refused,
        )

    def shutdown(self) -> None:
        """Send what is queued within ``shutdown_timeout`` seconds, then close the sockets.

        Batches still queued at the deadline are dropped, counted and logged. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._shutdown_timeout
        self._loop.flush_deadline = deadline
        self._handoff.closing = True
        self._handoff.wake()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._handoff.abort = True
            self._handoff.wake()
            self._thread.join()
        unsent = self._loop.stats.dropped_at_shutdown
        if unsent:
            logger.warning("publisher shut down with %d batches unsent (timeout)", unsent)
        os.close(self._handoff.wake_fd)
        if self._gate is not None:
            self._gate.stop()
        if self._owns_context:
            self._ctx.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- engine-thread helpers ----------------------------------------------------------------

    def _take_snapshot(self, seq: int) -> None:
        """Run the provider here, on the engine thread, so the snapshot is the state after seq."""
        assert self._snapshot_provider is not None
        self._handoff.snapshot_wanted = False
        events: tuple[KVEvent, ...] | None
        try:
            events = tuple(self._snapshot_provider())
        except Exception:
            logger.exception("snapshot provider failed; the requesters get no snapshot")
            events = None
        self._handoff.snapshots.append((seq, events))
        self._handoff.wake()

    def _open_sockets(
        self, hwm: int, replay_hwm: int, binds: bool
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """Bind or connect here, so a taken port fails the constructor, as in vLLM; on failure
        close what was opened, since no shutdown() will follow."""
        opened: list[zmq.Socket[bytes]] = []
        try:
            if self._curve is not None and (binds or self._replay_endpoint is not None):
                clients = self._curve.clients
                self._gate = CurveGate(self._ctx, lambda key: clients is None or key in clients)
            pub = self._ctx.socket(zmq.PUB)
            opened.append(pub)
            pub.set_hwm(hwm)
            self._secure(pub, serves=binds)
            if binds:
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self._replay_endpoint is None:
                return pub, None
            router = self._ctx.socket(zmq.ROUTER)
            opened.append(router)
            # Refuse instead of silently dropping replies to a full or departed client.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, replay_hwm)
            self._secure(router, serves=True)
            router.bind(self._replay_endpoint)
            return pub, router
        except zmq.ZMQError:
            for sock in opened:
                sock.close(linger=0)
            if self._gate is not None:
                self._gate.stop()
            if self._owns_context:
                self._ctx.term()
            raise

    def _secure(self, sock: zmq.Socket[bytes], *, serves: bool) -> None:
        curve = self._curve
        if curve is None:
            return
        if serves:
            serve(sock, curve.keys)
        else:
            assert curve.server_key is not None  # the constructor checked
            connect_to(sock, curve.keys, curve.server_key)
