"""The bridge's view of each worker, as the compacted workers topic shows it.

Sources say what they know (health, groups, DP rank, endpoint); the sink says how far Kafka has
acknowledged each worker's log. A ``WorkerState`` is written when either changes, the resume point
at most once per ``interval`` (a restarted bridge replays a little more, which consumers skip),
health, epoch and groups at once: they change rarely and matter to whoever reads the topic. A
state Kafka refuses is written again: the worker's current one, or the refused one of a worker
no longer followed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from hmakv.kvlog.records import RETIRED, Health, WorkerState
from hmakv.producer.events import GroupSpec


@dataclass
class BoardEntry:
    """What the workers topic says, or is about to say, of one worker.

    ``epoch`` is the epoch the topic announces, not the worker's: the worker's is its tracker's
    (``WorkerRelay.epoch``), which opens an epoch before the sink announces it with the epoch's
    first record (``begin_epoch``). The board only ever catches up with it, so whoever needs the
    worker's own epoch (a retirement, a position kept over a reload) asks the relay.
    """

    health: Health = "live"
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    data_parallel_rank: int | None = None
    endpoint: str | None = None
    epoch: int = 0
    last_seq: int = -1
    last_ts: float = 0.0
    changed: bool = True  # something readers must see soon
    progressed: bool = False  # only the resume point moved
    written_at: float = float("-inf")


class WorkerBoard:
    def __init__(self, interval: float = 1.0) -> None:
        self._interval = interval
        self.views: dict[str, BoardEntry] = {}
        self._last: list[WorkerState] = []  # of workers no longer followed: written once, next
        # Per worker, the newest state handed out that Kafka has not settled yet: the one to
        # write again if refused, for a worker this board no longer follows.
        self._unsettled: dict[str, WorkerState] = {}

    def add(self, worker: str, view: BoardEntry) -> None:
        self.views[worker] = view

    def release(self, worker: str, now: float) -> None:
        """This bridge stops following the worker and another may take it over: what the topic
        does not say of it yet (its latest resume point) is written with the next states, so
        that the next bridge resumes exactly where this one stopped."""
        view = self.views.pop(worker, None)
        if view is not None and (view.changed or view.progressed):
            self._last.append(self._handed_out(worker, view, now))

    def retire(self, worker: str, epoch: int, now: float) -> WorkerState | None:
        """The worker left the fleet: its last state, ``retired`` at ``epoch`` (the worker's, as
        its relay says: records of it may still be queued), is the last written for it."""
        view = self.views.pop(worker, None)
        if view is None:
            return None
        view.epoch = epoch
        state = msgspec.structs.replace(self._state(worker, view, now), health=RETIRED)
        self._unsettled[worker] = state
        self._last.append(state)
        return state

    def set_health(self, worker: str, health: Health) -> None:
        view = self.views.get(worker)
        if view is not None and view.health != health:
            view.health = health
            view.changed = True

    def set_groups(self, worker: str, groups: dict[int, GroupSpec]) -> None:
        view = self.views.get(worker)
        if view is not None:
            view.groups = groups
            view.changed = True

    def begin_epoch(self, worker: str, epoch: int, *, new_life: bool) -> None:
        """The worker's next records open ``epoch``: the workers topic must say so first.

        A restart resumes the new epoch from seq 0 for a new engine life; otherwise (a refusal
        opened it) from where Kafka holds the worker's records, checked against that batch.
        """
        view = self.views.get(worker)
        if view is None or epoch <= view.epoch:
            return
        view.epoch = epoch
        if new_life:
            view.last_seq, view.last_ts = -1, 0.0
        view.changed = True

    def opens_epoch(self, worker: str | None, epoch: int) -> bool:
        """Whether a record of this epoch would be the worker's first of a newer epoch."""
        view = self.views.get(worker) if worker is not None else None
        return view is not None and epoch > view.epoch

    def acknowledged(
        self, worker: str, epoch: int, seq: int, ts: float, *, resumable: bool
    ) -> None:
        """Kafka holds the worker's records up to this position (a record of an older epoch,
        acknowledged late, moves nothing: the newer epoch is where a restart resumes). Only a
        ``resumable`` one (the engine's batch at that seq) moves the resume point."""
        view = self.views.get(worker)
        if view is None or epoch < view.epoch:
            return
        if epoch != view.epoch:
            view.epoch, view.last_seq, view.last_ts = epoch, -1, 0.0
            view.changed = True
        if resumable and seq > view.last_seq:
            view.last_seq, view.last_ts = seq, ts
            view.progressed = True

    def due(self, now: float, *, flush: bool = False) -> list[WorkerState]:
        """The states to write now (all pending ones when flushing), marked as written: the
        sink tells how each settled (``settled``)."""
        states, self._last = self._last, []
        for worker, view in self.views.items():
            due_by_time = view.progressed and now - view.written_at >= self._interval
            if view.changed or due_by_time or (flush and view.progressed):
                states.append(self._handed_out(worker, view, now))
        return states

    def settled(self, state: WorkerState, *, refused: bool) -> None:
        """Kafka took this state, or refused it for good (``due`` marked it written): a refused
        one is written again. A worker still followed has its current view written, newer than
        the refused state anyway; one no longer followed (released or retired) has its state
        put back in line if it is the newest handed out, never an older one, which would take
        the newest's place in the compacted topic."""
        worker = state.worker
        newest = self._unsettled.get(worker) is state
        if not refused:
            if newest:
                del self._unsettled[worker]
            return
        view = self.views.get(worker)
        if view is not None:
            view.changed = True
        elif newest:
            self._last.append(state)

    def _handed_out(self, worker: str, view: BoardEntry, now: float) -> WorkerState:
        state = self._state(worker, view, now)
        self._unsettled[worker] = state
        return state

    @staticmethod
    def _state(worker: str, view: BoardEntry, now: float) -> WorkerState:
        view.changed = view.progressed = False
        view.written_at = now
        return WorkerState(
            worker=worker,
            epoch=view.epoch,
            last_seq=view.last_seq,
            health=view.health,
            groups=dict(view.groups),
            ts=view.last_ts,
            data_parallel_rank=view.data_parallel_rank,
            endpoint=view.endpoint,
        )

    @property
    def dirty(self) -> bool:
        return bool(self._last) or any(view.changed for view in self.views.values())
