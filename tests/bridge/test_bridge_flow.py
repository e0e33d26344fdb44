"""The bridge end to end: real publishers on loopback, the bridge in this event loop, real Kafka.

What each test checks is what a consumer of the Kafka log would see: every record keyed and
ordered per worker and group, gaps repaired, restarts as new epochs opening with a clear, and a
ring too short for a gap turned into a clear and a degraded worker (or a snapshot).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Callable

import pytest
import zmq
from bridge_harness import (
    EngineThread,
    KafkaLog,
    by_group,
    engines_running,
    expected_records,
    free_port,
    free_port_pair,
    metric,
    running_bridge,
    settings_for,
    shape,
)

from hmakv.bridge.config import EngineConfig
from hmakv.kvlog.records import EventRecord, encode, event_key
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored
from hmakv.producer.protocol import decode_seq

pytestmark = pytest.mark.kafka


class LossyRelay:
    """A network that loses chosen messages: SUB from the engine, PUB to the bridge."""

    def __init__(self, upstream_port: int, drop: set[int]) -> None:
        self.port = free_port()
        self._upstream = f"tcp://127.0.0.1:{upstream_port}"
        self._drop = drop
        self.dropped: list[int] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub, ctx.socket(zmq.PUB) as pub:
            sub.connect(self._upstream)
            sub.subscribe(b"")
            pub.bind(f"tcp://127.0.0.1:{self.port}")
            self._ready.set()
            while not self._stop.is_set():
                if not sub.poll(10):
                    continue
                frames = sub.recv_multipart()
                seq = decode_seq(frames[1])
                if seq in self._drop:
                    self.dropped.append(seq)
                else:
                    pub.send_multipart(frames)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def degraded_clears(log: KafkaLog, worker: str) -> list[tuple[int, int]]:
    """(epoch, seq) of the clears the bridge made for a loss (restarts clear at seq -1)."""
    return sorted(
        {
            (r.epoch, r.seq)
            for r in log.records_of(worker)
            if r.events == [AllBlocksCleared()] and r.seq > 0
        }
    )


async def test_every_batch_reaches_kafka_keyed_and_in_order_per_worker_and_group(
    kafka_bootstrap: str,
) -> None:
    base, replay_base = free_port_pair(), free_port_pair()
    a = EngineThread("engine-a")
    dp = [EngineThread("dp", pub_port=base, replay_port=replay_base, rank=r) for r in (0, 1)]
    dp_config = EngineConfig(
        "dp",
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{replay_base}",
        topic="kv-events",
        dp_ranks=(0, 1),
    )
    settings = settings_for(kafka_bootstrap)
    with engines_running(a, *dp):
        async with running_bridge(settings, [a.config, dp_config]):
            for engine in (a, *dp):
                await engine.published_all(40)
            log = KafkaLog(kafka_bootstrap, settings.topics)
            workers = {"engine-a": a, "dp-dp0": dp[0], "dp-dp1": dp[1]}

            def complete(log: KafkaLog) -> bool:
                states = [log.state(worker) for worker in workers]
                return all(s is not None and (s.last_seq, s.health) == (40, "live") for s in states)

            await log.wait_for(complete, "every worker's 40 steps and its resume point")
    for worker, engine in workers.items():
        records = log.records_of(worker)
        first, rest = [r for r in records if r.seq == 0], [r for r in records if r.seq > 0]
        assert shape(first) == [(0, 0, 0, [AllBlocksCleared()])]  # no group known yet
        assert by_group(rest) == by_group(expected_records(worker, 0, engine))
        state = log.state(worker)
        assert state is not None
        assert (state.epoch, state.health, sorted(state.groups)) == (0, "live", [0, 1])
        assert state.groups[1].sliding_window == 64
        assert state.data_parallel_rank == (None if worker == "engine-a" else engine.rank)
    for key, record, headers in zip(log.keys, log.events, log.headers, strict=True):
        assert key == event_key(record.worker, record.group_idx)
        assert headers == {
            "worker": record.worker.encode(),
            "group": str(record.group_idx).encode(),
            "epoch": str(record.epoch).encode(),
            "seq": str(record.seq).encode(),
        }


async def test_messages_lost_on_the_way_are_replayed_and_the_log_equals_what_was_published(
    kafka_bootstrap: str,
) -> None:
    engine = EngineThread("engine-a")
    relay = LossyRelay(engine.pub_port, drop={5, 6, 7, 20, 33})
    config = EngineConfig(
        "engine-a",
        f"tcp://127.0.0.1:{relay.port}",
        f"tcp://127.0.0.1:{engine.replay_port}",
        topic="kv-events",
    )
    settings = settings_for(kafka_bootstrap)
    try:
        with engines_running(engine):
            async with running_bridge(settings, [config]) as bridge:
                await engine.published_all(40, interval=0.002)
                log = KafkaLog(kafka_bootstrap, settings.topics)
                await log.wait_for(lambda log: log.has_seq("engine-a", 40), "all 40 steps")
                detected = metric(bridge, "hmakv_bridge_gaps_detected_total", worker="engine-a")
                replayed = metric(
                    bridge, "hmakv_bridge_gaps_replayed_total", worker="engine-a", by="replay"
                )
                lost = metric(bridge, "hmakv_bridge_gaps_unrecoverable_total", worker="engine-a")
    finally:
        relay.stop()
    assert {5, 6, 7, 20, 33} <= set(relay.dropped)
    assert detected >= 3 and replayed == detected and lost == 0
    rest = [r for r in log.records_of("engine-a") if r.seq > 0]
    assert by_group(rest) == by_group(expected_records("engine-a", 0, engine))


async def test_an_engine_restart_becomes_a_new_epoch_that_opens_with_a_clear(
    kafka_bootstrap: str,
) -> None:
    pub_port, replay_port = free_port(), free_port()
    first = EngineThread("engine-a", pub_port=pub_port, replay_port=replay_port)
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    async with running_bridge(settings, [first.config]) as bridge:
        with engines_running(first):
            await first.published_all(20)
            await log.wait_for(lambda log: log.has_seq("engine-a", 20), "the first life")
        second = EngineThread("engine-a", pub_port=pub_port, replay_port=replay_port)
        with engines_running(second):
            # Spread over the bridge's reconnect (100 ms): until a batch of the new life arrives
            # live, nothing tells an idle engine's restart from a pause.
            await second.published_all(10, interval=0.05)

            def second_life(log: KafkaLog) -> bool:
                records = log.records_of("engine-a")
                return {r.group_idx for r in records if (r.epoch, r.seq) == (1, 10)} == {0, 1}

            await log.wait_for(second_life, "the second life")
        assert metric(bridge, "hmakv_bridge_epochs_started_total", worker="engine-a") == 1
    for group, records in log.applied("engine-a").items():
        epochs = [r.epoch for r in records]
        assert epochs == sorted(epochs)
        second_epoch = [r for r in records if r.epoch == 1]
        assert shape(second_epoch[:2]) == [
            (1, -1, group, [AllBlocksCleared()]),  # the bridge's clear, before anything else
            (1, 0, group, [AllBlocksCleared()]),  # the engine's own leading clear
        ]
        expected = by_group(expected_records("engine-a", 1, second))[group]
        assert second_epoch[2:] == expected


def resident_after(engine: EngineThread, seq: int) -> dict[int, set[int]]:
    resident: dict[int, set[int]] = defaultdict(set)
    for step in range(1, seq + 1):
        for event in engine.published[step].events:
            if isinstance(event, BlockStored):
                resident[event.group_idx or 0].add(int(event.block_hashes[0]))
            elif isinstance(event, BlockRemoved):
                resident[event.group_idx or 0].discard(int(event.block_hashes[0]))
    return resident


async def test_a_ring_too_short_clears_the_worker_and_marks_it_degraded(
    kafka_bootstrap: str,
) -> None:
    engine = EngineThread("engine-a", buffer_steps=5)
    settings = settings_for(kafka_bootstrap)
    with engines_running(engine):
        await engine.published_all(30)  # before the bridge: a gap from seq 0 it cannot fill
        async with running_bridge(settings, [engine.config]) as bridge:
            await engine.published_all(5, interval=0.01)
            log = KafkaLog(kafka_bootstrap, settings.topics)

            def degraded(log: KafkaLog) -> bool:
                state = log.state("engine-a")
                return state is not None and state.health == "degraded" and state.last_seq == 35

            await log.wait_for(degraded, "a degraded worker with every step after the loss")
            health = metric(
                bridge, "hmakv_bridge_worker_health", worker="engine-a", health="degraded"
            )
            lost = metric(bridge, "hmakv_bridge_gaps_unrecoverable_total", worker="engine-a")
    assert health == 1 and lost == 1
    [(_, clear_seq)] = degraded_clears(log, "engine-a")
    after = [r for r in log.records_of("engine-a") if r.seq > clear_seq]
    # nothing of the worker was known yet: the clear reaches the one group a clear always does
    assert {r.group_idx for r in log.records_of("engine-a") if r.seq == clear_seq} == {0}
    assert by_group(after) == by_group(expected_records("engine-a", 0, engine, clear_seq + 1))
    assert not [r for r in log.records_of("engine-a") if 0 <= r.seq < clear_seq]


def first_events(parts: list[EventRecord]) -> list[int]:
    """Where each part of a split record starts: after every event of the parts before it."""
    return list(itertools.accumulate((len(r.events) for r in parts[:-1]), initial=0))


def live_at(seq: int) -> Callable[[KafkaLog], bool]:
    """Whether the workers topic says engine-a is live and forwarded up to ``seq``."""

    def reached(log: KafkaLog) -> bool:
        state = log.state("engine-a")
        return state is not None and (state.last_seq, state.health) == (seq, "live")

    return reached


async def test_a_ring_too_short_is_bridged_by_the_engines_snapshot(kafka_bootstrap: str) -> None:
    engine = EngineThread("engine-a", buffer_steps=5, snapshots=True)
    settings = settings_for(kafka_bootstrap)
    with engines_running(engine):
        await engine.published_all(30)
        async with running_bridge(settings, [engine.config]) as bridge:
            await engine.published_all(5, interval=0.01)
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(live_at(35), "every step after the snapshot, the worker live")
            replayed = metric(
                bridge, "hmakv_bridge_gaps_replayed_total", worker="engine-a", by="snapshot"
            )
    assert replayed == 1
    assert not degraded_clears(log, "engine-a")
    snapshot = [r for r in log.records_of("engine-a") if r.events[0] == AllBlocksCleared()]
    snapshot_seq = max(r.seq for r in snapshot)
    resident = resident_after(engine, snapshot_seq)
    for record in (r for r in snapshot if r.seq == snapshot_seq):
        stored = {int(e.block_hashes[0]) for e in record.events if isinstance(e, BlockStored)}
        assert stored == resident[record.group_idx]
    after = [r for r in log.records_of("engine-a") if r.seq > snapshot_seq]
    assert by_group(after) == by_group(expected_records("engine-a", 0, engine, snapshot_seq + 1))


async def test_a_snapshot_too_large_for_one_record_arrives_in_parts(kafka_bootstrap: str) -> None:
    """With ``--max-record-bytes`` just above a step's records, each group's snapshot is split
    over parts of its seq: nothing is lost, the worker stays live."""
    engine = EngineThread("engine-a", buffer_steps=5, snapshots=True)
    with engines_running(engine):
        await engine.published_all(30)
        step_bytes = max(len(encode(r)) for r in expected_records("engine-a", 0, engine))
        settings = settings_for(kafka_bootstrap, max_record_bytes=step_bytes + 16)
        async with running_bridge(settings, [engine.config]):
            await engine.published_all(5, interval=0.01)
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(live_at(35), "every step after the snapshot, the worker live")
    assert not degraded_clears(log, "engine-a")
    written = log.records_of("engine-a")
    snapshot_seq = max(r.seq for r in written if r.events[0] == AllBlocksCleared())
    resident = resident_after(engine, snapshot_seq)
    for group, parts in by_group([r for r in written if r.seq == snapshot_seq]).items():
        assert len(parts) > 1
        assert [r.first_event for r in parts] == first_events(parts)
        events = [e for r in parts for e in r.events]
        assert events[0] == AllBlocksCleared()
        assert {int(e.block_hashes[0]) for e in events[1:]} == resident[group]  # type: ignore[union-attr]
    after = [r for r in written if r.seq > snapshot_seq]
    assert by_group(after) == by_group(expected_records("engine-a", 0, engine, snapshot_seq + 1))
