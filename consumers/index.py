"""The HMA-aware KV-cache index: which worker holds which block, per cache group and medium.

Pure data structure, no I/O: the follower applies Kafka records (``bridge.records.EventRecord``,
one per worker, epoch, seq and group) to it; the score API and the exporter read it.

Why it is shaped this way:

- One *lane* per (group_idx, medium) maps a block hash to an int bitset over worker slots (bit
  set: that worker holds at least one copy). Memory grows with distinct (hash, lane) pairs, not
  with workers times blocks, and scoring ANDs the whole fleet in one integer operation per block.
- vLLM can hold two copies of one hash in one group (vLLM #48933, #55092); the rare counts above
  one live in a side table per (lane, slot), so a removal clears the bit only with the last copy.
- A worker's first copy of a hash stores that worker's own single-bit int object, so a hash that
  only one worker holds costs a dict entry but no int of its own.
- The bridge delivers at least once: the last applied seq per (worker, epoch, group) makes a
  replayed record a no-op, an older epoch is ignored and a newer one clears the worker first.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import reduce
from itertools import repeat
from operator import or_

import msgspec

from bridge.records import HEALTH_STATES, EventRecord, Health
from consumers.hit_rule import (
    WINDOW_KINDS,
    Acceptance,
    GroupRule,
    alignment,
    longest_hits,
    rule_for,
)
from producer.events import MEDIUM_GPU, BlockRemoved, BlockStored, ExternalBlockHash, GroupSpec

DEFAULT_HASH_BLOCK_SIZE = 16
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
FULL_COPY_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SNAPSHOT_FORMAT = 1

LaneKey = tuple[int, str]
HoldersOf = Callable[[ExternalBlockHash, int], int]  # a lane's owners.get: hash -> worker bitset
# What a score call answers per worker: the hit, each group's own hit, each tier's, the blind one.
AnswerKey = tuple[str, int | str]
_HIT: AnswerKey = ("hit", 0)
_BLIND: AnswerKey = ("blind", 0)


class ApplyOutcome(enum.Enum):
    """What ``apply`` did with a record, for the follower's own accounting."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"


class IndexCounters(msgspec.Struct, gc=False):
    """Monotonic counters for the exporter: every odd or ignored input is counted, none dropped.

    ``stored`` and ``removed`` count block copies; ``cleared`` group clears; ``restarts`` new
    epochs; ``anomalies`` removals of a hash the worker did not hold; ``partial_evictions``
    sliding-window removals whose full-attention copy stays resident; ``duplicate_copies`` stores
    of a hash the worker already held; ``duplicates_ignored`` and ``stale_epoch_ignored`` records
    applied already or from an older epoch.
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


class WorkerInfo(msgspec.Struct, frozen=True, gc=False):
    """What the index knows about one worker; ``resident`` is distinct hashes per group, medium."""

    name: str
    epoch: int
    health: Health
    groups: dict[int, GroupSpec]
    last_seq: dict[int, int]
    resident: dict[int, dict[str, int]]


class WorkerScore(msgspec.Struct, frozen=True, gc=False):
    """One worker's answer for one prompt.

    ``hit_tokens`` is the hit vLLM's own lookup would find on the worker's GPU. ``tier_hit_tokens``
    gives, per medium in tier order, the hit if blocks on that medium and every faster one counted;
    ``weighted_tokens`` weights each stretch of that ladder by the slowest tier it needs (see
    ``KVIndex``). ``group_blind_hit_tokens`` is what an index ignoring groups would answer.
    ``catalog_ok`` is False when the worker's groups are unknown or unusable, so its 0 is no answer.
    """

    worker: str
    health: Health
    catalog_ok: bool
    hit_tokens: int
    hit_blocks: int
    group_hit_tokens: dict[int, int]
    tier_hit_tokens: dict[str, int]
    weighted_tokens: float
    group_blind_hit_tokens: int


class _Worker:
    __slots__ = ("bit", "epoch", "groups", "health", "last_seq", "name", "resident", "slot")

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.epoch = 0
        self.health: Health = "live"
        self.groups: dict[int, GroupSpec] = {}
        self.last_seq: dict[int, int] = {}
        self.resident: dict[LaneKey, int] = {}


class _Lane:
    __slots__ = ("copies", "key", "owners")

    def __init__(self, key: LaneKey) -> None:
        self.key = key
        self.owners: dict[ExternalBlockHash, int] = {}
        # slot -> hash -> copies beyond the first; only hashes with two or more copies appear.
        self.copies: dict[int, dict[ExternalBlockHash, int]] = {}


class _CatalogClass:
    """Workers sharing one group catalog: the hit rule runs once for all of them."""

    __slots__ = ("align", "everyone", "rules")

    def __init__(self, rules: tuple[GroupRule, ...], everyone: int) -> None:
        self.rules = rules
        self.everyone = everyone
        self.align = alignment(rules) if rules else 0


class KVIndex:
    """Residency of every worker's KV-cache blocks per group and medium, scored by vLLM's rule.

    ``hash_block_size`` is the block size the prompts' hashes are computed at. A group whose blocks
    span ``k`` hash blocks is looked up with the hash of its last sub-block: that is exactly vLLM's
    external int for such a block (the last 8 bytes of the concatenated digests) and current vLLM's
    hash for it; older vLLM's concatenated bytes-form hashes are not recognised.

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
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.hash_block_size = hash_block_size
        weights = DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights
        self.tiers: tuple[tuple[str, float], ...] = tuple(
            sorted(weights.items(), key=lambda tier: -tier[1])
        )
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._lanes: dict[LaneKey, _Lane] = {}
        self._classes: list[_CatalogClass] | None = None
        self._counters = IndexCounters()

    # ----------------------------------------------------------------------------- applying

    def apply(self, record: EventRecord) -> ApplyOutcome:
        """Apply one (worker, epoch, seq, group) record; replays and older epochs change nothing."""
        worker = self._worker(record.worker)
        if record.epoch < worker.epoch:
            self._counters.stale_epoch_ignored += 1
            return ApplyOutcome.STALE_EPOCH
        if record.epoch > worker.epoch:
            self._start_epoch(worker, record.epoch)
        group = record.group_idx
        if record.seq <= worker.last_seq.get(group, -1):
            self._counters.duplicates_ignored += 1
            return ApplyOutcome.DUPLICATE
        worker.last_seq[group] = record.seq
        for event in record.events:
            if isinstance(event, BlockStored):
                self._learn_group(worker, group, event)
                self._store(worker, self._lane((group, event.medium or MEDIUM_GPU)), event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, (group, event.medium or MEDIUM_GPU), event.block_hashes)
            else:
                self._clear_group(worker, group)
        return ApplyOutcome.APPLIED

    def set_catalog(self, worker: str, groups: Mapping[int, GroupSpec]) -> None:
        """Set a worker's groups explicitly, e.g. from ``hmakv.workers`` or configuration.

        Needed for what stores do not carry (a chunked-local group's chunk size) and for groups
        that have not stored anything yet; later stores update kind, window and block size.
        """
        self._worker(worker).groups = dict(groups)
        self._classes = None

    def set_health(self, worker: str, health: Health) -> None:
        """Record what the caller knows and the log does not: a worker replaying or degraded.

        Scores carry it, so a router can discount a worker whose state may be stale.
        """
        if health not in HEALTH_STATES:
            raise ValueError(f"health must be one of {HEALTH_STATES}, got {health!r}")
        self._worker(worker).health = health

    def forget_worker(self, worker: str) -> None:
        """Drop a worker that left the fleet, and free its slot for the next one."""
        state = self._workers.pop(worker, None)
        if state is None:
            return
        for lane in self._lanes.values():
            self._drop_from_lane(state, lane)
        del self._by_slot[state.slot]
        heapq.heappush(self._free_slots, state.slot)
        self._classes = None

    def _worker(self, name: str) -> _Worker:
        worker = self._workers.get(name)
        if worker is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            worker = self._workers[name] = self._by_slot[slot] = _Worker(name, slot)
            self._classes = None
        return worker

    def _lane(self, key: LaneKey) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
        return lane

    def _learn_group(self, worker: _Worker, group: int, event: BlockStored) -> None:
        """Learn a group's spec from a store; an explicit chunk size is kept, it never travels."""
        known = worker.groups.get(group)
        kind = event.kv_cache_spec_kind
        if known is not None and (
            kind is None
            or (known.kind, known.block_size, known.sliding_window)
            == (kind, event.block_size, event.kv_cache_spec_sliding_window)
        ):
            return
        worker.groups[group] = GroupSpec(
            kind=kind or "unknown",
            block_size=event.block_size,
            sliding_window=event.kv_cache_spec_sliding_window,
            chunk_size=known.chunk_size if known is not None else None,
        )
        self._classes = None

    def _store(self, worker: _Worker, lane: _Lane, event: BlockStored) -> None:
        owners = lane.owners
        held_by = owners.get
        bit = worker.bit
        extra: dict[ExternalBlockHash, int] | None = None
        added = 0
        for block_hash in event.block_hashes:
            held = held_by(block_hash, 0)
            if held & bit:
                if extra is None:
                    extra = lane.copies.setdefault(worker.slot, {})
                extra[block_hash] = extra.get(block_hash, 0) + 1
            else:
                owners[block_hash] = held | bit if held else bit
                added += 1
        stored = len(event.block_hashes)
        self._counters.stored += stored
        self._counters.duplicate_copies += stored - added
        worker.resident[lane.key] = worker.resident.get(lane.key, 0) + added

    def _remove(self, worker: _Worker, key: LaneKey, hashes: Sequence[ExternalBlockHash]) -> None:
        lane = self._lanes.get(key)
        if lane is None:
            self._counters.anomalies += len(hashes)
            return
        dropped, missing, partial = self._remove_copies(
            worker, lane, hashes, self._full_copy_holders(worker, key, hashes)
        )
        self._counters.removed += len(hashes) - missing
        self._counters.anomalies += missing
        self._counters.partial_evictions += partial
        if dropped:
            worker.resident[key] -= dropped

    @staticmethod
    def _remove_copies(
        worker: _Worker,
        lane: _Lane,
        hashes: Sequence[ExternalBlockHash],
        full_copy_holders: HoldersOf | None,
    ) -> tuple[int, int, int]:
        """Remove one copy per hash: (hashes no longer held, hashes not held, partial evictions)."""
        owners = lane.owners
        held_by = owners.get
        bit = worker.bit
        extra = lane.copies.get(worker.slot)
        dropped = missing = partial = 0
        for block_hash in hashes:
            held = held_by(block_hash, 0)
            if not held & bit:
                missing += 1
                continue
            if full_copy_holders is not None and full_copy_holders(block_hash, 0) & bit:
                partial += 1
            if extra and block_hash in extra:
                left = extra[block_hash] - 1
                if left:
                    extra[block_hash] = left
                else:
                    del extra[block_hash]
                continue
            rest = held ^ bit
            if rest:
                owners[block_hash] = rest
            else:
                del owners[block_hash]
            dropped += 1
        return dropped, missing, partial

    def _full_copy_holders(
        self, worker: _Worker, key: LaneKey, hashes: Sequence[ExternalBlockHash]
    ) -> HoldersOf | None:
        """For a sliding-window lane: who holds each hash in a full-attention group, same medium.

        One lookup per removed hash: the full-attention lane itself, or, for a model with
        several full-attention groups, their union over just these hashes.
        """
        group, medium = key
        spec = worker.groups.get(group)
        if spec is None or spec.kind not in WINDOW_KINDS:
            return None
        fulls = [
            lane.owners
            for other, other_spec in worker.groups.items()
            if other_spec.kind in FULL_COPY_KINDS and (lane := self._lanes.get((other, medium)))
        ]
        if len(fulls) <= 1:
            return fulls[0].get if fulls else None
        merged = {h: reduce(or_, (full.get(h, 0) for full in fulls)) for h in hashes}
        return merged.get

    def _clear_group(self, worker: _Worker, group: int) -> None:
        """AllBlocksCleared for one group: every medium, since nothing says which survived."""
        for lane in self._lanes.values():
            if lane.key[0] == group:
                self._drop_from_lane(worker, lane)
        self._counters.cleared += 1

    def _start_epoch(self, worker: _Worker, epoch: int) -> None:
        """The engine restarted: nothing of its previous life is cached any more."""
        for lane in self._lanes.values():
            self._drop_from_lane(worker, lane)
        worker.epoch = epoch
        worker.last_seq.clear()
        self._counters.restarts += 1

    @staticmethod
    def _drop_from_lane(worker: _Worker, lane: _Lane) -> None:
        """Remove every copy a worker holds in a lane (scans the lane: clears are rare)."""
        owners = lane.owners
        bit = worker.bit
        for block_hash in [h for h, held in owners.items() if held & bit]:
            rest = owners[block_hash] ^ bit
            if rest:
                owners[block_hash] = rest
            else:
                del owners[block_hash]
        lane.copies.pop(worker.slot, None)
        worker.resident.pop(lane.key, None)

    # ----------------------------------------------------------------------------- reading

    @property
    def counters(self) -> IndexCounters:
        """A copy of the counters, safe to hand to an exporter thread."""
        return msgspec.structs.replace(self._counters)

    def workers(self) -> list[WorkerInfo]:
        """Every worker by name: epoch, health, groups, last applied seqs, resident hashes."""
        return [self._info(self._workers[name]) for name in sorted(self._workers)]

    @staticmethod
    def _info(worker: _Worker) -> WorkerInfo:
        resident: dict[int, dict[str, int]] = {}
        for (group, medium), count in worker.resident.items():
            if count:
                resident.setdefault(group, {})[medium] = count
        return WorkerInfo(
            name=worker.name,
            epoch=worker.epoch,
            health=worker.health,
            groups=dict(worker.groups),
            last_seq=dict(worker.last_seq),
            resident=resident,
        )

    def _catalog_classes(self) -> list[_CatalogClass]:
        if self._classes is None:
            members: dict[tuple[tuple[int, GroupSpec], ...], int] = {}
            for worker in self._workers.values():
                catalog = tuple(sorted(worker.groups.items()))
                members[catalog] = members.get(catalog, 0) | worker.bit
            self._classes = [
                _CatalogClass(self._rules(catalog), everyone)
                for catalog, everyone in members.items()
            ]
        return self._classes

    def _rules(self, catalog: Iterable[tuple[int, GroupSpec]]) -> tuple[GroupRule, ...]:
        """The hit rules of a catalog; none (unscorable) if a block size does not fit the hashes."""
        rules = tuple(rule for group, spec in catalog if (rule := rule_for(group, spec)))
        if any(rule.block_size % self.hash_block_size for rule in rules):
            return ()
        return rules

    # ----------------------------------------------------------------------------- scoring

    def score(
        self, block_hashes: Sequence[ExternalBlockHash], num_tokens: int
    ) -> list[WorkerScore]:
        """Every worker's prefix hit for one prompt, best first (weighted tokens, then hit).

        ``block_hashes`` are the prompt's hashes at ``hash_block_size`` in vLLM's external form;
        ``num_tokens`` is the prompt's length: vLLM always computes the last token, so a hit is at
        most ``num_tokens - 1`` tokens.
        """
        max_tokens = max(0, min(num_tokens - 1, len(block_hashes) * self.hash_block_size))
        residency = _Residency(self._lanes, block_hashes, self.hash_block_size, max_tokens)
        everyone = reduce(or_, (worker.bit for worker in self._workers.values()), 0)
        answers = _Answers(everyone)
        for catalog_class in self._catalog_classes():
            if catalog_class.rules:
                self._score_class(catalog_class, residency, max_tokens, answers)
        answers.record(_BLIND, self._group_blind_hits(residency, everyone, max_tokens))
        scores = [score for part in answers.parts.items() for score in self._part_scores(*part)]
        scores.sort(key=lambda s: (-s.weighted_tokens, -s.hit_tokens, s.worker))
        return scores

    def _score_class(
        self,
        catalog_class: _CatalogClass,
        residency: _Residency,
        max_tokens: int,
        answers: _Answers,
    ) -> None:
        everyone, align = catalog_class.everyone, catalog_class.align
        gpu = self._acceptances(catalog_class, residency, (MEDIUM_GPU,))
        gpu_hits = longest_hits(gpu, everyone, align, max_tokens)
        answers.record(_HIT, gpu_hits)
        for acceptance in gpu:
            hits = longest_hits([acceptance], everyone, align, max_tokens)
            answers.record(("group", acceptance.rule.group_idx), hits)
        ladder: tuple[str, ...] = ()
        hits = [(0, everyone)]
        for medium, _ in self.tiers:
            ladder = (*ladder, medium)
            if ladder == (MEDIUM_GPU,):
                hits = gpu_hits
            elif self._holds_any(catalog_class, medium):
                hits = longest_hits(
                    self._acceptances(catalog_class, residency, ladder), everyone, align, max_tokens
                )
            answers.record(("tier", medium), hits)

    def _acceptances(
        self, catalog_class: _CatalogClass, residency: _Residency, media: tuple[str, ...]
    ) -> list[Acceptance]:
        return [
            Acceptance(
                rule,
                residency.resident(rule.group_idx, media, rule.block_size),
                catalog_class.everyone,
            )
            for rule in catalog_class.rules
        ]

    def _holds_any(self, catalog_class: _CatalogClass, medium: str) -> bool:
        """Whether the class has any lane on this medium; without one a tier adds nothing."""
        return any((rule.group_idx, medium) in self._lanes for rule in catalog_class.rules)

    def _group_blind_hits(
        self, residency: _Residency, everyone: int, max_tokens: int
    ) -> list[tuple[int, int]]:
        """What an index ignoring groups answers: a left-to-right scan over hashes in any group."""
        size = self.hash_block_size
        groups = sorted({group for group, medium in self._lanes if medium == MEDIUM_GPU})
        columns = [residency.resident(group, (MEDIUM_GPU,), size) for group in groups]
        blind_rule = GroupRule(-1, "prefix", size)
        anywhere = Acceptance(blind_rule, _union(columns), everyone)
        return longest_hits([anywhere], everyone, size, max_tokens)

    def _part_scores(self, workers: int, answers: dict[AnswerKey, int]) -> Iterator[WorkerScore]:
        """The scores of workers sharing every answer: one payload, a copy per worker."""
        hit = answers.get(_HIT, 0)
        groups = {
            group: tokens
            for (kind, group), tokens in answers.items()
            if kind == "group" and isinstance(group, int)
        }
        tiers = {medium: answers.get(("tier", medium), 0) for medium, _ in self.tiers}
        weighted = 0.0
        faster = 0
        for medium, weight in self.tiers:
            weighted += weight * (tiers[medium] - faster)
            faster = tiers[medium]
        while workers:
            lowest = workers & -workers
            worker = self._by_slot[lowest.bit_length() - 1]
            workers ^= lowest
            yield WorkerScore(
                worker=worker.name,
                health=worker.health,
                catalog_ok=_HIT in answers,
                hit_tokens=hit,
                hit_blocks=hit // self.hash_block_size,
                group_hit_tokens=dict(groups),
                tier_hit_tokens=dict(tiers),
                weighted_tokens=weighted,
                group_blind_hit_tokens=answers.get(_BLIND, 0),
            )

    # ----------------------------------------------------------------------------- snapshots

    def snapshot(self) -> bytes:
        """The whole state, last applied seqs included, as msgpack bytes."""
        return _snapshot_encoder.encode(
            _Snapshot(
                format=SNAPSHOT_FORMAT,
                workers=[_worker_snapshot(w) for w in self._workers.values()],
                lanes=[_lane_snapshot(lane) for lane in self._lanes.values() if lane.owners],
                counters=self._counters,
            )
        )

    @classmethod
    def restore(
        cls,
        data: bytes,
        *,
        hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
        tier_weights: Mapping[str, float] | None = None,
    ) -> KVIndex:
        """An index in the state ``snapshot`` saved; configuration is the caller's, not saved."""
        saved = _snapshot_decoder.decode(data)
        if saved.format != SNAPSHOT_FORMAT:
            raise ValueError(f"unsupported index snapshot format {saved.format}")
        index = cls(hash_block_size=hash_block_size, tier_weights=tier_weights)
        for worker in saved.workers:
            index._restore_worker(worker)
        index._next_slot = max((w.slot + 1 for w in saved.workers), default=0)
        taken = {w.slot for w in saved.workers}
        index._free_slots = [slot for slot in range(index._next_slot) if slot not in taken]
        slot_bits = {worker.bit: worker.bit for worker in index._workers.values()}
        for lane in saved.lanes:
            index._restore_lane(lane, slot_bits)
        index._counters = saved.counters
        return index

    def _restore_worker(self, saved: _WorkerSnapshot) -> None:
        worker = _Worker(saved.name, saved.slot)
        worker.epoch = saved.epoch
        worker.health = saved.health
        worker.groups = saved.groups
        worker.last_seq = saved.last_seq
        worker.resident = {(group, medium): count for group, medium, count in saved.resident}
        self._workers[saved.name] = self._by_slot[saved.slot] = worker

    def _restore_lane(self, saved: _LaneSnapshot, slot_bits: dict[int, int]) -> None:
        lane = self._lane((saved.group_idx, saved.medium))
        owners = (_owners_from_wire(held) for held in saved.owners)
        # Keep single-owner entries on the worker's shared bit object, as applying does.
        lane.owners = dict(zip(saved.hashes, (slot_bits.get(h, h) for h in owners), strict=True))
        for slot, block_hash, extra in saved.copies:
            lane.copies.setdefault(slot, {})[block_hash] = extra


class _Answers:
    """Every worker's answers to one score call, kept per set of workers that share them.

    Each scan answers with (tokens, workers) pairs; a part of the fleet splits only where answers
    differ, so a fleet that mostly holds the same prefix builds a handful of payloads, not one
    per worker, and never walks its bitsets worker by worker until the end.
    """

    __slots__ = ("parts",)

    def __init__(self, everyone: int) -> None:
        self.parts: dict[int, dict[AnswerKey, int]] = {everyone: {}} if everyone else {}

    def record(self, key: AnswerKey, hits: list[tuple[int, int]]) -> None:
        parts: dict[int, dict[AnswerKey, int]] = {}
        for workers, answers in self.parts.items():
            rest = workers
            for tokens, hit_workers in hits:
                both = rest & hit_workers
                if both:
                    parts[both] = {**answers, key: tokens}
                    rest ^= both
            if rest:
                parts[rest] = answers
        self.parts = parts


class _Residency:
    """Which workers hold each of a prompt's blocks, per group, media and block size, memoised.

    One dict lookup per block and lane, shared by every catalog class, view and group-blind scan.
    """

    __slots__ = ("_hash_block_size", "_hashes", "_lanes", "_max_tokens", "_memo")

    def __init__(
        self,
        lanes: dict[LaneKey, _Lane],
        hashes: Sequence[ExternalBlockHash],
        hash_block_size: int,
        max_tokens: int,
    ) -> None:
        self._lanes = lanes
        self._hashes = hashes
        self._hash_block_size = hash_block_size
        self._max_tokens = max_tokens
        self._memo: dict[tuple[int, tuple[str, ...], int], list[int]] = {}

    def resident(self, group: int, media: tuple[str, ...], block_size: int) -> list[int]:
        """Bitset of workers holding each of the group's blocks on any of ``media``."""
        key = (group, media, block_size)
        held = self._memo.get(key)
        if held is None:
            held = self._memo[key] = self._lookup(group, media, block_size)
        return held

    def _lookup(self, group: int, media: tuple[str, ...], block_size: int) -> list[int]:
        step = block_size // self._hash_block_size
        blocks = self._max_tokens // block_size
        # A group block spanning several hash blocks goes by the hash of its last sub-block.
        hashes = self._hashes[step - 1 : blocks * step : step]
        lanes = [lane for medium in media if (lane := self._lanes.get((group, medium)))]
        if not lanes:
            return [0] * len(hashes)
        return list(_union([list(map(lane.owners.get, hashes, repeat(0))) for lane in lanes]))


def _union(columns: Sequence[Iterable[int]]) -> Iterator[int]:
    """Element-wise OR of bitset columns, computed as it is consumed."""
    if not columns:
        return iter(())
    return iter(reduce(lambda a, b: map(or_, a, b), columns))


# ----------------------------------------------------------------------------- snapshot format


class _WorkerSnapshot(msgspec.Struct, array_like=True, gc=False):
    name: str
    slot: int
    epoch: int
    health: Health
    groups: dict[int, GroupSpec]
    last_seq: dict[int, int]
    resident: list[tuple[int, str, int]]


class _LaneSnapshot(msgspec.Struct, array_like=True, gc=False):
    group_idx: int
    medium: str
    hashes: list[ExternalBlockHash]
    # Bitsets over slots: an int while it fits msgpack's 64 bits, else little-endian bytes.
    owners: list[int | bytes]
    copies: list[tuple[int, ExternalBlockHash, int]]


class _Snapshot(msgspec.Struct, gc=False):
    format: int
    workers: list[_WorkerSnapshot]
    lanes: list[_LaneSnapshot]
    counters: IndexCounters


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(_Snapshot)
_WIRE_INT_LIMIT = 1 << 64


def _worker_snapshot(worker: _Worker) -> _WorkerSnapshot:
    return _WorkerSnapshot(
        name=worker.name,
        slot=worker.slot,
        epoch=worker.epoch,
        health=worker.health,
        groups=worker.groups,
        last_seq=worker.last_seq,
        resident=[(group, medium, count) for (group, medium), count in worker.resident.items()],
    )


def _lane_snapshot(lane: _Lane) -> _LaneSnapshot:
    return _LaneSnapshot(
        group_idx=lane.key[0],
        medium=lane.key[1],
        hashes=list(lane.owners),
        owners=[_owners_to_wire(held) for held in lane.owners.values()],
        copies=[
            (slot, block_hash, extra)
            for slot, extras in lane.copies.items()
            for block_hash, extra in extras.items()
        ],
    )


def _owners_to_wire(held: int) -> int | bytes:
    if held < _WIRE_INT_LIMIT:
        return held
    return held.to_bytes((held.bit_length() + 7) // 8, "little")


def _owners_from_wire(held: int | bytes) -> int:
    return held if isinstance(held, int) else int.from_bytes(held, "little")
