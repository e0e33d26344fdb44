"""What the bridge does when Kafka refuses records for good, and when its own delivery fails.

A refusal is made real: the events topic exists before the bridge starts, with a record limit
below one batch's record for group 1, so the broker answers that produce request with
RECORD_TOO_LARGE, a final error.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from bridge_harness import (
    GROUPS,
    EngineThread,
    KafkaLog,
    engines_running,
    metric,
    metric_reaches,
    running_bridge,
    settings_for,
    step_batch,
)

from hmakv.kvlog.kafka_client import TopicSpec, ensure_topics
from hmakv.producer.events import AllBlocksCleared, BlockStored, GroupSpec, KVEventBatch

pytestmark = pytest.mark.kafka

REFUSED_SEQ = 3
TOPIC_RECORD_LIMIT = 4000  # bytes: every step's record fits, the refused one's group 1 does not


def with_a_large_group_1_record(seq: int, rank: int) -> KVEventBatch:
    """A step as usual, but at REFUSED_SEQ group 1 also stores 600 blocks (~6 KB of hashes),
    and the step after it has group 0's events only: its record is on another partition
    (``engine-a/0`` and ``engine-a/1`` hash to partitions 2 and 1 of 3), which takes it."""
    batch = step_batch(seq, rank)
    if seq == REFUSED_SEQ:
        hashes = [2**63 + seq * 1000 + i for i in range(600)]
        batch.events.append(BlockStored(hashes, None, [], 4, None, "GPU", None, group_idx=1))
    if seq == REFUSED_SEQ + 1:
        batch.events[:] = [e for e in batch.events if not e.group_idx]  # type: ignore[union-attr]
    return batch


async def test_a_refused_batch_starts_one_new_epoch_and_no_resume_point_passes_it(
    kafka_bootstrap: str,
) -> None:
    settings = settings_for(kafka_bootstrap)
    limit = {"max.message.bytes": str(TOPIC_RECORD_LIMIT)}
    await ensure_topics(kafka_bootstrap, [TopicSpec(settings.topics.events, 3, config=limit)])
    engine = EngineThread("engine-a", make_batch=with_a_large_group_1_record)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(engine):
        async with running_bridge(settings, [engine.config]) as bridge:
            await engine.published_all(5)
            failures = "hmakv_bridge_delivery_failures_total"
            await metric_reaches(bridge, failures, 1, worker="engine-a")
            await engine.published_all(5)

            def caught_up(log: KafkaLog) -> bool:
                state = log.state("engine-a")
                return state is not None and (state.epoch, state.last_seq) == (1, 10)

            await log.wait_for(caught_up, "the steps after the refusal, in epoch 1")
            await asyncio.sleep(0.5)  # time for any further (wrong) epoch to start
            epochs = metric(bridge, "hmakv_bridge_epochs_started_total", worker="engine-a")
            replaced = metric(bridge, "hmakv_bridge_kafka_producer_replacements_total")
    assert epochs == 1
    # The steps after it went through a new producer: one that saw a refusal may be stuck.
    assert replaced == 1
    # The workers topic never said that epoch 0 reached the refused seq: a restart would have
    # resumed after it.
    assert not [s for s in log.states if s.epoch == 0 and s.last_seq >= REFUSED_SEQ]
    assert log.state("engine-a").health == "degraded"  # type: ignore[union-attr]
    # Epoch 1 opens with a clear in every group; what follows is the engine's later steps.
    for group in GROUPS:
        later = [r for r in log.records_of("engine-a") if r.epoch == 1 and r.group_idx == group]
        assert later[0].events == [AllBlocksCleared()]
        assert [r.seq for r in later[1:]][-5:] == [6, 7, 8, 9, 10]


async def test_a_delivery_loop_that_fails_stops_the_bridge_being_ready(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the sink's loops cannot be caused from outside, so one is planted: the bridge
    must say so (``wait_crashed``, ``/readyz``) instead of holding its queue forever."""
    engine = EngineThread("engine-a")
    with engines_running(engine):
        async with running_bridge(settings_for(kafka_bootstrap), [engine.config]) as bridge:
            assert bridge.readiness().started
            sink = bridge._sink
            assert sink is not None

            async def planted_bug(*_: object, **__: object) -> None:
                raise RuntimeError("a planted bug")

            monkeypatch.setattr(sink, "_prepare", planted_bug)
            await engine.published_all(3)
            await asyncio.wait_for(bridge.wait_crashed(), 10)
            assert not bridge.readiness().ready


@pytest.mark.parametrize("refused", ["before the reload", "while the reload closes its channel"])
async def test_an_engine_reloaded_after_a_refusal_goes_on_in_the_refusals_epoch(
    kafka_bootstrap: str, refused: str
) -> None:
    """A reload restarts a changed engine from its position. A refusal (told to the worker's
    channel directly, no broker refusing on cue), seen before the reload or while it closes the
    old channel, has opened epoch 1, its clear still queued: the engine must go on in epoch 1,
    whose clear consumers will see, not in epoch 0, whose records they would then ignore."""
    engine = EngineThread("engine-a")
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(engine):
        async with running_bridge(settings, [engine.config]) as bridge:
            await engine.published_all(3)
            await metric_reaches(bridge, "hmakv_bridge_worker_last_seq", 3, worker="engine-a")
            channel = bridge._channels["engine-a"]
            if refused == "before the reload":
                channel.on_refused(0, 3)
            else:
                close = channel.close

                async def close_with_a_refusal_meanwhile() -> None:
                    channel.on_refused(0, 3)
                    await close()

                channel.close = close_with_a_refusal_meanwhile  # type: ignore[method-assign]
            groups = {0: GroupSpec("full_attention", 4)}
            await bridge.reload([dataclasses.replace(engine.config, groups=groups)])
            await engine.published_all(3)

            def caught_up(log: KafkaLog) -> bool:
                state = log.state("engine-a")
                return state is not None and state.last_seq == 6

            await log.wait_for(caught_up, "the steps after the reload")
    assert log.state("engine-a").epoch == 1  # type: ignore[union-attr]
    for group in GROUPS:
        epochs = [r.epoch for r in log.records_of("engine-a") if r.group_idx == group]
        assert epochs == sorted(epochs) and epochs[-1] == 1


async def test_a_refusal_reported_while_a_channel_closes_starts_no_fetch(
    kafka_bootstrap: str,
) -> None:
    """A reload closes a changed engine's channel, and Kafka may report a refusal in the event
    loop turns that takes (told to the channel directly here): the snapshot it asks for must not
    start, or it would run on, for a worker the new channel follows in another epoch."""
    engine = EngineThread("engine-a")
    settings = settings_for(kafka_bootstrap)
    with engines_running(engine):
        async with running_bridge(settings, [engine.config]) as bridge:
            await engine.published_all(3)
            await metric_reaches(bridge, "hmakv_bridge_worker_last_seq", 3, worker="engine-a")
            channel = bridge._channels["engine-a"]
            closing = asyncio.create_task(channel.close())
            await asyncio.sleep(0)  # close() has begun
            channel.on_refused(0, 3)
            await closing
            fetches = [t for t in asyncio.all_tasks() if "WorkerChannel._fetch" in repr(t)]
            assert fetches == []
