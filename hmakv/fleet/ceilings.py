"""Each hop alone, doing only what no implementation of it can avoid: what bounds that hop here.

* receive: a SUB socket per engine, only receiving and decoding (``producer.events.decode``),
  drained per wake-up as the bridge's intake does;
* append: aiokafka ``create_batch``/``send_batch`` of pre-encoded event records (two per step, as
  the bridge writes them), acks=all, idempotent, several chunks in flight;
* fetch: a bare aiokafka consumer reading an events topic from its beginning and decoding every
  record (``kvlog.records.decode_event_record``), applying nothing.

A pipeline's throughput over the lowest of them is its efficiency on this machine.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import zmq
from aiokafka import AIOKafkaProducer

from hmakv.bridge.fanout import fan_out
from hmakv.bridge.readable import take_ready
from hmakv.fleet.engines import GROUP_IDS, ExpectedState, engine_name, engines, step_batch
from hmakv.kafka import unique_topic
from hmakv.kvlog import records
from hmakv.kvlog.kafka_client import (
    TopicSpec,
    create_consumer,
    ensure_topics,
    partition_for,
    start_producer,
    stop_consumer,
)
from hmakv.producer.events import decode
from hmakv.producer.protocol import encode_seq

RECEIVE_LIMIT = 1024  # messages taken from one socket per turn
START_SEQ = encode_seq(0)  # an engine's seq 0: the clear it publishes when it starts
APPEND_CHUNK = 4096  # records handed to the producer per round

Ceiling = dict[str, float]
Encoded = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


def receive_main(ports: list[int], expected: int, ready: Any, result: Any) -> None:
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


def receive_ceiling(
    engine_count: int, steps: int, target: Callable[..., None] = receive_main
) -> Ceiling:
    """``target`` (``receive_main`` or a variant with its signature) in its own process,
    receiving every step of ``engine_count`` engines publishing flat out."""
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
        outcome: Ceiling = result.get(timeout=300)
        process.join()
    outcome["batches_per_s"] = outcome["received"] / outcome["seconds"]
    outcome["events_per_s"] = outcome["events"] / outcome["seconds"]
    outcome["lost"] = expected - outcome["received"]
    return outcome


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


def encoded_steps(engine_count: int, steps: int) -> list[Encoded]:
    """Every step of every engine as the bridge writes it: a record per group."""
    return [
        (records.event_key(r.worker, r.group_idx), records.encode(r), r.headers())
        for step in range(1, steps + 1)
        for engine in range(engine_count)
        for r in fan_out(engine_name(engine), 0, step, step_batch(step, engine), GROUP_IDS)
    ]


async def append_ceiling(bootstrap: str, engine_count: int, steps: int, partitions: int) -> Ceiling:
    topic = unique_topic("ceiling-append")
    await ensure_topics(bootstrap, [TopicSpec(topic, partitions)])
    encoded = encoded_steps(engine_count, steps)
    started_producer = await start_producer(
        bootstrap, client_id="ceiling-append", linger_ms=0, max_batch_size=512 * 1024
    )
    producer = started_producer.producer
    owners = sorted(await producer.partitions_for(topic))
    started = time.monotonic()
    in_flight: list[asyncio.Future[object]] = []
    for offset in range(0, len(encoded), APPEND_CHUNK):
        by_partition: dict[int, list[Encoded]] = defaultdict(list)
        for key, value, headers in encoded[offset : offset + APPEND_CHUNK]:
            by_partition[partition_for(key, owners)].append((key, value, headers))
        for partition, chunk in by_partition.items():
            in_flight += await send_chunk(producer, topic, partition, chunk)
    await asyncio.gather(*in_flight)
    seconds = time.monotonic() - started
    await producer.stop()
    batches = engine_count * steps
    return {
        "batches_per_s": batches / seconds,
        "records_per_s": len(encoded) / seconds,
        "events_per_s": ExpectedState.of(engine_count, steps).events / seconds,
        "seconds": seconds,
        "idempotent": float(started_producer.idempotent),
    }


async def fetch_ceiling(bootstrap: str, topic: str, record_count: int) -> Ceiling:
    """Read ``record_count`` records of ``topic`` from its beginning and decode each one."""
    consumer = create_consumer(bootstrap, topic, client_id="ceiling-fetch")
    await consumer.start()
    read = 0
    try:
        started = time.monotonic()
        fetched = await consumer.getmany(timeout_ms=10_000)
        while fetched:
            for messages in fetched.values():
                for message in messages:
                    records.decode_event_record(message.value)
                read += len(messages)
            if read >= record_count:
                break
            fetched = await consumer.getmany(timeout_ms=5000)
        seconds = max(time.monotonic() - started, 1e-9)
    finally:
        await stop_consumer(consumer)
    # A step is a record per group.
    return {"batches_per_s": read / len(GROUP_IDS) / seconds, "records_per_s": read / seconds}
