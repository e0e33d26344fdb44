"""Workers that leave the fleet, move between bridges or come back (real ZMQ, Apache Kafka).

A worker nothing follows any more must not be served from a state nobody keeps current: the
bridge writes it ``retired`` once, and follows it as a new life (one epoch later) should it come
back. A worker that only moves to another bridge's shard is not retired: that bridge resumes it
from the workers topic as it is at that moment.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
from bridge_harness import (
    EngineThread,
    KafkaLog,
    by_group,
    engines_running,
    expected_records,
    free_port,
    free_port_pair,
    metric,
    publish_steps,
    running_bridge,
    settings_for,
    shape,
)

from hmakv.bridge.config import EngineConfig
from hmakv.producer.publisher import ZmqEventPublisher

pytestmark = pytest.mark.kafka


def state_is(
    worker: str, health: str | None, *, epoch: int = 0, last_seq: int | None = None
) -> Callable[[KafkaLog], bool]:
    """Whether the worker's latest state says so (None: whatever it says)."""

    def condition(log: KafkaLog) -> bool:
        state = log.state(worker)
        return (
            state is not None
            and state.epoch == epoch
            and health in (None, state.health)
            and last_seq in (None, state.last_seq)
        )

    return condition


async def test_an_engine_removed_from_the_fleet_is_retired_and_comes_back_as_a_new_life(
    kafka_bootstrap: str,
) -> None:
    gone, staying = EngineThread("engine-a"), EngineThread("engine-b")
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(gone, staying):
        async with running_bridge(settings, [gone.config, staying.config]) as bridge:
            await gone.published_all(3)
            await log.wait_for(state_is("engine-a", "live", last_seq=3), "engine-a's steps")
            await bridge.reload([staying.config], fleet=["engine-b"])
            await log.wait_for(state_is("engine-a", "retired"), "engine-a retired")
            assert metric(bridge, "hmakv_bridge_workers_retired_total") == 1
            assert metric(bridge, "hmakv_bridge_worker_epoch", worker="engine-a") == 0  # gone

            await gone.published_all(2)  # while nothing follows it
            await bridge.reload([gone.config, staying.config])
            await gone.published_all(2)
            back = state_is("engine-a", "live", epoch=1, last_seq=7)
            # A group's records share a partition: its seq 7 read, all before it are too.
            await log.wait_for(lambda log: back(log) and log.has_seq("engine-a", 7), "a new life")
    assert state_is("engine-b", "live")(log)
    # The new life is caught up from the engine's first seq: consumers dropped the old one.
    new_life = [r for r in log.records_of("engine-a") if r.epoch == 1 and r.seq > 0]
    expected = by_group(expected_records("engine-a", 1, gone))
    assert {g: shape(records) for g, records in by_group(new_life).items()} == {
        g: shape(records) for g, records in expected.items()
    }
    healths = [s.health for s in log.states if s.worker == "engine-a"]
    assert healths.count("retired") == 1


async def test_an_engine_moved_to_another_bridge_is_resumed_there_not_retired(
    kafka_bootstrap: str,
) -> None:
    """Shards are reloaded one after the other: the bridge that takes the engine over reads the
    workers topic as the previous one left it, and forwards each seq once."""
    engine = EngineThread("engine-a")
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    fleet = ["engine-a"]
    with engines_running(engine):
        async with (
            running_bridge(settings, [engine.config]) as first,
            running_bridge(settings, []) as second,
        ):
            await engine.published_all(3)
            await log.wait_for(state_is("engine-a", "live", last_seq=3), "the first steps")
            await first.reload([], fleet=fleet)  # pinned to the other shard now
            await second.reload([engine.config], fleet=fleet)
            await engine.published_all(3)
            caught_up = state_is("engine-a", "live", last_seq=6)
            await log.wait_for(lambda log: caught_up(log) and log.has_seq("engine-a", 6), "after")
            assert metric(first, "hmakv_bridge_workers_retired_total") == 0
    assert all(state.health != "retired" for state in log.states)
    forwarded = Counter((r.group_idx, r.seq) for r in log.records_of("engine-a") if r.seq > 0)
    assert set(forwarded.values()) == {1}, "the second bridge resumed where the first stopped"
    assert shape(log.applied("engine-a")[0][1:]) == shape(
        [r for r in expected_records("engine-a", 0, engine) if r.group_idx == 0]
    )


async def test_a_dp_rank_an_engine_no_longer_has_is_retired_and_the_others_go_on(
    kafka_bootstrap: str,
) -> None:
    base, replay_base = free_port_pair(), free_port_pair()
    ranks = [EngineThread("dp", pub_port=base, replay_port=replay_base, rank=r) for r in (0, 1)]
    both = EngineConfig(
        "dp", f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{replay_base}", dp_ranks=(0, 1)
    )
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(*ranks):
        async with running_bridge(settings, [both]) as bridge:
            for rank in ranks:
                await rank.published_all(3)
            await log.wait_for(
                lambda log: all(state_is(w, "live", last_seq=3)(log) for w in ("dp-dp0", "dp-dp1")),
                "both ranks",
            )
            await bridge.reload([dataclasses.replace(both, dp_ranks=(0,))])
            await ranks[0].published_all(2)
            await log.wait_for(state_is("dp-dp1", "retired"), "rank 1 retired")
            await log.wait_for(state_is("dp-dp0", "live", last_seq=5), "rank 0 going on")
            assert metric(bridge, "hmakv_bridge_workers_retired_total") == 1


async def test_a_pod_resumes_its_epoch_after_a_bridge_restart(kafka_bootstrap: str) -> None:
    """A worker named by its llm-d topic resumes from the workers topic like a configured one:
    after a restart of its engine (epoch 1) and then of the bridge, it goes on in epoch 1, whose
    records consumers read, not in a fresh epoch 0, which they would ignore. (Its health may be
    degraded: a pod has no replay endpoint, and its first messages may reach no socket yet.)"""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    settings = settings_for(kafka_bootstrap, bind_sub=endpoint, join_by_topic=True)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    topic = "kv@pod-x@llama"
    async with running_bridge(settings, []):
        first_life = ZmqEventPublisher(0, endpoint, None, topic=topic)
        await asyncio.sleep(0.5)  # its connection to the bridge is made
        await asyncio.to_thread(publish_steps, [first_life], 5)
        await log.wait_for(state_is("pod-x", None, last_seq=5), "the first life")
        first_life.shutdown()
        second_life = ZmqEventPublisher(0, endpoint, None, topic=topic)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(publish_steps, [second_life], 5)
        await log.wait_for(state_is("pod-x", None, epoch=1, last_seq=5), "the second life")
    try:
        async with running_bridge(settings, []):
            await asyncio.sleep(0.5)  # the publisher reconnects to the new bridge
            await asyncio.to_thread(publish_steps, [second_life], 5, 6)
            await log.wait_for(state_is("pod-x", None, epoch=1, last_seq=10), "after restart")
    finally:
        second_life.shutdown()
    later = [r for r in log.records_of("pod-x") if r.seq > 5]
    assert later and {r.epoch for r in later} == {1}
