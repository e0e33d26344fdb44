"""Bridge path benchmark: the bridge's own CPU per batch, without sockets or a broker.

The end-to-end benchmark (``benchmarks/bridge.py``) shares two cores between engines, broker and
bridge, so a change of a few percent in the bridge drowns in the machine's noise there. This one
runs, in one process, what the bridge does with every live message between the ZMQ receive and
aiokafka's send: split the frames, decode, count, track the sequence, learn the catalog, fan
out, encode records and headers, queue them, take a chunk, partition it, build record batches
and account for the acknowledgement. Sixteen workers' step batches (the end-to-end benchmark's
typical step) arrive in rounds of the intake's round limit per worker, as at max rate. The
producer is a stand-in: it builds each record batch as aiokafka would and acknowledges it at
once; nothing is sent.

Baseline, same process, same messages, repeats interleaved: the least any bridge does with a
message (decode, fan out, encode, append to a record batch). Process time per batch, the best of
the repeats, with the garbage collector tuned as ``hmakv bridge`` tunes it.

    python benchmarks/bridge_path.py [--steps 1500] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from aiokafka.producer.message_accumulator import BatchBuilder

# Run as a script, this file's folder comes first on sys.path, where the end-to-end benchmark's
# name would shadow the bridge package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from hmakv.bridge.board import WorkerBoard  # noqa: E402
from hmakv.bridge.catalog import GroupCatalog  # noqa: E402
from hmakv.bridge.channel import SourceSettings, WorkerChannel  # noqa: E402
from hmakv.bridge.config import WorkerAddress  # noqa: E402
from hmakv.bridge.deadletter import DeadLetterOffice  # noqa: E402
from hmakv.bridge.fanout import fan_out  # noqa: E402
from hmakv.bridge.intake import DEFAULT_ROUND_LIMIT, Intake  # noqa: E402
from hmakv.bridge.metrics import BridgeMetrics  # noqa: E402
from hmakv.bridge.relay import WorkerRelay  # noqa: E402
from hmakv.bridge.sink import KafkaSink  # noqa: E402
from hmakv.bridge.source import ConnectedSource, SubscriberDeps  # noqa: E402
from hmakv.bridge.tracking import SequenceTracker  # noqa: E402
from hmakv.kvlog import records  # noqa: E402
from hmakv.kvlog.heap import tune_garbage_collector  # noqa: E402
from hmakv.kvlog.records import Topics  # noqa: E402
from hmakv.producer.events import KVEventBatch, decode  # noqa: E402
from hmakv.producer.events import encode as encode_batch  # noqa: E402
from hmakv.producer.protocol import decode_seq, live_frames  # noqa: E402


def _load_step_batch() -> Callable[[int, int], KVEventBatch]:
    """The end-to-end benchmark's typical step batch, so that both measure the same message."""
    spec = importlib.util.spec_from_file_location("bridge_benchmark", HERE / "bridge.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    step_batch: Callable[[int, int], KVEventBatch] = module.step_batch
    return step_batch


DEFAULT_JSON = HERE / "results" / "bridge_path.json"
WORKERS = 16
MAX_BYTES = 1 << 22
BATCH_BYTES = 512 * 1024  # the bridge's producer batch size
PARTITIONS = 6

Messages = list[list[list[bytes]]]  # per worker, its live messages in order


class InstantProducer:
    """Stands in for aiokafka's producer: builds each record batch, acknowledges it at once."""

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(BATCH_BYTES, 0)

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(PARTITIONS))

    async def send_batch(
        self, batch: BatchBuilder, topic: str, *, partition: int
    ) -> asyncio.Future[None]:
        batch._build()  # what aiokafka does before it sends the batch
        acknowledged: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        acknowledged.set_result(None)
        return acknowledged


def live_messages(steps: int) -> Messages:
    step_batch = _load_step_batch()
    return [
        [live_frames(b"", seq, encode_batch(step_batch(seq, worker))) for seq in range(steps)]
        for worker in range(WORKERS)
    ]


async def bridge_path(messages: Messages) -> float:
    """Seconds of CPU for every message through the bridge's path, rounds as the intake's."""
    topics, metrics, board = Topics(), BridgeMetrics(), WorkerBoard()
    sink = KafkaSink(InstantProducer(), topics, board, metrics, max_queued=1 << 30, in_flight=2)
    office = DeadLetterOffice(sink, metrics, MAX_BYTES)
    settings = SourceSettings(max_payload_bytes=MAX_BYTES, replay_timeout=5.0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    deps = SubscriberDeps(ctx, Intake(sink.wait_for_room), office, metrics, settings, lambda: None)
    sources = []
    for worker in range(WORKERS):
        name = f"e{worker}"
        tracker = SequenceTracker(can_fetch=False)
        relay = WorkerRelay(
            name,
            tracker,
            GroupCatalog(),
            topics=topics,
            data_parallel_rank=None,
            max_record_bytes=MAX_BYTES,
        )
        address = WorkerAddress(name, None, "tcp://engine", None)
        channel = WorkerChannel(
            relay,
            address,
            ctx=ctx,
            sink=sink,
            board=board,
            metrics=metrics,
            replays=asyncio.Semaphore(1),
            office=office,
            settings=settings,
        )
        channel.start()
        channel.on_connected()
        sources.append(ConnectedSource(channel, "", deps))
    sink.start()
    started = time.process_time()
    for start in range(0, len(messages[0]), DEFAULT_ROUND_LIMIT):
        for source, worker_messages in zip(sources, messages, strict=True):
            # What the intake hands a source per round: that socket's messages, in order.
            source._on_messages(worker_messages[start : start + DEFAULT_ROUND_LIMIT])
        await sink.wait_idle()
    seconds = time.process_time() - started
    await sink.close(timeout=5.0)
    ctx.destroy(linger=0)
    return seconds


def bare_path(messages: Messages) -> float:
    """Seconds of CPU for the least any bridge does: decode, fan out, encode, append."""
    producer = InstantProducer()
    started = time.process_time()
    for worker, worker_messages in enumerate(messages):
        name, headers = f"e{worker}", records.EventHeaders(f"e{worker}")
        builder = producer.create_batch()
        for frames in worker_messages:
            seq = decode_seq(frames[1])
            batch = decode(frames[2]).batch
            for record in fan_out(name, 0, seq, batch, (0, 1)):
                key = records.event_key(name, record.group_idx)
                value = records.encode(record)
                record_headers = headers.of(record)
                if builder.append(timestamp=None, key=key, value=value, headers=record_headers):
                    continue
                builder._build()  # full: the next batch
                builder = producer.create_batch()
                builder.append(timestamp=None, key=key, value=value, headers=record_headers)
        builder._build()
    return time.process_time() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="batches per worker")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    messages = live_messages(args.steps)
    tune_garbage_collector()
    batches = WORKERS * args.steps
    bridge_s, bare_s = [], []
    for _ in range(args.repeats):
        bridge_s.append(asyncio.run(bridge_path(messages)))
        bare_s.append(bare_path(messages))
    bridge_us, bare_us = 1e6 * min(bridge_s) / batches, 1e6 * min(bare_s) / batches
    rows = [
        ("bare: decode, fan out, encode, append", bare_us),
        ("bridge: frames to acknowledged record batches", bridge_us),
    ]
    print(f"{'path':48s} {'µs CPU/batch':>12s} {'vs bare':>8s}")
    for name, us in rows:
        print(f"{name:48s} {us:12.2f} {us / bare_us:8.2f}")
    report = {
        "benchmark": "bridge_path",
        "machine": {"python": platform.python_version()},
        "workers": WORKERS,
        "steps_per_worker": args.steps,
        "repeats": args.repeats,
        "bare_us_per_batch": bare_us,
        "bridge_us_per_batch": bridge_us,
        "ratio": bridge_us / bare_us,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
