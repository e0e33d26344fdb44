"""Bridge benchmark: N engines (publishers) -> ``hmakv bridge`` -> Apache Kafka, acks=all.

Every engine publishes typical step batches (8 events: 6 stores of 4 blocks, 2 removals, in two
cache groups) through its own ``producer.publisher.ZmqEventPublisher`` (the engines share one
process per core, to leave the cores to what is measured); the bridge runs as its own process
(``hmakv bridge``, as deployed) so that its CPU time and memory are its own. In the same run, two
ceilings bound what the bridge could reach on this machine:

* ``SUB + decode``: one process with a SUB socket per engine that only receives and decodes
  (``producer.events.decode``), draining each socket per wake-up as the bridge does (the
  ``awaited`` row does the same with one ``await`` per message, as asyncio code usually does:
  what draining is worth);
* ``send_batch``: aiokafka ``create_batch``/``send_batch`` of pre-encoded event records
  (two per batch, as the bridge writes them), acks=all, idempotent, several chunks in flight.

Bridge runs: ``fixed`` publishes at a fixed total rate (10,000 batches/s, scaled down to half
the lower ceiling when this machine cannot reach it, which the table says, and a lower rate
given by ``--lower-rate``), ``max`` publishes as fast as the engines can, through one bridge and
through one bridge per core (``--shards``, each following its share of the engines, as a fleet
too large for one Python process is split with ``hmakv bridge --shard``). All of it shares this
machine's cores: engines, broker, bridge and reader, and whatever else runs (the load average
is printed with the table). Added latency is the broker's append time (the events topic is made
with ``message.timestamp.type=LogAppendTime``) minus the batch's engine timestamp, over every
batch and ("warm") over those published after the run's first ``WARMUP_S`` seconds. Loss is
checked by reading the whole events topic back: every (worker, group, seq) must be there.

With ``--pin REPEATS`` it runs only the latency target, the bridge and the forwarder each alone
on the last CPU and everything else on the others, as on a machine where the engines and the
broker do not share the bridge's core.

    python benchmarks/bridge.py [--engines 16] [--kafka HOST:PORT] [--pin REPEATS] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import zmq
from harness import write_report

from hmakv.bridge.fanout import fan_out
from hmakv.bridge.readable import take_ready
from hmakv.demo.promtext import MetricsPage
from hmakv.fleet.ceilings import (
    RECEIVE_LIMIT,
    START_SEQ,
    Encoded,
    append_ceiling,
    receive_ceiling,
    send_chunk,
)
from hmakv.fleet.engines import EngineSpec, ExpectedState, engines
from hmakv.fleet.services import PARTITIONS, ServiceProcess, apache_kafka, bridge_service
from hmakv.kafka import unique_topic
from hmakv.kvlog import records
from hmakv.kvlog.kafka_client import (
    TopicSpec,
    create_consumer,
    ensure_topics,
    partition_for,
    start_producer,
)
from hmakv.kvlog.records import Topics
from hmakv.producer.events import decode
from hmakv.producer.protocol import decode_seq

DEFAULT_JSON = Path(__file__).parent / "results" / "bridge.json"
TARGET_RATE = 10_000  # batches/s, all engines together, for the latency target
# The first seconds of a run warm the broker's JIT, the fresh topic's segments and the bridge
# up; latency is also reported without the batches published in them ("warm" columns).
WARMUP_S = 2.0
TARGETS = {"throughput_vs_ceiling": 0.5, "p99_ms_at_fixed_rate": 25.0}
GAPS_DETECTED = "hmakv_bridge_gaps_detected_total"
APPEND_TIME = "LogAppendTime"  # record timestamps set by the broker: the end of added latency
# --- receiving, one await per message (the ceiling is hmakv.fleet.ceilings.receive_main) ----


def awaited_sub_main(ports: list[int], expected: int, ready: Event, result: mp.Queue) -> None:  # type: ignore[type-arg]
    """The same, the way asyncio code is usually written: one await per message and socket."""
    import zmq.asyncio

    async def follow(sub: zmq.asyncio.Socket, counts: list[float]) -> None:
        while counts[0] < expected:
            frames = await sub.recv_multipart()
            batch = decode(frames[2]).batch
            if frames[1] == START_SEQ:
                continue
            counts[0] += 1
            counts[1] += len(batch.events)
            counts[3] = time.monotonic()
            counts[2] = counts[2] or counts[3]

    async def run() -> dict[str, float]:
        ctx = zmq.asyncio.Context()
        subs = []
        for port in ports:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.subscribe(b"")
            subs.append(sub)
        await asyncio.sleep(1.0)
        ready.set()
        counts = [0.0, 0.0, 0.0, 0.0]  # received, events, first, last
        tasks = [asyncio.create_task(follow(sub, counts)) for sub in subs]
        await asyncio.wait(tasks, timeout=60)
        for task in tasks:
            task.cancel()
        ctx.destroy(linger=0)
        seconds = max(counts[3] - counts[2], 1e-9)
        return {"received": counts[0], "events": counts[1], "seconds": seconds}

    result.put(asyncio.run(run()))


# --- baseline: a bare forwarder ------------------------------------------------------------------

FORWARDER_TICK_S = 0.002  # as the bridge's intake


@dataclass(frozen=True)
class ForwarderJob:
    ports: list[int]
    bootstrap: str
    topic: str
    steps: int  # per engine: the forwarder stops once every engine's last step is acknowledged
    cpus: frozenset[int] | None = None  # where it may run (``--pin``); None: anywhere


def forwarder_main(job: ForwarderJob, ready: Event, result: mp.Queue) -> None:  # type: ignore[type-arg]
    """The least any bridge does, as the latency baseline: drain every SUB socket per tick,
    decode, fan out per group, encode, and hand everything received to Kafka as soon as the
    previous chunk is acknowledged (one in flight, one ``send_batch`` per partition). No
    sequence tracking, replays, catalog, worker states or metrics, so no loss detection."""
    if job.cpus is not None:
        os.sched_setaffinity(0, job.cpus)
    asyncio.run(_forward(job, ready, result))


async def _forward(job: ForwarderJob, ready: Event, result: mp.Queue) -> None:  # type: ignore[type-arg]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs = []
    for port in job.ports:
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.subscribe(b"")
        subs.append(sub)
    producer = (
        await start_producer(
            job.bootstrap, client_id="bench-forwarder", linger_ms=0, max_batch_size=512 * 1024
        )
    ).producer
    partitions = sorted(await producer.partitions_for(job.topic))
    await asyncio.sleep(1.0)  # let every subscription reach its engine
    ready.set()
    cpu_before = time.process_time()
    last_seq = [0] * len(subs)
    held: dict[int, list[Encoded]] = defaultdict(list)
    in_flight: list[asyncio.Future[object]] = []
    headers = [records.EventHeaders(f"e{index}") for index in range(len(subs))]
    while min(last_seq) < job.steps or held or in_flight:
        for index, sub in enumerate(subs):
            for frames in take_ready(sub, RECEIVE_LIMIT):
                last_seq[index] = decode_seq(frames[1])
                batch = decode(frames[2]).batch
                for record in fan_out(f"e{index}", 0, last_seq[index], batch, (0, 1)):
                    key = records.event_key(record.worker, record.group_idx)
                    partition = partition_for(key, partitions)
                    encoded = (key, records.encode(record), headers[index].of(record))
                    held[partition].append(encoded)
        if in_flight and all(future.done() for future in in_flight):
            for future in in_flight:
                future.result()
            in_flight = []
        if held and not in_flight:
            for partition, chunk in held.items():
                in_flight += await send_chunk(producer, job.topic, partition, chunk)
            held = defaultdict(list)
        await asyncio.sleep(FORWARDER_TICK_S)
    result.put({"cpu_seconds": time.process_time() - cpu_before})
    await producer.stop()
    ctx.destroy(linger=0)


def fresh_topics(bootstrap: str) -> Topics:
    """A new prefix, with its events topic stamped by the broker (the end of added latency)."""
    topics = Topics(unique_topic("bench"))
    spec = TopicSpec(topics.events, PARTITIONS, config={"message.timestamp.type": APPEND_TIME})
    asyncio.run(ensure_topics(bootstrap, [spec]))
    return topics


def forwarder_run(
    bootstrap: str, engine_count: int, steps: int, rate: float, cpus: frozenset[int] | None = None
) -> dict[str, float]:
    topics = fresh_topics(bootstrap)
    ctx = mp.get_context("spawn")
    with engines(engine_count, steps, rate) as (specs, go):
        ready, result = ctx.Event(), ctx.Queue()
        job = ForwarderJob([s.port for s in specs], bootstrap, topics.events, steps, cpus)
        process = ctx.Process(target=forwarder_main, args=(job, ready, result))
        process.start()
        ready.wait(60)
        published_at = time.time()
        go.set()
        outcome: dict[str, float] = result.get(timeout=300)
        process.join(30)
    check = asyncio.run(read_back(bootstrap, topics, engine_count, steps, published_at + WARMUP_S))
    seconds = check["last_append"] - published_at
    return {
        "batches_per_s": engine_count * steps / seconds,
        "events_per_s": ExpectedState.of(engine_count, steps).events / seconds,
        **{k: check[k] for k in ("p50_ms", "p99_ms", "p50_warm_ms", "p99_warm_ms", "lost")},
        "bridge_cpu_percent": 100 * outcome["cpu_seconds"] / seconds,
        "bridge_cpu_us_per_batch": 1e6 * outcome["cpu_seconds"] / (engine_count * steps),
        "seconds": seconds,
    }


# --- the bridge ----------------------------------------------------------------------------------


def bridge_run(
    bootstrap: str,
    engine_count: int,
    steps: int,
    rate: float,
    shards: int = 1,
    cpus: frozenset[int] | None = None,
) -> dict[str, float]:
    """One run through ``shards`` bridge processes (one follows every engine; more split them
    with ``--shard``); CPU is theirs together, RSS the largest one's."""
    topics = fresh_topics(bootstrap)
    with engines(engine_count, steps, rate) as (specs, go):
        bridges = [
            bridge_service(bootstrap, topics.prefix, specs, i, shards, cpus) for i in range(shards)
        ]
        try:
            for bridge in bridges:
                bridge.wait_ready()
            time.sleep(0.5)  # the catch-up replays of a fresh start are done
            cpu_before = sum(bridge.cpu_seconds() for bridge in bridges)
            published_at = time.time()
            go.set()
            wait_caught_up(bridges, specs, steps)
            cpu = sum(bridge.cpu_seconds() for bridge in bridges) - cpu_before
            samples = merged_metrics(bridges)
            rss = max(bridge.peak_rss_mib() for bridge in bridges)
        finally:
            for bridge in bridges:
                bridge.stop()
    warm_from = published_at + WARMUP_S
    check = asyncio.run(read_back(bootstrap, topics, engine_count, steps, warm_from))
    seconds = check["last_append"] - published_at
    wakeups = samples.total("hmakv_bridge_messages_per_wakeup_count")
    return {
        "batches_per_s": engine_count * steps / seconds,
        "events_per_s": ExpectedState.of(engine_count, steps).events / seconds,
        "p50_ms": check["p50_ms"],
        "p99_ms": check["p99_ms"],
        "p50_warm_ms": check["p50_warm_ms"],
        "p99_warm_ms": check["p99_warm_ms"],
        "lost": check["lost"],
        "duplicates": check["duplicates"],
        "bridge_cpu_percent": 100 * cpu / seconds,
        "bridge_cpu_us_per_batch": 1e6 * cpu / (engine_count * steps),
        "bridge_peak_rss_mib": rss,
        "messages_per_wakeup": samples.total("hmakv_bridge_messages_per_wakeup_sum")
        / max(wakeups, 1.0),
        "gaps_detected": samples.total(GAPS_DETECTED),
        "seconds": seconds,
        "shards": shards,
    }


def merged_metrics(bridges: list[ServiceProcess]) -> MetricsPage:
    """Every bridge's samples on one page (their sums are the fleet's)."""
    return MetricsPage(sample for bridge in bridges for sample in bridge.metrics().samples())


def wait_caught_up(bridges: list[ServiceProcess], specs: list[EngineSpec], steps: int) -> None:
    """Until Kafka acknowledged every engine's last step (a bridge forwards in order)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        last_seqs = merged_metrics(bridges).by_label("hmakv_bridge_worker_last_seq", "worker")
        if all(last_seqs.get(spec.name, -1) >= steps for spec in specs):
            return
        # A scrape costs a bridge a few ms (2.6% of its CPU at 4 per second): not the load to
        # measure. Throughput comes from the broker's append times, not from this loop.
        time.sleep(1.0)
    raise RuntimeError("the bridge did not catch up within 300 s")


async def read_back(
    bootstrap: str, topics: Topics, engine_count: int, steps: int, warm_from: float
) -> dict[str, float]:
    """Every record of the events topic: what is missing, what is twice, the added latency (of
    every batch, and of those an engine stamped at ``warm_from`` or later)."""
    consumer = create_consumer(bootstrap, topics.events, client_id="bench-read-back")
    await consumer.start()
    seen: dict[tuple[str, int], set[int]] = defaultdict(set)
    duplicates = 0
    latencies: list[float] = []
    warm: list[float] = []
    last_append = 0.0
    expected = engine_count * (2 * steps + 1)  # seq 0 is the engine's clear, in group 0 only
    total = 0
    try:
        while total - duplicates < expected:
            fetched = await consumer.getmany(timeout_ms=2000)
            if not fetched:
                break
            for batch in fetched.values():
                for message in batch:
                    record = records.decode_event_record(message.value)
                    total += 1
                    if record.seq in seen[(record.worker, record.group_idx)]:
                        duplicates += 1
                    seen[(record.worker, record.group_idx)].add(record.seq)
                    append = message.timestamp / 1000
                    last_append = max(last_append, append)
                    if record.seq > 0:
                        latencies.append(append - record.ts)
                        if record.ts >= warm_from:
                            warm.append(append - record.ts)
    finally:
        await consumer.stop()
    lost = sum(
        len(set(range(1, steps + 1)) - seen[(f"e{i}", group)])
        for i in range(engine_count)
        for group in (0, 1)
    )
    return {
        "lost": float(lost),
        "duplicates": float(duplicates),
        **percentiles_ms(latencies, ""),
        **percentiles_ms(warm, "_warm"),
        "last_append": last_append,
    }


def percentiles_ms(latencies: list[float], suffix: str) -> dict[str, float]:
    """p50 and p99 in ms; NaN without enough samples (a run shorter than its warm-up)."""
    if len(latencies) < 100:
        return {f"p50{suffix}_ms": float("nan"), f"p99{suffix}_ms": float("nan")}
    quantiles = statistics.quantiles(latencies, n=100)
    return {f"p50{suffix}_ms": 1000 * quantiles[49], f"p99{suffix}_ms": 1000 * quantiles[98]}


# --- report --------------------------------------------------------------------------------------

COLUMNS = (  # (header, key, width, format)
    ("batches/s", "batches_per_s", 11, ",.0f"),
    ("events/s", "events_per_s", 11, ",.0f"),
    ("p50 ms", "p50_ms", 9, ".1f"),
    ("p99 ms", "p99_ms", 9, ".1f"),
    ("warm p50", "p50_warm_ms", 10, ".1f"),
    ("warm p99", "p99_warm_ms", 10, ".1f"),
    ("CPU %", "bridge_cpu_percent", 8, ".0f"),
    ("us/batch", "bridge_cpu_us_per_batch", 10, ".0f"),
    ("RSS MiB", "bridge_peak_rss_mib", 9, ".0f"),
    ("msg/wake", "messages_per_wakeup", 10, ".1f"),
    ("lost", "lost", 6, ".0f"),
)


def table(rows: dict[str, dict[str, float]]) -> str:
    header = f"{'run':<28}" + "".join(f"{title:>{width}}" for title, _, width, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        cells = [
            f"{row[key]:>{width}{fmt}}" if key in row else f"{'-':>{width}}"
            for _, key, width, fmt in COLUMNS
        ]
        lines.append(f"{name:<28}" + "".join(cells))
    return "\n".join(lines)


def targets(
    rows: dict[str, dict[str, float]], fixed: str, rate: int, ceiling: float
) -> dict[str, bool]:
    """The throughput target counts the best way to run bridges here: one, or one per core."""
    best = max(
        (name for name in rows if name.startswith("bridge: max rate")),
        key=lambda name: rows[name]["batches_per_s"],
    )
    ratio = rows[best]["batches_per_s"] / ceiling
    how = best.removeprefix("bridge: max rate").removeprefix(", ") or "1 bridge"
    p99 = rows[fixed]["p99_warm_ms"]
    bridge_rows = [row for name, row in rows.items() if name.startswith("bridge")]
    return {
        f"max-rate throughput ({how}) {ratio:.2f} x min(ceilings) >= 0.5": (
            ratio >= TARGETS["throughput_vs_ceiling"]
        ),
        f"p99 {p99:.1f} ms at {rate:,}/s (after {WARMUP_S:g} s) < 25 ms": p99
        < TARGETS["p99_ms_at_fixed_rate"],
        "zero loss": all(row["lost"] == 0 for row in bridge_rows),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6000, help="steps per engine and run")
    parser.add_argument("--kafka", help="an Apache Kafka broker to use (default: start one)")
    parser.add_argument(
        "--lower-rate",
        type=int,
        default=4000,
        help="a second fixed rate, batches/s (0: none): what latency is at a load this machine "
        "sustains next to its engines and broker",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=os.cpu_count() or 1,
        help="bridges splitting the engines (--shard) in the last run, one per core by default "
        "(1: no such run)",
    )
    parser.add_argument(
        "--pin",
        type=int,
        metavar="REPEATS",
        default=0,
        help="instead of the full run: the latency target only, the bridge (and the forwarder) "
        "alone on the last CPU, engines, broker and reader on the others, as where engines do "
        "not share the bridge's cores; REPEATS interleaved pairs (JSON: bridge-pinned.json)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.pin:
        pinned_main(args)
        return
    args.json = args.json or DEFAULT_JSON
    load_before = os.getloadavg()
    rows: dict[str, dict[str, float]] = {}
    with apache_kafka(args.kafka) as bootstrap:
        rows["ceiling: SUB + decode"] = receive_ceiling(args.engines, args.steps)
        rows["ceiling: send_batch"] = asyncio.run(
            append_ceiling(bootstrap, args.engines, args.steps, PARTITIONS)
        )
        ceiling = min(row["batches_per_s"] for row in rows.values())
        rows["SUB + decode, awaited"] = receive_ceiling(args.engines, args.steps, awaited_sub_main)
        # The latency target's rate, unless this machine's ceilings are too low for it.
        rate = TARGET_RATE if ceiling >= 2 * TARGET_RATE else int(ceiling / 2 // 100 * 100)
        fixed = f"bridge: fixed {rate:,}/s"
        rows[f"baseline: forwarder {rate:,}/s"] = forwarder_run(
            bootstrap, args.engines, args.steps, rate / args.engines
        )
        rows[fixed] = bridge_run(bootstrap, args.engines, args.steps, rate / args.engines)
        if args.lower_rate:
            lower = args.lower_rate / args.engines
            rows[f"bridge: fixed {args.lower_rate:,}/s"] = bridge_run(
                bootstrap, args.engines, args.steps, lower
            )
        rows["bridge: max rate"] = bridge_run(bootstrap, args.engines, args.steps, 0)
        if args.shards > 1:
            rows[f"bridge: max rate, {args.shards} shards"] = bridge_run(
                bootstrap, args.engines, args.steps, 0, args.shards
            )
    print(table(rows))
    load = f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"{os.cpu_count()} CPUs, load average {load}")
    if rate != TARGET_RATE:
        print(f"fixed rate scaled down from {TARGET_RATE:,}/s to half the lower ceiling")
    met = targets(rows, fixed, rate, ceiling)
    print("targets:", "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in met.items()))
    report = {
        "benchmark": "bridge",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before[0],
        },
        "engines": args.engines,
        "steps_per_engine": args.steps,
        "partitions": PARTITIONS,
        "fixed_rate": rate,
        "ceiling_batches_per_s": ceiling,
        "rows": rows,
        "targets": met,
    }
    write_report(args.json, report)


def pinned_main(args: argparse.Namespace) -> None:
    """The bridge and the bare forwarder at the target rate, each alone on the last CPU, the
    rest of the run on the others (set before the broker and the engines start: they inherit
    it); pairs interleaved, as one run's tail says little on a shared machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs or more")
    alone, others = frozenset(cpus[-1:]), frozenset(cpus[:-1])
    os.sched_setaffinity(0, others)
    rate = TARGET_RATE / args.engines
    rows: dict[str, dict[str, float]] = {}
    with apache_kafka(args.kafka) as bootstrap:
        for pair in range(1, args.pin + 1):
            rows[f"forwarder, pinned, {pair}"] = forwarder_run(
                bootstrap, args.engines, args.steps, rate, alone
            )
            rows[f"bridge, pinned, {pair}"] = bridge_run(
                bootstrap, args.engines, args.steps, rate, cpus=alone
            )
    print(table(rows))
    print(f"bridge and forwarder on CPU {cpus[-1]}; engines, broker and reader on {sorted(others)}")
    p99s = {name: row["p99_warm_ms"] for name, row in rows.items()}
    for kind in ("forwarder", "bridge"):
        mine = sorted(p99 for name, p99 in p99s.items() if name.startswith(kind))
        met = sum(p99 < TARGETS["p99_ms_at_fixed_rate"] for p99 in mine)
        print(
            f"{kind}: warm p99 at {TARGET_RATE:,}/s median {statistics.median(mine):.1f} ms, "
            f"under 25 ms in {met} of {len(mine)}"
        )
    lost = sum(row["lost"] for name, row in rows.items() if name.startswith("bridge"))
    print(f"bridge loss: {lost:.0f}")
    path = args.json or DEFAULT_JSON.with_name("bridge-pinned.json")
    report = {"benchmark": "bridge, pinned", "engines": args.engines, "rate": TARGET_RATE}
    write_report(path, report | {"rows": rows})


if __name__ == "__main__":
    main()
