"""Index benchmark: apply throughput, score latency and memory, each beside a plain baseline.

(a) apply: a synthetic fleet of 64 workers x 3 groups (full attention, sliding windows of 32 and
    64 tokens) serving requests that share system prompts; each worker caches what it computes,
    evicts the oldest blocks when full and evicts window blocks sooner. The same pre-decoded
    records go to the index and to a dict of sets per (worker, group), the floor that neither
    counts copies, nor deduplicates records, nor knows media. Block updates per second.
(b) score: 512-block prompts over 64 workers, the whole prompt cached on 48 of them, half on 8;
    p50/p99 of ``KVIndex.score`` (hit, per-group breakdown, tiers, group-blind answer) for the
    whole prompt and for a fork of it, and of the hit alone (``details=False``), back to back,
    beside a per-worker loop over those sets applying the same rule (cost in workers x blocks);
    and the whole prompt's score right after each loop call, whose memory traffic evicts the
    index from the CPU caches (a worst case: a router's own work is mostly the index).
(c) memory: tracemalloc of the whole state at 64 workers x N resident (group, block) entries
    each, hashes decoded from msgpack per worker and group as records bring them; per resident
    entry, for a fleet where most blocks are shared system prompts and for one sharing none.
    N is 50k by default: tracing 64 x 200k entries costs minutes on a small machine, so that
    size (the target's) runs with --full-memory; per-entry costs hardly move with N.

    python benchmarks/index.py [--json PATH] [--quick] [--full-memory]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

# Run as a script, this file's folder comes first on sys.path, where benchmarks/bridge.py would
# shadow the bridge package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from hmakv.consumers.index import KVIndex  # noqa: E402
from hmakv.kvlog.records import EventRecord  # noqa: E402
from hmakv.producer.events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
)

DEFAULT_JSON = Path(__file__).parent / "results" / "index.json"
SEED = 20261129
BLOCK = 16
GROUPS = {
    0: GroupSpec("full_attention", BLOCK),
    1: GroupSpec("sliding_window", BLOCK, sliding_window=32),
    2: GroupSpec("sliding_window", BLOCK, sliding_window=64),
}
TARGETS = {"apply_updates_per_s": 2_000_000, "score_p99_us": 200, "bytes_per_entry": 16}


@dataclass(frozen=True)
class Sizes:
    workers: int
    requests_per_worker: int
    apply_repeats: int
    score_calls: int
    memory_workers: int
    memory_blocks_per_worker: int


FULL = Sizes(64, 60, 3, 3000, 64, 50_000)
QUICK = Sizes(16, 20, 2, 500, 16, 20_000)
FULL_MEMORY_BLOCKS = 200_000


def random_hash(rng: random.Random) -> int:
    return rng.getrandbits(64)


# --- (a) apply ------------------------------------------------------------------------------------


def store(hashes: Sequence[ExternalBlockHash], group: int) -> BlockStored:
    spec = GROUPS[group]
    return BlockStored(
        list(hashes),
        None,
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
    """One worker's cache as the synthetic engine keeps it: FIFO eviction per group."""

    def __init__(self, name: str, full_capacity: int, window_capacity: int) -> None:
        self.name = name
        self.capacity = {0: full_capacity, 1: window_capacity, 2: window_capacity}
        self.held: dict[int, deque[int]] = {g: deque() for g in GROUPS}
        self.members: dict[int, set[int]] = {g: set() for g in GROUPS}
        self.seq = {g: 0 for g in GROUPS}

    def record(self, group: int, event: KVEvent) -> EventRecord:
        self.seq[group] += 1
        return EventRecord(self.name, 0, self.seq[group], 0.0, group, [event])

    def serve(self, request: list[int]) -> Iterator[EventRecord]:
        """Store what the request computed in every group, then evict past capacity."""
        for group in GROUPS:
            held, members = self.held[group], self.members[group]
            new = [h for h in request if h not in members]
            if new:
                held.extend(new)
                members.update(new)
                yield self.record(group, store(new, group))
            excess = len(held) - self.capacity[group]
            if excess > 0:
                evicted: list[ExternalBlockHash] = [held.popleft() for _ in range(excess)]
                members.difference_update(evicted)
                yield self.record(group, BlockRemoved(evicted, "GPU", group))


def fleet_records(sizes: Sizes, rng: random.Random) -> list[EventRecord]:
    system_prompts = [[random_hash(rng) for _ in range(64)] for _ in range(32)]
    records: list[EventRecord] = []
    for w in range(sizes.workers):
        cache = EngineCache(f"worker-{w}", full_capacity=4096, window_capacity=1024)
        for _ in range(sizes.requests_per_worker):
            prefix = system_prompts[min(int(rng.expovariate(0.2)), 31)]
            suffix = [random_hash(rng) for _ in range(rng.randint(32, 128))]
            records.extend(cache.serve(prefix + suffix))
    rng.shuffle(records)  # workers interleave on the log...
    records.sort(key=lambda r: (r.worker, r.group_idx, r.seq))  # ...but each keeps its order
    return records


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


def time_apply(
    make: Callable[[], Callable[[EventRecord], object]], records: list[EventRecord]
) -> float:
    apply = make()
    gc.collect()
    start = time.perf_counter()
    for record in records:
        apply(record)
    return time.perf_counter() - start


def bench_apply(sizes: Sizes, rng: random.Random) -> dict[str, float]:
    records = fleet_records(sizes, rng)
    updates = updates_in(records)
    index_s: list[float] = []
    sets_s: list[float] = []
    for _ in range(sizes.apply_repeats):  # interleaved, so a noisy machine slows both alike
        index_s.append(time_apply(lambda: KVIndex().apply, records))
        sets_s.append(time_apply(lambda: DictOfSets().apply, records))
    return {
        "records": len(records),
        "block_updates": updates,
        "index_updates_per_s": updates / statistics.median(index_s),
        "dict_of_sets_updates_per_s": updates / statistics.median(sets_s),
    }


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


def bench_score(sizes: Sizes, rng: random.Random) -> dict[str, float]:
    index, sets = KVIndex(), DictOfSets()
    for record in fleet_records(sizes, rng):  # realistic dict sizes around the prompts
        index.apply(record)
        sets.apply(record)
    prompt = [random_hash(rng) for _ in range(512)]
    fork = prompt[:256] + [random_hash(rng) for _ in range(256)]
    workers = [f"worker-{w}" for w in range(64)]
    for w, worker in enumerate(workers):
        held = prompt if w < 48 else prompt[:256] if w < 56 else []
        for group in GROUPS:
            record = EventRecord(worker, 0, 10**6, 0.0, group, [store(held, group)])
            index.apply(record)
            sets.apply(record)
    tokens = 512 * BLOCK + 1
    assert [s.hit_tokens for s in index.score(prompt, tokens)][:48] == [512 * BLOCK] * 48
    assert hybrid_per_worker(sets.sets, workers, prompt, tokens)["worker-0"] == 512 * BLOCK
    gc.collect()
    gc.freeze()  # what a long-running scorer does once its state is loaded
    # (prompt, details) -> seconds per call, back to back; then each after a loop call, whose
    # memory traffic leaves the index's entries out of the CPU caches (the worst case).
    warm: dict[tuple[str, bool], list[float]] = defaultdict(list)
    cold: list[float] = []
    loop_samples: list[float] = []
    prompts = {"whole": prompt, "fork": fork}
    for call in range(sizes.score_calls):
        name = "whole" if call % 2 else "fork"
        details = call // 2 % 2 == 0  # both prompts, both answers, in turn
        start = time.perf_counter()
        index.score(prompts[name], tokens, details=details)
        warm[(name, details)].append(time.perf_counter() - start)
    for _ in range(sizes.score_calls // 2):
        start = time.perf_counter()
        hybrid_per_worker(sets.sets, workers, prompt, tokens)
        loop_samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        index.score(prompt, tokens)
        cold.append(time.perf_counter() - start)
    gc.unfreeze()
    results: dict[str, float] = {}
    for (name, details), samples in warm.items():
        label = f"index_{name}{'' if details else '_hit_only'}"
        results[f"{label}_p50_us"], results[f"{label}_p99_us"] = percentiles_us(samples)
    results["index_whole_cold_p50_us"], results["index_whole_cold_p99_us"] = percentiles_us(cold)
    loop_p50, loop_p99 = percentiles_us(loop_samples)
    results["per_worker_loop_p50_us"], results["per_worker_loop_p99_us"] = loop_p50, loop_p99
    return results


# --- (c) memory -----------------------------------------------------------------------------------


def worker_blocks(sizes: Sizes, shared: list[int], share: float, rng: random.Random) -> list[int]:
    """One worker's full-attention blocks: a share from the fleet-wide pool, the rest its own."""
    count = sizes.memory_blocks_per_worker // 2
    from_pool = int(count * share)
    return rng.sample(shared, from_pool) + [random_hash(rng) for _ in range(count - from_pool)]


def build_state(
    sizes: Sizes, share: float, make: Callable[[], Any], seed: int
) -> tuple[int, int, Any]:
    """Traced bytes and resident entries of a state built from msgpack-decoded hash lists.

    Each worker holds n full-attention blocks and the last n/2 of them in each window group.
    """
    rng = random.Random(seed)
    shared = [random_hash(rng) for _ in range(sizes.memory_blocks_per_worker // 2)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[int])
    tracemalloc.start()
    state = make()
    entries = 0
    for w in range(sizes.memory_workers):
        blocks = encoder.encode(worker_blocks(sizes, shared, share, rng))
        for group in GROUPS:
            hashes = decoder.decode(blocks)  # fresh int objects, as each record brings
            if group:
                hashes = hashes[len(hashes) // 2 :]
            state.apply(EventRecord(f"worker-{w}", 0, 0, 0.0, group, [store(hashes, group)]))
            entries += len(hashes)
        del blocks, hashes
    del shared
    gc.collect()
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return traced, entries, state


def bench_memory(sizes: Sizes) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, share in (("shared_90pct", 0.9), ("unshared", 0.0)):
        for name, make in (("index", KVIndex), ("dict_of_sets", DictOfSets)):
            traced, entries, state = build_state(sizes, share, make, SEED)
            out[f"{name}_{label}_bytes_per_entry"] = traced / entries
            out["entries"] = entries
            del state
            gc.collect()
    return out


# --- report ---------------------------------------------------------------------------------------


def _pair(results: dict[str, float], label: str) -> str:
    return f"{results[f'{label}_p50_us']:.0f} / {results[f'{label}_p99_us']:.0f}"


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
    for label in ("shared_90pct", "unshared"):
        rows.append(
            (
                f"  {label}",
                f"{c[f'index_{label}_bytes_per_entry']:.1f}",
                f"{c[f'dict_of_sets_{label}_bytes_per_entry']:.1f}",
                f"<= {TARGETS['bytes_per_entry']}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--quick", action="store_true", help="smaller fleet, for a smoke run")
    parser.add_argument(
        "--full-memory",
        action="store_true",
        help=f"memory at {FULL_MEMORY_BLOCKS:,} entries per worker (minutes under tracemalloc)",
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.full_memory:
        sizes = dataclasses.replace(sizes, memory_blocks_per_worker=FULL_MEMORY_BLOCKS)
    started = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    sections: tuple[tuple[str, Callable[[], dict[str, float]]], ...] = (
        ("apply", lambda: bench_apply(sizes, random.Random(SEED))),
        ("score", lambda: bench_score(sizes, random.Random(SEED + 1))),
        ("memory", lambda: bench_memory(sizes)),
    )
    for name, run in sections:
        section_started = time.perf_counter()
        results[name] = run()
        results[name]["seconds"] = time.perf_counter() - section_started
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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
