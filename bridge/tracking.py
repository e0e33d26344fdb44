"""Sequence tracking for one worker: gaps, replays, restarts and unrecoverable loss, without I/O.

A ``SequenceTracker`` sees the batches of one engine publisher (one worker: one engine, one DP
rank) as they arrive, live from the SUB socket or fetched over the replay socket, and answers
with ``Step`` values: what to forward, in which order, what to fetch, and what happened. The I/O
shell around it only carries batches in and steps out, so every rule below is testable without
a socket.

The guarantees:

* Within one epoch the tracker forwards each seq at most once, in increasing order.
* Every seq of an engine life is either forwarded, or lies in a span announced by
  ``GapUnrecoverable`` and followed by a ``Clear`` (the worker is then ``degraded`` until a
  snapshot or an engine-side clear makes its view complete again).
* A restart (a live seq that goes backwards, a batch at seq 0 opening with ``AllBlocksCleared``
  after later seqs, or a replayed batch that is not the one forwarded at its seq: every replay
  starts at the last forwarded seq to check that) starts a new epoch whose first step is a
  ``Clear``.

How the shell must drive it:

* ``start()`` once (it catches a resumed worker up), and ``on_connected`` each time the live
  stream (re)connects: what was published meanwhile only a replay can tell.
* ``on_live`` for each live batch (the shell stops receiving while Kafka's queue is full, so
  nothing is dropped here; what the engine then drops shows as a gap).
* For each ``Fetch``: ask the engine's replay socket from ``start_seq`` (or for a snapshot),
  feed every reply batch to ``on_fetched`` and the end marker to ``on_fetch_end``, or call
  ``on_fetch_failed`` when the reply stalls. A ``CancelFetch`` (or a newer ``Fetch``) ends the
  old one; late messages of a superseded fetch are ignored anyway.
* ``on_undecodable`` for a frame with a valid seq but a payload that cannot be used,
  ``on_unwritable`` for a forwarded batch with an event too large to write, and
  ``on_delivery_failed`` when Kafka refused a forwarded batch for good.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from hmakv.kvlog.records import Health
from hmakv.producer.events import AllBlocksCleared, KVEventBatch

# Live batches held per worker while a fetch runs: one that does not fit is fetched again by
# the next replay, so the bound costs little and caps memory (a step batch is a few KiB).
DEFAULT_MAX_BUFFERED = 2_000


class FetchKind(enum.Enum):
    REPLAY = "replay"
    SNAPSHOT = "snapshot"


# --- Steps: what the tracker tells its shell ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward this engine batch to Kafka as (epoch, seq); ``snapshot``: the engine's state
    after seq, not the batch it published at seq (whose ts a restarted bridge checks)."""

    epoch: int
    seq: int
    batch: KVEventBatch
    snapshot: bool = False


@dataclass(frozen=True, slots=True)
class Clear:
    """Clear every known group of the worker; ``seq`` places it between forwarded batches."""

    epoch: int
    seq: int
    cause: str


@dataclass(frozen=True, slots=True)
class Fetch:
    """Ask the engine's replay socket for batches from ``start_seq``, or for a snapshot."""

    fetch_id: int
    kind: FetchKind
    start_seq: int


@dataclass(frozen=True, slots=True)
class CancelFetch:
    fetch_id: int


@dataclass(frozen=True, slots=True)
class EpochStarted:
    epoch: int
    cause: str


@dataclass(frozen=True, slots=True)
class HealthChanged:
    """The worker's health changed; the steps before it in the same answer say why."""

    health: Health


@dataclass(frozen=True, slots=True)
class GapDetected:
    """Seqs ``start`` to ``end - 1`` are missing."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class GapReplayed:
    """A detected gap was filled, by replay or snapshot."""

    start: int
    end: int
    by: FetchKind


@dataclass(frozen=True, slots=True)
class GapUnrecoverable:
    """Seqs ``start`` to ``end - 1`` are lost for good; a ``Clear`` follows."""

    start: int
    end: int
    cause: str


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch already forwarded (replay overlap, or a resumed position verified)."""

    seq: int


@dataclass(frozen=True, slots=True)
class BufferOverflow:
    """A live batch arrived during a fetch with the buffer full; a later replay fetches it."""

    seq: int


Step = (
    Forward
    | Clear
    | Fetch
    | CancelFetch
    | EpochStarted
    | HealthChanged
    | GapDetected
    | GapReplayed
    | GapUnrecoverable
    | Duplicate
    | BufferOverflow
)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a previous bridge left a worker: from its ``WorkerState`` in the workers topic.

    ``last_ts`` is the engine timestamp of the batch at ``last_seq``: replaying that seq and
    comparing timestamps tells the same engine life from a new one that has reached past it.
    """

    epoch: int
    last_seq: int
    last_ts: float
    degraded: bool = False


# --- The tracker ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _ActiveFetch:
    fetch_id: int
    kind: FetchKind
    # Every seq below ``known_end`` was published before the request: a replay that ends
    # without having delivered one of them proves that the ring no longer holds it.
    known_end: int
    verify: tuple[int, float] | None = None  # (seq, ts) the first replayed batch must match
    catch_up_from: int | None = None  # a replay after a (re)connect, not for a gap seen live
    # A replay from 0 asked because a verifying one got no batch at all: the life that published
    # the batch it verified would have sent that one, so any batch here is another life's.
    probing: bool = False
    reply_high: int | None = None  # the highest seq the reply has brought so far
    snapshot: list[tuple[int, KVEventBatch | None]] = field(default_factory=list)


class SequenceTracker:
    """The per-worker state machine; see the module docstring for its guarantees and protocol.

    ``can_fetch`` says whether the engine has a replay endpoint; without one every gap is
    unrecoverable. ``max_buffered`` bounds the live batches held while a fetch runs.
    """

    def __init__(
        self,
        *,
        can_fetch: bool,
        resume: ResumePoint | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be at least 1")
        self._can_fetch = can_fetch
        self.max_buffered = max_buffered
        self._resume = resume
        self.epoch = resume.epoch if resume else 0
        self.next_seq = resume.last_seq + 1 if resume else 0
        # The highest seq known to be published in this life: a live seq at or below it is a
        # restart. After a bridge restart, the last forwarded seq was published by definition.
        self.live_high: int | None = resume.last_seq if resume and resume.last_seq >= 0 else None
        self.degraded = resume.degraded if resume else False
        self._fetch: _ActiveFetch | None = None
        self._buffer: deque[tuple[int, KVEventBatch]] = deque()
        # Seqs forwarded from a fetch ahead of the live stream, with their engine ts: the same
        # seqs arriving live later are overlap (same ts) or a new engine life (another ts).
        self._ahead_ts: dict[int, float] = {}
        # (seq, ts) of the last engine batch forwarded: a replay starts there to check that the
        # engine is still the same life (a new life has another batch at that seq).
        self._last_forward: tuple[int, float] | None = (
            (resume.last_seq, resume.last_ts) if resume and resume.last_seq >= 0 else None
        )
        self._snapshot_offered: bool | None = None
        self._repairing: tuple[int, int] | None = None
        # The seq of the clear a refusal placed, while nothing of its epoch follows it: an idle
        # engine's snapshot is at that very seq (its last), and is the view to rebuild.
        self._refusal_clear_seq: int | None = None
        # A (re)connect while a fetch ran: replay once it ends, for what the reconnect missed.
        self._catch_up_pending = False
        self._fetch_ids = itertools.count(1)
        self._reported_health: Health = self.health

    @property
    def health(self) -> Health:
        if self.degraded:
            return "degraded"
        return "replaying" if self._fetch is not None else "live"

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # --- inputs ----------------------------------------------------------------------------------

    def start(self) -> list[Step]:
        """Catch a resumed worker up from where the previous bridge left it."""
        resume = self._resume
        if resume is not None and resume.last_seq >= 0:
            return self.on_connected()
        return []

    def on_connected(self) -> list[Step]:
        """The live stream (re)connected: what it missed meanwhile, an idle engine never shows,
        so replay from the next seq (from 0 for an engine never seen)."""
        steps: list[Step] = []
        if self._fetch is not None:
            self._catch_up_pending = True  # the running fetch may have been served before
        elif self._can_fetch:
            self._catch_up(steps)
        return self._finish(steps)

    def _catch_up(self, steps: list[Step]) -> None:
        self._begin_replay(steps)
        assert self._fetch is not None
        self._fetch.catch_up_from = self.next_seq

    def on_live(self, seq: int, batch: KVEventBatch) -> list[Step]:
        steps: list[Step] = []
        cause = self._restart_cause(seq, batch)
        if cause is not None:
            self._restart(cause, steps, keep_buffer=False)
        self._note_live(seq)
        if self._fetch is not None:
            self._hold(seq, batch, steps)
        elif seq < self.next_seq:
            steps.append(Duplicate(seq))
        elif seq == self.next_seq:
            self._forward(seq, batch, steps)
        else:
            self._hold(seq, batch, steps)
            self._open_gap(seq, steps)
        return self._finish(steps)

    def on_undecodable(self, seq: int) -> list[Step]:
        """A live batch that cannot be used: lost, since a replay would give the same bytes."""
        steps: list[Step] = []
        if (self.live_high is not None and seq <= self.live_high) or seq < self.next_seq:
            return steps  # no place in the sequence: dead-lettered, nothing else
        self._note_live(seq)
        if self._fetch is None:
            if seq > self.next_seq:
                self._open_gap(seq + 1, steps)  # the replay brings seq again, then it is lost
            else:
                self._unrecoverable(seq + 1, "the batch could not be decoded", steps)
        return self._finish(steps)

    def on_fetched(self, fetch_id: int, seq: int, batch: KVEventBatch | None) -> list[Step]:
        """A batch of a fetch reply; None when its payload could not be decoded."""
        fetch = self._fetch
        steps: list[Step] = []
        if fetch is None or fetch.fetch_id != fetch_id:
            return steps
        if fetch.kind is FetchKind.SNAPSHOT:
            fetch.snapshot.append((seq, batch))
            return steps
        fetch.reply_high = seq
        if fetch.probing:
            cause = "the ring holds batches but not the last one forwarded: another life"
            self._restart(cause, steps, keep_buffer=True)
            self._begin_fetch(FetchKind.REPLAY, 0, steps)
            return self._finish(steps)
        if fetch.verify is not None and not self._verified(fetch, seq, batch, steps):
            return self._finish(steps)
        if seq < self.next_seq:
            steps.append(Duplicate(seq))
        elif seq > self.next_seq:
            self._unrecoverable(seq, "the replay ring no longer reaches back", steps)
            if self._fetch is fetch:
                self._take_fetched(seq, batch, steps)
        else:
            self._take_fetched(seq, batch, steps)
        return self._finish(steps)

    def on_fetch_end(self, fetch_id: int) -> list[Step]:
        fetch = self._fetch
        steps: list[Step] = []
        if fetch is None or fetch.fetch_id != fetch_id:
            return steps
        self._fetch = None
        if fetch.kind is FetchKind.SNAPSHOT:
            self._end_snapshot(fetch, steps)
        elif fetch.verify is not None:  # not even the batch it verifies: the ring is empty, or
            self._begin_fetch(FetchKind.REPLAY, 0, steps)  # another life's has fewer seqs
            assert self._fetch is not None
            self._fetch.probing = True
            self._fetch.catch_up_from = fetch.catch_up_from
            return self._finish(steps)
        elif self._replied_from_another_life(fetch):
            cause = "the replay did not reach batches held from live: another life replied"
            self._restart(cause, steps, keep_buffer=False)
            self._begin_replay(steps)
        else:
            self._count_catch_up(fetch, steps)
            self._close_repair(FetchKind.REPLAY, steps)
            self._drain(steps, known_end=fetch.known_end, router_answers=True)
        self._catch_up_if_pending(steps)
        return self._finish(steps)

    def on_fetch_failed(self, fetch_id: int, cause: str) -> list[Step]:
        """The replay socket did not answer in time: nothing more can come from it for now."""
        fetch = self._fetch
        steps: list[Step] = []
        if fetch is None or fetch.fetch_id != fetch_id:
            return steps
        self._fetch = None
        if fetch.kind is FetchKind.SNAPSHOT:
            self._snapshot_offered = False
        self._drain(steps, known_end=0, router_answers=False, cause=f"replay failed: {cause}")
        self._catch_up_if_pending(steps)
        return self._finish(steps)

    def _catch_up_if_pending(self, steps: list[Step]) -> None:
        if self._catch_up_pending and self._fetch is None and self._can_fetch:
            self._catch_up(steps)

    def on_delivery_failed(self, epoch: int, seq: int) -> list[Step]:
        """Kafka refused a forwarded batch for good: what this epoch holds is not to be trusted.

        Later batches of the epoch may already be in Kafka, so the batch cannot be re-sent in
        its place; a new epoch opening with a clear (then a snapshot, if offered) is the only
        way back to a view consumers can trust.
        """
        steps: list[Step] = []
        if epoch != self.epoch:
            return steps
        self.epoch += 1
        cause = f"Kafka refused seq {seq} of epoch {epoch}"
        steps.append(EpochStarted(self.epoch, cause))
        steps.append(Clear(self.epoch, self.next_seq - 1, cause))
        self._refusal_clear_seq = self.next_seq - 1
        self.degraded = True
        running = self._fetch
        if self._may_snapshot() and (running is None or running.kind is FetchKind.REPLAY):
            # A running replay would only bring batches onto the cleared view: a snapshot,
            # then what the replay and live hold beyond it, rebuilds it.
            self._begin_fetch(FetchKind.SNAPSHOT, self.next_seq, steps)
        return self._finish(steps)

    def on_unwritable(self, seq: int, limit: int, cleared_later: bool) -> list[Step]:
        """A batch forwarded holds an event too large for any Kafka record: it is lost.

        Nothing after it has been written yet, so a clear in its place keeps the log in order.
        ``cleared_later``: a batch forwarded after it (in the same answer) holds the engine's
        own clear, which makes the view complete again. No snapshot is asked for: it
        could well hold such an event too.
        """
        cause = f"an event of seq {seq} exceeds the Kafka record limit of {limit} bytes"
        steps: list[Step] = [GapUnrecoverable(seq, seq + 1, cause), Clear(self.epoch, seq, cause)]
        self.degraded = self.degraded or not cleared_later
        return self._finish(steps)

    # --- live ------------------------------------------------------------------------------------

    def _restart_cause(self, seq: int, batch: KVEventBatch) -> str | None:
        if self.live_high is not None and seq <= self.live_high:
            return f"the live sequence went backwards ({self.live_high} -> {seq})"
        replayed_ts = self._ahead_ts.get(seq)
        if replayed_ts == batch.ts:  # a replay brought this very batch first
            return None
        if seq == 0 and self.next_seq > 0 and _opens_with_clear(batch):
            return "seq 0 opened with AllBlocksCleared"
        if replayed_ts is not None:
            return f"live seq {seq} is not the batch replayed at that seq"
        return None

    def _note_live(self, seq: int) -> None:
        self.live_high = seq
        ahead = self._ahead_ts
        while ahead:
            first = next(iter(ahead))
            if first > seq:
                break
            del ahead[first]

    def _hold(self, seq: int, batch: KVEventBatch, steps: list[Step]) -> None:
        if len(self._buffer) >= self.max_buffered:
            steps.append(BufferOverflow(seq))
            return
        self._buffer.append((seq, batch))

    # --- gaps ------------------------------------------------------------------------------------

    def _open_gap(self, end: int, steps: list[Step]) -> None:
        """Seqs next_seq..end-1 are missing: replay them, or lose them without a replay socket."""
        start = self.next_seq
        if self._repairing is None or self._repairing[0] != start:
            steps.append(GapDetected(start, end))
        self._repairing = (start, end)
        if self._can_fetch:
            self._begin_replay(steps)
        else:
            self._lose(end, "the engine has no replay endpoint", steps)
            self._drain(steps, known_end=0, router_answers=False)

    def _unrecoverable(self, end: int, cause: str, steps: list[Step]) -> None:
        """Seqs next_seq..end-1 are not in the ring: ask for a snapshot, or lose them."""
        if self._may_snapshot():
            self._begin_fetch(FetchKind.SNAPSHOT, self.next_seq, steps)
        else:
            self._lose(end, cause, steps)

    def _lose(self, end: int, cause: str, steps: list[Step]) -> None:
        """Seqs next_seq..end-1 are gone for good: clear the worker and carry on, degraded."""
        steps.append(GapUnrecoverable(self.next_seq, end, cause))
        steps.append(Clear(self.epoch, end - 1, cause))
        self.degraded = True
        self.next_seq = end
        self._repairing = None

    def _may_snapshot(self) -> bool:
        return self._can_fetch and self._snapshot_offered is not False

    def _drain(
        self,
        steps: list[Step],
        *,
        known_end: int,
        router_answers: bool,
        cause: str = "the replay ring no longer reaches back",
    ) -> None:
        """Forward held live batches in order after a fetch, and deal with what gap remains.

        Missing seqs below ``known_end`` were in the reply's reach and did not come: they are
        unrecoverable. Missing seqs above it were published after the request: replay them.
        """
        while self._fetch is None:
            end = self._forward_held(steps)
            if end is None:
                return
            if not router_answers:
                self._lose(end, cause, steps)
            elif self.next_seq >= known_end:
                self._open_gap(end, steps)
            else:
                self._unrecoverable(min(end, known_end), cause, steps)

    def _forward_held(self, steps: list[Step]) -> int | None:
        """Forward held batches up to the first missing seq; return where that gap ends."""
        while self._buffer:
            seq, batch = self._buffer[0]
            if seq > self.next_seq:
                return seq
            self._buffer.popleft()
            if seq == self.next_seq:
                self._forward(seq, batch, steps)
            else:
                steps.append(Duplicate(seq))
        if self.live_high is not None and self.live_high >= self.next_seq:
            return self.live_high + 1
        return None

    # --- fetches ---------------------------------------------------------------------------------

    def _begin_replay(self, steps: list[Step]) -> None:
        """Replay from the last engine batch forwarded, to check that the same life answers,
        or from next_seq when none can be checked (none forwarded since a restart or snapshot).
        Seqs in between are lost already, and come back as duplicates if the ring has them."""
        verify = self._last_forward
        if verify is None:
            self._begin_fetch(FetchKind.REPLAY, self.next_seq, steps)
        else:
            self._begin_fetch(FetchKind.REPLAY, verify[0], steps, verify=verify)

    def _begin_fetch(
        self,
        kind: FetchKind,
        start_seq: int,
        steps: list[Step],
        *,
        verify: tuple[int, float] | None = None,
    ) -> None:
        if self._fetch is not None:
            steps.append(CancelFetch(self._fetch.fetch_id))
        self._catch_up_pending = False  # what this fetch brings reaches the engine's head
        known_end = -1 if self.live_high is None else self.live_high + 1
        self._fetch = _ActiveFetch(next(self._fetch_ids), kind, known_end, verify)
        steps.append(Fetch(self._fetch.fetch_id, kind, start_seq))

    def _verified(
        self, fetch: _ActiveFetch, seq: int, batch: KVEventBatch | None, steps: list[Step]
    ) -> bool:
        """Check a resumed position against the first batch replayed; False after a restart."""
        assert fetch.verify is not None
        verified_seq, verified_ts = fetch.verify
        fetch.verify = None
        if seq != verified_seq or batch is None or batch.ts == verified_ts:
            return True
        cause = f"replayed seq {seq} is not the batch forwarded at that seq"
        self._restart(cause, steps, keep_buffer=True)
        self._begin_fetch(FetchKind.REPLAY, 0, steps)
        return False

    def _take_fetched(self, seq: int, batch: KVEventBatch | None, steps: list[Step]) -> None:
        """The fetched batch at next_seq: forward it, or handle it as lost if undecodable."""
        if batch is None:
            self._unrecoverable(seq + 1, "a replayed batch could not be decoded", steps)
            return
        self._forward(seq, batch, steps)
        if self.live_high is None or seq > self.live_high:
            self._ahead_ts[seq] = batch.ts

    def _end_snapshot(self, fetch: _ActiveFetch, steps: list[Step]) -> None:
        snapshot = _merge_snapshot(fetch.snapshot)
        if snapshot is None or snapshot[0] < self._snapshot_floor():
            # Replay again: the ring may hold more than the span that made us ask.
            self._snapshot_offered = False
            self._drain(steps, known_end=self.next_seq, router_answers=True)
            return
        self._snapshot_offered = True
        self._refusal_clear_seq = None  # its seq is taken now
        seq, batch = snapshot
        self._forward(seq, batch, steps, snapshot=True)
        self._last_forward = None  # the snapshot's ts is not that of the batch at its seq
        self.degraded = False
        self._close_repair(FetchKind.SNAPSHOT, steps)
        self._drain(steps, known_end=self.next_seq, router_answers=True)

    def _snapshot_floor(self) -> int:
        """The lowest seq a snapshot may have: one past what was forwarded, or the seq of a
        refusal's clear that nothing followed (consumers apply the snapshot after that clear:
        both open with ``AllBlocksCleared``, and a record at a seq already applied is taken
        from the event after those applied)."""
        refusal = self._refusal_clear_seq
        if refusal is not None and refusal == self.next_seq - 1:
            return refusal
        return self.next_seq

    def _replied_from_another_life(self, fetch: _ActiveFetch) -> bool:
        """A reply that ends below a held batch published before the request cannot come from
        the life that published it: its ring held that batch, or later ones it would have sent.
        (An empty reply proves nothing: a ring may keep nothing at all. An empty reply to a
        verifying replay is probed from 0: the life that published the batch it verifies holds
        at least that one, so a ring with any batch but that one is another life's.)"""
        high = fetch.reply_high
        return high is not None and any(high < seq < fetch.known_end for seq, _ in self._buffer)

    def _count_catch_up(self, fetch: _ActiveFetch, steps: list[Step]) -> None:
        """What a catch-up replay brought was a gap too: one nobody had seen yet."""
        start = fetch.catch_up_from
        if start is not None and self._repairing is None and self.next_seq > start:
            steps.append(GapDetected(start, self.next_seq))
            steps.append(GapReplayed(start, self.next_seq, FetchKind.REPLAY))

    def _close_repair(self, by: FetchKind, steps: list[Step]) -> None:
        if self._repairing is not None and self.next_seq >= self._repairing[1]:
            steps.append(GapReplayed(*self._repairing, by))
            self._repairing = None

    # --- forwarding, restarts, health ------------------------------------------------------------

    def _forward(
        self, seq: int, batch: KVEventBatch, steps: list[Step], *, snapshot: bool = False
    ) -> None:
        steps.append(Forward(self.epoch, seq, batch, snapshot))
        self.next_seq = seq + 1
        self._last_forward = (seq, batch.ts)
        if self.degraded and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.degraded = False  # the engine cleared itself: the view is complete again

    def _restart(self, cause: str, steps: list[Step], *, keep_buffer: bool) -> None:
        if self._fetch is not None:
            steps.append(CancelFetch(self._fetch.fetch_id))
            self._fetch = None
        if not keep_buffer:
            self._buffer.clear()
        self.epoch += 1
        steps.append(EpochStarted(self.epoch, cause))
        steps.append(Clear(self.epoch, -1, cause))
        self.next_seq = 0
        # Held batches (kept when a replay revealed the restart) are of the new life.
        self.live_high = self._buffer[-1][0] if self._buffer else None
        self.degraded = False
        self._ahead_ts.clear()
        self._last_forward = None
        self._snapshot_offered = None
        self._repairing = None
        self._refusal_clear_seq = None

    def _finish(self, steps: list[Step]) -> list[Step]:
        health = self.health
        if health != self._reported_health:
            self._reported_health = health
            steps.append(HealthChanged(health))
        return steps


def _opens_with_clear(batch: KVEventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)


def _merge_snapshot(
    chunks: list[tuple[int, KVEventBatch | None]],
) -> tuple[int, KVEventBatch] | None:
    """One batch from a snapshot's chunks; None when none came, one was bad, or seqs differ."""
    if not chunks or len({seq for seq, _ in chunks}) != 1:
        return None
    batches = [batch for _, batch in chunks if batch is not None]
    if len(batches) != len(chunks):
        return None
    first = batches[0]
    events = [event for batch in batches for event in batch.events]
    return chunks[0][0], KVEventBatch(first.ts, events, first.data_parallel_rank)
