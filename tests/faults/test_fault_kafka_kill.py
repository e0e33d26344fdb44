"""Scenario 2: Kafka SIGKILLed mid-stream and restarted on its data dir (the same cluster).

The test runs its own Apache Kafka broker (the session's must stay up for the other tests), on
a fixed port and data dir so that the restarted broker has the log it had. While it is gone the
bridge stops receiving (the engines' rings hold what it misses) and the index says Kafka is
silent; once it is back both recover on their own, and the index agrees with the engines.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fault_kit import BRIDGE, INDEX, Pipeline, pipeline

from hmakv.kafka import ApacheKafkaBroker
from hmakv.kafka.process import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.apache, pytest.mark.timeout(240)]

SILENCE_S = 2.0


async def readiness(fleet: Pipeline, url: str) -> int:
    return await fleet.http.status_code(f"{url}/readyz")


async def test_kafka_killed_and_restarted_on_its_data_dir_and_both_services_recover(
    tmp_path: Path,
) -> None:
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    index_args = ("--snapshot-to", "none", "--max-broker-silence", f"{SILENCE_S:g}")
    try:
        async with pipeline(tmp_path, broker.bootstrap, index_args=index_args) as fleet:
            await fleet.serve(30)
            async with fleet.streaming():
                await fleet.serve(20)
                await asyncio.to_thread(broker.kill)
                killed_at = {name: await fleet.seq(name) for name in fleet.setups}

                async def both_notice() -> bool:
                    bridge = await fleet.bridge_metrics()
                    index = await fleet.index_metrics()
                    return (
                        bridge.total(f"{BRIDGE}_kafka_reachable") == 0
                        and index.total(f"{INDEX}_ready") == 0
                        and index.total(f"{INDEX}_broker_silence_seconds") > SILENCE_S
                    )

                await fleet.until(both_notice, "the bridge and the index notice Kafka is gone")
                assert await readiness(fleet, fleet.bridge_url) == 503
                assert await readiness(fleet, fleet.index_url) == 503
                outage = {name: await fleet.seq(name) - killed_at[name] for name in fleet.setups}
                await asyncio.to_thread(broker.start)

                async def both_ready() -> bool:
                    return all(
                        [
                            await readiness(fleet, fleet.bridge_url) == 200,
                            await readiness(fleet, fleet.index_url) == 200,
                        ]
                    )

                await fleet.until(both_ready, "the bridge and the index ready again")
                await fleet.serve(20)
            await fleet.settle()
            await fleet.assert_agreement()
            bridge = await fleet.bridge_metrics()
            index = await fleet.index_metrics()
            views = await fleet.workers()
    finally:
        await asyncio.to_thread(broker.stop)
    assert all(published > 0 for published in outage.values()), "the engines went on meanwhile"
    assert bridge.total(f"{BRIDGE}_kafka_reachable") == 1
    assert index.total(f"{INDEX}_ready") == 1
    assert index.total(f"{INDEX}_records_lost_total") == 0, "the log came back whole"
    for name in fleet.setups:
        assert bridge.total(f"{BRIDGE}_gaps_unrecoverable_total", worker=name) == 0
        assert bridge.total(f"{BRIDGE}_batches_lost_total", worker=name) == 0
        assert views[name].health == "live"
        assert views[name].epoch == 0
        # Shorter than the producer's delivery timeout (40 s): nothing refused, no new epoch.
        assert bridge.total(f"{BRIDGE}_delivery_failures_total", worker=name) == 0
        assert bridge.total(f"{BRIDGE}_epochs_started_total", worker=name) == 0
