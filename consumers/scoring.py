"""A prompt scored against the index's packed residency: every worker's answer, best first.

``KVIndex`` keeps the structure (lanes, packed ints, catalogs); this module reads it for one
prompt and assembles the per-worker answers (``kvlog.answers.WorkerHit``). It changes nothing
in the index, and imports nothing of it: the index hands it a ``Fleet``, a read-only view.

Why it is shaped this way:

- The prompt is looked up once per hash block and medium (``_Residency``); one packed int
  answers for every group's lane, a tier ladder ORs its media's values, a larger block size
  takes every k-th hash block's value. Every catalog class, tier and the group-blind scan share
  these columns.
- vLLM's rule (``hit_rule.longest_hits``) runs once per catalog class for all its workers at
  once, over bitsets; answers come back as (tokens, workers) pairs.
- The fleet splits into parts only where answers differ (``_Answers``), so a fleet that mostly
  holds the same prefix builds a handful of payloads, not one per worker, and each worker's
  ``WorkerHit`` is made once, at the end, in one C-level pass per part.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from functools import reduce
from itertools import islice, repeat
from operator import attrgetter, itemgetter, or_
from typing import NamedTuple, Protocol

from msgspec.structs import replace

from hmakv.consumers.block_table import Table
from hmakv.consumers.hit_rule import Acceptance, Column, GroupRule, alignment, longest_hits
from hmakv.kvlog.answers import WorkerHit
from hmakv.kvlog.records import Health
from hmakv.producer.events import MEDIUM_GPU, ExternalBlockHash

ROSTER_SETS = 1024  # worker sets whose names a score call may reuse
# The table of blocks routed to a worker and not yet confirmed by its events: a medium of the
# index's own, under a name no engine may store on (the index refuses it), read with the GPU's.
SPECULATIVE_MEDIUM = "~speculative"
# Up to this many workers, a part's answers are copies of its payload; above, built in one pass.
_FEW_WORKERS = 16
# Above this many parts x pairs, a score call's answers split by slot (``_Answers.record``).
_PAIRS_TRIED = 256

Media = tuple[str, ...]
# What a score call answers per worker: the hit, each group's own hit, each tier's, the blind one.
AnswerKey = tuple[str, int | str]
_HIT: AnswerKey = ("hit", 0)
_BLIND: AnswerKey = ("blind", 0)
_LOOKAHEAD: AnswerKey = ("lookahead", 0)  # the hashing a worker was scored with, not a hit
_SPECULATIVE: AnswerKey = ("speculative", 0)
_GPU_ONLY: Media = (MEDIUM_GPU,)
_GPU_AND_SPECULATIVE: Media = (MEDIUM_GPU, SPECULATIVE_MEDIUM)


class Held(Protocol):
    """One medium's residency as the index keeps it: block hash -> packed holders."""

    @property
    def owners(self) -> Table: ...


class Member(Protocol):
    """One worker as the roster lists it: its bit in a worker set, its name and health."""

    @property
    def name(self) -> str: ...

    @property
    def bit(self) -> int: ...

    @property
    def health(self) -> Health: ...


class CatalogClass:
    """Workers sharing one group catalog: the hit rule runs once for all of them.

    ``shifts`` are the rules' lane offsets in the packed ints (a group that never stored reads an
    always-empty lane past the last one).
    """

    __slots__ = ("align", "everyone", "rules", "shifts")

    def __init__(
        self, rules: tuple[GroupRule, ...], everyone: int, shifts: tuple[int, ...]
    ) -> None:
        self.rules = rules
        self.everyone = everyone
        self.shifts = shifts
        self.align = alignment(rules) if rules else 0


class Roster:
    """The workers in name order, and the names and health of each worker set asked for.

    The sets a score call splits the fleet into recur from call to call, so each is listed once
    and reused (up to ``ROSTER_SETS`` of them, then the list starts again). A set is listed from
    its own bits, not by a pass over the roster: a wide fleet split into many small parts lists
    each in a few steps.
    """

    __slots__ = ("_order", "_rank_of", "_sets")

    def __init__(self, workers: Iterable[Member]) -> None:
        self._order = sorted(workers, key=attrgetter("name"))
        self._rank_of = {
            worker.bit.bit_length() - 1: rank for rank, worker in enumerate(self._order)
        }
        self._sets: dict[int, tuple[list[str], list[Health], list[bool]]] = {}

    def named(self, workers: int) -> tuple[list[str], list[Health], list[bool]]:
        """Names, health and whether degraded (not live), of the set's workers in name order."""
        named = self._sets.get(workers)
        if named is None:
            if len(self._sets) >= ROSTER_SETS:
                self._sets.clear()
            ranks = sorted(map(self._rank_of.__getitem__, _slots(workers)))
            chosen = [self._order[rank] for rank in ranks]
            health = [worker.health for worker in chosen]
            names = [worker.name for worker in chosen]
            named = self._sets[workers] = (names, health, [h != "live" for h in health])
        return named


class Fleet(NamedTuple):
    """What one score call reads of the index."""

    media: Mapping[str, Held]
    classes: Sequence[CatalogClass]
    lookahead_bits: Mapping[int, int]  # lookahead > 0 -> its workers' bits
    roster: Roster
    speculating: int = 0  # the bits of workers holding speculative blocks


class Top(NamedTuple):
    """A score answering only its best ``limit`` live workers, leaving out ``passed_over``."""

    limit: int
    passed_over: Collection[str] = ()

    def eligible(
        self, names: list[str], health: list[Health], degraded: list[bool], *, room: int
    ) -> tuple[list[str], list[Health], list[bool]]:
        """A part's first ``room`` live workers not passed over, in name order."""
        passed_over = self.passed_over
        wanted = (
            at for at, name in enumerate(names) if not degraded[at] and name not in passed_over
        )
        chosen = list(islice(wanted, min(room, len(names))))  # ``room`` may pass islice's bound
        return (
            [names[at] for at in chosen],
            [health[at] for at in chosen],
            [degraded[at] for at in chosen],
        )


class Scorer:
    """Scores prompts at ``hash_block_size`` with a tier ladder, fastest medium first."""

    def __init__(self, hash_block_size: int, tier_weights: Mapping[str, float]) -> None:
        self.hash_block_size = hash_block_size
        self.tiers: tuple[tuple[str, float], ...] = tuple(
            sorted(tier_weights.items(), key=lambda tier: -tier[1])
        )
        self._gpu_weight = tier_weights.get(MEDIUM_GPU, 0.0)

    def score(
        self,
        fleet: Fleet,
        block_hashes: Sequence[ExternalBlockHash],
        num_tokens: int,
        scored: int,
        *,
        details: bool,
        lookahead_hashes: Callable[[int], Sequence[ExternalBlockHash]] | None,
        top: Top | None = None,
    ) -> list[WorkerHit]:
        """The ``scored`` workers' answers, best first (see ``KVIndex.score``); hashes in the
        index's key form."""
        answers = _Answers(scored)
        prompts = _prompt_hashes(fleet, block_hashes, scored, lookahead_hashes, answers)
        for hashes, members in prompts:
            max_tokens = max(0, min(num_tokens - 1, len(hashes) * self.hash_block_size))
            residency = _Residency(fleet.media, hashes, self.hash_block_size, max_tokens)
            call = _Call(residency, max_tokens, answers, details, fleet.media, fleet.speculating)
            for catalog_class in fleet.classes:
                class_members = catalog_class.everyone & members
                if class_members and catalog_class.rules:
                    self._score_class(catalog_class, class_members, call)
            if details:
                answers.record(_BLIND, self._group_blind_hits(residency, members, max_tokens))
        return self._hits(answers, fleet.roster, details, top)

    def _score_class(self, catalog_class: CatalogClass, members: int, call: _Call) -> None:
        align = catalog_class.align
        gpu = _acceptances(catalog_class, call.residency, _GPU_ONLY)
        gpu_hits = longest_hits(gpu, members, align, call.max_tokens)
        call.answers.record(_HIT, gpu_hits)
        self._score_speculative(catalog_class, members & call.speculating, call)
        if not call.details:
            return
        # Every group accepts the whole length for a worker whose hit it is: only the others scan.
        top = call.max_tokens // align * align
        topped = gpu_hits[0][1] if gpu_hits[0][0] == top else 0
        for acceptance in gpu:
            if len(gpu) == 1:  # a single group's own hit is the hit
                hits = gpu_hits
            else:
                hits = longest_hits([acceptance], members ^ topped, align, call.max_tokens)
                hits.append((top, topped))
            call.answers.record(("group", acceptance.rule.group_idx), hits)
        self._score_tiers(catalog_class, members, call)

    @staticmethod
    def _score_speculative(catalog_class: CatalogClass, members: int, call: _Call) -> None:
        """The GPU hit with speculative blocks held too, for the workers that have any (the
        others' is their hit)."""
        if members:
            acceptances = _acceptances(catalog_class, call.residency, _GPU_AND_SPECULATIVE)
            hits = longest_hits(acceptances, members, catalog_class.align, call.max_tokens)
            call.answers.record(_SPECULATIVE, hits)

    def _score_tiers(self, catalog_class: CatalogClass, members: int, call: _Call) -> None:
        """The hit on each tier of the ladder below the GPU's (which is the hit).

        A tier that adds no blocks repeats the faster one's answer (see ``_ladder``); the first
        is computed even empty (a chunked-local group accepts a new chunk with no blocks).
        """
        ladder: Media = ()
        for medium, _ in self.tiers:
            ladder = (*ladder, medium)
            held = call.media.get(medium)
            if ladder != _GPU_ONLY and (len(ladder) == 1 or (held is not None and held.owners)):
                acceptances = _acceptances(catalog_class, call.residency, ladder)
                hits = longest_hits(acceptances, members, catalog_class.align, call.max_tokens)
                call.answers.record(("tier", medium), hits)

    def _group_blind_hits(
        self, residency: _Residency, everyone: int, max_tokens: int
    ) -> list[tuple[int, int]]:
        """What an index ignoring groups answers: a left-to-right scan of lane 0 (any group)."""
        size = self.hash_block_size
        anywhere = Acceptance(
            GroupRule(-1, "prefix", size), residency.column(_GPU_ONLY, size), shift=0
        )
        return longest_hits([anywhere], everyone, size, max_tokens)

    def _hits(
        self, answers: _Answers, roster: Roster, details: bool, top: Top | None
    ) -> list[WorkerHit]:
        """Best first (speculative weighted tokens, weighted tokens, hit), by name among equal
        answers; with ``top``, its first ``top.limit`` live workers not passed over.

        The parts are sorted, not the workers (whose names ``Roster`` lists once per worker set,
        in name order), so only parts that tie are merged by name. With ``top``, parts past it
        are never built, and each part of a tie gives at most what the tie may still take: its
        first names are the only ones that can come first once the tie is merged.
        """
        parts = [
            (_rank(payload), payload, workers)
            for workers, part in answers.parts.items()
            for payload in (self._payload(part, details),)
        ]
        parts.sort(key=itemgetter(0))
        hits: list[WorkerHit] = []
        tie_start, tied, rank_before = 0, False, None
        for rank, payload, workers in parts:
            if rank == rank_before:
                tied = True
            else:
                if tied:
                    hits[tie_start:] = sorted(hits[tie_start:], key=attrgetter("worker"))
                if top is not None and len(hits) >= top.limit:
                    break
                tie_start, tied, rank_before = len(hits), False, rank
            named = roster.named(workers)
            if top is not None:
                named = top.eligible(*named, room=top.limit - tie_start)
            if named[0]:
                _add_hits(hits, payload, *named)
        if tied:
            hits[tie_start:] = sorted(hits[tie_start:], key=attrgetter("worker"))
        return hits if top is None else hits[: top.limit]

    def _payload(self, answers: dict[AnswerKey, int], details: bool) -> WorkerHit:
        """What every worker of one part is told (its own fields left blank)."""
        hit = answers.get(_HIT, 0)
        groups: dict[int, int] = {}
        tiers: dict[str, int] = {}
        weighted = hit * self._gpu_weight
        if details:
            groups = {
                group: tokens
                for (kind, group), tokens in answers.items()
                if kind == "group" and isinstance(group, int)
            }
            tiers, weighted = self._ladder(answers, hit)
        speculative = answers.get(_SPECULATIVE, hit)
        return WorkerHit(
            "",
            hit,
            hit // self.hash_block_size,
            groups,
            tiers,
            weighted,
            "live",
            False,
            _HIT in answers,  # the catalog is usable: the hit rule ran for the worker
            answers.get(_BLIND, 0),
            (),
            answers.get(_LOOKAHEAD, 0),
            False,
            speculative,
            weighted + (speculative - hit) * self._gpu_weight,
        )

    def _ladder(self, answers: dict[AnswerKey, int], hit: int) -> tuple[dict[str, int], float]:
        """Each tier's hit (one without its own answer repeats the faster one's; the GPU's, when
        fastest, is the hit) and the tier-weighted tokens."""
        tiers: dict[str, int] = {}
        weighted = 0.0
        faster = 0
        for medium, weight in self.tiers:
            first_is_gpu = not tiers and medium == MEDIUM_GPU
            tokens = answers.get(("tier", medium), hit if first_is_gpu else faster)
            tiers[medium] = tokens
            weighted += weight * (tokens - faster)
            faster = tokens
        return tiers, weighted


def _prompt_hashes(
    fleet: Fleet,
    block_hashes: Sequence[ExternalBlockHash],
    scored: int,
    lookahead_hashes: Callable[[int], Sequence[ExternalBlockHash]] | None,
    answers: _Answers,
) -> list[tuple[Sequence[ExternalBlockHash], int]]:
    """The prompt's hashes for each set of scored workers that hashes alike, and each lookahead
    worker's setting recorded in its answers. A fleet without lookahead workers, the usual one,
    costs one look."""
    lookaheads = [
        (tokens, members)
        for tokens, bits in fleet.lookahead_bits.items()
        if (members := bits & scored)
    ]
    if not lookaheads:
        return [(block_hashes, scored)]
    answers.record(_LOOKAHEAD, lookaheads)
    if lookahead_hashes is None:
        return [(block_hashes, scored)]
    classic = scored & ~reduce(or_, (members for _, members in lookaheads))
    rehashed = [(lookahead_hashes(tokens), members) for tokens, members in lookaheads]
    return [(block_hashes, classic), *rehashed] if classic else rehashed


def _acceptances(
    catalog_class: CatalogClass, residency: _Residency, media: Media
) -> list[Acceptance]:
    return [
        Acceptance(rule, residency.column(media, rule.block_size), shift)
        for rule, shift in zip(catalog_class.rules, catalog_class.shifts, strict=True)
    ]


def _rank(hit: WorkerHit) -> tuple[float, float, int]:
    return -(hit.speculative_weighted_tokens or 0.0), -hit.weighted_tokens, -hit.hit_tokens


def _add_hits(
    hits: list[WorkerHit],
    payload: WorkerHit,
    names: list[str],
    health: list[Health],
    degraded: list[bool],
) -> None:
    """The payload for each worker, with the worker's own fields. The part's workers share its
    dicts: a ``WorkerHit`` is a frozen value, and nothing writes into an answer's dicts (copying
    them was 40% of building a 1,000-worker answer). A large part is built in one C-level pass."""
    hits.append(replace(payload, worker=names[0], health=health[0], degraded=degraded[0]))
    if len(names) > _FEW_WORKERS:
        hits.extend(_worker_hits(names[1:], health[1:], degraded[1:], payload))
        return
    for other in range(1, len(names)):  # an index, not zip: this runs once per small part
        hits.append(
            replace(payload, worker=names[other], health=health[other], degraded=degraded[other])
        )


def _worker_hits(
    names: list[str], health: list[Health], degraded: list[bool], payload: WorkerHit
) -> Iterator[WorkerHit]:
    return map(
        WorkerHit,
        names,
        repeat(payload.hit_tokens),
        repeat(payload.hit_blocks),
        repeat(payload.group_hit_tokens),
        repeat(payload.tier_hit_tokens),
        repeat(payload.weighted_tokens),
        health,
        degraded,
        repeat(payload.catalog_ok),
        repeat(payload.group_blind_hit_tokens),
        repeat(()),  # stale_groups: the index knows no partitions, the API adds them
        repeat(payload.hash_lookahead),
        repeat(False),  # stale: the follower's to say
        repeat(payload.speculative_hit_tokens),
        repeat(payload.speculative_weighted_tokens),
    )


class _Answers:
    """Every worker's answers to one score call, kept per set of workers that share them.

    Each scan answers with (tokens, workers) pairs; a part of the fleet splits only where answers
    differ, so a fleet that mostly holds the same prefix builds a handful of payloads, not one
    per worker, and never walks its bitsets worker by worker until the end. Each part owns its
    dict: a split copies it, an answer for a whole part is written into it.
    """

    __slots__ = ("parts",)

    def __init__(self, everyone: int) -> None:
        self.parts: dict[int, dict[AnswerKey, int]] = {everyone: {}} if everyone else {}

    def record(self, key: AnswerKey, hits: list[tuple[int, int]]) -> None:
        """Each part, split where ``hits`` answer its workers differently.

        Few parts and pairs, or one part (the first scan's): each part tries the pairs in turn.
        Many of both (a wide fleet whose workers hold prefixes of many lengths) would make that
        parts x pairs: then each part goes straight to the pair of its lowest worker left, found
        in a table of slots, which costs a step per worker (3.4x the pairs' loop for one part of
        1,000 workers and 512 pairs).
        """
        if len(self.parts) > 1 and len(self.parts) * len(hits) > _PAIRS_TRIED:
            self.parts = _split_by_slot(self.parts, key, hits)
            return
        parts: dict[int, dict[AnswerKey, int]] = {}
        for workers, answers in self.parts.items():
            rest = workers
            for tokens, hit_workers in hits:
                both = rest & hit_workers
                if both == workers:  # one answer for the whole part: its own dict takes it
                    answers[key] = tokens
                    break
                if both:
                    parts[both] = {**answers, key: tokens}
                    rest ^= both
            if rest:
                parts[rest] = answers
        self.parts = parts


def _split_by_slot(
    parts: dict[int, dict[AnswerKey, int]], key: AnswerKey, hits: list[tuple[int, int]]
) -> dict[int, dict[AnswerKey, int]]:
    """``_Answers.record`` in parts + pairs + workers steps rather than parts x pairs."""
    pair_of = _pair_of_slot(hits)
    answered = reduce(or_, (workers for _, workers in hits), 0)
    split: dict[int, dict[AnswerKey, int]] = {}
    for workers, answers in parts.items():
        rest = workers & answered
        if workers != rest:  # workers the hits say nothing of keep the part's answers
            split[workers ^ rest] = answers
        while rest:
            tokens, hit_workers = hits[pair_of[(rest & -rest).bit_length() - 1]]
            both = rest & hit_workers
            if both == workers:
                answers[key] = tokens
                split[workers] = answers
                break
            split[both] = {**answers, key: tokens}
            rest ^= both
    return split


def _pair_of_slot(hits: list[tuple[int, int]]) -> list[int]:
    """For each worker slot, the index of the pair holding it (-1: none)."""
    width = max((workers.bit_length() for _, workers in hits), default=0)
    pair_of = [-1] * width
    for position, (_, workers) in enumerate(hits):
        for slot in _slots(workers):
            pair_of[slot] = position
    return pair_of


def _slots(workers: int) -> Iterator[int]:
    """The slots of a worker set's bits, lowest first, in steps of its own bits."""
    while workers:
        lowest = workers & -workers
        yield lowest.bit_length() - 1
        workers ^= lowest


class _Call(NamedTuple):
    """What one score call's catalog classes share."""

    residency: _Residency
    max_tokens: int
    answers: _Answers
    details: bool
    media: Mapping[str, Held]
    speculating: int


class _Residency:
    """The prompt's packed columns per media and block size, looked up once and memoised.

    One dict lookup per hash block and medium answers for every group; a tier ladder ORs its
    media's values, a larger block size takes every k-th hash block's value. Every catalog
    class, view and the group-blind scan share them.
    """

    __slots__ = ("_blocks", "_columns", "_hash_block_size", "_hashes", "_media", "_values")

    def __init__(
        self,
        media: Mapping[str, Held],
        hashes: Sequence[ExternalBlockHash],
        hash_block_size: int,
        max_tokens: int,
    ) -> None:
        self._media = media
        self._hashes = hashes
        self._hash_block_size = hash_block_size
        self._blocks = max_tokens // hash_block_size
        self._values: dict[Media, list[int]] = {}
        self._columns: dict[tuple[Media, int], Column] = {}

    def column(self, media: Media, block_size: int) -> Column:
        """Packed residency of each of the prompt's blocks of ``block_size`` on any of ``media``."""
        key = (media, block_size)
        column = self._columns.get(key)
        if column is None:
            # A group block spanning several hash blocks goes by the hash of its last sub-block.
            step = block_size // self._hash_block_size
            count = self._blocks // step
            held = self._media.get(media[0]) if len(media) == 1 else None
            if held is not None:  # one table: it finds the runs itself, in one call
                column = Column.from_runs(*held.owners.runs(self._hashes, step, count))
            else:
                column = Column(self._held(media)[step - 1 : count * step : step])
            self._columns[key] = column
        return column

    def _held(self, media: Media) -> list[int]:
        """Each hash block's packed residency on any of ``media``."""
        values = self._values.get(media)
        if values is None:
            if len(media) > 1:
                values = list(map(or_, self._held(media[:-1]), self._held(media[-1:])))
            elif (medium := self._media.get(media[0])) is not None:
                values = medium.owners.get_many(self._hashes, 0)
            else:
                values = [0] * self._blocks
            self._values[media] = values
        return values
