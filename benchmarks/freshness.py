"""Freshness: from an engine's batch to the index applying it, hop by hop, on both brokers.

For each broker (Apache Kafka and the demo's embedded Tansu), in one run:

- the pipeline at the demo's load: ``hmakv demo --kafka BROKER --no-model`` (two reference
  engines at 4 requests/s each, the probe's routed prompts, and its score and workers calls on
  the index), read from the summary: the event age (engine batch to index apply) and its hops,
  engine to bridge (``hmakv_bridge_intake_age_seconds``), the bridge handing records to its
  producer to Kafka's ack (``hmakv_bridge_kafka_send_latency_seconds``), and a record's Kafka
  timestamp to the index fetching it (``hmakv_index_fetch_age_seconds``); each interpolated in
  its histogram's buckets;
- the broker's floor: a bare aiokafka producer (acks=all, no linger) and consumer (the index's
  fetch wait) through a fresh broker of the same kind, one small record every 10 ms, the time
  from ``send`` to the consumer holding it. No pipeline can deliver faster through that broker
  and client on this machine.

Figures are ratios to the floor of the same broker, and Tansu's to Apache Kafka's: on 2 shared
cores absolute milliseconds are a property of the load.

    python benchmarks/freshness.py [--duration 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from harness import quantile, write_report

from hmakv.consumers.follower import FollowerConfig
from hmakv.kafka import local_broker
from hmakv.kvlog.kafka_client import TopicSpec, ensure_topics

DEFAULT_JSON = Path(__file__).parent / "results" / "freshness.json"
BROKERS = ("apache", "tansu")
HMAKV = Path(sys.executable).with_name("hmakv")
FLOOR_RECORDS = 500
FLOOR_GAP_S = 0.01


async def _floor(bootstrap: str) -> dict[str, float]:
    topic = "freshness-floor"
    await ensure_topics(bootstrap, [TopicSpec(topic)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_wait_ms=round(FollowerConfig.fetch_max_wait_s * 1000),
    )
    await producer.start()
    await consumer.start()
    try:
        await producer.send_and_wait(topic, b"warm-up")
        await consumer.getone()
        ages: list[float] = []
        reading = asyncio.create_task(_read(consumer, ages))
        for _ in range(FLOOR_RECORDS):
            await producer.send(topic, repr(time.perf_counter()).encode())
            await asyncio.sleep(FLOOR_GAP_S)
        await asyncio.wait_for(reading, 30)
    finally:
        await producer.stop()
        await consumer.stop()
    return {"p50_s": quantile(ages, 0.5), "p99_s": quantile(ages, 0.99)}


async def _read(consumer: AIOKafkaConsumer, ages: list[float]) -> None:
    while len(ages) < FLOOR_RECORDS:
        batches = await consumer.getmany(timeout_ms=1000)
        now = time.perf_counter()
        ages.extend(now - float(r.value) for rs in batches.values() for r in rs if r.value)


def floor(dist: str) -> dict[str, float]:
    broker = local_broker(dist).start()
    try:
        return asyncio.run(_floor(broker.bootstrap))
    finally:
        broker.stop()


def pipeline(dist: str, duration_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        summary_path = Path(folder) / "summary.json"
        argv = [str(HMAKV), "demo", "--kafka", dist, "--no-model", "--duration", f"{duration_s:g}"]
        argv += ["--json", str(summary_path), "--workdir", str(Path(folder) / "work")]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 600)
        if run.returncode != 0 or not summary_path.exists():
            raise RuntimeError(f"hmakv demo --kafka {dist} failed:\n{run.stdout[-3000:]}")
        summary = json.loads(summary_path.read_text())
    return {
        "event_age": summary["event_age"],
        "kafka_ack_age": summary["kafka_ack_age"],
        **summary["hops"],
        "lost": summary["pipeline"]["lost"],
        "batches": summary["pipeline"]["batches_published"],
    }


ROWS = (
    ("event age, engine -> index", "event_age"),
    ("  engine -> Kafka ack", "kafka_ack_age"),
    ("  engine -> bridge", "engine_to_bridge"),
    ("  bridge -> Kafka ack", "bridge_to_kafka_ack"),
    ("  Kafka -> index fetch", "kafka_to_index_fetch"),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'':28s}" + "".join(f"{d + ' p50':>13s}{d + ' p99':>13s}" for d in results)]
    for label, key in ROWS:
        cells = "".join(
            f"{_ms(r['pipeline'][key]['p50_s']):>13s}{_ms(r['pipeline'][key]['p99_s']):>13s}"
            for r in results.values()
        )
        lines.append(f"{label:28s}{cells}")
    floors = "".join(
        f"{_ms(r['floor']['p50_s']):>13s}{_ms(r['floor']['p99_s']):>13s}" for r in results.values()
    )
    lines.append(f"{'floor: bare producer -> consumer':28s}{floors}")
    for dist, r in results.items():
        age, base = r["pipeline"]["event_age"], r["floor"]
        lines.append(
            f"{dist}: event age / floor p50 {age['p50_s'] / base['p50_s']:.1f}x, "
            f"p99 {age['p99_s'] / base['p99_s']:.1f}x; lost {r['pipeline']['lost']} of "
            f"{r['pipeline']['batches']} batches"
        )
    if set(results) == set(BROKERS):
        apache, tansu = (results[d]["pipeline"]["event_age"] for d in BROKERS)
        lines.append(
            f"tansu / apache event age: p50 {tansu['p50_s'] / apache['p50_s']:.2f}, "
            f"p99 {tansu['p99_s'] / apache['p99_s']:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of demo per broker")
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for dist in args.brokers.split(","):
        print(f"{dist}: floor, then the demo for {args.duration:g} s", flush=True)
        results[dist] = {"floor": floor(dist), "pipeline": pipeline(dist, args.duration)}
    print(table(results))
    report = {
        "command": " ".join(["python", "benchmarks/freshness.py", *sys.argv[1:]]),
        "machine": platform.platform(),
        "duration_s": args.duration,
        "results": results,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()
