"""The Applier against a reference model, on any stream Kafka can deliver.

A bridge history is drawn per worker: lives whose epochs go up (a restart) or down (a bridge
that lost its resume point), each with its records per cache group in seq order and its worker
states, maybe ending retired, maybe a tombstone. Kafka delivers it as it may: each key's records
in order, with runs sent again (delivery is at least once), compacted states left out, the keys
and the two topics interleaved in any order; and records with wrong keys or values, and lost or
restarted partitions, come in between.

``Model`` is the rules written out plainly over dicts and sets: after every record the outcome,
the index (epochs, retired lives, health, catalogs, seqs, blocks, counters) and the books must be
the model's, and so must the workers it keeps as behind the bridge (any seq behind, here: the
applier keeps them as each record and state comes, the model works them out from scratch).
Apart from the model, when every life has a newer epoch than the one before and nothing was lost
or forgotten, the index must end holding exactly each worker's last life.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from dataclasses import dataclass, field

from follower_kit import FULL, SWA, stored
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.consumers.applier import (
    Applier,
    BadRecord,
    EventOutcome,
    EventTaken,
    KeylessTombstone,
    StateIgnored,
    StateOutcome,
    StateTaken,
    WorkerForgotten,
    WorkerRetired,
)
from hmakv.consumers.index import ApplyOutcome, KVIndex
from hmakv.kvlog.records import RETIRED, EventRecord, Health, Retired, WorkerState, encode
from hmakv.kvlog.records import event_key as key_of
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

WORKERS = ("u", "v")
GROUPS = (0, 1)
PARTITIONS = 3
EPOCHS = 4
MAX_LIVES = 3
HEALTHS: tuple[Health, ...] = ("live", "replaying", "degraded")
CATALOGS: tuple[dict[int, GroupSpec], ...] = ({}, {0: FULL}, {0: FULL, 1: FULL}, {0: SWA})
STORED_SPECS = {0: FULL, 1: SWA}  # what each group's stores say of it


def placed(key: bytes) -> int:
    """Where the bridge's producer would put a key no record was read of."""
    return zlib.crc32(key) % PARTITIONS


# ------------------------------------------------------------------------------ the deliveries


@dataclass(frozen=True)
class EventMessage:
    key: bytes | None
    value: bytes | None
    partition: int
    record: EventRecord | None  # what the value is, when it is one


@dataclass(frozen=True)
class StateMessage:
    key: bytes | None
    value: bytes | None
    state: WorkerState | None  # what the value is, when it is one
    replayed: bool


@dataclass(frozen=True)
class Lost:
    """Records of a partition deleted before they were read."""

    partition: int


@dataclass(frozen=True)
class Restarted:
    """A partition's log is not the one read (recreated, or truncated)."""

    partition: int


Delivery = EventMessage | StateMessage | Lost | Restarted


def events_of(worker: str, epoch: int, seq: int, group: int) -> list[KVEvent]:
    """A batch's events, a function of its place, so that a batch sent again is the same one:
    a clear opens a life (seq -1), and a seq either stores a block of its own or removes the
    block of the seq before it."""
    if seq < 0:
        return [AllBlocksCleared()]
    if seq % 3 == 2:
        return [BlockRemoved([block_of(worker, epoch, seq - 1, group)], "GPU", group_idx=group)]
    return [stored([block_of(worker, epoch, seq, group)], group=group, spec=STORED_SPECS[group])]


def block_of(worker: str, epoch: int, seq: int, group: int) -> int:
    """A block hash of its own for each (worker, epoch, seq, group)."""
    return ((WORKERS.index(worker) * EPOCHS + epoch) * 8 + seq) * len(GROUPS) + group + 1


def event_record(worker: str, epoch: int, seq: int, group: int) -> EventRecord:
    return EventRecord(worker, epoch, seq, float(seq), group, events_of(worker, epoch, seq, group))


@dataclass(frozen=True)
class Life:
    epoch: int
    seqs: dict[int, int]  # group -> records (seq -1 up to this - 1)
    healths: list[Health]
    catalog: dict[int, GroupSpec]
    retired: bool


lives = st.builds(
    Life,
    epoch=st.integers(0, EPOCHS - 1),
    seqs=st.fixed_dictionaries({g: st.integers(0, 4) for g in GROUPS}),
    healths=st.lists(st.sampled_from(HEALTHS), min_size=1, max_size=3),
    catalog=st.sampled_from(CATALOGS),
    retired=st.booleans(),
)


@dataclass
class History:
    """Per worker its lives, as the bridge wrote them."""

    lives: dict[str, list[Life]]
    tombstones: set[str]

    def rising(self) -> bool:
        return all(
            all(a.epoch < b.epoch for a, b in itertools.pairwise(each))
            for each in self.lives.values()
        )


histories = st.builds(
    History,
    lives=st.fixed_dictionaries(
        {w: st.lists(lives, min_size=1, max_size=MAX_LIVES) for w in WORKERS}
    ),
    tombstones=st.sets(st.sampled_from(WORKERS)),
)


@st.composite
def at_least_once(draw: st.DrawFn, stream: list[Delivery]) -> list[Delivery]:
    """The stream with runs sent again right after themselves, as a retried send does."""
    resent: list[Delivery] = []
    for item in stream:
        resent.append(item)
        if draw(st.integers(0, 5)) == 0:
            resent.extend(resent[-draw(st.integers(1, 3)) :])
    return resent


def key_streams(history: History, partitions: dict[tuple[bytes, int], int]) -> list[list[Delivery]]:
    """Each events key's records and each worker's states, in the order the bridge wrote them;
    ``partitions``: each key's partition in each life (a bridge that lost its resume point
    places keys anew, over the partitions there are by then)."""
    streams: list[list[Delivery]] = []
    for worker, each in history.lives.items():
        for group in GROUPS:
            key = key_of(worker, group)
            streams.append(
                [
                    EventMessage(key, encode(rec), partitions[key, n], rec)
                    for n, life in enumerate(each)
                    for rec in (
                        event_record(worker, life.epoch, seq, group)
                        for seq in range(-1, life.seqs[group])
                    )
                ]
            )
        states = [state for life in each for state in life_states(worker, life)]
        messages: list[Delivery] = [
            StateMessage(state.key(), encode(state), state, replayed=False) for state in states
        ]
        if worker in history.tombstones:
            messages.append(StateMessage(worker.encode(), None, None, replayed=False))
        streams.append(messages)
    return streams


def life_states(worker: str, life: Life) -> list[WorkerState]:
    healths: list[Health | Retired] = [*life.healths, *([RETIRED] if life.retired else [])]
    return [
        WorkerState(worker, life.epoch, n, health, life.catalog, float(n))
        for n, health in enumerate(healths)
    ]


@st.composite
def noise(draw: st.DrawFn) -> Delivery:
    """A record no bridge wrote, or a partition lost or restarted under the follower."""
    worker = draw(st.sampled_from(WORKERS))
    good = event_record(worker, 0, 0, 0)
    state = WorkerState(worker, 0, 0, "live", {}, 0.0)
    partition = draw(st.integers(0, PARTITIONS - 1))
    choices: list[Delivery] = [
        # keys of another worker, of another group, of no group
        EventMessage(b"x/0", encode(good), partition, None),
        EventMessage(key_of(worker, 1), encode(good), partition, None),
        EventMessage(b"nogroup", encode(good), partition, None),
        EventMessage(key_of(worker, 0), b"\xc1", partition, None),
        EventMessage(key_of(worker, 0), None, partition, None),
        StateMessage(b"x", encode(state), None, replayed=False),
        StateMessage(worker.encode(), b"\x93", None, replayed=False),
        StateMessage(None, None, None, replayed=False),
        Lost(partition),
        Restarted(partition),
    ]
    return draw(st.sampled_from(choices))


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[History, list[Delivery]]:
    history = draw(histories)
    keys = [key_of(w, g) for w in WORKERS for g in GROUPS]
    partitions = {
        (key, n): draw(st.integers(0, PARTITIONS - 1)) for key in keys for n in range(MAX_LIVES)
    }
    streams = [draw(at_least_once(stream)) for stream in key_streams(history, partitions)]
    streams = [[s for s in stream if draw(compacted(s, stream))] for stream in streams]
    streams.append(draw(st.lists(noise(), max_size=4)))
    merged: list[Delivery] = []
    while any(streams):
        left = [stream for stream in streams if stream]
        message = left[draw(st.integers(0, len(left) - 1))].pop(0)
        if isinstance(message, StateMessage) and draw(st.booleans()):
            message = dataclasses.replace(message, replayed=True)  # read while catching up
        merged.append(message)
    return history, merged


def compacted(message: Delivery, stream: list[Delivery]) -> st.SearchStrategy[bool]:
    """Compaction may leave out any state but the last of its worker."""
    if isinstance(message, StateMessage) and message is not stream[-1]:
        return st.booleans()
    return st.just(True)


# ------------------------------------------------------------------------------ the model


def apply_events(held: set[ExternalBlockHash], events: list[KVEvent]) -> None:
    """A group's blocks after its events (every block hash here is stored once at most)."""
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()


@dataclass
class ModelWorker:
    epoch: int
    health: Health = "live"
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    last_seq: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, set[ExternalBlockHash]] = field(default_factory=dict)

    def groups_known(self) -> set[int]:
        return {*self.groups, *self.last_seq, *(g for g, held in self.blocks.items() if held)}


@dataclass
class Model:
    """The rules, plainly: the index's lives and blocks, the worker states, the key book."""

    workers: dict[str, ModelWorker] = field(default_factory=dict)
    retired: dict[str, int] = field(default_factory=dict)  # worker -> its first unretired epoch
    states: dict[str, WorkerState] = field(default_factory=dict)
    book: dict[tuple[str, int], int] = field(default_factory=dict)
    noticed: set[tuple[str, int]] = field(default_factory=set)
    duplicates: int = 0
    stale: int = 0
    retired_ignored: int = 0
    workers_retired: int = 0

    def lagging(self) -> set[str]:
        """Workers behind the bridge's state of their life by any seq (``max_worker_lag`` 0)."""
        return {
            name
            for name, worker in self.workers.items()
            if (state := self.states.get(name)) is not None
            and state.epoch == worker.epoch
            and state.last_seq > max(worker.last_seq.values(), default=-1)
        }

    # --- the index's lives

    def is_retired(self, worker: str, epoch: int) -> bool:
        return epoch < self.retired.get(worker, 0)

    def worker(self, name: str) -> ModelWorker:
        if name not in self.workers:
            self.workers[name] = ModelWorker(epoch=self.retired.pop(name, 0))
        return self.workers[name]

    def start_epoch(self, worker: ModelWorker, epoch: int) -> None:
        if epoch > worker.epoch:
            worker.epoch, worker.last_seq, worker.blocks = epoch, {}, {}

    def forget(self, name: str) -> None:
        self.workers.pop(name, None)
        self.retired.pop(name, None)
        self.drop_books(name)

    def drop_books(self, name: str) -> None:
        self.states.pop(name, None)
        self.drop_keys(name)

    def drop_keys(self, name: str) -> None:
        self.book = {key: p for key, p in self.book.items() if key[0] != name}

    # --- records

    def event(self, message: EventMessage) -> ApplyOutcome | None:
        """None: a bad record."""
        record = message.record
        if record is None:
            return None
        name, group = record.worker, record.group_idx
        if name not in self.workers and self.is_retired(name, record.epoch):
            self.retired_ignored += 1
            return ApplyOutcome.STALE_EPOCH
        worker = self.worker(name)
        if record.epoch < worker.epoch:
            self.stale += 1
            return ApplyOutcome.STALE_EPOCH
        self.start_epoch(worker, record.epoch)
        if record.seq <= worker.last_seq.get(group, -2):
            self.duplicates += 1
            return ApplyOutcome.DUPLICATE
        worker.last_seq[group] = record.seq
        apply_events(worker.blocks.setdefault(group, set()), record.events)
        if any(isinstance(event, BlockStored) for event in record.events):
            worker.groups[group] = STORED_SPECS[group]  # a store teaches its group's spec
        self.book[(name, group)] = message.partition
        return ApplyOutcome.APPLIED

    def state(self, message: StateMessage) -> StateOutcome | None:
        """None: a bad record."""
        if message.value is None:
            name = message.key.decode() if message.key else ""
            if not name:
                return KeylessTombstone()
            self.forget(name)
            return WorkerForgotten(name)
        state = message.state
        if state is None:
            return None
        name, epoch = state.worker, state.epoch
        present = self.workers.get(name)
        if state.health == RETIRED:
            if self.is_retired(name, epoch):
                return StateIgnored(state, "retired")
            if present is not None and present.epoch > epoch:
                return StateIgnored(state, "stale_epoch")
            self.forget(name)
            self.retired[name] = epoch + 1
            self.workers_retired += 1
            return WorkerRetired(state)
        if self.is_retired(name, epoch):
            return StateIgnored(state, "retired")
        worker = self.worker(name)
        if worker.epoch > epoch:
            first = not message.replayed and (name, epoch) not in self.noticed
            if first:
                self.noticed.add((name, epoch))
            return StateIgnored(state, "stale_epoch", worker.epoch if first else None)
        self.start_epoch(worker, epoch)
        previous = self.states.get(name)
        self.states[name] = state
        self.keep_catalog_and_health(state)
        return StateTaken(state, previous is None or previous.health != state.health)

    def keep_catalog_and_health(self, state: WorkerState) -> None:
        worker = self.worker(state.worker)
        if state.groups:
            worker.groups = dict(state.groups)
        assert state.health != RETIRED
        worker.health = state.health

    # --- lost logs

    def groups_on(self, partition: int) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for name in sorted(self.workers):
            for group in sorted(self.workers[name].groups_known()):
                key = (name, group)
                if self.book.get(key, placed(key_of(name, group))) == partition:
                    found.setdefault(name, []).append(group)
        return found

    def lost(self, partition: int) -> dict[str, list[int]]:
        lost = self.groups_on(partition)
        for name, groups in lost.items():
            for group in groups:
                self.workers[name].blocks.pop(group, None)
        return lost

    def restarted(self, partition: int) -> dict[str, list[int]]:
        restarted = self.groups_on(partition)
        for name in restarted:
            self.workers.pop(name)
            self.retired.pop(name, None)
            self.drop_keys(name)
            state = self.states.get(name)
            if state is not None:
                self.keep_catalog_and_health(state)
        return restarted


# ------------------------------------------------------------------------------ the checks


def deliver(applier: Applier, model: Model, delivery: Delivery) -> None:
    if isinstance(delivery, EventMessage):
        check_event(
            applier.apply_event(delivery.key, delivery.value, delivery.partition),
            model.event(delivery),
        )
    elif isinstance(delivery, StateMessage):
        got = applier.apply_worker_state(delivery.key, delivery.value, replayed=delivery.replayed)
        expected = model.state(delivery)
        if expected is None:
            assert isinstance(got, BadRecord), got
        else:
            assert got == expected
    elif isinstance(delivery, Lost):
        assert applier.forget_lost_groups(delivery.partition, placed) == model.lost(
            delivery.partition
        )
    else:
        assert applier.forget_restarted_workers(delivery.partition, placed) == model.restarted(
            delivery.partition
        )


def check_event(got: EventOutcome, expected: ApplyOutcome | None) -> None:
    if expected is None:
        assert isinstance(got, BadRecord), got
    else:
        assert isinstance(got, EventTaken), got
        assert got.outcome is expected


def check_index(applier: Applier, model: Model) -> None:
    index = applier.index
    found = {
        info.name: (
            info.epoch,
            info.health,
            info.groups,
            info.last_seq,
            {g: media["GPU"] for g, media in info.resident.items()},
        )
        for info in index.workers()
    }
    assert found == {
        name: (
            w.epoch,
            w.health,
            w.groups,
            w.last_seq,
            {g: len(held) for g, held in w.blocks.items() if held},
        )
        for name, w in model.workers.items()
    }
    for name in WORKERS:
        assert [index.is_retired(name, e) for e in range(EPOCHS)] == [
            model.is_retired(name, e) for e in range(EPOCHS)
        ]
        assert applier.worker_state(name) == model.states.get(name)
    counters = index.counters
    assert (
        counters.duplicates_ignored,
        counters.stale_epoch_ignored,
        counters.retired_ignored,
        counters.workers_retired,
    ) == (model.duplicates, model.stale, model.retired_ignored, model.workers_retired)
    assert {(w, g): p for w, g, p in applier.keys.entries()} == model.book
    assert applier.lagging == model.lagging()


def check_last_lives(applier: Applier, history: History) -> None:
    """With rising epochs and nothing lost or forgotten, each worker is its last life."""
    for name, each in history.lives.items():
        last = each[-1]
        info = next((i for i in applier.index.workers() if i.name == name), None)
        if last.retired:
            assert info is None
            assert applier.index.is_retired(name, last.epoch)
            continue
        assert info is not None
        assert info.epoch == last.epoch
        assert info.last_seq == {g: n - 1 for g, n in last.seqs.items()}
        blocks = {g: len(blocks_of(name, last.epoch, g, n)) for g, n in last.seqs.items()}
        assert info.resident == {g: {"GPU": n} for g, n in blocks.items() if n}
        assert info.health == last.healths[-1]
        assert set(last.catalog) <= set(info.groups)


def blocks_of(worker: str, epoch: int, group: int, records: int) -> set[ExternalBlockHash]:
    held: set[ExternalBlockHash] = set()
    for seq in range(-1, records):
        apply_events(held, events_of(worker, epoch, seq, group))
    return held


@settings(max_examples=400, deadline=None)
@given(deliveries())
def test_every_delivery_does_what_the_model_says(drawn: tuple[History, list[Delivery]]) -> None:
    history, stream = drawn
    applier = Applier(KVIndex(hash_block_size=16), max_worker_lag=0)
    model = Model()
    for delivery in stream:
        deliver(applier, model, delivery)
        check_index(applier, model)
    calm = not history.tombstones and not any(isinstance(d, Lost | Restarted) for d in stream)
    if calm and history.rising():
        check_last_lives(applier, history)
