"""A second subscriber to a vLLM server's KV events, beside the bridge: what vLLM published.

The bridge is what is under test, so the checks need their own record of vLLM's stream: every
seq, when vLLM published it (the batch's ``ts``, vLLM's ``time.time()`` in the scheduler step),
which cache groups its events touched, and the groups' specs. A subscription misses what was
sent before it propagated (ZMQ's slow joiner), so a hole in the seqs is filled from vLLM's replay
endpoint, as the bridge fills its own.

How a check knows the index holds everything vLLM published before a request: vLLM enqueues a
step's batch (``Scheduler.update_from_output``) before that step's outputs leave the engine core,
so once an answer is back and the witness has been quiet for a moment, its newest seq ``S`` is
vLLM's state; the index holds exactly that state when each group's applied seq is the newest seq
at or before ``S`` that touched the group. After the request, any batch stamped before the request
was sent but numbered past ``S`` proves the moment was missed: that comparison is a race.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    WireDecodeError,
    decode,
    has_group_sizes,
)
from hmakv.producer.protocol import Malformed, ReplyEnd, parse_live, parse_reply, replay_request

REPLAY_TIMEOUT_S = 5.0
ALL_GROUPS = -1
"""In ``Published.groups``: the batch cleared the cache, which reaches every group."""


@dataclass(frozen=True)
class Published:
    """One batch vLLM published: its stamp, its events, and the groups they touched."""

    seq: int
    ts: float
    events: int
    removals: int
    groups: frozenset[int]


@dataclass
class WitnessState:
    """Everything the witness saw, by seq; pure, so checks can be tested without sockets."""

    batches: dict[int, Published] = field(default_factory=dict)
    payloads: dict[int, bytes] = field(default_factory=dict)
    """Each batch exactly as vLLM sent it, for recording traces."""
    catalog: dict[int, GroupSpec] = field(default_factory=dict)
    undecodable: int = 0
    newest_ts: float = float("-inf")

    @property
    def last_seq(self) -> int:
        return max(self.batches, default=-1)

    def missing(self) -> list[int]:
        """Seqs below the newest that were never seen."""
        return [seq for seq in range(self.last_seq + 1) if seq not in self.batches]

    def add(self, seq: int, payload: bytes) -> None:
        if seq in self.batches:
            return  # a replayed copy
        try:
            batch = decode(payload).batch
        except WireDecodeError:
            self.undecodable += 1
            return
        groups: set[int] = set()
        removals = 0
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                groups.add(ALL_GROUPS)
                continue
            group = event.group_idx or 0
            groups.add(group)
            if isinstance(event, BlockRemoved):
                removals += 1
            elif isinstance(event, BlockStored) and has_group_sizes(event):
                self._learn(group, event)
        self.batches[seq] = Published(seq, batch.ts, len(batch.events), removals, frozenset(groups))
        self.payloads[seq] = payload
        self.newest_ts = max(self.newest_ts, batch.ts)

    def _learn(self, group: int, store: BlockStored) -> None:
        self.catalog[group] = GroupSpec(
            kind=store.kv_cache_spec_kind or "full_attention",
            block_size=store.block_size,
            sliding_window=store.kv_cache_spec_sliding_window,
        )

    def expected_last_seq(self, group: int, through: int) -> int | None:
        """The newest seq at or before ``through`` whose batch reached ``group`` (None: none)."""
        touching = [
            seq
            for seq, batch in self.batches.items()
            if seq <= through and (group in batch.groups or ALL_GROUPS in batch.groups)
        ]
        return max(touching, default=None)

    def reached(self, seq: int) -> bool:
        return self.last_seq >= seq

    def fenced(self, sent_at: float) -> bool:
        """Whether vLLM published a batch after ``sent_at``: then every batch it published
        before has been seen (one PUB stream keeps its order; holes are replayed)."""
        return self.newest_ts > sent_at and not self.missing()

    def published_late(self, through: int, sent_at: float) -> list[int]:
        """Seqs past ``through`` stamped before ``sent_at``: published before a request went out,
        yet not in the state it was compared against."""
        return [s for s, b in self.batches.items() if s > through and b.ts < sent_at]

    @property
    def events(self) -> int:
        return sum(batch.events for batch in self.batches.values())

    @property
    def removals(self) -> int:
        return sum(batch.removals for batch in self.batches.values())


class EventWitness:
    """Subscribes to one server's PUB endpoint; ``settle`` waits for its stream to go quiet."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        topic: str,
        context: zmq.asyncio.Context,
    ) -> None:
        self.name = name
        self.state = WitnessState()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._context = context
        self._last_arrival = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)

    def start(self) -> None:
        self._task = asyncio.create_task(self._receive())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close()

    async def _receive(self) -> None:
        while True:
            message = parse_live(await self._sub.recv_multipart())
            if isinstance(message, Malformed):
                self.state.undecodable += 1
                continue
            self.state.add(message.seq, message.payload)
            self._last_arrival = time.monotonic()

    async def settle(self, quiet_s: float = 0.05, timeout_s: float = 5.0) -> int:
        """Wait until nothing arrived for ``quiet_s``, fill holes by replay; the newest seq."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self._last_arrival < quiet_s and time.monotonic() < deadline:
            await asyncio.sleep(quiet_s / 2)
        if self.state.last_seq < 0 or self.state.missing():
            # Nothing yet (or a hole): what was published before the subscription took.
            await self.replay_from(self.state.missing()[0] if self.state.missing() else 0)
        return self.state.last_seq

    async def wait_for(self, seen: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``seen()`` holds for the state (False: not within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not seen():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    async def replay_from(self, start: int) -> None:
        """vLLM's replay protocol: ``[b"", start]`` to the ROUTER, batches back, then the end."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        try:
            await dealer.send_multipart(replay_request(start))
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await dealer.recv_multipart()
                reply = parse_reply(frames)  # with or without the topic frame
                if isinstance(reply, ReplyEnd):
                    return
                if isinstance(reply, Malformed):
                    self.state.undecodable += 1
                    continue
                self.state.add(reply.seq, reply.payload)
        finally:
            dealer.close()
