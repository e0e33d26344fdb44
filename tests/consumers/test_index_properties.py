"""Property tests: the index against the brute-force model on random fleets and event streams.

Random group catalogs (full attention, sliding windows of many sizes, mamba, chunked local, kinds
the rule does not know; block sizes of one or two hash blocks), one to four workers, and random
records: stores, removals (of held and never-held hashes), clears, restarts, replays of applied
records, records from an older epoch, workers leaving. Every answer of ``score`` and every
counter must equal the model's, also after a snapshot is restored halfway through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_index import stored
from test_index_model import ReferenceIndex

import hmakv.consumers.index
from hmakv.consumers.index import KVIndex
from hmakv.kvlog.answers import WorkerHit, hma_best
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

HASH_BLOCK = 4
PROMPT_BLOCKS = 12
KINDS = (
    "full_attention",
    "sliding_window",
    "sliding_window",
    "sliding_window",
    "mamba",
    "chunked_local_attention",
    "unknown",
    "encoder_only_attention",
)
WORKERS = ("w0", "w1", "w2", "w3")
# The default ladder, one without STORAGE, and one whose fastest tier is not the GPU.
TIER_WEIGHTS = (None, {"GPU": 1.0, "CPU": 0.25}, {"CPU": 1.0, "GPU": 0.5, "STORAGE": 0.2})


@st.composite
def catalogs(draw: st.DrawFn) -> dict[int, GroupSpec]:
    """Mostly what hybrid models look like: full attention first, then other kinds."""
    first = draw(st.sampled_from(["full_attention"] * 4 + list(KINDS)))
    kinds = [first, *draw(st.lists(st.sampled_from(KINDS), max_size=3))]
    # vLLM only combines chunked local attention with groups of its own block size.
    chunked_size = draw(st.sampled_from([HASH_BLOCK, 2 * HASH_BLOCK]))
    chunked = "chunked_local_attention" in kinds
    groups = {}
    for group, kind in enumerate(kinds):
        size = chunked_size if chunked else draw(st.sampled_from([HASH_BLOCK, 2 * HASH_BLOCK]))
        window = draw(st.integers(1, 40)) if kind == "sliding_window" else None
        chunk = draw(st.sampled_from([8, 12, 16])) if kind == "chunked_local_attention" else None
        groups[group] = GroupSpec(kind, size, window, chunk)
    return groups


def prompts(shared: list[int], as_bytes: bool) -> list[list[ExternalBlockHash]]:
    """Three prompts; prompt p shares its first shared[p] blocks with prompt 0."""
    first = [1000 + i for i in range(PROMPT_BLOCKS)]
    out: list[list[int]] = [first]
    for p, common in enumerate(shared, start=1):
        out.append(first[:common] + [1000 * (p + 1) + i for i in range(common, PROMPT_BLOCKS)])
    if as_bytes:
        return [[h.to_bytes(16, "big") for h in prompt] for prompt in out]
    return [list[ExternalBlockHash](prompt) for prompt in out]


# Few, dense choices, so that stores, copies, removals and holes meet in the same lanes.
worker_idx = st.sampled_from([0, 0, 1, 2, 3])
group_idx = st.sampled_from([0, 0, 1, 1, 2, 3, 4])
prompt_idx = st.sampled_from([0, 0, 1, 2])
stored_span = st.tuples(prompt_idx, st.integers(0, 3), st.integers(1, PROMPT_BLOCKS))
removed_span = st.tuples(prompt_idx, st.integers(0, PROMPT_BLOCKS - 1), st.integers(1, 3))
medium = st.sampled_from(["GPU", "GPU", "GPU", "GPU", None, "CPU", "STORAGE"])
evicted = st.tuples(st.integers(0, 10_000), st.integers(0, PROMPT_BLOCKS - 1), st.integers(1, 3))
operations = st.one_of(
    st.tuples(st.just("request"), worker_idx, medium, stored_span, st.booleans()),
    st.tuples(st.just("request"), worker_idx, medium, stored_span, st.booleans()),
    st.tuples(st.just("store"), worker_idx, group_idx, medium, stored_span, st.booleans()),
    st.tuples(st.just("evict"), evicted),
    st.tuples(st.just("evict"), evicted),
    st.tuples(st.just("evict"), evicted),
    st.tuples(st.just("remove"), worker_idx, group_idx, medium, removed_span),
    st.tuples(st.just("clear"), worker_idx, group_idx),
    st.tuples(st.just("restart"), worker_idx, st.booleans()),
    st.tuples(st.just("replay"), st.integers(0, 10_000)),
    st.tuples(st.just("stale"), worker_idx, group_idx),
    st.tuples(st.just("forget"), worker_idx),
    st.tuples(st.just("health"), worker_idx, st.sampled_from(["live", "replaying", "degraded"])),
)


@dataclass
class Fleet:
    """Turns operations into records, and applies them to the index and the model alike."""

    catalogs: dict[str, dict[int, GroupSpec]]
    other_catalogs: dict[str, dict[int, GroupSpec]]
    prompts: list[list[ExternalBlockHash]]
    index: KVIndex
    model: ReferenceIndex
    epochs: dict[str, int] = field(default_factory=dict)
    seqs: dict[tuple[str, int, int], int] = field(default_factory=dict)
    history: list[EventRecord] = field(default_factory=list)
    stored: list[tuple[str, int, str | None, list[Any]]] = field(default_factory=list)

    def record(self, worker: str, group: int, events: list[KVEvent], epoch: int) -> EventRecord:
        key = (worker, epoch, group)
        self.seqs[key] = self.seqs.get(key, -1) + 1
        return EventRecord(worker, epoch, self.seqs[key], 0.0, group, events)

    def hashes(self, worker: str, group: int, span: tuple[int, int, int]) -> list[Any]:
        spec = self.catalogs[worker].get(group)
        step = (spec.block_size if spec else HASH_BLOCK) // HASH_BLOCK
        prompt, start, length = span
        group_hashes = self.prompts[prompt][step - 1 :: step]
        return group_hashes[start : start + length]

    def store(self, worker: str, group: int, medium: str | None, hashes: list[Any]) -> KVEvent:
        spec = self.catalogs[worker].get(group)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=[],
            block_size=spec.block_size if spec else HASH_BLOCK,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group,
            kv_cache_spec_kind=spec.kind if spec else None,
            kv_cache_spec_sliding_window=spec.sliding_window if spec else None,
        )

    def run(self, operation: tuple[Any, ...]) -> None:
        kind = operation[0]
        if kind == "replay":
            if self.history:
                self.apply(self.history[operation[1] % len(self.history)])
            return
        if kind == "evict":
            self.evict(*operation[1])
            return
        worker = WORKERS[operation[1]]
        epoch = self.epochs.get(worker, 0)
        if kind == "request":  # an engine stores a request's blocks in every group
            _, _, medium, span, twice = operation
            for group in self.catalogs[worker]:
                self.store_blocks(worker, group, medium, span, twice)
        elif kind == "store":
            self.store_blocks(worker, *operation[2:])
        elif kind == "remove":
            _, _, group, medium, span = operation
            removal = BlockRemoved(self.hashes(worker, group, span), medium, group)
            self.apply(self.record(worker, group, [removal], epoch))
        elif kind == "clear":
            self.apply(self.record(worker, operation[2], [AllBlocksCleared()], epoch))
        elif kind == "restart":
            self.epochs[worker] = epoch + 1
            if operation[2]:  # it comes back serving the other model: its stores say so
                self.catalogs[worker] = self.other_catalogs[worker]
        elif kind == "stale" and epoch > 0:
            event = self.store(worker, operation[2], "GPU", self.hashes(worker, 0, (0, 0, 4)))
            self.apply(self.record(worker, operation[2], [event], epoch - 1))
        elif kind == "forget":
            self.index.forget_worker(worker)
            self.model.workers.pop(worker, None)
        elif kind == "health" and worker in self.model.workers:
            self.index.set_health(worker, operation[2])
            self.model.worker(worker).health = operation[2]

    def store_blocks(
        self, worker: str, group: int, medium: str | None, span: tuple[int, int, int], twice: bool
    ) -> None:
        """Store a span, twice in one record if asked: two copies of each hash."""
        hashes = self.hashes(worker, group, span)
        events = [self.store(worker, group, medium, hashes)] * (2 if twice else 1)
        record = self.record(worker, group, events, self.epochs.get(worker, 0))
        if twice and record.seq % 2:  # as the bridge splits a record too large for Kafka
            for first, event in enumerate(events):
                self.apply(msgspec.structs.replace(record, events=[event], first_event=first))
        else:
            self.apply(record)
        self.stored.append((worker, group, medium, hashes))

    def evict(self, which: int, start: int, length: int) -> None:
        """Remove part of something stored earlier, as the engine evicts it."""
        if not self.stored:
            return
        worker, group, medium, hashes = self.stored[which % len(self.stored)]
        event = BlockRemoved(hashes[start : start + length], medium, group)
        self.apply(self.record(worker, group, [event], self.epochs.get(worker, 0)))

    def apply(self, record: EventRecord) -> None:
        self.history.append(record)
        assert self.index.apply(record) == self.model.apply(record)


def assert_best_first(hits: list[WorkerHit]) -> None:
    """The answer is in ``hma_best``'s order, so that the API's best is its first routable
    worker: also once the follower marks any of them stale (it keeps the order)."""
    for stale in range(len(hits) + 1):
        viewed = [msgspec.structs.replace(h, stale=i < stale) for i, h in enumerate(hits)]
        assert hma_best(viewed, ranked=True) == hma_best(viewed)
        assert hma_best(viewed[::-1]) == hma_best(viewed)


def assert_top(index: KVIndex, prompt: list[int], num_tokens: int, hits: list[WorkerHit]) -> None:
    """``top`` answers the answer's first live workers not passed over, with and without
    details, for every size up to one past the fleet and with the best worker passed over."""
    lean = index.score(prompt, num_tokens, details=False)
    for passed_over in (set(), {hits[0].worker} if hits else set()):
        for answer, details in ((hits, True), (lean, False)):
            routable = [h for h in answer if h.health == "live" and h.worker not in passed_over]
            for top in range(1, len(answer) + 2):
                got = index.score(
                    prompt, num_tokens, details=details, top=top, passed_over=passed_over
                )
                assert got == routable[:top], (top, passed_over, details)


def assert_same(
    index: KVIndex, model: ReferenceIndex, fleet: Fleet, token_counts: list[int]
) -> None:
    assert {n: getattr(index.counters, n) for n in vars(model.counters)} == vars(model.counters)
    infos = {info.name: info for info in index.workers()}
    assert set(infos) == set(model.workers)
    for name, info in infos.items():
        state = model.workers[name]
        assert (info.epoch, info.health, info.last_seq) == (
            state.epoch,
            state.health,
            state.last_seq,
        )
        assert info.groups == state.groups
        assert info.resident == model.resident(name)
    # [h, h] makes each group's own hit say whether it holds h (every alignment divides 8).
    whole = PROMPT_BLOCKS * HASH_BLOCK + 1
    probes = [(prompt, n) for prompt in fleet.prompts for n in [*token_counts, whole]]
    probes += [([h, h], 2 * HASH_BLOCK + 1) for h in {h for p in fleet.prompts for h in p}]
    for prompt, num_tokens in probes:
        hits = index.score(prompt, num_tokens)
        assert_best_first(hits)
        assert_top(index, prompt, num_tokens, hits)
        scores = {s.worker: s for s in hits}
        assert set(scores) == set(model.workers)
        for name, got in scores.items():
            assert got.hit_tokens == model.hit_tokens(name, prompt, num_tokens), name
            assert got.hit_blocks == got.hit_tokens // HASH_BLOCK
            assert got.catalog_ok == model.catalog_ok(name)
            assert got.health == model.workers[name].health
            assert got.group_hit_tokens == model.group_hit_tokens(name, prompt, num_tokens)
            assert got.tier_hit_tokens == model.tier_hit_tokens(name, prompt, num_tokens)
            assert got.weighted_tokens == pytest.approx(
                model.weighted_tokens(name, prompt, num_tokens)
            )
            assert got.group_blind_hit_tokens == model.group_blind_hit_tokens(
                name, prompt, num_tokens
            )


@settings(max_examples=200, deadline=None)
@given(
    catalog_choices=st.lists(catalogs(), min_size=1, max_size=2),
    worker_catalogs=st.lists(st.integers(0, 1), min_size=4, max_size=4),
    explicit=st.booleans(),
    shared=st.lists(st.integers(0, PROMPT_BLOCKS), min_size=2, max_size=2),
    as_bytes=st.booleans(),
    ops=st.lists(operations, min_size=20, max_size=60),
    token_counts=st.lists(st.integers(0, PROMPT_BLOCKS * HASH_BLOCK + 5), min_size=1, max_size=3),
    tier_weights=st.sampled_from(TIER_WEIGHTS),
    narrow_lanes=st.booleans(),
)
def test_index_matches_model(
    catalog_choices: list[dict[int, GroupSpec]],
    worker_catalogs: list[int],
    explicit: bool,
    shared: list[int],
    as_bytes: bool,
    ops: list[tuple[Any, ...]],
    token_counts: list[int],
    tier_weights: dict[str, float] | None,
    narrow_lanes: bool,
) -> None:
    """Same answers and counters as the model; a restored snapshot carries on identically.

    With ``narrow_lanes`` the index starts with one slot per lane, so every new worker widens
    the lanes while blocks are stored, removed and cleared around it.
    """
    catalogs_by_worker = {
        worker: catalog_choices[choice % len(catalog_choices)]
        for worker, choice in zip(WORKERS, worker_catalogs, strict=True)
    }
    other_catalogs = {
        worker: catalog_choices[(choice + 1) % len(catalog_choices)]
        for worker, choice in zip(WORKERS, worker_catalogs, strict=True)
    }
    with patch.object(hmakv.consumers.index, "INITIAL_LANE_WIDTH", 1 if narrow_lanes else 8):
        index = KVIndex(hash_block_size=HASH_BLOCK, tier_weights=tier_weights)
    model = ReferenceIndex(HASH_BLOCK, tier_weights)
    fleet = Fleet(dict(catalogs_by_worker), other_catalogs, prompts(shared, as_bytes), index, model)
    if explicit:
        for worker, catalog in catalogs_by_worker.items():
            index.set_catalog(worker, catalog)
            model.set_catalog(worker, catalog)
    half = len(ops) // 2
    for operation in ops[:half]:
        fleet.run(operation)
    assert_same(index, model, fleet, token_counts)

    restored = KVIndex.restore(
        index.snapshot(), hash_block_size=HASH_BLOCK, tier_weights=tier_weights
    )
    assert restored.snapshot() == index.snapshot()
    fleet.index = restored
    model.counters = type(model.counters)()  # a restored index counts from zero, as a process
    for operation in ops[half:]:
        fleet.run(operation)
    assert_same(restored, model, fleet, token_counts)


RUN_CATALOG = {
    0: GroupSpec("full_attention", HASH_BLOCK),
    1: GroupSpec("sliding_window", HASH_BLOCK, 8),
}
run_hashes = st.lists(st.integers(0, 9), max_size=6)
run_medium = st.sampled_from(["GPU", None, "CPU", "~speculative"])
run_events = st.lists(
    st.one_of(
        st.tuples(st.just("store"), run_medium, run_hashes),
        st.tuples(st.just("remove"), run_medium, run_hashes),
        st.tuples(st.just("clear"), st.none(), st.just([])),
    ),
    max_size=8,
)


def run_event(kind: str, medium: str | None, hashes: list[int], group: int) -> KVEvent:
    if kind == "clear":
        return AllBlocksCleared()
    if kind == "remove":
        return BlockRemoved(hashes, medium, group)
    return stored(hashes, group, RUN_CATALOG[group], medium)


@settings(max_examples=300, deadline=None)
@given(
    before=run_events,
    events=run_events,
    group=st.sampled_from([0, 1]),
    speculated=st.lists(st.integers(0, 9), max_size=4),
    room=st.integers(1, 12),
)
def test_a_record_applies_as_its_events_would_one_record_each(
    before: list[tuple[str, str | None, list[int]]],
    events: list[tuple[str, str | None, list[int]]],
    group: int,
    speculated: list[int],
    room: int,
) -> None:
    """The index applies a record's consecutive stores (or removals) on one medium as one run:
    the same state, counters and answers as each event in a part of its own (vLLM's split
    records), with copies, refusals past the worker's room, speculative holdings settled and
    another worker's holdings shared."""
    indexes = [KVIndex(hash_block_size=HASH_BLOCK, max_blocks_per_worker=room) for _ in range(2)]
    for index in indexes:
        for seq, worker in enumerate(("w1", "w0")):
            index.set_catalog(worker, RUN_CATALOG)
            for other in (0, 1):
                made = [run_event(*each, other) for each in before]
                index.apply(EventRecord(worker, 0, seq, 0.0, other, made))
        index.speculate(
            "w0", speculated, (max(speculated, default=0) + 1) * HASH_BLOCK + 1, expires_at=1.0
        )
    made = [run_event(*each, group) for each in events]
    whole, parts = indexes
    record = EventRecord("w0", 0, 2, 0.0, group, made)
    whole.apply(record)
    one_each = [
        msgspec.structs.replace(record, events=[event], first_event=first)
        for first, event in enumerate(made)
    ]
    for part in one_each or [record]:
        parts.apply(part)
    assert whole.snapshot() == parts.snapshot()
    assert whole.counters == parts.counters
    assert whole.workers() == parts.workers()
    prompt = list(range(10))
    assert whole.score(prompt, 41) == parts.score(prompt, 41)
