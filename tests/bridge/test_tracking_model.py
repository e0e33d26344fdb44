"""The SequenceTracker against a model of an engine and its sockets, under any interleaving.

The model is a publisher with a replay ring (vLLM's protocol: PUB, ROUTER replay, snapshot
requests), a lossy PUB->SUB channel (HWM and slow-joiner drops; a full Kafka queue only delays
delivery, since the bridge then stops receiving), engine restarts (what a dead engine sent
arrives before its successor's first batch), batches the publisher drops from its queue, and
payloads nobody can decode.
Hypothesis interleaves these freely; whatever happens, the tracker's output (the worker's Kafka
log) must satisfy the guarantees in ``bridge.tracking``'s docstring, and under loss-free
conditions it must be exactly what the engine published.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.bridge.tracking import (
    CancelFetch,
    Clear,
    Fetch,
    FetchKind,
    Forward,
    GapUnrecoverable,
    SequenceTracker,
    Step,
)
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, KVEvent, KVEventBatch

LIFE_SPAN = 1_000_000  # batch ts = life * LIFE_SPAN + seq (+ .5 live, + .25 snapshot)


def engine_batch(life: int, seq: int, clears: frozenset[int] = frozenset()) -> KVEventBatch:
    """Seq 0 and the seqs in ``clears`` open with AllBlocksCleared, as an engine's reset does."""
    head: list[KVEvent] = [AllBlocksCleared()] if seq == 0 or seq in clears else []
    events = [*head, BlockRemoved([seq], "GPU")]
    return KVEventBatch(life * LIFE_SPAN + seq + 0.5, events, data_parallel_rank=life)


def snapshot_batch(life: int, seq: int) -> KVEventBatch:
    return KVEventBatch(life * LIFE_SPAN + seq + 0.25, [AllBlocksCleared()], life)


@dataclass
class Entry:
    life: int
    seq: int
    corrupt: bool = False
    # The first batch of a life is never lost on the way (the sink may still refuse it): with
    # nothing of the new life arriving, no subscriber can tell that the engine restarted.
    must_deliver: bool = False


@dataclass
class Request:
    fetch_id: int
    kind: FetchKind
    start_seq: int
    life: int
    reply: deque[Entry | tuple[int, KVEventBatch]] | None = None  # None until served


@dataclass
class World:
    """The engine, its sockets and the shell around one tracker."""

    tracker: SequenceTracker
    ring_size: int
    snapshots: bool
    life: int = 0
    next_seq: int = 0
    ring: deque[Entry | None] = field(default_factory=deque)
    channel: deque[Entry] = field(default_factory=deque)
    request: Request | None = None
    log: list[Step] = field(default_factory=list)
    published: dict[int, int] = field(default_factory=dict)  # life -> batches published
    unusable: set[int] = field(default_factory=set)  # seqs dropped or corrupted by the engine
    clears: set[int] = field(default_factory=set)  # seqs at which the engine cleared its cache

    # --- the engine ---

    def publish(self, *, dropped_by_publisher: bool = False, corrupt: bool = False) -> None:
        entry = Entry(self.life, self.next_seq, corrupt, must_deliver=self.next_seq == 0)
        if dropped_by_publisher or corrupt:
            self.unusable.add(self.next_seq)
        self.next_seq += 1
        self.published[self.life] = self.next_seq
        self.ring.append(None if dropped_by_publisher else entry)
        while len(self.ring) > self.ring_size:
            self.ring.popleft()
        if not dropped_by_publisher:
            self.channel.append(entry)

    def publish_clear(self) -> None:
        self.clears.add(self.next_seq)
        self.publish()

    def batch(self, entry: Entry) -> KVEventBatch:
        return engine_batch(entry.life, entry.seq, frozenset(self.clears))

    def restart(self) -> None:
        # What the dead engine sent is in the bridge's socket by the time another process is
        # up: it arrives before anything of the successor. (Nothing on vLLM's wire names a
        # life, so a batch of a dead life arriving after its successor's could not be placed.)
        while self.channel:
            self.deliver()
        self.life += 1
        self.next_seq = 0
        self.ring.clear()
        self.clears.clear()
        self.publish()

    # --- the sockets ---

    def deliver(self) -> None:
        entry = self.channel.popleft()
        if entry.corrupt:
            self.apply(self.tracker.on_undecodable(entry.seq))
        else:
            self.apply(self.tracker.on_live(entry.seq, self.batch(entry)))

    def lose_live(self) -> None:
        if self.channel[0].must_deliver:
            self.deliver()
        else:
            self.channel.popleft()

    def serve(self) -> None:
        # A request dies with the engine it reached. (One still queued in the bridge's socket
        # while the engine is down can reach its successor: see "Limits" in bridge/README.md.)
        request = self.request
        assert request is not None and request.reply is None
        if request.life != self.life:
            self.fail()
            return
        if request.kind is FetchKind.SNAPSHOT:
            taken = self.next_seq - 1
            offered = self.snapshots and taken >= 0
            request.reply = deque([(taken, snapshot_batch(self.life, taken))] if offered else [])
        else:
            kept = [e for e in self.ring if e is not None and e.seq >= request.start_seq]
            request.reply = deque(kept)

    def reply_one(self) -> None:
        request = self.request
        assert request is not None and request.reply
        item = request.reply.popleft()
        if isinstance(item, Entry):
            batch = None if item.corrupt else self.batch(item)
            self.apply(self.tracker.on_fetched(request.fetch_id, item.seq, batch))
        else:
            self.apply(self.tracker.on_fetched(request.fetch_id, *item))

    def end_reply(self) -> None:
        request, self.request = self.request, None
        assert request is not None
        self.apply(self.tracker.on_fetch_end(request.fetch_id))

    def fail(self) -> None:
        request, self.request = self.request, None
        assert request is not None
        self.apply(self.tracker.on_fetch_failed(request.fetch_id, "no answer"))

    def apply(self, steps: list[Step]) -> None:
        assert self.tracker.buffered <= self.tracker.max_buffered
        for step in steps:
            self.log.append(step)
            if isinstance(step, Fetch):
                self.request = Request(step.fetch_id, step.kind, step.start_seq, self.life)
            elif isinstance(step, CancelFetch) and self._requested(step.fetch_id):
                self.request = None

    def _requested(self, fetch_id: int) -> bool:
        return self.request is not None and self.request.fetch_id == fetch_id

    # --- driving ---

    def step(self, op: str) -> None:
        request = self.request
        if op == "publish":
            self.publish()
        elif op == "publish_dropped":
            self.publish(dropped_by_publisher=True)
        elif op == "publish_corrupt":
            self.publish(corrupt=True)
        elif op == "publish_clear":
            self.publish_clear()
        elif op == "restart":
            self.restart()
        elif op in ("deliver", "lose_live") and self.channel:
            if op == "lose_live":
                self.lose_live()
            else:
                self.deliver()
        elif request is not None:
            self._step_request(op, request)

    def _step_request(self, op: str, request: Request) -> None:
        if request.reply is None:
            if op == "serve":
                self.serve()
            elif op == "fail":
                self.fail()
        elif op == "reply":
            self.reply_one() if request.reply else self.end_reply()
        elif op == "fail":
            self.fail()

    def settle(self) -> None:
        """Deliver everything without loss until the tracker has nothing left to do."""
        for _ in range(10_000):
            request = self.request
            if self.channel:
                self.deliver()
            elif request is not None and request.reply is None:
                self.serve()
            elif request is not None and request.reply:
                self.reply_one()
            elif request is not None:
                self.end_reply()
            else:
                return
        raise AssertionError("the tracker never settled")


LOSSY_OPS = [
    "publish",
    "publish",
    "publish",
    "deliver",
    "deliver",
    "deliver",
    "lose_live",
    "serve",
    "reply",
    "reply",
    "fail",
    "publish_dropped",
    "publish_corrupt",
    "publish_clear",
    "restart",
]
EXACT_LOSS_OPS = [  # every loss is the publisher's own (dropped or undecodable batches)
    "publish",
    "publish",
    "deliver",
    "deliver",
    "lose_live",
    "serve",
    "reply",
    "reply",
    "publish_dropped",
    "publish_corrupt",
    "publish_clear",
]
LOSS_FREE_OPS = [  # live loss: a big enough ring repairs it
    "publish",
    "publish",
    "deliver",
    "deliver",
    "lose_live",
    "serve",
    "reply",
    "reply",
    "restart",
]


def epochs_of(log: list[Step]) -> dict[int, list[Forward | Clear]]:
    by_epoch: dict[int, list[Forward | Clear]] = {}
    for step in log:
        if isinstance(step, Forward | Clear):
            by_epoch.setdefault(step.epoch, []).append(step)
    return by_epoch


def lost_spans(log: list[Step]) -> dict[int, list[range]]:
    """Unrecoverable spans by epoch: each GapUnrecoverable is followed by its Clear."""
    spans: dict[int, list[range]] = {}
    for step, after in itertools.pairwise(log):
        if isinstance(step, GapUnrecoverable):
            assert isinstance(after, Clear) and after.seq == step.end - 1
            spans.setdefault(after.epoch, []).append(range(step.start, step.end))
    return spans


def is_snapshot(forward: Forward) -> bool:
    life = forward.batch.data_parallel_rank
    assert life is not None
    return forward.batch.ts == snapshot_batch(life, forward.seq).ts


def check_guarantees(world: World) -> None:
    spans = lost_spans(world.log)
    for epoch, steps in epochs_of(world.log).items():
        seqs = [s.seq for s in steps]
        assert seqs == sorted(set(seqs)), f"epoch {epoch}: seqs not strictly increasing: {seqs}"
        forwards = [s for s in steps if isinstance(s, Forward)]
        lives = {f.batch.data_parallel_rank for f in forwards}
        assert len(lives) <= 1, f"epoch {epoch} mixes engine lives {lives}"
        covered: set[int] = set()
        for forward in forwards:
            life = forward.batch.data_parallel_rank
            assert life is not None
            if is_snapshot(forward):
                covered.update(range(forward.seq + 1))  # a snapshot stands for all before it
            else:
                assert forward.batch.ts == engine_batch(life, forward.seq).ts
                covered.add(forward.seq)
        for span in spans.get(epoch, []):
            covered.update(span)
        if forwards:
            missing = set(range(max(covered) + 1)) - covered
            assert not missing, f"epoch {epoch}: seqs {sorted(missing)} silently skipped"


def run(ops: list[str], ring_size: int, snapshots: bool, max_buffered: int) -> World:
    world = World(SequenceTracker(can_fetch=True, max_buffered=max_buffered), ring_size, snapshots)
    for op in ops:
        world.step(op)
    world.settle()  # an idle engine: whatever is pending must resolve without new batches
    world.publish()  # a last batch that does arrive, so that every earlier loss shows
    world.channel[-1].must_deliver = True
    world.settle()
    return world


@settings(max_examples=1500, deadline=None)
@given(
    ops=st.lists(st.sampled_from(LOSSY_OPS), max_size=80),
    ring_size=st.integers(1, 12),
    snapshots=st.booleans(),
    max_buffered=st.integers(1, 6),
)
def test_any_interleaving_keeps_the_guarantees(
    ops: list[str], ring_size: int, snapshots: bool, max_buffered: int
) -> None:
    world = run(ops, ring_size, snapshots, max_buffered)
    check_guarantees(world)
    final = epochs_of(world.log)[world.tracker.epoch]
    last = world.published[world.life] - 1
    assert final[-1].seq == last, "the last published batch was not forwarded"
    assert all(f.batch.data_parallel_rank == world.life for f in final if isinstance(f, Forward))


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.sampled_from(LOSS_FREE_OPS), max_size=80),
    max_buffered=st.integers(1, 6),
)
def test_with_a_ring_that_reaches_back_every_seq_arrives_exactly_once(
    ops: list[str], max_buffered: int
) -> None:
    world = run(ops, ring_size=1000, snapshots=False, max_buffered=max_buffered)
    check_guarantees(world)
    # An earlier life can lose its tail for good: its engine died before serving a replay.
    assert world.tracker.epoch not in lost_spans(world.log)
    final = epochs_of(world.log)[world.tracker.epoch]
    forwarded = [s.seq for s in final if isinstance(s, Forward)]
    assert forwarded == list(range(world.published[world.life]))
    assert world.tracker.health == "live"


@settings(max_examples=600, deadline=None)
@given(
    ops=st.lists(st.sampled_from(EXACT_LOSS_OPS), max_size=80),
    max_buffered=st.integers(1, 6),
)
def test_with_a_ring_that_reaches_back_only_what_the_engine_lost_is_lost(
    ops: list[str], max_buffered: int
) -> None:
    world = run(ops, ring_size=1000, snapshots=False, max_buffered=max_buffered)
    check_guarantees(world)
    lost = {seq for span in lost_spans(world.log).get(0, []) for seq in span}
    assert lost == world.unusable
    forwarded = [s.seq for s in epochs_of(world.log)[0] if isinstance(s, Forward)]
    assert forwarded == sorted(set(range(world.published[0])) - world.unusable)
    # Degraded from the first loss until the engine's next clear makes the view complete.
    clears_forwarded = {seq for seq in forwarded if seq == 0 or seq in world.clears}
    degraded = bool(lost) and max(lost) > max(clears_forwarded, default=-1)
    assert world.tracker.health == ("degraded" if degraded else "live")
