"""Scenario 5: ``hmakv index`` SIGKILLed and restarted from its last snapshot on disk.

A SIGKILL leaves no final snapshot: the restarted index restores the last periodic one (the
index and the exact offsets it reflects) and reads only the records after it, including those
the bridge wrote while no index ran. Its answers must equal the engines' again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_kit import INDEX, kill, pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


async def test_an_index_killed_restarts_from_its_snapshot_and_agrees(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    snapshot = tmp_path / "index.snapshot"
    index_args = ("--snapshot-to", f"file:{snapshot}", "--snapshot-interval", "0.5")
    async with pipeline(tmp_path, kafka_bootstrap, index_args=index_args) as fleet:
        await fleet.serve(60)
        await fleet.settle()
        await fleet.assert_agreement()

        async def snapshot_taken() -> bool:
            page = await fleet.index_metrics()
            return page.total(f"{INDEX}_snapshots_total", outcome="written") >= 1

        await fleet.until(snapshot_taken, "a periodic snapshot written")
        async with fleet.streaming():
            await fleet.serve(20)
            kill(fleet.processes["index"])
            await fleet.serve(40)  # what the bridge writes while no index runs
        assert snapshot.is_file()
        await fleet.start_index(*index_args)
        await fleet.settle()
        await fleet.assert_agreement()
        page = await fleet.index_metrics()
        written = len(await fleet.read_topic(fleet.topics.events))
    consumed = page.total(f"{INDEX}_records_consumed_total", topic=fleet.topics.events)
    assert 0 < consumed < written, "it read what followed its snapshot, not the whole log"
    log = (tmp_path / "index.2.log").read_text()
    assert "restored" in log
