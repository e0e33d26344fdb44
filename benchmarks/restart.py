"""Restart benchmark: time to ready from a snapshot, beside rebuilding from the start of the log.

A synthetic fleet writes a KV-event log to Kafka as the bridge would: ``--workers`` workers,
two groups (full attention, sliding window 128), batches that store 64 new blocks per group and,
once a worker's cache is full, evict its 64 oldest. The log ends with ``--entries`` resident
(worker, group, block) entries, after ``--churn`` times as many stores: a log keeps growing
while the cache it describes stays the same size. The default, 10 turnovers of every cache, is
a short log: a busy GPU cache turns over in minutes and Kafka keeps hours. A restart from the
log costs time in its length, one from a snapshot in the index's size, so the speedup grows
with ``--churn``; the table shows both times, not only their ratio. Then, in the same run:

* ``from log``: a follower with no snapshot reads every record from offset 0;
* ``from snapshot (file)`` and ``(kafka)``: the same follower restarts from the snapshot the
  first one wrote, restoring the index and consuming from the saved offsets.

Time to ready is from ``Follower.start()`` to ``/readyz`` turning true (positions reached the log
ends seen at start), measured in this process. Each restart must end with the same index as the
rebuild (workers, counters) and consume no event record. Target: a restart at least 10x faster.

    python benchmarks/restart.py [--kafka HOST:PORT] [--entries N] [--full] [--json PATH]

Without ``--kafka`` (or ``KAFKA_BOOTSTRAP``) an Apache Kafka broker is started for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import write_report

from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.snapshots import FileSnapshotStore, KafkaSnapshotStore, SnapshotStore, pack
from hmakv.fleet.engines import GroupOf, group_store
from hmakv.kafka import ApacheKafkaBroker, unique_topic
from hmakv.kvlog.kafka_client import TopicSpec, ensure_topics, start_producer
from hmakv.kvlog.records import EventRecord, Topics, encode, event_key
from hmakv.producer.events import BlockRemoved, ExternalBlockHash, KVEvent

DEFAULT_JSON = Path(__file__).parent / "results" / "restart.json"
DEFAULT_ENTRIES = 400_000
FULL_ENTRIES = 10_000_000
TARGET_SPEEDUP = 10.0
BLOCKS_PER_RECORD = 64
GROUPS: tuple[GroupOf, ...] = ((0, "full_attention", None), (1, "sliding_window", 128))
PARTITIONS = 6
_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Scenario:
    entries: int
    churn: float
    workers: int

    @property
    def capacity(self) -> int:
        """Resident blocks per (worker, group), a whole number of records."""
        per_lane = self.entries // (self.workers * len(GROUPS))
        return max(BLOCKS_PER_RECORD, per_lane // BLOCKS_PER_RECORD * BLOCKS_PER_RECORD)

    @property
    def batches_per_worker(self) -> int:
        stores = self.capacity * self.churn
        return max(1, round(stores / BLOCKS_PER_RECORD))


def block_hash(worker: int, number: int) -> int:
    """Distinct, well-spread 64-bit hashes, as vLLM's external ints are."""
    return ((worker << 40 | number) * _MIX) & (2**64 - 1)


def records(scenario: Scenario) -> Iterator[EventRecord]:
    """The fleet's log, workers interleaved batch by batch as their steps would be."""
    capacity_records = scenario.capacity // BLOCKS_PER_RECORD
    for seq in range(scenario.batches_per_worker):
        for worker in range(scenario.workers):
            name = f"worker-{worker}"
            new: list[ExternalBlockHash] = [
                block_hash(worker, seq * BLOCKS_PER_RECORD + i) for i in range(BLOCKS_PER_RECORD)
            ]
            evicted_batch = seq - capacity_records
            for group_of in GROUPS:
                group = group_of[0]
                events: list[KVEvent] = [group_store(new, group_of)]
                if evicted_batch >= 0:
                    old: list[ExternalBlockHash] = [
                        block_hash(worker, evicted_batch * BLOCKS_PER_RECORD + i)
                        for i in range(BLOCKS_PER_RECORD)
                    ]
                    events.append(BlockRemoved(old, "GPU", group_idx=group))
                yield EventRecord(name, 0, seq, time.time(), group, events)


async def write_log(bootstrap: str, topics: Topics, scenario: Scenario) -> int:
    await ensure_topics(
        bootstrap,
        [
            TopicSpec(topics.events, partitions=PARTITIONS),
            TopicSpec(topics.workers, config={"cleanup.policy": "compact"}),
        ],
    )
    started = await start_producer(
        bootstrap, client_id="restart-benchmark", linger_ms=20, max_batch_size=512 * 1024
    )
    producer = started.producer
    written = 0
    try:
        pending = []
        for record in records(scenario):
            pending.append(
                await producer.send(
                    topics.events, encode(record), key=event_key(record.worker, record.group_idx)
                )
            )
            written += 1
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return written


@dataclass
class Run:
    name: str
    ready_s: float
    consumed: int
    snapshot_bytes: int
    workers: Any
    counters: Any


async def time_to_ready(
    config: FollowerConfig, store: SnapshotStore | None, name: str
) -> tuple[Run, Follower]:
    gc.collect()
    follower = Follower(config, store)
    started = time.perf_counter()
    await follower.start()
    while not follower.ready:
        await asyncio.sleep(0.002)
    ready_s = time.perf_counter() - started
    run = Run(
        name=name,
        ready_s=ready_s,
        consumed=follower.stats.consumed.get(config.topics.events, 0),
        snapshot_bytes=follower.stats.last_snapshot_bytes,
        workers=follower.index.workers(),
        counters=follower.index.counters,
    )
    return run, follower


async def measure(bootstrap: str, scenario: Scenario, snapshot_dir: Path) -> dict[str, Any]:
    topics = Topics(unique_topic("restart-bench"))
    began = time.perf_counter()
    written = await write_log(bootstrap, topics, scenario)
    write_s = time.perf_counter() - began
    print(f"log written: {written} records in {write_s:.1f} s", file=sys.stderr)
    config = FollowerConfig(
        bootstrap=bootstrap,
        topics=topics,
        follower_id="restart-bench",
        snapshot_interval_s=0,
        ready_max_lag=0,
        max_records_per_fetch=20_000,
    )
    file_store = FileSnapshotStore(snapshot_dir / "index.snapshot")
    kafka_store = KafkaSnapshotStore(bootstrap, topics.snapshots, "restart-bench")

    baseline, follower = await time_to_ready(config, file_store, "from log")
    resident = sum(
        n for info in baseline.workers for media in info.resident.values() for n in media.values()
    )
    began = time.perf_counter()
    await follower.snapshot_now()
    snapshot_write_s = {"file": time.perf_counter() - began}
    began = time.perf_counter()
    await kafka_store.save(await asyncio.to_thread(pack, follower.capture()))
    snapshot_write_s["kafka"] = time.perf_counter() - began
    await kafka_store.close()
    await follower.stop(final_snapshot=False)
    del follower

    rows = [baseline]
    stores: dict[str, SnapshotStore] = {
        "file": FileSnapshotStore(file_store.path),
        "kafka": KafkaSnapshotStore(bootstrap, topics.snapshots, "restart-bench"),
    }
    for label, store in stores.items():
        run, follower = await time_to_ready(config, store, f"from snapshot ({label})")
        await follower.stop(final_snapshot=False)
        del follower
        assert run.consumed == 0, f"{run.name} re-read {run.consumed} event records"
        assert (run.workers, run.counters) == (baseline.workers, baseline.counters), run.name
        rows.append(run)
    return {
        "records": written,
        "resident_entries": resident,
        "log_write_s": write_s,
        "snapshot_write_s": snapshot_write_s,
        "rows": [
            {
                "name": r.name,
                "ready_s": r.ready_s,
                "event_records_consumed": r.consumed,
                "snapshot_bytes": r.snapshot_bytes,
            }
            for r in rows
        ],
    }


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    baseline = rows[0]["ready_s"]
    lines = [
        f"{result['resident_entries']:,} resident entries, {result['records']:,} event records",
        f"{'restart':24s} {'time to ready':>14s} {'speedup':>8s} {'records read':>13s} "
        f"{'snapshot':>10s}",
    ]
    for row in rows:
        size = f"{row['snapshot_bytes'] / 2**20:.1f} MiB" if row["snapshot_bytes"] else "-"
        lines.append(
            f"{row['name']:24s} {row['ready_s']:13.2f}s {baseline / row['ready_s']:7.1f}x "
            f"{row['event_records_consumed']:13,d} {size:>10s}"
        )
    for store, seconds in result["snapshot_write_s"].items():
        lines.append(f"snapshot write to {store}: {seconds:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kafka",
        default=os.environ.get("KAFKA_BOOTSTRAP"),
        help="bootstrap of a running broker (default: start Apache Kafka)",
    )
    parser.add_argument(
        "--entries",
        type=int,
        default=DEFAULT_ENTRIES,
        help=f"resident entries at the end of the log (default {DEFAULT_ENTRIES:,})",
    )
    parser.add_argument(
        "--full", action="store_true", help=f"the target scenario: {FULL_ENTRIES:,} entries"
    )
    parser.add_argument(
        "--churn",
        type=float,
        default=10.0,
        help="stores in the log per resident entry: cache turnovers the log holds (default 10)",
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    scenario = Scenario(FULL_ENTRIES if args.full else args.entries, args.churn, args.workers)

    with ExitStack() as stack:
        bootstrap = args.kafka or stack.enter_context(ApacheKafkaBroker()).bootstrap
        snapshot_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        result = asyncio.run(measure(bootstrap, scenario, snapshot_dir))
    print(table(result))
    speedups = {
        row["name"]: result["rows"][0]["ready_s"] / row["ready_s"] for row in result["rows"][1:]
    }
    met = all(speedup >= TARGET_SPEEDUP for speedup in speedups.values())
    print(f"target >= {TARGET_SPEEDUP:.0f}x faster: {'met' if met else 'MISSED'}")
    report = {
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "scenario": {
            "entries": scenario.entries,
            "churn": scenario.churn,
            "workers": scenario.workers,
            "groups": len(GROUPS),
            "blocks_per_record": BLOCKS_PER_RECORD,
            "partitions": PARTITIONS,
        },
        "target_speedup": TARGET_SPEEDUP,
        "speedups": speedups,
        "target_met": met,
        **result,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()
