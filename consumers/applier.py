"""What each record of the log does to the index, without Kafka: the follower's rules as values.

The follower (``follower.py``) hands every record's key and value here and gets back what
happened: taken (and what the index made of it), ignored and why, or bad and why. It counts and
logs those; what a record changes in the index and in the books below is done here, so every
rule can be tested with plain values, no broker, no event loop.

- A record's key must be its value's (``"<worker>/<group>"`` for an event record, ``"<worker>"``
  for a worker state): a record that disagrees is a ``BadRecord`` and changes nothing, whichever
  half is wrong.
- Event records go to ``KVIndex.apply``, which ignores what it applied already (delivery is at
  least once) and lives older than, or retired before, the one it holds. A record it fails on is
  a bad record too, and its group, maybe half applied, is forgotten: stopping would only stop
  again at the same offset after every restart.
- A worker state takes effect at once: a newer epoch drops the previous life before the events
  partitions deliver the new one's records. A state of an older life changes nothing, catalog
  and health included (a looser catalog would count window blocks the worker no longer holds);
  ``retired`` drops the worker and makes its records of that life change nothing; a tombstone
  forgets it, retired or not.

The index keeps the lives (each worker's epoch, the retired ones) and is saved with every
snapshot: the rules read them through its own compare-and-advance calls (``start_epoch``,
``retire_worker``) rather than keep a second copy that could drift from it.

A worker's lag behind the bridge (``freshness.lag_seqs``) changes only with a record or a state
of its own, both of which pass here: so the workers past ``max_worker_lag`` are kept as each
comes (``lagging``), and a score call reads them without reading every worker's lag.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from hmakv.consumers.freshness import DEFAULT_MAX_WORKER_LAG, behind, lag_seqs
from hmakv.consumers.index import ApplyOutcome, KVIndex
from hmakv.kvlog.records import (
    RETIRED,
    EventRecord,
    RecordDecodeError,
    WorkerState,
    decode_event_record,
    decode_worker_state,
    event_key,
    parse_event_key,
)

# Why a record was skipped (a metric label).
BadReason = Literal["empty", "bad_key", "undecodable", "key_mismatch", "apply_error"]
# Why a worker state changed nothing (a metric label): a life older than the index's, or one
# that was retired.
IgnoredState = Literal["stale_epoch", "retired"]
# The events partition the bridge's producer puts a key on when nothing says otherwise.
Placement = Callable[[bytes], int]


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record skipped: ``detail`` says what was wrong; ``error`` is what the index raised
    (``apply_error``), for the traceback in the log."""

    reason: BadReason
    detail: str
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class EventTaken:
    """An event record given to the index, as read (its stores' token ids left undecoded:
    ``decode_event_record(..., token_ids=False)``); ``outcome`` says whether it changed
    anything."""

    record: EventRecord
    outcome: ApplyOutcome


@dataclass(frozen=True, slots=True)
class StateTaken:
    """A state in effect: epoch, catalog and health. ``health_changed``: against the last state
    taken for the worker (true for the first one)."""

    state: WorkerState
    health_changed: bool


@dataclass(frozen=True, slots=True)
class StateIgnored:
    """A state that changed nothing. ``behind``: the index's epoch, set for the first state of
    an older life read live (not while catching up, where older states are history): the
    bridge may have lost its resume point, which is worth a warning once per worker and epoch."""

    state: WorkerState
    reason: IgnoredState
    behind: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerRetired:
    """The worker was dropped: nothing follows its cache any more."""

    state: WorkerState


@dataclass(frozen=True, slots=True)
class WorkerForgotten:
    """A tombstone forgot the worker."""

    worker: str


@dataclass(frozen=True, slots=True)
class KeylessTombstone:
    """A tombstone without a key names no worker: nothing to forget."""


EventOutcome = EventTaken | BadRecord
StateOutcome = (
    StateTaken | StateIgnored | WorkerRetired | WorkerForgotten | KeylessTombstone | BadRecord
)
Outcome = TypeVar("Outcome", EventOutcome, StateOutcome)


def decode_event(key: bytes | None, value: bytes | None) -> EventRecord | BadRecord:
    """The event record, or why it is not one."""
    if value is None:
        return BadRecord("empty", "no value (a tombstone on the events topic)")
    try:
        key_names = parse_event_key(key or b"")
    except RecordDecodeError as exc:
        return BadRecord("bad_key", str(exc))
    try:
        record = decode_event_record(value, token_ids=False)  # the index never reads them
    except RecordDecodeError as exc:
        return BadRecord("undecodable", str(exc))
    if key_names != (record.worker, record.group_idx):
        return BadRecord(
            "key_mismatch", f"key {key!r} but the value is {record.worker}/{record.group_idx}"
        )
    return record


def decode_state(key: bytes | None, value: bytes) -> WorkerState | BadRecord:
    """The worker state, or why it is not one."""
    try:
        state = decode_worker_state(value)
    except RecordDecodeError as exc:
        return BadRecord("undecodable", str(exc))
    if key != state.key():
        return BadRecord("key_mismatch", f"key {key!r} but the value is {state.worker}")
    return state


class KeyBook:
    """The events partition each (worker, group)'s records were read from.

    The bridge keeps a followed worker's partitions when partitions are added, so the partition
    a key was read on, not the partitioner, says where its records are: which groups a lost or
    restarted partition touches, and which a group member no longer reads.
    """

    def __init__(self, entries: Iterable[tuple[str, int, int]] = ()) -> None:
        self._partitions: dict[str, dict[int, int]] = {}
        # The assignment the stale groups were worked out for, and those groups.
        self._stale: tuple[frozenset[int], dict[str, set[int]]] | None = None
        for worker, group, partition in entries:
            self.note(worker, group, partition)

    def note(self, worker: str, group: int, partition: int) -> None:
        groups = self._partitions.setdefault(worker, {})
        if groups.get(group) != partition:
            groups[group] = partition
            self._stale = None

    def partition_of(self, worker: str, group: int) -> int | None:
        return self._partitions.get(worker, {}).get(group)

    def drop(self, worker: str) -> None:
        if self._partitions.pop(worker, None) is not None:
            self._stale = None

    def entries(self) -> list[tuple[str, int, int]]:
        """(worker, group, partition) of every key read, as a snapshot keeps them."""
        return [
            (worker, group, partition)
            for worker, groups in self._partitions.items()
            for group, partition in groups.items()
        ]

    def stale_groups(self, assigned: Collection[int]) -> Mapping[str, set[int]]:
        """Each worker's groups read on a partition not in ``assigned``; worked out once per
        assignment and set of keys, not once per worker and request."""
        reading = frozenset(assigned)
        if self._stale is None or self._stale[0] != reading:
            stale: dict[str, set[int]] = {}
            for worker, groups in self._partitions.items():
                for group, partition in groups.items():
                    if partition not in reading:
                        stale.setdefault(worker, set()).add(group)
            self._stale = (reading, stale)
        return self._stale[1]


class Applier:
    """Records in, the index and the books kept, outcomes out; see the module docstring.

    ``worker_states`` and ``key_partitions``: the books saved with a snapshot of ``index``.
    """

    def __init__(
        self,
        index: KVIndex,
        *,
        worker_states: Iterable[WorkerState] = (),
        key_partitions: Iterable[tuple[str, int, int]] = (),
        max_worker_lag: int = DEFAULT_MAX_WORKER_LAG,
    ) -> None:
        self.keys = KeyBook(key_partitions)
        self._states = {state.worker: state for state in worker_states}
        # Per worker: the newest engine timestamp of a record applied by this process (not in
        # snapshots: how current this index is, not what the log holds).
        self._applied_ts: dict[str, float] = {}
        self._behind_noticed: set[tuple[str, int]] = set()
        self._max_worker_lag = max_worker_lag
        self._lagging: set[str] = set()
        self.index = index

    @property
    def index(self) -> KVIndex:
        return self._index

    @index.setter
    def index(self, index: KVIndex) -> None:
        """A new index (restored, or a test's): every worker's lag is read again."""
        self._index = index
        self._lagging.clear()
        for worker in index.progress():
            self._note_lag(worker)

    @property
    def lagging(self) -> set[str]:
        """The workers more than ``max_worker_lag`` seqs behind the bridge (a copy)."""
        return set(self._lagging)

    def worker_state(self, worker: str) -> WorkerState | None:
        """The bridge's latest view of the worker taken, from the workers topic."""
        return self._states.get(worker)

    def worker_states(self) -> list[WorkerState]:
        return list(self._states.values())

    def applied_ts(self, worker: str) -> float | None:
        """The engine's timestamp of the newest record applied for the worker since this
        process started (its groups' partitions may be read out of step, hence the newest)."""
        return self._applied_ts.get(worker)

    # ------------------------------------------------------------------------------ records

    def apply_event(self, key: bytes | None, value: bytes | None, partition: int) -> EventOutcome:
        """One record of the events topic, read on ``partition``."""
        record = decode_event(key, value)
        if isinstance(record, BadRecord):
            return record
        try:
            outcome = self.index.apply(record)
        except Exception as error:
            # It may be half applied: forget the group rather than report blocks it may not hold.
            self.index.drop_group(record.worker, record.group_idx)
            return self._noted(record.worker, _apply_error(error))
        if outcome is ApplyOutcome.APPLIED:  # a duplicate or older life changed nothing
            self.keys.note(record.worker, record.group_idx, partition)
            newest = self._applied_ts.get(record.worker, record.ts)
            self._applied_ts[record.worker] = max(newest, record.ts)
            self._note_lag(record.worker)
        return EventTaken(record, outcome)

    def apply_worker_state(
        self, key: bytes | None, value: bytes | None, *, replayed: bool
    ) -> StateOutcome:
        """One record of the workers topic; ``replayed``: it was in the log before the follower
        caught up."""
        if value is None:
            worker = key.decode("utf-8", "replace") if key else ""
            return self._noted(worker, self._forget(worker))
        state = decode_state(key, value)
        if isinstance(state, BadRecord):
            return state
        try:
            outcome = self._take(state, replayed)
        except Exception as error:
            outcome = _apply_error(error)
        return self._noted(state.worker, outcome)

    def _noted(self, worker: str, outcome: Outcome) -> Outcome:
        """The outcome, once the worker's lag after it is noted."""
        if worker:
            self._note_lag(worker)
        return outcome

    def _note_lag(self, worker: str) -> None:
        progress = self.index.progress_of(worker)
        lag = None if progress is None else lag_seqs(self._states.get(worker), *progress)
        if behind(lag, self._max_worker_lag):
            self._lagging.add(worker)
        else:
            self._lagging.discard(worker)

    def _take(self, state: WorkerState, replayed: bool) -> StateOutcome:
        if state.health == RETIRED:
            return self._retire(state)
        if self.index.is_retired(state.worker, state.epoch):
            return StateIgnored(state, "retired")  # a life retired since: nothing to serve
        previous = self._states.get(state.worker)
        epoch = self.index.start_epoch(state.worker, state.epoch)
        if epoch > state.epoch:
            return StateIgnored(state, "stale_epoch", self._first_behind(state, epoch, replayed))
        self._states[state.worker] = state
        self._keep_catalog_and_health(state)
        return StateTaken(state, previous is None or previous.health != state.health)

    def _first_behind(self, state: WorkerState, epoch: int, replayed: bool) -> int | None:
        noticed = (state.worker, state.epoch)
        if replayed or noticed in self._behind_noticed:
            return None
        self._behind_noticed.add(noticed)
        return epoch

    def _retire(self, state: WorkerState) -> StateOutcome:
        if self.index.is_retired(state.worker, state.epoch):
            return StateIgnored(state, "retired")  # read before (catching up, or written again)
        if not self.index.retire_worker(state.worker, state.epoch):
            return StateIgnored(state, "stale_epoch")  # the worker is in a later life already
        self._drop_books(state.worker)
        return WorkerRetired(state)

    def _forget(self, worker: str) -> StateOutcome:
        if not worker:
            return KeylessTombstone()
        self._drop_books(worker)
        self.index.forget_worker(worker)
        return WorkerForgotten(worker)

    def _drop_books(self, worker: str) -> None:
        self._states.pop(worker, None)
        self._applied_ts.pop(worker, None)
        self.keys.drop(worker)

    def _keep_catalog_and_health(self, state: WorkerState) -> None:
        """What the bridge says of a worker, in the index (a retired one is not in it)."""
        health = state.health
        if health == RETIRED:
            return
        if state.groups:
            self.index.set_catalog(state.worker, state.groups)
        self.index.set_health(state.worker, health)

    # ------------------------------------------------------------------------------ lost logs

    def groups_on(self, partition: int, place: Placement) -> dict[str, list[int]]:
        """The groups of each worker in the index whose records go to ``partition``: where they
        were read, else where ``place`` puts their key."""
        found: dict[str, list[int]] = {}
        for info in self.index.workers():
            for group in sorted({*info.groups, *info.last_seq, *info.resident}):
                read_on = self.keys.partition_of(info.name, group)
                if read_on is None:
                    read_on = place(event_key(info.name, group))
                if read_on == partition:
                    found.setdefault(info.name, []).append(group)
        return found

    def forget_lost_groups(self, partition: int, place: Placement) -> dict[str, list[int]]:
        """Records of ``partition`` were deleted before they were applied, and may have removed
        blocks: forget what each worker holds in the groups there (``groups_on``), which then
        under-report until new records arrive rather than report blocks that may be gone."""
        lost = self.groups_on(partition, place)
        for worker, groups in lost.items():
            for group in groups:
                self.index.drop_group(worker, group)
        return lost

    def forget_restarted_workers(self, partition: int, place: Placement) -> dict[str, list[int]]:
        """``partition``'s log is not the one applied (recreated, or truncated): forget every
        worker with a group there, blocks, seqs and epoch, so that the new log's records apply
        instead of being taken for replays. The index keeps seqs per worker, so its groups on
        other partitions go too; its catalog and health, from the workers topic, stay."""
        restarted = self.groups_on(partition, place)
        for worker in restarted:
            self.index.forget_worker(worker)
            self.keys.drop(worker)
            self._applied_ts.pop(worker, None)
            state = self._states.get(worker)
            if state is not None:
                self._keep_catalog_and_health(state)
            self._note_lag(worker)
        return restarted


def _apply_error(error: Exception) -> BadRecord:
    return BadRecord("apply_error", f"{type(error).__name__}: {error}", error)
