"""Freshness through a running index on real sockets and a real Apache Kafka (issue 16): Kafka
silent makes /readyz 503 and every worker stale, and its return undoes both; a worker further
behind the bridge than --max-worker-lag is stale in /v1/workers, /v1/score and /metrics; the index
stops cleanly while Kafka is away.

The outage tests run their own broker (the session's must stay up for the other tests), with a
fixed port and data dir so that a restarted broker is the same cluster with the same log. A
paused broker keeps its connections open and answers nothing (requests hang); a stopped one
refuses them: the index must notice either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from follower_kit import (
    LogWriter,
    follower_config,
    fresh_topics,
    record,
    stored,
    wait_until,
    worker_state,
)
from prometheus_client.parser import text_string_to_metric_families

from hmakv.consumers.freshness import FreshnessLimits
from hmakv.consumers.service import IndexService, ServiceConfig
from hmakv.kafka import ApacheKafkaBroker
from hmakv.kafka.process import free_port
from hmakv.kvlog.records import Topics

SILENCE_S = 1.0
PROMPT = [1, 2, 3]  # block hashes the workers hold
SCORE = {"block_hashes": PROMPT}


class IndexClient:
    """The index's HTTP API as a router and a probe see it."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url

    async def readiness(self) -> tuple[int, Any]:
        async with self.http.get(f"{self.url}/readyz") as response:
            return response.status, await response.json()

    async def ready(self) -> bool:
        return (await self.readiness())[0] == 200

    async def workers(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/v1/workers") as response:
            assert response.status == 200
            return {view["worker"]: view for view in (await response.json())["workers"]}

    async def score(self, **asked: Any) -> Any:
        async with self.http.post(f"{self.url}/v1/score", json=SCORE | asked) as response:
            assert response.status == 200
            return await response.json()

    async def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        async with self.http.get(f"{self.url}/metrics") as response:
            text = await response.text()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


@asynccontextmanager
async def running_index(
    bootstrap: str, topics: Topics, limits: FreshnessLimits
) -> AsyncIterator[IndexClient]:
    config = follower_config(bootstrap, topics, freshness=limits)
    service = IndexService(ServiceConfig(follower=config, port=0, snapshot_to="none"))
    await service.start()
    try:
        async with aiohttp.ClientSession() as http:
            yield IndexClient(http, service.url)
    finally:
        await service.stop(final_snapshot=False)


def stale_flags(answer: dict[str, Any]) -> dict[str, bool]:
    return {hit["worker"]: hit["stale"] for hit in answer["workers"]}


async def fill(log: LogWriter, *workers: str) -> None:
    """Each worker holds the prompt at seq 0, which its bridge state says it forwarded."""
    for worker in workers:
        await log.state(worker_state(worker, "live", last_seq=0))
        await log.events(record(worker, 0, [stored(PROMPT)]))


async def both_workers_current(index: IndexClient) -> bool:
    workers = await index.workers()
    return set(workers) == {"a", "b"} and all(view["lag_seqs"] == 0 for view in workers.values())


# ----------------------------------------------------------------------------- Kafka away


def pause(broker: ApacheKafkaBroker) -> Callable[[], Awaitable[None]]:
    """Freeze the broker's processes; the returned call thaws them."""
    os.killpg(broker.pid, signal.SIGSTOP)

    async def resume() -> None:
        os.killpg(broker.pid, signal.SIGCONT)

    return resume


def stop(broker: ApacheKafkaBroker) -> Callable[[], Awaitable[None]]:
    """Stop the broker; the returned call starts it again, the same cluster."""
    broker.stop()

    async def restart() -> None:
        await asyncio.to_thread(broker.start)

    return restart


@pytest.mark.kafka
@pytest.mark.apache
@pytest.mark.parametrize("outage", [pause, stop], ids=["paused", "stopped"])
async def test_kafka_silent_makes_readyz_503_and_every_worker_stale_until_it_answers(
    tmp_path: Path, outage: Callable[[ApacheKafkaBroker], Callable[[], Awaitable[None]]]
) -> None:
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    limits = FreshnessLimits(max_broker_silence_s=SILENCE_S)
    try:
        topics = await fresh_topics(broker.bootstrap)
        async with LogWriter(broker.bootstrap, topics) as log:
            await fill(log, "a", "b")
        async with running_index(broker.bootstrap, topics, limits) as index:
            await wait_until(index.ready, "the index ready")
            await wait_until(lambda: both_workers_current(index), "both workers applied")
            assert stale_flags(await index.score()) == {"a": False, "b": False}
            assert (await index.score())["best"] == "a"

            back = await asyncio.to_thread(outage, broker)

            async def silent() -> bool:
                status, body = await index.readiness()
                return status == 503 and "broker_silent" in body["reasons"]

            await wait_until(silent, "/readyz says Kafka is silent")
            status, body = await index.readiness()
            assert (status, body["ready"], body["stale_workers"]) == (503, False, 2)
            assert body["broker_silence_s"] > SILENCE_S
            workers = await index.workers()
            assert {name: view["stale"] for name, view in workers.items()} == {"a": True, "b": True}
            assert [view["lag_seqs"] for view in workers.values()] == [0, 0]  # what it last knew
            answer = await index.score()
            assert stale_flags(answer) == {"a": True, "b": True}
            assert answer["best"] is None and answer["group_blind"]["best"] is None
            assert answer["workers"][0]["hit_tokens"] > 0  # the blocks are still there
            page = await index.metrics()
            assert page[("hmakv_index_ready", frozenset())] == 0
            assert page[("hmakv_index_broker_silence_seconds", frozenset())] > SILENCE_S
            assert page[("hmakv_index_worker_stale", frozenset({("worker", "a")}))] == 1

            await back()
            await wait_until(index.ready, "/readyz 200 once Kafka answers again")
            status, body = await index.readiness()
            assert (status, body["reasons"], body["stale_workers"]) == (200, [], 0)
            assert stale_flags(await index.score()) == {"a": False, "b": False}
            assert (await index.score())["best"] == "a"
            assert not any(view["stale"] for view in (await index.workers()).values())
    finally:
        thaw(broker)
        await asyncio.to_thread(broker.stop)


@pytest.mark.kafka
@pytest.mark.apache
async def test_the_index_stops_cleanly_while_kafka_is_away(
    tmp_path: Path, aiokafka_tasks: Callable[[], list[asyncio.Task[object]]]
) -> None:
    """An operator stopping the index during an outage: its consumers' fetches sleep out their
    retry backoff, which aiokafka's own stop turned into a CancelledError out of the index's
    shutdown (once in CI, at the end of the test above). It must stop, leaving no client behind."""
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    try:
        topics = await fresh_topics(broker.bootstrap)
        async with LogWriter(broker.bootstrap, topics) as log:
            await fill(log, "a", "b")
        config = follower_config(broker.bootstrap, topics, freshness=FreshnessLimits())
        service = IndexService(ServiceConfig(follower=config, port=0, snapshot_to="none"))
        await service.start()
        async with aiohttp.ClientSession() as http:
            index = IndexClient(http, service.url)
            await wait_until(lambda: both_workers_current(index), "both workers applied")
    finally:
        await asyncio.to_thread(broker.stop)
    await asyncio.sleep(1.0)  # the index's fetches have met the refused connections
    await service.stop()
    assert aiokafka_tasks() == []


def thaw(broker: ApacheKafkaBroker) -> None:
    """A broker a failed test left paused must be able to take the SIGTERM that stops it."""
    with contextlib.suppress(RuntimeError, ProcessLookupError):  # stopped already
        os.killpg(broker.pid, signal.SIGCONT)


# ----------------------------------------------------------------------------- lag


@pytest.mark.kafka
async def test_a_worker_further_behind_the_bridge_than_the_limit_is_stale_and_never_best(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    limits = FreshnessLimits(max_worker_lag=3)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running_index(kafka_bootstrap, topics, limits) as index,
    ):
        await fill(log, "a", "b")
        await wait_until(lambda: both_workers_current(index), "both workers applied")
        # The bridge forwarded a's seqs up to 10; the index has applied 0 of them.
        await log.state(worker_state("a", "live", last_seq=10))

        async def a_lags() -> bool:
            return (await index.workers())["a"]["lag_seqs"] == 10

        await wait_until(a_lags, "a's new state read")
        workers = await index.workers()
        assert (workers["a"]["stale"], workers["b"]["stale"]) == (True, False)
        assert workers["a"]["applied_age_s"] >= 0
        answer = await index.score()
        assert stale_flags(answer) == {"a": True, "b": False}
        assert answer["best"] == "b", "a has the same hit and the first name, but is stale"
        for top in (1, 2):  # a router asking for the best few is never offered a stale worker
            topped = await index.score(top=top, details=False)
            assert ([hit["worker"] for hit in topped["workers"]], topped["best"]) == (["b"], "b")
        page = await index.metrics()
        assert page[("hmakv_index_worker_stale", frozenset({("worker", "a")}))] == 1
        assert page[("hmakv_index_worker_lag_seqs", frozenset({("worker", "a")}))] == 10
        assert page[("hmakv_index_worker_stale", frozenset({("worker", "b")}))] == 0
        status, body = await index.readiness()
        assert (status, body["reasons"], body["stale_workers"]) == (200, [], 1)

        # Within the limit again: 3 seqs behind is not more than 3.
        await log.events(*(record("a", seq, [stored(PROMPT)]) for seq in range(1, 8)))

        async def a_within_the_limit() -> bool:
            return (await index.workers())["a"]["lag_seqs"] == 3

        await wait_until(a_within_the_limit, "a's records applied")
        assert not (await index.workers())["a"]["stale"]
        assert (await index.score())["best"] == "a"

        # Retired: its series go with it.
        await log.state(worker_state("a", "retired", last_seq=7))

        async def a_gone() -> bool:
            return "a" not in await index.workers()

        await wait_until(a_gone, "a retired")
        page = await index.metrics()
        assert ("hmakv_index_worker_stale", frozenset({("worker", "a")})) not in page
        assert ("hmakv_index_worker_lag_seqs", frozenset({("worker", "a")})) not in page
        assert ("hmakv_index_worker_stale", frozenset({("worker", "b")})) in page
