"""The HMA-aware KV-cache index: which worker holds which block, per cache group and medium.

Pure data structure, no I/O: the follower applies Kafka records (``kvlog.records.EventRecord``,
one per worker, epoch, seq and group) to it; the score API and the exporter read it. This module
keeps the structure (workers, lanes, packed ints, apply); ``scoring`` assembles a prompt's
answers from it and ``index_snapshot`` is the snapshot format, so that each can be read alone.

Why it is shaped this way:

- One table per medium (``block_table``) maps a block hash to one int that packs every group's
  worker bitset: each cache group gets a *lane* of ``width`` bits, and worker slot ``s`` holds the
  hash in the group of lane ``p`` when bit ``p * width + s`` is set. Lane 0 is every group at once
  (the worker holds the hash in some group), which is the group-blind answer's lane and the worker
  set's bit. A hash is stored once however many groups hold it (a window group's blocks are mostly
  the full-attention group's), so memory grows with distinct hashes, not with workers times groups
  times blocks; one lookup per block answers for every group, and ANDing a prompt's packed ints runs
  every group's prefix scan at once.
- Equal ints are shared objects where it is cheap: an int held by one worker alone is that
  worker's (``_Worker.patterns``), so a hash nobody shares costs its table entry and nothing more,
  and a store or removal over a run of blocks with equal holders makes one int for the run.
  Scoring reads a prompt as runs of equal values (``hit_rule.Column``).
- ``width`` starts at 8 slots and doubles when a worker's slot does not fit: every packed int is
  re-spread lane by lane then (rare: the fleet outgrows a power of two).
- vLLM can hold two copies of one hash in one group (vLLM #48933, #55092); the rare counts above
  one live in a side table per (medium, group, slot), so a removal clears the bit only with the
  last copy.
- The bridge delivers at least once: the last applied seq per (worker, epoch, group) makes a
  replayed record a no-op, an older epoch is ignored and a newer one clears the worker first.
- A routing decision is known before its events arrive: ``speculate`` marks a prompt's blocks
  as held by the worker it was sent to, in a medium table of the index's own
  (``SPECULATIVE_MEDIUM``, same lanes and packed ints), until a real event of the block in that
  group confirms or removes it, or its expiry passes (``expire_speculation``: the index keeps no
  clock). Clears, epochs, dropped groups and departures drop it with the rest, so it never hides
  a removal; snapshots leave it out, and only ``speculative_hit_tokens`` reads it.
- A worker running vLLM's lookahead hashing (EAGLE drafters, vLLM 0.33.0) hashes each block
  together with the tokens after it; its stores say how many (``lookahead_token_ids``), and a
  score call is given the prompt's hashes for each such setting in the fleet (see ``score``).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cache, partial, reduce
from operator import or_

import msgspec

from hmakv.consumers import index_snapshot
from hmakv.consumers.block_table import Table, new_table
from hmakv.consumers.hit_rule import GroupRule, alignment, rule_for
from hmakv.consumers.record_runs import KnownSpec, as_keys, record_runs
from hmakv.consumers.scoring import (
    SPECULATIVE_MEDIUM,
    CatalogClass,
    Fleet,
    Roster,
    Scorer,
    Top,
)
from hmakv.kvlog.answers import WorkerHit, speculative_hit
from hmakv.kvlog.records import HEALTH_STATES, EventRecord, Health
from hmakv.producer.events import (
    FULL_ATTENTION_KINDS,
    MEDIUM_GPU,
    SLIDING_WINDOW_KINDS,
    AllBlocksCleared,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
    has_group_sizes,
)
from hmakv.producer.hashing import external

DEFAULT_HASH_BLOCK_SIZE = 16
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
INITIAL_LANE_WIDTH = 8  # worker slots per group lane, doubled whenever the fleet outgrows it
# What one worker may make the index keep: every block is a table entry (18-100 bytes), and an
# engine (or whoever poses as one) may say it holds any number. 4M blocks is a 64M-token cache
# at 16 tokens a block, beyond any one engine's; past it stores are refused and counted.
DEFAULT_MAX_BLOCKS_PER_WORKER = 4 * 1024 * 1024
MAX_MEDIA = 16  # vLLM's tiers are GPU, CPU and a few storage media: each one is a table

LaneKey = tuple[int, str]  # (group, medium)
# A group's last seq before any record: below the -1 of the clear that opens an epoch.
_NONE_APPLIED = -2
_WHOLE_SEQ = 2**62  # next_event of a seq applied whole


class ApplyOutcome(enum.Enum):
    """What ``apply`` did with a record, for the follower's own accounting."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"


class UnknownWorker(ValueError):
    """Speculation names a worker the index does not know: a router never creates workers."""


class IndexCounters(msgspec.Struct, gc=False):
    """Monotonic counters for the exporter: every odd or ignored input is counted, none dropped.

    ``stored`` and ``removed`` count block copies; ``cleared`` group clears; ``restarts`` new
    epochs; ``anomalies`` removals of a hash the worker did not hold; ``partial_evictions``
    sliding-window removals whose full-attention copy stays resident; ``duplicate_copies`` stores
    of a hash the worker already held; ``duplicates_ignored`` and ``stale_epoch_ignored`` records
    applied already or from an older epoch; ``sizeless_stores`` stores whose block size or window
    no group can have (vLLM's CPU-offloading stores carry block size 0), whose blocks are kept but
    teach no group spec; ``workers_retired`` workers dropped as retired, and ``retired_ignored``
    records of a retired worker's life read after it was retired; ``blocks_refused`` stored
    blocks not kept, past a worker's ``max_blocks_per_worker`` or on a medium past
    ``MAX_MEDIA`` (the index then knows less than the engine holds, never more);
    ``reserved_medium_blocks`` blocks of stores and removals an engine sent on the speculative
    medium's name, refused. Speculative blocks (``speculate``): ``speculated`` added,
    ``speculation_confirmed`` dropped by a real store, ``speculation_removed`` by a real removal,
    clear, new epoch, dropped group or departure, ``speculation_expired`` by their expiry, and
    ``speculation_refused`` not added, past ``max_blocks_per_worker``.
    """

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    restarts: int = 0
    anomalies: int = 0
    partial_evictions: int = 0
    duplicate_copies: int = 0
    duplicates_ignored: int = 0
    stale_epoch_ignored: int = 0
    sizeless_stores: int = 0
    workers_retired: int = 0
    retired_ignored: int = 0
    blocks_refused: int = 0
    reserved_medium_blocks: int = 0
    speculated: int = 0
    speculation_confirmed: int = 0
    speculation_removed: int = 0
    speculation_expired: int = 0
    speculation_refused: int = 0


class WorkerInfo(msgspec.Struct, frozen=True, gc=False):
    """What the index knows about one worker; ``resident`` is distinct hashes per group, medium;
    ``hash_lookahead`` the tokens past each block its hashes cover (0: vLLM's classic hashes)."""

    name: str
    epoch: int
    health: Health
    groups: dict[int, GroupSpec]
    last_seq: dict[int, int]
    resident: dict[int, dict[str, int]]
    hash_lookahead: int = 0
    speculative_blocks: int = 0


class _Worker:
    """One worker's state. ``bit`` is its bit in a worker set, and in lane 0 (any group).

    ``mine`` is its bit in every group's lane and ``others`` every bit not its own, so
    ``held & others == 0`` says a packed int is held by this worker alone; ``patterns`` interns
    such ints.
    """

    __slots__ = (
        "bit",
        "epoch",
        "groups",
        "health",
        "last_seq",
        "lookahead",
        "mine",
        "name",
        "next_event",
        "others",
        "patterns",
        "resident",
        "slot",
        "speculative",
    )

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.mine = 0
        self.others = -1
        self.patterns: dict[int, int] = {}
        self.epoch = 0
        self.health: Health = "live"
        self.groups: dict[int, GroupSpec] = {}
        self.last_seq: dict[int, int] = {}
        self.next_event: dict[int, int] = {}  # per group: events of its last_seq applied
        self.resident: dict[LaneKey, int] = {}
        self.lookahead = 0  # vLLM's num_hash_lookahead_tokens, as its stores show it
        # (group, hash) -> when its speculative holding expires; not in ``resident``
        self.speculative: dict[tuple[int, ExternalBlockHash], float] = {}


# (expires at, serial, worker, (group, hash) keys): one ``speculate`` call's holdings.
_Expiry = tuple[float, int, _Worker, list[tuple[int, ExternalBlockHash]]]


class _Medium:
    __slots__ = ("copies", "owners")

    def __init__(self) -> None:
        # hash -> packed worker bitsets of every group lane; a hash nobody holds has no entry.
        self.owners: Table = new_table()
        # (group, slot) -> hash -> copies beyond the first; only hashes with two or more appear.
        self.copies: dict[tuple[int, int], dict[ExternalBlockHash, int]] = {}


class KVIndex:
    """Residency of every worker's KV-cache blocks per group and medium, scored by vLLM's rule.

    ``hash_block_size`` is the block size the prompts' hashes are computed at. A group whose blocks
    span ``k`` hash blocks is looked up with the hash of its last sub-block: that is exactly vLLM's
    external int for such a block (the last 8 bytes of the concatenated digests) and current vLLM's
    hash for it. Hashes are kept in the int form (``_as_keys``), so engines that send whole digests
    and those that send ints are found by the same prompt hashes.

    Tier weighting: ``tier_weights`` orders media fastest first. ``tier_hit_tokens[m]`` is the
    hit when blocks on ``m`` and every faster medium count as cached; these only grow down the
    ladder, and ``weighted_tokens`` is the sum over the ladder of each medium's weight times the
    tokens its step adds: the tokens reusable from GPU count fully, those that need at least one
    CPU block loaded count 0.8, and so on. Media without a weight are stored but never scored.
    """

    def __init__(
        self,
        *,
        hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
        tier_weights: Mapping[str, float] | None = None,
        max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        if max_blocks_per_worker <= 0:
            raise ValueError(f"max_blocks_per_worker must be positive: {max_blocks_per_worker}")
        self.hash_block_size = hash_block_size
        self.max_blocks_per_worker = max_blocks_per_worker
        weights = DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights
        if SPECULATIVE_MEDIUM in weights:
            raise ValueError(f"{SPECULATIVE_MEDIUM} is the index's own medium: it has no tier")
        self._scorer = Scorer(hash_block_size, weights)
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._everyone = 0
        self._media: dict[str, _Medium] = {}
        self._lanes: dict[int, int] = {}  # group -> lane (from 1), in order of first store
        self._lookahead_bits: dict[int, int] = {}  # lookahead > 0 -> its workers' bits
        self._width = INITIAL_LANE_WIDTH
        self._classes: list[CatalogClass] | None = None
        self._named: Roster | None = None
        self._counters = IndexCounters()
        # Workers retired and not back: the first epoch that may return (older records of a
        # retired life are still in Kafka, and must not bring the worker back).
        self._retired: dict[str, int] = {}
        self._speculating = 0  # the bits of workers holding speculative blocks
        # (expires at, serial, worker, its (group, hash) keys): what ``speculate`` added, by
        # expiry; a key renewed or dropped since is skipped when its entry comes up.
        self._expiries: list[_Expiry] = []
        self._serial = 0

    # ----------------------------------------------------------------------------- applying

    def apply(self, record: EventRecord) -> ApplyOutcome:
        """Apply one (worker, epoch, seq, group) record's events; what was applied before (a
        replay) and older epochs change nothing, nor do records of a retired worker's life."""
        worker = self._workers.get(record.worker)
        if worker is None:
            if self.is_retired(record.worker, record.epoch):
                self._counters.retired_ignored += 1
                return ApplyOutcome.STALE_EPOCH
            worker = self._worker(record.worker)
        if record.epoch < worker.epoch:
            self._counters.stale_epoch_ignored += 1
            return ApplyOutcome.STALE_EPOCH
        if record.epoch > worker.epoch:
            self._start_epoch(worker, record.epoch)
        group = record.group_idx
        events = _unapplied(worker, record)
        if events is None:
            self._counters.duplicates_ignored += 1
            return ApplyOutcome.DUPLICATE
        worker.last_seq[group] = record.seq
        worker.next_event[group] = record.first_event + len(record.events)
        self._apply_events(worker, group, events)
        return ApplyOutcome.APPLIED

    def _apply_events(self, worker: _Worker, group: int, events: Sequence[KVEvent]) -> None:
        """A record's events in order, each run of stores (or of removals) on one medium as one
        change of the table (``record_runs``). A run applies as its events one by one would: a
        store reads nothing a later store of the run learns, and the table sees the blocks in
        their order, so a hash stored twice in the run is a second copy. A record with a clear,
        or with a store that teaches the index something, is applied event by event."""
        runs = record_runs(events, _known_spec(worker, group), worker.lookahead)
        if runs is None:
            for event in events:
                self._apply_event(worker, group, event)
            return
        for stores, medium, hashes in runs:
            self._apply_blocks(worker, group, stores, medium, hashes)

    def _apply_event(self, worker: _Worker, group: int, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._drop(worker, (group,))
            self._counters.cleared += 1
            return
        if isinstance(event, BlockStored):
            self._learn_group(worker, group, event)
            lookahead = event.lookahead_token_ids
            if (len(lookahead[0]) if lookahead else 0) != worker.lookahead:
                self._learn_lookahead(worker, event)
        stores, medium = isinstance(event, BlockStored), event.medium or MEDIUM_GPU
        self._apply_blocks(worker, group, stores, medium, list(_as_keys(event.block_hashes)))

    def _apply_blocks(
        self,
        worker: _Worker,
        group: int,
        stored: bool,
        medium: str,
        hashes: list[ExternalBlockHash],
    ) -> None:
        """A real store or removal (a run of them); either settles the blocks' speculative
        holdings in the group (a removal must never stay hidden behind one)."""
        if medium == SPECULATIVE_MEDIUM:
            self._counters.reserved_medium_blocks += len(hashes)
            return
        if stored:
            self._store(worker, group, medium, hashes)
        else:
            self._remove(worker, group, medium, hashes)
        if worker.speculative:
            settled = self._unspeculate(worker, group, hashes)
            if stored:
                self._counters.speculation_confirmed += settled
            else:
                self._counters.speculation_removed += settled

    def set_catalog(self, worker: str, groups: Mapping[int, GroupSpec]) -> None:
        """Set a worker's groups explicitly, e.g. from ``hmakv.workers`` or configuration.

        Needed for what stores do not carry (a chunked-local group's chunk size) and for groups
        that have not stored anything yet; later stores update kind, window and block size.
        A size that is not positive raises ``ValueError`` and changes nothing: scoring divides by
        block sizes, and a negative one would make hits up.
        """
        for group, spec in groups.items():
            _check_sizes(group, spec)
        self._worker(worker).groups = dict(groups)
        self._classes = None

    def start_epoch(self, worker: str, epoch: int) -> int:
        """Move a worker to ``epoch`` if it is newer, dropping its state as a record of a newer
        epoch does; the worker's epoch afterwards (higher than asked when the index is past it).

        The bridge names a worker's new epoch on ``hmakv.workers`` before it writes any record
        of it: the previous life is over, whether or not this index has read those records.
        """
        if worker not in self._workers and self.is_retired(worker, epoch):
            return self._retired[worker]  # that life was retired: nothing to bring back
        state = self._worker(worker)
        if epoch > state.epoch:
            self._start_epoch(state, epoch)
        return state.epoch

    def drop_group(self, worker: str, group: int) -> None:
        """Forget what a worker holds in one group, on every medium, keeping its seqs.

        For when the log can no longer say what the group holds (its records were lost): the
        index then under-reports the group until new stores arrive, and never reports a block
        whose removal it missed.
        """
        state = self._workers.get(worker)
        if state is not None:
            self._drop(state, (group,))

    def set_health(self, worker: str, health: Health) -> None:
        """Record what the caller knows and the log does not: a worker replaying or degraded.

        Scores carry it, so a router can discount a worker whose state may be stale.
        """
        if health not in HEALTH_STATES:
            raise ValueError(f"health must be one of {HEALTH_STATES}, got {health!r}")
        self._worker(worker).health = health
        self._named = None

    def retire_worker(self, worker: str, epoch: int) -> bool:
        """Drop a worker that left the fleet at ``epoch``; its records of that epoch or an older
        one change nothing from now on, and a newer epoch brings it back, empty.

        False, changing nothing, when that is known already (the retirement read again) or the
        worker is in a later life (it came back, and its new records were read first).
        """
        current = self._workers.get(worker)
        if self.is_retired(worker, epoch) or (current is not None and current.epoch > epoch):
            return False
        self.forget_worker(worker)
        self._retired[worker] = epoch + 1
        self._counters.workers_retired += 1
        return True

    def is_retired(self, worker: str, epoch: int) -> bool:
        """Whether that life of the worker was retired (and the worker has not come back)."""
        return epoch < self._retired.get(worker, 0)

    def forget_worker(self, worker: str) -> None:
        """Drop a worker entirely, retired or not (a tombstone on the workers topic), and free
        its slot for the next one."""
        self._retired.pop(worker, None)
        state = self._workers.pop(worker, None)
        if state is None:
            return
        self._drop(state, self._lanes)
        self._set_lookahead(state, 0)
        del self._by_slot[state.slot]
        heapq.heappush(self._free_slots, state.slot)
        self._everyone &= ~state.bit
        self._classes = self._named = None

    def _worker(self, name: str) -> _Worker:
        worker = self._workers.get(name)
        if worker is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            if slot >= self._width:
                self._widen(slot + 1)
            worker = self._workers[name] = self._by_slot[slot] = _Worker(name, slot)
            worker.epoch = self._retired.pop(name, 0)  # back from retirement: a later life
            self._spread(worker)
            self._everyone |= worker.bit
            self._classes = self._named = None
        return worker

    def _spread(self, worker: _Worker) -> None:
        """Set the worker's bits in every lane, after a lane is added or the lanes widen."""
        width = self._width
        worker.mine = reduce(or_, (worker.bit << lane * width for lane in self._lanes.values()), 0)
        worker.others = ~(worker.mine | worker.bit)

    def _lane_bit(self, worker: _Worker, group: int) -> int:
        """The worker's bit in the group's lane (added on first use), as its shared object."""
        lane = self._lanes.get(group)
        if lane is None:
            lane = self._lanes[group] = len(self._lanes) + 1
            for each in self._workers.values():
                self._spread(each)
            self._classes = None
        bit = worker.bit << lane * self._width
        return worker.patterns.setdefault(bit, bit)

    def _widen(self, slots: int) -> None:
        """Double the lanes' width until ``slots`` workers fit, re-spreading every packed int.

        Equal ints become one object (the memo), which keeps single-worker ints interned.
        """
        old, width = self._width, _fitting_width(self._width, slots)
        moves = [(lane * old, lane * width) for lane in (0, *self._lanes.values())]
        spread = cache(partial(_moved, moves=moves, mask=(1 << old) - 1))
        for medium in self._media.values():
            medium.owners.map_values(spread)
        self._width = width
        for worker in self._workers.values():
            worker.patterns = {spread(held): spread(held) for held in worker.patterns}
            self._spread(worker)
        self._classes = None

    def _intern(self, held: int) -> int:
        """The shared object for a packed int held by one worker alone; others as they are."""
        lowest = held & -held  # in lane 0, which every holder has a bit in
        owner = self._by_slot.get(lowest.bit_length() - 1)
        if owner is None or held & owner.others:
            return held
        return owner.patterns.setdefault(held, held)

    def _medium(self, name: str) -> _Medium:
        medium = self._media.get(name)
        if medium is None:
            medium = self._media[name] = _Medium()
        return medium

    def _stored_medium(self, name: str) -> _Medium | None:
        """The medium a store names, made if new and there is room: a medium is any string an
        engine sends, and each is a table of its own."""
        medium = self._media.get(name)
        if medium is None and len(self._media) - (SPECULATIVE_MEDIUM in self._media) < MAX_MEDIA:
            medium = self._media[name] = _Medium()
        return medium

    def _learn_group(self, worker: _Worker, group: int, event: BlockStored) -> None:
        """Learn a group's spec from a store; an explicit chunk size is kept, it never travels."""
        if not has_group_sizes(event):
            self._counters.sizeless_stores += 1
            return
        window = event.kv_cache_spec_sliding_window
        known = worker.groups.get(group)
        kind = event.kv_cache_spec_kind
        if known is not None and (
            kind is None
            or (known.kind, known.block_size, known.sliding_window)
            == (kind, event.block_size, window)
        ):
            return
        worker.groups[group] = GroupSpec(
            kind=kind or "unknown",
            block_size=event.block_size,
            sliding_window=window,
            chunk_size=known.chunk_size if known is not None else None,
        )
        self._classes = None

    def _learn_lookahead(self, worker: _Worker, store: BlockStored) -> None:
        """Learn how the worker hashes from a store of blocks: one lookahead list per hash.

        Only the GPU block pool's stores say: vLLM's offloading tiers never send the lists, and
        a store without hashes (a window group's step that kept none) has none to send.
        """
        if store.block_hashes and (store.medium or MEDIUM_GPU) == MEDIUM_GPU:
            lookahead = store.lookahead_token_ids
            self._set_lookahead(worker, len(lookahead[0]) if lookahead else 0)

    def _set_lookahead(self, worker: _Worker, lookahead: int) -> None:
        """Move the worker's bit from its old lookahead's workers to the new one's; only
        lookaheads above 0 keep a set, so a fleet without any makes scoring look once."""
        for tokens, bit in ((worker.lookahead, 0), (lookahead, worker.bit)):
            if tokens:
                bits = self._lookahead_bits.get(tokens, 0) & ~worker.bit | bit
                if bits:
                    self._lookahead_bits[tokens] = bits
                else:
                    del self._lookahead_bits[tokens]
        worker.lookahead = lookahead

    def _store(
        self, worker: _Worker, group: int, medium: str, hashes: Sequence[ExternalBlockHash]
    ) -> None:
        state = self._stored_medium(medium)
        if state is None:
            self._counters.blocks_refused += len(hashes)
            return
        bit = self._lane_bit(worker, group)
        stamp = bit | worker.bit  # the group's lane and lane 0
        room = self.max_blocks_per_worker - sum(worker.resident.values())
        patterns, others = worker.patterns, worker.others

        def derive(held: int) -> int | None:
            if held & bit:
                return None  # held in the group already: another copy
            stored = held | stamp
            return patterns.setdefault(stored, stored) if not stored & others else stored

        added, refused, copies = state.owners.store(hashes, room, derive)
        if copies:
            extra = state.copies.setdefault((group, worker.slot), {})
            for block_hash in copies:
                extra[block_hash] = extra.get(block_hash, 0) + 1
        self._counters.stored += len(hashes) - refused
        self._counters.blocks_refused += refused
        self._counters.duplicate_copies += len(copies)
        key = (group, medium)
        worker.resident[key] = worker.resident.get(key, 0) + added

    def _remove(
        self, worker: _Worker, group: int, medium: str, hashes: Sequence[ExternalBlockHash]
    ) -> None:
        state = self._media.get(medium)
        if state is None or group not in self._lanes:
            self._counters.anomalies += len(hashes)
            return
        bit = self._lane_bit(worker, group)
        dropped, missing, partial = _remove_copies(
            worker, group, state, hashes, bit, self._full_copy_bits(worker, group)
        )
        self._counters.removed += len(hashes) - missing
        self._counters.anomalies += missing
        self._counters.partial_evictions += partial
        if dropped:
            worker.resident[(group, medium)] -= dropped

    def _full_copy_bits(self, worker: _Worker, group: int) -> int:
        """For a sliding-window group: the worker's bits in its full-attention lanes, else 0.

        A window block removed while one of these is set leaves a full-attention copy behind.
        """
        spec = worker.groups.get(group)
        if spec is None or spec.kind not in SLIDING_WINDOW_KINDS:
            return 0
        return reduce(
            or_,
            (
                worker.bit << lane * self._width
                for other, other_spec in worker.groups.items()
                if other_spec.kind in FULL_ATTENTION_KINDS
                and (lane := self._lanes.get(other)) is not None
            ),
            0,
        )

    def _start_epoch(self, worker: _Worker, epoch: int) -> None:
        """The engine restarted: nothing of its previous life is cached any more."""
        self._drop(worker, self._lanes)
        worker.epoch = epoch
        worker.last_seq.clear()
        worker.next_event.clear()
        self._counters.restarts += 1

    def _drop(self, worker: _Worker, groups: Iterable[int]) -> None:
        """Remove every copy a worker holds in these groups, on every medium.

        It scans each medium's dict (clears, restarts and departures are rare) once, however
        many groups go.
        """
        groups = set(groups)
        lanes = [self._lanes[group] for group in groups if group in self._lanes]
        bits = reduce(or_, (worker.bit << lane * self._width for lane in lanes), 0)
        left: dict[int, int] = {}  # held -> what is left of it, one int per distinct value
        for medium in self._media.values() if bits else ():
            owners = medium.owners
            for block_hash in [h for h, held in owners.items() if held & bits]:
                held = owners[block_hash]
                rest = left.get(held)
                if rest is None:
                    rest = left[held] = self._intern(_without(held, bits, worker))
                if rest:
                    owners[block_hash] = rest
                else:
                    del owners[block_hash]
            for group in groups:
                medium.copies.pop((group, worker.slot), None)
        for key in [key for key in worker.resident if key[0] in groups]:
            del worker.resident[key]
        if worker.speculative:
            self._drop_speculation(worker, groups)

    def _drop_speculation(self, worker: _Worker, groups: set[int]) -> None:
        """Forget the groups' speculative keys, whose blocks ``_drop`` took from the table."""
        speculative = worker.speculative
        gone = [key for key in speculative if key[0] in groups]
        for key in gone:
            del speculative[key]
        self._counters.speculation_removed += len(gone)
        if not speculative:
            self._speculating &= ~worker.bit

    # ----------------------------------------------------------------------------- speculation

    def speculate(
        self,
        worker: str,
        block_hashes: Sequence[ExternalBlockHash],
        num_tokens: int,
        *,
        expires_at: float,
        prefill_chunk_tokens: int | None = None,
    ) -> int:
        """Count a prompt just routed to ``worker`` as held there until ``expires_at`` (on the
        caller's clock, see ``expire_speculation``), or until its events settle each block; the
        blocks newly held speculatively (renewed ones are not counted again).

        Each group of the worker's catalog gets the blocks its engine caches once it computed the
        prompt (``_cached_by_prefill``), at the group's own block size; blocks it really holds on
        the GPU are left alone. ``prefill_chunk_tokens`` (the engine's ``max_num_batched_tokens``)
        adds the mamba states a lone prefill of the prompt caches where its chunks stop, from the
        worker's hit for it (``_prefill_stops``); without it, only the last aligned state.
        Past ``max_blocks_per_worker`` (real and speculative blocks together) blocks are refused
        and counted; real stores never are for speculation's sake.
        Raises ``UnknownWorker``: a router must not make the index invent workers.
        """
        state = self._workers.get(worker)
        if state is None:
            raise UnknownWorker(worker)
        rules = self._rules(sorted(state.groups.items()))
        if not rules:
            return 0
        keys = _as_keys(block_hashes)[: num_tokens // self.hash_block_size]
        align = alignment(rules)
        stops = [num_tokens // align * align]
        if prefill_chunk_tokens is not None and any(rule.rule == "state" for rule in rules):
            start = self._hit_before_routing(worker, keys, num_tokens)
            stops = _prefill_stops(start, num_tokens, align, prefill_chunk_tokens)
        room = self.max_blocks_per_worker - sum(state.resident.values()) - len(state.speculative)
        held: list[tuple[int, ExternalBlockHash]] = []
        added = 0
        for rule in rules:
            hashes = _cached_by_prefill(rule, keys, self.hash_block_size, stops)
            added += self._speculate_group(
                state, rule.group_idx, hashes, expires_at, room - added, held
            )
        if held:
            self._serial += 1
            heapq.heappush(self._expiries, (expires_at, self._serial, state, held))
            self._speculating |= state.bit
        self._counters.speculated += added
        return added

    def _hit_before_routing(
        self, worker: str, keys: Sequence[ExternalBlockHash], num_tokens: int
    ) -> int:
        """Where the worker's prefill of the prompt starts: its hit, speculative blocks held."""
        hits = self.score(keys, num_tokens, workers=[worker], details=False)
        if not hits:  # no catalog it can be scored by
            return 0
        return speculative_hit(hits[0])

    def expire_speculation(self, now: float) -> int:
        """Drop the speculative blocks whose expiry is at or before ``now``; how many went.

        Costs what expires: the entries come off a heap by expiry, and a block renewed or
        settled since its entry was made is passed over.
        """
        expired = 0
        while self._expiries and self._expiries[0][0] <= now:
            _, _, worker, keys = heapq.heappop(self._expiries)
            by_group: dict[int, list[ExternalBlockHash]] = {}
            for group, block_hash in keys:
                if worker.speculative.get((group, block_hash), now + 1) <= now:
                    by_group.setdefault(group, []).append(block_hash)
            for group, hashes in by_group.items():
                expired += self._unspeculate(worker, group, hashes)
        self._counters.speculation_expired += expired
        return expired

    def next_expiry(self) -> float | None:
        """When the earliest speculative entry expires (None without any)."""
        return self._expiries[0][0] if self._expiries else None

    def _speculate_group(
        self,
        worker: _Worker,
        group: int,
        hashes: Sequence[ExternalBlockHash],
        expires_at: float,
        room: int,
        held: list[tuple[int, ExternalBlockHash]],
    ) -> int:
        """Hold the group's blocks speculatively, set-wise (held again: renewed); how many new.

        Every key held or renewed goes to ``held``, for the expiry heap."""
        bit = self._lane_bit(worker, group)
        gpu = self._media.get(MEDIUM_GPU)
        really = gpu.owners if gpu is not None else new_table()
        owners = self._medium(SPECULATIVE_MEDIUM).owners
        speculative = worker.speculative
        stamp = bit | worker.bit
        added = refused = 0
        for block_hash in hashes:
            if really.get(block_hash, 0) & bit:
                continue
            key = (group, block_hash)
            known = speculative.get(key)
            if known is None:
                if added >= room:
                    refused += 1
                    continue
                owners[block_hash] = self._intern(owners.get(block_hash, 0) | stamp)
                added += 1
            speculative[key] = expires_at if known is None else max(known, expires_at)
            held.append(key)
        self._counters.speculation_refused += refused
        return added

    def _unspeculate(self, worker: _Worker, group: int, hashes: Sequence[ExternalBlockHash]) -> int:
        """Drop the worker's speculative holdings of these hashes in the group; how many it had."""
        speculative = worker.speculative
        held = [h for h in hashes if speculative.pop((group, h), None) is not None]
        if held:
            medium = self._media[SPECULATIVE_MEDIUM]
            _remove_copies(worker, group, medium, held, self._lane_bit(worker, group), 0)
            if not speculative:
                self._speculating &= ~worker.bit
        return len(held)

    # ----------------------------------------------------------------------------- reading

    @property
    def counters(self) -> IndexCounters:
        """A copy of the counters, safe to hand to an exporter thread."""
        return msgspec.structs.replace(self._counters)

    def workers(self) -> list[WorkerInfo]:
        """Every worker by name: epoch, health, groups, last applied seqs, resident hashes."""
        return [self._info(self._workers[name]) for name in sorted(self._workers)]

    def progress(self) -> dict[str, tuple[int, int]]:
        """Every worker's epoch and the newest seq applied in it over its groups (-1 before
        any), which is what its lag behind the bridge is measured from; cheaper than
        ``workers``, for each score call."""
        return {name: _progress(worker) for name, worker in self._workers.items()}

    def progress_of(self, name: str) -> tuple[int, int] | None:
        """``progress`` of one worker; None for a worker the index does not know."""
        worker = self._workers.get(name)
        return None if worker is None else _progress(worker)

    @staticmethod
    def _info(worker: _Worker) -> WorkerInfo:
        resident: dict[int, dict[str, int]] = {}
        for (group, medium), held in worker.resident.items():
            if held:
                resident.setdefault(group, {})[medium] = held
        return WorkerInfo(
            name=worker.name,
            epoch=worker.epoch,
            health=worker.health,
            groups=dict(worker.groups),
            last_seq=dict(worker.last_seq),
            resident=resident,
            hash_lookahead=worker.lookahead,
            speculative_blocks=len(worker.speculative),
        )

    def _catalog_classes(self) -> list[CatalogClass]:
        if self._classes is None:
            members: dict[tuple[tuple[int, GroupSpec], ...], int] = {}
            for worker in self._workers.values():
                catalog = tuple(sorted(worker.groups.items()))
                members[catalog] = members.get(catalog, 0) | worker.bit
            self._classes = [
                self._catalog_class(catalog, bits) for catalog, bits in members.items()
            ]
        return self._classes

    def _catalog_class(
        self, catalog: tuple[tuple[int, GroupSpec], ...], everyone: int
    ) -> CatalogClass:
        rules = self._rules(catalog)
        empty = len(self._lanes) + 1  # a lane no packed int has bits in
        shifts = tuple(self._lanes.get(rule.group_idx, empty) * self._width for rule in rules)
        return CatalogClass(rules, everyone, shifts)

    def _rules(self, catalog: Iterable[tuple[int, GroupSpec]]) -> tuple[GroupRule, ...]:
        """The hit rules of a catalog; none (unscorable) if a block size does not fit the hashes."""
        rules = tuple(rule for group, spec in catalog if (rule := rule_for(group, spec)))
        if any(rule.block_size % self.hash_block_size for rule in rules):
            return ()
        return rules

    # ----------------------------------------------------------------------------- scoring

    def score(
        self,
        block_hashes: Sequence[ExternalBlockHash],
        num_tokens: int,
        *,
        workers: Iterable[str] | None = None,
        details: bool = True,
        lookahead_hashes: Callable[[int], Sequence[ExternalBlockHash]] | None = None,
        top: int | None = None,
        passed_over: Collection[str] = (),
    ) -> list[WorkerHit]:
        """Every worker's prefix hit for one prompt, best first (weighted tokens, then hit).

        ``block_hashes`` are the prompt's hashes at ``hash_block_size`` in vLLM's external form;
        ``num_tokens`` is the prompt's length: vLLM always computes the last token, so a hit is at
        most ``num_tokens - 1`` tokens. ``workers`` scores only those named (unknown names are
        left out). ``details=False`` answers only the GPU hit, for a router that needs nothing
        else: no per-group, tier or group-blind answers (empty or 0), and ``weighted_tokens`` is
        the GPU hit at the GPU's weight.

        A worker with lookahead hashing ``k`` is scored with ``lookahead_hashes(k)``, the prompt's
        hashes as vLLM makes them with ``k`` (fewer: a block is hashed once its lookahead tokens
        exist), asked once per ``k`` in the scored fleet; without it, with ``block_hashes`` as
        they are. Each score names the worker's ``hash_lookahead`` either way.

        ``top``: only the first ``top`` of the answer's live workers not named in
        ``passed_over`` (the follower's stale ones), for a router choosing among the best: on a
        wide fleet the rest are never built.

        The answers are the API's own structs, built once (``scoring`` assembles them);
        ``stale_groups`` is left empty and ``stale`` false, since only the follower knows which
        partitions it reads and how far behind the bridge and Kafka it is.
        """
        if top is not None and top < 1:
            raise ValueError(f"top must be positive, got {top}")
        scored = self._everyone if workers is None else self._bits_of(workers)
        fleet = Fleet(
            self._media,
            self._catalog_classes(),
            self._lookahead_bits,
            self._roster(),
            self._speculating,
        )
        return self._scorer.score(
            fleet,
            _as_keys(block_hashes),
            num_tokens,
            scored,
            details=details,
            lookahead_hashes=None if lookahead_hashes is None else _keyed(lookahead_hashes),
            top=None if top is None else Top(top, passed_over),
        )

    def _bits_of(self, names: Iterable[str]) -> int:
        return reduce(or_, (worker.bit for name in names if (worker := self._workers.get(name))), 0)

    def _roster(self) -> Roster:
        """Kept until a worker joins, leaves or changes health."""
        if self._named is None:
            self._named = Roster(self._workers.values())
        return self._named

    # ----------------------------------------------------------------------------- snapshots

    def snapshot(self) -> bytes:
        """The whole state, last applied seqs included, as msgpack bytes.

        A packed int goes as every group's bitset over the slots in use, lane after lane, without
        lane 0 (their OR): no padding, and the same bytes whatever width the lanes have here.
        Speculative holdings are left out: they last seconds, and a restored index has not
        routed anything.
        """
        slots = max((worker.slot + 1 for worker in self._workers.values()), default=1)
        moves = [(lane * self._width, (lane - 1) * slots) for lane in self._lanes.values()]
        packed = cache(partial(_moved, moves=moves, mask=(1 << self._width) - 1))
        return index_snapshot.encode(
            index_snapshot.IndexSnapshot(
                slots=slots,
                lanes=list(self._lanes),
                workers=[_worker_snapshot(w) for w in self._workers.values()],
                media=[
                    index_snapshot.medium_snapshot(name, medium.owners, medium.copies, packed)
                    for name, medium in self._media.items()
                    if medium.owners and name != SPECULATIVE_MEDIUM
                ],
                retired=self._retired,
            )
        )

    @classmethod
    def restore(
        cls,
        data: bytes,
        *,
        hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
        tier_weights: Mapping[str, float] | None = None,
        max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
    ) -> KVIndex:
        """An index in the state ``snapshot`` saved; configuration is the caller's, not saved."""
        saved = index_snapshot.decode(data)
        index = cls(
            hash_block_size=hash_block_size,
            tier_weights=tier_weights,
            max_blocks_per_worker=max_blocks_per_worker,
        )
        index._width = _fitting_width(INITIAL_LANE_WIDTH, saved.slots)
        index._lanes = {group: lane for lane, group in enumerate(saved.lanes, start=1)}
        for worker in saved.workers:
            index._restore_worker(worker)
        index._next_slot = max((w.slot + 1 for w in saved.workers), default=0)
        taken = {w.slot for w in saved.workers}
        index._free_slots = [slot for slot in range(index._next_slot) if slot not in taken]
        moves = [((lane - 1) * saved.slots, lane * index._width) for lane in index._lanes.values()]
        unpacked = cache(partial(index._unpacked, moves=moves, mask=(1 << saved.slots) - 1))
        for medium in saved.media:
            state = index._medium(medium.medium)
            owners = dict(zip(medium.hashes, map(unpacked, medium.owners), strict=True))
            for group, slot, block_hash, extra in medium.copies:
                state.copies.setdefault((group, slot), {})[block_hash] = extra
            if not all(isinstance(block_hash, int) for block_hash in medium.hashes):
                owners = index._rekey(owners, state)
            state.owners = new_table(owners.items())
        index._retired = saved.retired
        return index

    def _rekey(
        self, saved: dict[ExternalBlockHash, int], state: _Medium
    ) -> dict[ExternalBlockHash, int]:
        """Whole digests as their ints, as ``_as_keys`` keeps them now: a snapshot from before
        kept them whole. A block held in both forms (by two engines) gets both its holders."""
        owners: dict[ExternalBlockHash, int] = {}
        for block_hash, held in saved.items():
            key = block_hash if isinstance(block_hash, int) else external(block_hash)
            owners[key] = self._intern(owners.get(key, 0) | held)
        for copies in state.copies.values():
            for block_hash in [h for h in copies if not isinstance(h, int)]:
                copies[external(block_hash)] = copies.pop(block_hash)
        return owners

    def _unpacked(self, wire: int | bytes, moves: list[tuple[int, int]], mask: int) -> int:
        """A saved packed int in this index's lanes, lane 0 rebuilt, single-worker ones interned."""
        packed = index_snapshot.owners_from_wire(wire)
        anywhere = reduce(or_, (packed >> source & mask for source, _ in moves), 0)
        return self._intern(_moved(packed, moves, mask) | anywhere)

    def _restore_worker(self, saved: index_snapshot.WorkerSnapshot) -> None:
        worker = _Worker(saved.name, saved.slot)
        worker.epoch = saved.epoch
        worker.health = saved.health
        worker.groups = saved.groups
        worker.last_seq = saved.last_seq
        # A snapshot from before records could be split applied each seq whole.
        worker.next_event = {g: saved.next_event.get(g, _WHOLE_SEQ) for g in saved.last_seq}
        worker.resident = {(group, medium): count for group, medium, count in saved.resident}
        self._workers[saved.name] = self._by_slot[saved.slot] = worker
        self._spread(worker)
        self._everyone |= worker.bit
        self._set_lookahead(worker, saved.hash_lookahead)


def _check_sizes(group: int, spec: GroupSpec) -> None:
    """Raise ``ValueError`` unless the spec's sizes are what ``GroupSpec`` declares (positive)."""
    try:
        msgspec.convert(msgspec.structs.asdict(spec), GroupSpec)
    except msgspec.ValidationError as error:
        raise ValueError(f"group {group}: {spec}: {error}") from error


def _fitting_width(width: int, slots: int) -> int:
    """``width`` doubled until ``slots`` fit."""
    while width < slots:
        width *= 2
    return width


def _moved(held: int, moves: Sequence[tuple[int, int]], mask: int) -> int:
    """``held``'s lanes moved: the ``mask`` bits at each source offset go to its target one."""
    return reduce(or_, ((held >> source & mask) << target for source, target in moves), 0)


def _cached_by_prefill(
    rule: GroupRule,
    hashes: Sequence[ExternalBlockHash],
    hash_block_size: int,
    stops: Sequence[int],
) -> Sequence[ExternalBlockHash]:
    """The group's blocks (by the hash of each one's last sub-block) that its engine caches once
    it computed a prompt with these full hash blocks, its prefill stopping at ``stops`` tokens.

    Attention groups (full, window, chunked local) cache every full block; a mamba group in
    vLLM's "align" mode only the state blocks its prefill's chunks end on (a request decoding,
    or prefilled in smaller chunks beside others, may cache more).
    """
    step = rule.block_size // hash_block_size
    if rule.rule != "state":
        return hashes[step - 1 : len(hashes) // step * step : step]
    ends = (stop // hash_block_size for stop in stops)  # hash blocks up to each state
    return [hashes[end - 1] for end in ends if step <= end <= len(hashes)]


def _prefill_stops(start: int, num_tokens: int, align: int, chunk_tokens: int) -> list[int]:
    """Where a lone prefill from ``start`` (an aligned hit) stops its chunks, in tokens.

    vLLM's ``Scheduler._mamba_block_aligned_split`` (and the reference engine's): chunks of
    ``chunk_tokens`` cut to whole aligned blocks until the prompt's last aligned length, where
    the chunk crossing it stops; the states at those ends are cached.
    """
    last = num_tokens // align * align
    chunk = chunk_tokens // align * align
    stops = list(range(start + chunk, last, chunk)) if chunk > 0 else []
    return [*stops, last]


def _unapplied(worker: _Worker, record: EventRecord) -> list[KVEvent] | None:
    """The record's events this worker's group has not applied yet; None when it has them all.

    Within one seq, ``next_event`` says how many of the (batch, group)'s events were applied: a
    record split over parts is taken part by part, and one sent again, split the same way or
    not, only for what is new (an empty one brings nothing). A group that applied nothing has
    applied none of the events of ``_NONE_APPLIED``'s seq either: a record with that seq, which
    no bridge writes but anyone who can write the log can, raised a KeyError here.
    """
    group = record.group_idx
    last_seq = worker.last_seq.get(group, _NONE_APPLIED)
    if record.seq != last_seq:
        return record.events if record.seq > last_seq else None
    done = worker.next_event.get(group, 0) - record.first_event
    if done >= len(record.events) or not record.events:
        return None
    return record.events[done:] if done > 0 else record.events


def _known_spec(worker: _Worker, group: int) -> KnownSpec | None:
    """The (kind, block size, window) of a store that teaches ``_learn_group`` nothing about
    the worker's group and counts nothing: its known spec, when its sizes are a group's."""
    known = worker.groups.get(group)
    window = known.sliding_window if known is not None else None
    if known is None or known.block_size <= 0 or (window is not None and window <= 0):
        return None
    return known.kind, known.block_size, known.sliding_window


def _as_keys(hashes: Sequence[ExternalBlockHash]) -> Sequence[ExternalBlockHash]:
    """``record_runs.as_keys``, refusing a hash that is neither an int nor a digest."""
    keys = as_keys(hashes)
    if keys is None:
        raise TypeError("a block hash is neither an int nor a digest")
    return keys


def _keyed(
    hashes: Callable[[int], Sequence[ExternalBlockHash]],
) -> Callable[[int], Sequence[ExternalBlockHash]]:
    """``hashes`` answering in the index's key form (see ``_as_keys``)."""
    return lambda lookahead: _as_keys(hashes(lookahead))


def _remove_copies(
    worker: _Worker,
    group: int,
    medium: _Medium,
    hashes: Sequence[ExternalBlockHash],
    bit: int,
    full_copy_bits: int,
) -> tuple[int, int, int]:
    """Remove one copy per hash: (hashes no longer held, hashes not held, partial evictions)."""
    patterns, others = worker.patterns, worker.others

    def classify(held: int) -> tuple[bool, bool, int]:
        if not held & bit:
            return False, False, 0
        rest = _without(held, bit, worker)
        if rest and not rest & others:
            rest = patterns.setdefault(rest, rest)
        return True, bool(held & full_copy_bits), rest

    return medium.owners.remove(hashes, classify, medium.copies.get((group, worker.slot)))


def _without(held: int, bits: int, worker: _Worker) -> int:
    """``held`` less some of the worker's group bits, and less its lane-0 bit with the last."""
    rest = held & ~bits
    return rest if rest & worker.mine else rest & ~worker.bit


def _worker_snapshot(worker: _Worker) -> index_snapshot.WorkerSnapshot:
    return index_snapshot.WorkerSnapshot(
        name=worker.name,
        slot=worker.slot,
        epoch=worker.epoch,
        health=worker.health,
        groups=worker.groups,
        last_seq=worker.last_seq,
        resident=[(group, medium, count) for (group, medium), count in worker.resident.items()],
        next_event=worker.next_event,
        hash_lookahead=worker.lookahead,
    )


def _progress(worker: _Worker) -> tuple[int, int]:
    return worker.epoch, max(worker.last_seq.values(), default=-1)
