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
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import zmq
from aiokafka import AIOKafkaProducer
from harness import GroupOf, group_store, write_report

from hmakv.bridge.fanout import fan_out
from hmakv.bridge.readable import take_ready
from hmakv.kafka import ApacheKafkaBroker, unique_topic
from hmakv.kafka.process import free_port
from hmakv.kvlog import records
from hmakv.kvlog.kafka_client import (
    TopicSpec,
    create_consumer,
    ensure_topics,
    partition_for,
    start_producer,
)
from hmakv.kvlog.records import Topics
from hmakv.producer.events import (
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    decode,
)
from hmakv.producer.protocol import decode_seq, encode_seq
from hmakv.producer.publisher import ZmqEventPublisher

DEFAULT_JSON = Path(__file__).parent / "results" / "bridge.json"
TARGET_RATE = 10_000  # batches/s, all engines together, for the latency target
# The first seconds of a run warm the broker's JIT, the fresh topic's segments and the bridge
# up; latency is also reported without the batches published in them ("warm" columns).
WARMUP_S = 2.0
TARGETS = {"throughput_vs_ceiling": 0.5, "p99_ms_at_fixed_rate": 25.0}
PARTITIONS = 6
GAPS_DETECTED = "hmakv_bridge_gaps_detected_total"
# The engines are stand-ins sharing this machine's cores with the bridge and Kafka: their idle
# publisher threads look for work every 5 ms instead of every 1 ms (16 threads polling each
# millisecond cost half a core here). It adds up to 5 ms to the measured latency.
ENGINE_FLUSH_MS = 5
APPEND_TIME = "LogAppendTime"  # record timestamps set by the broker: the end of added latency
GROUPS: tuple[GroupOf, ...] = ((0, "full_attention", None), (1, "sliding_window", 128))
START_SEQ = encode_seq(0)  # an engine's seq 0: the clear it publishes when it starts
RECEIVE_LIMIT = 1024  # messages the bare loops take from one socket per turn


def step_batch(step: int, engine: int) -> KVEventBatch:
    """A typical step: 6 stores of 4 blocks x 16 tokens (3 per group), 2 removals."""
    events: list[BlockStored | BlockRemoved] = []
    for i in range(6):
        base = (engine << 40) + step * 100 + i * 4
        hashes: list[ExternalBlockHash] = [
            (base + j) * 0x9E3779B97F4A7C15 % 2**64 for j in range(4)
        ]
        events.append(group_store(hashes, GROUPS[i % 2], list(range(64))))
    for group, _, _ in GROUPS:
        events.append(BlockRemoved([(engine << 40) + step], "GPU", group_idx=group))
    return KVEventBatch(time.time(), list(events), 0)


def free_ports(count: int) -> list[int]:
    """Distinct free ports below the ephemeral range: one that ``bind(0)`` hands out can become
    the local end of a Kafka client's connection before the engine or bridge binds it (seen
    with 64 engines: the bridge's health port was taken)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


# --- engines -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    index: int
    port: int
    replay_port: int


def engine_main(specs: list[EngineSpec], count: int, rate: float, go: Event, stop: Event) -> None:
    """Several engines' publishers: publish ``count`` steps on each at ``rate`` per second and
    engine (0: flat out), then keep the replay rings up until told to stop, since the bridge may
    still be catching up from them."""
    publishers = [
        ZmqEventPublisher(
            0,
            f"tcp://*:{spec.port}",  # a wildcard binds, as vLLM's default endpoint does
            f"tcp://127.0.0.1:{spec.replay_port}",
            buffer_steps=count + 1,
            max_queue_size=count + 1,
            flush_interval_ms=ENGINE_FLUSH_MS,
        )
        for spec in specs
    ]
    # The events are built before the clock starts; each batch is stamped when published.
    steps = {
        spec.index: [step_batch(step, spec.index).events for step in range(1, count + 1)]
        for spec in specs
    }
    go.wait()
    started = time.monotonic()
    for step in range(1, count + 1):
        if rate:
            delay = started + step / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        for spec, publisher in zip(specs, publishers, strict=True):
            publisher.publish(KVEventBatch(time.time(), steps[spec.index][step - 1], 0))
    stop.wait()
    for publisher in publishers:
        publisher.shutdown()


@contextmanager
def engines(count: int, steps: int, rate: float) -> Iterator[tuple[list[EngineSpec], Event]]:
    """Engine processes, waiting for the returned event to start publishing.

    The engines are stand-ins that share this machine's two cores with the bridge and Kafka, so
    they are as cheap as they can be: one process per core, each publishing for its share of
    the engines (every engine still has its own publisher, sockets, sequence and ring).
    """
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    ports = free_ports(2 * count)
    specs = [EngineSpec(i, ports[2 * i], ports[2 * i + 1]) for i in range(count)]
    hosts = min(count, os.cpu_count() or 1)
    processes = [
        ctx.Process(
            target=engine_main, args=(specs[host::hosts], steps, rate, go, stop), daemon=True
        )
        for host in range(hosts)
    ]
    for process in processes:
        process.start()
    try:
        yield specs, go
    finally:
        stop.set()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


# --- ceiling (a): receive and decode only --------------------------------------------------------


def sub_ceiling_main(ports: list[int], expected: int, ready: Event, result: mp.Queue) -> None:  # type: ignore[type-arg]
    """Receive and decode only, draining each ready socket as the bridge does."""
    with zmq.Context() as ctx:
        sockets = []
        poller = zmq.Poller()
        for port in ports:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.subscribe(b"")
            poller.register(sub, zmq.POLLIN)
            sockets.append(sub)
        time.sleep(1.0)  # let every subscription reach its engine
        ready.set()
        received = events = 0
        first = last = 0.0
        while received < expected:
            ready_sockets = poller.poll(2000)
            if not ready_sockets:
                break
            for sub, _ in ready_sockets:
                for frames in take_ready(sub, RECEIVE_LIMIT):
                    batch = decode(frames[2]).batch
                    if frames[1] == START_SEQ:  # the engine's start-up clear, not a step
                        continue
                    received += 1
                    events += len(batch.events)
                    last = time.monotonic()
                    first = first or last
        for sub in sockets:
            sub.close(linger=0)
    result.put({"received": received, "events": events, "seconds": max(last - first, 1e-9)})


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


def sub_ceiling(engine_count: int, steps: int, target: Callable[..., None]) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with engines(engine_count, steps, 0) as (specs, go):
        ready, result = ctx.Event(), ctx.Queue()
        expected = engine_count * steps
        process = ctx.Process(
            target=target, args=([s.port for s in specs], expected, ready, result)
        )
        process.start()
        ready.wait(30)
        go.set()
        outcome: dict[str, float] = result.get(timeout=300)
        process.join()
    outcome["batches_per_s"] = outcome["received"] / outcome["seconds"]
    outcome["events_per_s"] = outcome["events"] / outcome["seconds"]
    outcome["lost"] = expected - outcome["received"]
    return outcome


# --- ceiling (b): aiokafka send_batch of pre-encoded records --------------------------------------


Encoded = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


async def send_chunk(
    producer: AIOKafkaProducer, topic: str, partition: int, chunk: list[Encoded]
) -> list[asyncio.Future[object]]:
    """One partition's records as few record batches as fit; their delivery futures."""
    futures = []
    builder = producer.create_batch()
    for key, value, headers in chunk:
        if builder.append(timestamp=None, key=key, value=value, headers=headers) is None:
            builder.close()
            futures.append(await producer.send_batch(builder, topic, partition=partition))
            builder = producer.create_batch()
            builder.append(timestamp=None, key=key, value=value, headers=headers)
    builder.close()
    futures.append(await producer.send_batch(builder, topic, partition=partition))
    return futures


async def kafka_ceiling(bootstrap: str, batches: int) -> dict[str, float]:
    topic = unique_topic("bench-ceiling")
    await ensure_topics(bootstrap, [TopicSpec(topic, PARTITIONS)])
    encoded = [
        (records.event_key(r.worker, r.group_idx), records.encode(r), r.headers())
        for step in range(batches)
        for r in fan_out(f"w{step % 16}", 0, step, step_batch(step, step % 16), (0, 1))
    ]
    started_producer = await start_producer(
        bootstrap, client_id="bench-ceiling", linger_ms=0, max_batch_size=512 * 1024
    )
    producer = started_producer.producer
    partitions = sorted(await producer.partitions_for(topic))
    started = time.monotonic()
    in_flight: list[asyncio.Future[object]] = []
    for offset in range(0, len(encoded), 4096):
        by_partition: dict[int, list[Encoded]] = defaultdict(list)
        for key, value, headers in encoded[offset : offset + 4096]:
            by_partition[partition_for(key, partitions)].append((key, value, headers))
        for partition, chunk in by_partition.items():
            in_flight += await send_chunk(producer, topic, partition, chunk)
    await asyncio.gather(*in_flight)
    seconds = time.monotonic() - started
    await producer.stop()
    return {
        "batches_per_s": batches / seconds,
        "records_per_s": len(encoded) / seconds,
        "events_per_s": batches * 8 / seconds,
        "seconds": seconds,
        "idempotent": float(started_producer.idempotent),
    }


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
        "events_per_s": engine_count * steps * 8 / seconds,
        **{k: check[k] for k in ("p50_ms", "p99_ms", "p50_warm_ms", "p99_warm_ms", "lost")},
        "bridge_cpu_percent": 100 * outcome["cpu_seconds"] / seconds,
        "bridge_cpu_us_per_batch": 1e6 * outcome["cpu_seconds"] / (engine_count * steps),
        "seconds": seconds,
    }


# --- the bridge ----------------------------------------------------------------------------------


class BridgeProcess:
    """``hmakv bridge`` following every engine, or shard ``index`` of ``shards``: engine ``i``
    is pinned to shard ``i % shards``, since with 16 names a hash splits them only roughly
    (e0..e15 hash 6/10 over two shards), and an operator who cares pins them the same way."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        specs: list[EngineSpec],
        index: int = 0,
        shards: int = 1,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.listen = free_ports(1)[0]
        command = [sys.executable, "-m", "hmakv.cli", "--log-level", "WARNING", "bridge"]
        command += ["--kafka", bootstrap, "--topic-prefix", prefix, "--partitions", str(PARTITIONS)]
        command += ["--listen", f"127.0.0.1:{self.listen}", "--shard", f"{index}/{shards}"]
        for spec in specs:
            flag = f"e{spec.index}=tcp://127.0.0.1:{spec.port},replay=tcp://127.0.0.1:"
            command += ["--engine", f"{flag}{spec.replay_port},shard={spec.index % shards}"]
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.process = subprocess.Popen(command, preexec_fn=pin)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen}{path}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url("/readyz"), timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the bridge never became ready")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as response:
            text = response.read().decode()
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)


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
            BridgeProcess(bootstrap, topics.prefix, specs, i, shards, cpus) for i in range(shards)
        ]
        try:
            for bridge in bridges:
                bridge.wait_ready()
            time.sleep(0.5)  # the catch-up replays of a fresh start are done
            cpu_before = sum(bridge.cpu_seconds() for bridge in bridges)
            published_at = time.time()
            go.set()
            wait_caught_up(bridges, engine_count, steps)
            cpu = sum(bridge.cpu_seconds() for bridge in bridges) - cpu_before
            samples = merged_metrics(bridges)
            rss = max(bridge.peak_rss_mib() for bridge in bridges)
        finally:
            for bridge in bridges:
                bridge.stop()
    warm_from = published_at + WARMUP_S
    check = asyncio.run(read_back(bootstrap, topics, engine_count, steps, warm_from))
    seconds = check["last_append"] - published_at
    wakeups = samples.get("hmakv_bridge_messages_per_wakeup_count", 0.0)
    return {
        "batches_per_s": engine_count * steps / seconds,
        "events_per_s": engine_count * steps * 8 / seconds,
        "p50_ms": check["p50_ms"],
        "p99_ms": check["p99_ms"],
        "p50_warm_ms": check["p50_warm_ms"],
        "p99_warm_ms": check["p99_warm_ms"],
        "lost": check["lost"],
        "duplicates": check["duplicates"],
        "bridge_cpu_percent": 100 * cpu / seconds,
        "bridge_cpu_us_per_batch": 1e6 * cpu / (engine_count * steps),
        "bridge_peak_rss_mib": rss,
        "messages_per_wakeup": samples.get("hmakv_bridge_messages_per_wakeup_sum", 0.0)
        / max(wakeups, 1.0),
        "gaps_detected": sum(
            v for k, v in samples.items() if k.startswith("hmakv_bridge_gaps_detected_total")
        ),
        "seconds": seconds,
        "shards": shards,
    }


def merged_metrics(bridges: list[BridgeProcess]) -> dict[str, float]:
    """Every bridge's samples, summed where several have the same one."""
    merged: dict[str, float] = defaultdict(float)
    for bridge in bridges:
        for name, value in bridge.metrics().items():
            merged[name] += value
    return merged


def wait_caught_up(bridges: list[BridgeProcess], engine_count: int, steps: int) -> None:
    """Until Kafka acknowledged every engine's last step (a bridge forwards in order)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        samples = merged_metrics(bridges)
        done = [
            samples.get(f'hmakv_bridge_worker_last_seq{{worker="e{i}"}}', -1) >= steps
            for i in range(engine_count)
        ]
        if all(done):
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


@contextmanager
def kafka(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with ApacheKafkaBroker() as broker:
        yield broker.bootstrap


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
    total = args.engines * args.steps
    load_before = os.getloadavg()
    rows: dict[str, dict[str, float]] = {}
    with kafka(args.kafka) as bootstrap:
        rows["ceiling: SUB + decode"] = sub_ceiling(args.engines, args.steps, sub_ceiling_main)
        rows["ceiling: send_batch"] = asyncio.run(kafka_ceiling(bootstrap, total))
        ceiling = min(row["batches_per_s"] for row in rows.values())
        rows["SUB + decode, awaited"] = sub_ceiling(args.engines, args.steps, awaited_sub_main)
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
    with kafka(args.kafka) as bootstrap:
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
