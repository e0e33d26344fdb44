"""Kafka away for a while: the bridge holds what fits, stops receiving, and loses nothing.

The test runs its own Apache Kafka broker (the session's must stay up for the other tests), with
a fixed port and data dir so that the restarted broker is the same cluster with the same log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from bridge_harness import (
    EngineThread,
    KafkaLog,
    by_group,
    engines_running,
    expected_records,
    free_port,
    metric,
    metric_reaches,
    running_bridge,
    settings_for,
)

from hmakv.bridge.service import BridgeService
from hmakv.kafka import ApacheKafkaBroker
from hmakv.producer.events import GroupSpec


@pytest.mark.kafka
@pytest.mark.apache
async def test_kafka_stopped_and_restarted_loses_nothing_the_ring_covered(tmp_path: Path) -> None:
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    engine = EngineThread("engine-a")
    settings = settings_for(broker.bootstrap, queue_size=20)
    log = KafkaLog(broker.bootstrap, settings.topics)
    try:
        with engines_running(engine):
            async with running_bridge(settings, [engine.config]) as bridge:
                await engine.published_all(20)
                await log.wait_for(lambda log: log.has_seq("engine-a", 20), "the first steps")
                await asyncio.to_thread(broker.stop)
                await engine.published_all(200, interval=0.005)  # the queue holds 20 of them
                # the time the intake is paused shows while the outage lasts
                await metric_reaches(bridge, "hmakv_bridge_queue_full_seconds_total", 0.5)
                await asyncio.to_thread(broker.start)
                await engine.published_all(10)
                await log.wait_for(lambda log: log.has_seq("engine-a", 230), "every step", 90)
                paused = metric(bridge, "hmakv_bridge_queue_full_seconds_total")
                lost = metric(bridge, "hmakv_bridge_gaps_unrecoverable_total", worker="engine-a")
    finally:
        await asyncio.to_thread(broker.stop)
    assert paused > 0, "the outage never filled the queue: the test proves nothing"
    assert lost == 0
    for group, records in log.applied("engine-a").items():
        rest = [r for r in records if r.seq > 0]
        assert rest == by_group(expected_records("engine-a", 0, engine))[group]


@pytest.mark.kafka
@pytest.mark.apache
async def test_stopping_during_an_outage_counts_what_is_left_and_keeps_to_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM while Kafka is away: the bridge must not wait for Kafka (its idempotent producer
    would retry forever) and must say how many batches it did not deliver."""
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    engine = EngineThread("engine-a")
    settings = settings_for(broker.bootstrap, queue_size=20, shutdown_timeout=1.0)
    log = KafkaLog(broker.bootstrap, settings.topics)
    try:
        with engines_running(engine):
            service = BridgeService(settings, [engine.config])
            await service.start()
            try:
                await engine.published_all(5)
                await log.wait_for(lambda log: log.has_seq("engine-a", 5), "the first steps")
                await asyncio.to_thread(broker.stop)
                await engine.published_all(50, interval=0.005)
                await asyncio.sleep(0.5)  # the intake takes what the queue holds
            finally:
                started = time.monotonic()
                await service.stop()
                stopping = time.monotonic() - started
    finally:
        await asyncio.to_thread(broker.stop)
    assert stopping < 15 * settings.shutdown_timeout  # its producer alone would retry forever
    [left] = [r.args[0] for r in caplog.records if "not delivered at shutdown" in r.getMessage()]
    assert isinstance(left, int) and left >= 20  # at least what the queue held


@pytest.mark.kafka
@pytest.mark.apache
async def test_a_reload_before_kafka_answers_takes_effect_once_the_bridge_has_started(
    tmp_path: Path,
) -> None:
    """``hmakv bridge`` takes SIGHUP from the start, and start waits for Kafka as long as it
    takes: a reload meanwhile must wait for start, then follow the engines it names. (It ran at
    once and dropped the engine it changed, for good.)"""
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    engine = EngineThread("engine-a")
    settings = settings_for(broker.bootstrap, kafka_retry=0.2)
    service = BridgeService(settings, [engine.config])
    changed = dataclasses.replace(engine.config, groups={0: GroupSpec("full_attention", 16)})
    try:
        with engines_running(engine):
            starting = asyncio.create_task(service.start())
            reloading = asyncio.create_task(service.reload([changed]))
            await asyncio.sleep(1.0)
            assert not starting.done() and not reloading.done()
            await asyncio.to_thread(broker.start)
            await asyncio.wait_for(asyncio.gather(starting, reloading), 60)
            log = KafkaLog(broker.bootstrap, settings.topics)
            await engine.published_all(3)
            await log.wait_for(lambda log: log.has_seq("engine-a", 3), "engine-a's steps")
            assert service.readiness().sources == {"engine-a": "connected"}
    finally:
        await service.stop()
        await asyncio.to_thread(broker.stop)


@pytest.mark.kafka
@pytest.mark.apache
async def test_a_stop_during_a_reload_that_waits_for_kafka_ends_it_changing_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload reads the workers topic until Kafka answers; SIGTERM meanwhile must end it
    without a new engine's source being added to a bridge that is closing its sources (it was
    added once Kafka came back, and ran on a ZMQ context already destroyed)."""
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    engine, newcomer = EngineThread("engine-a"), EngineThread("engine-b")
    settings = settings_for(broker.bootstrap, kafka_retry=0.2)
    service = BridgeService(settings, [engine.config])
    try:
        with engines_running(engine, newcomer):
            await service.start()
            await asyncio.to_thread(broker.stop)
            reloading = asyncio.create_task(service.reload([engine.config, newcomer.config]))
            await asyncio.sleep(1.0)
            assert not reloading.done()  # reading the workers topic, which is away
            stopping = asyncio.create_task(service.stop())
            await asyncio.wait_for(reloading, 30)
            await asyncio.to_thread(broker.start)  # the old reload would go on now
            await asyncio.wait_for(stopping, 60)
    finally:
        await asyncio.to_thread(broker.stop)
    assert "engines not reloaded: the bridge is stopping" in caplog.text
    assert service.readiness().sources == {"engine-a": "connected"}
