"""Scenario 1: ``hmakv bridge`` SIGKILLed mid-stream and restarted by its supervisor.

The engines go on publishing while no bridge follows them; the new bridge resumes every worker
from the workers topic and replays what it missed from the engines' rings. Nothing is lost, no
engine life is mistaken for a new one, and the index agrees with the engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_kit import BRIDGE, INDEX, kill, pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


async def test_a_bridge_killed_mid_stream_resumes_and_loses_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    async with pipeline(tmp_path, kafka_bootstrap) as fleet:
        async with fleet.streaming():
            seqs = {name: await fleet.seq(name) for name in fleet.setups}

            async def resumable() -> bool:
                page = await fleet.bridge_metrics()
                return all(
                    page.total(f"{BRIDGE}_worker_last_seq", worker=name) > 20 for name in seqs
                )

            await fleet.until(resumable, "resume points past seq 20")
            kill(fleet.processes["bridge"])
            killed_at = {name: await fleet.seq(name) for name in seqs}

            async def moved_on() -> bool:
                now = {name: await fleet.seq(name) for name in seqs}
                return all(now[name] >= killed_at[name] + 30 for name in seqs)

            await fleet.until(moved_on, "the engines published 30 batches with no bridge")
            await fleet.start_bridge()
        await fleet.settle()

        async def all_live() -> bool:  # the quiet catch-up's probe replay may still be running
            page = await fleet.bridge_metrics()
            return all(
                page.total(f"{BRIDGE}_worker_health", worker=name, health="live") == 1
                for name in seqs
            )

        await fleet.until(all_live, "every worker live again")
        page = await fleet.bridge_metrics()
        index_page = await fleet.index_metrics()
        await fleet.assert_agreement()
        views = await fleet.workers()
    bridge_log = (tmp_path / "bridge.2.log").read_text()
    assert "2 workers resumed" in bridge_log
    # Every removal the index applied was of a block it held: no batch went missing between.
    assert index_page.total(f"{INDEX}_removal_anomalies_total") == 0
    assert index_page.total(f"{INDEX}_worker_restarts_total") == 0
    for name in seqs:
        detected = page.total(f"{BRIDGE}_gaps_detected_total", worker=name)
        assert detected >= 1, "the bridge saw no gap: the kill proves nothing"
        assert page.total(f"{BRIDGE}_gaps_replayed_total", worker=name, by="replay") == detected
        assert page.total(f"{BRIDGE}_gaps_replayed_total", worker=name, by="snapshot") == 0
        assert page.total(f"{BRIDGE}_batches_lost_total", worker=name) == 0
        assert page.total(f"{BRIDGE}_gaps_unrecoverable_total", worker=name) == 0
        assert page.total(f"{BRIDGE}_epochs_started_total", worker=name) == 0
        assert page.total(f"{BRIDGE}_worker_health", worker=name, health="live") == 1
        assert views[name].epoch == 0, "a bridge restart is not an engine restart"
        assert views[name].health == "live"
