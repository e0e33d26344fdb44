"""/metrics of a running index fed through Kafka: Prometheus' own parser and linter accept it,
and its numbers are the index's and the follower's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest
from follower_kit import (
    FULL,
    SWA,
    LogWriter,
    cleared,
    follower_config,
    fresh_topics,
    record,
    removed,
    stored,
    wait_until,
    worker_state,
)
from prometheus_client.parser import text_string_to_metric_families

from hmakv.consumers.service import IndexService, ServiceConfig

pytestmark = pytest.mark.kafka

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(page: Samples, name: str, **labels: str) -> float:
    return page[(name, frozenset(labels.items()))]


async def test_metrics_parse_pass_promtool_and_report_the_index(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # One partition: a partial eviction needs group 1's removal after group 0's store.
    topics = await fresh_topics(kafka_bootstrap)
    service = IndexService(
        ServiceConfig(
            follower=follower_config(kafka_bootstrap, topics),
            port=0,
            snapshot_to=f"file:{tmp_path / 'index.snapshot'}",
        )
    )
    records = [
        record("a", 0, [stored([1, 2, 3, 4])], group=0),
        record("a", 0, [stored([1, 2, 3, 4], group=1, spec=SWA)], group=1),
        record("a", 1, [removed([1, 2], group=1)], group=1),  # full copies stay: partial
        record("b", 0, [stored([1, 2])], group=0),
        record("b", 1, [cleared()], group=0),
        record("b", 1, [cleared()], group=0),  # a replay
    ]
    await service.start()
    try:
        async with LogWriter(kafka_bootstrap, topics) as log, aiohttp.ClientSession() as http:
            await log.events(*records)
            await log.state(worker_state("a", "live", groups={0: FULL, 1: SWA}))
            await log.state(worker_state("b", "degraded"))
            await log.raw(topics.events, b"a/0", b"\xc1")
            follower = service.follower
            await wait_until(lambda: follower.stats.worker_states_applied == 2, "states applied")
            # lag() knows only the log ends of the last fetch: wait for the last record itself
            await wait_until(
                lambda: (topics.events, "undecodable") in follower.stats.bad_records,
                "the bad record counted",
            )
            await wait_until(lambda: follower.ready and follower.lag() == 0, "caught up")
            await follower.snapshot_now()
            bodies: list[dict[str, list[int]]] = [{"block_hashes": [1, 2, 3]}, {"block_hashes": []}]
            for body in bodies:
                async with http.post(f"{service.url}/v1/score", json=body):
                    pass
            async with http.get(f"{service.url}/metrics") as response:
                assert response.status == 200
                assert response.content_type == "text/plain"
                text = await response.text()
    finally:
        await service.stop()

    lint = subprocess.run(
        [shutil.which("promtool") or "promtool", "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")

    page = samples(text)
    counters = follower.index.counters
    for info in follower.index.workers():
        for group, media in info.resident.items():
            for medium, blocks in media.items():
                kind = info.groups[group].kind
                labels = {"worker": info.name, "group": str(group), "kind": kind, "medium": medium}
                assert value(page, "hmakv_index_resident_blocks", **labels) == blocks
    assert (
        value(
            page,
            "hmakv_index_resident_blocks",
            worker="a",
            group="1",
            kind="sliding_window",
            medium="GPU",
        )
        == 2
    )
    assert value(page, "hmakv_index_blocks_stored_total") == counters.stored == 10
    assert value(page, "hmakv_index_blocks_removed_total") == 2
    assert value(page, "hmakv_index_partial_evictions_total") == 2
    assert value(page, "hmakv_index_clears_total") == 1
    assert value(page, "hmakv_index_records_ignored_total", reason="duplicate") == 1
    assert value(page, "hmakv_index_records_applied_total") == 5
    assert value(page, "hmakv_index_workers", health="degraded") == 1
    assert value(page, "hmakv_index_workers", health="live") == 1
    assert (
        value(page, "hmakv_index_bad_records_total", topic=topics.events, reason="undecodable") == 1
    )
    assert value(page, "hmakv_index_records_consumed_total", topic=topics.events) == 7
    assert value(page, "hmakv_index_consumer_lag_records", topic=topics.events) == 0
    assert value(page, "hmakv_index_event_age_seconds_count") == 5
    # every events-topic record fetched, applied or not; Kafka's timestamps are the producer's
    assert value(page, "hmakv_index_fetch_age_seconds_count") == 7
    assert value(page, "hmakv_index_fetch_age_seconds_sum") < 60
    assert value(page, "hmakv_index_score_requests_total", outcome="ok") == 1
    assert value(page, "hmakv_index_score_requests_total", outcome="rejected") == 1
    assert value(page, "hmakv_index_score_duration_seconds_count") == 2
    assert value(page, "hmakv_index_snapshots_total", outcome="written") == 1
    assert value(page, "hmakv_index_snapshot_age_seconds") >= 0
    assert value(page, "hmakv_index_ready") == 1
    names = {name for name, _ in page}
    assert all(name.startswith("hmakv_index_") for name in names), names
