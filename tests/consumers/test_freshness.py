"""The freshness rules alone (issue 16): broker contact on an injected clock, a worker's lag and
staleness, what /readyz makes of them, and the books they read; no broker. The last test serves
them on a real socket, Kafka's silence made by the clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiokafka.structs import TopicPartition
from follower_kit import record, stored, worker_state
from hypothesis import given
from hypothesis import strategies as st

from hmakv.consumers.api import ScoreApi, build_app
from hmakv.consumers.applier import Applier
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.freshness import (
    BrokerContact,
    Freshness,
    FreshnessLimits,
    lag_seqs,
    not_ready,
    record_age,
)
from hmakv.consumers.index import KVIndex
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import EventRecord, Topics, WorkerState, encode, event_key


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- broker contact


def test_the_silence_counts_from_the_last_answer_and_from_the_start_before_any() -> None:
    clock = Clock()
    contact = BrokerContact(clock)
    clock.now += 4.0
    assert contact.silence_s() == 4.0  # never answered: silent since it was made
    contact.heard()
    assert contact.silence_s() == 0.0
    clock.now += 2.5
    assert contact.silence_s() == 2.5
    clock.now -= 10.0  # a clock that went back says no silence, not a negative one
    assert contact.silence_s() == 0.0


@pytest.mark.parametrize(("silence", "silent"), [(9.99, False), (10.0, False), (10.01, True)])
def test_kafka_is_silent_only_past_the_limit(silence: float, silent: bool) -> None:
    freshness = Freshness(silence, {}, FreshnessLimits(max_broker_silence_s=10.0))
    assert freshness.broker_silent is silent


@pytest.mark.parametrize(
    "limits",
    [{"max_broker_silence_s": 0.0}, {"max_broker_silence_s": float("inf")}, {"max_worker_lag": -1}],
)
def test_limits_that_cannot_work_are_refused(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        FreshnessLimits(**limits)


# ----------------------------------------------------------------------------- lag and staleness


@given(
    bridge_epoch=st.integers(0, 3),
    epoch=st.integers(0, 3),
    forwarded=st.integers(-1, 1000),
    applied=st.integers(-1, 1000),
)
def test_the_lag_is_what_the_bridge_forwarded_in_the_same_life_and_the_index_has_not_applied(
    bridge_epoch: int, epoch: int, forwarded: int, applied: int
) -> None:
    state = worker_state("w", "live", epoch=bridge_epoch, last_seq=forwarded)
    lag = lag_seqs(state, epoch, applied)
    if bridge_epoch != epoch:
        assert lag is None  # another life: its seqs count from elsewhere
    else:
        assert lag == max(0, forwarded - applied)
    assert lag_seqs(None, epoch, applied) is None


lags = st.dictionaries(st.sampled_from("abcdef"), st.none() | st.integers(0, 50))


@given(lags=lags, max_lag=st.integers(0, 50), silence=st.floats(0, 20), limit=st.floats(0.1, 20))
def test_a_worker_is_stale_past_its_lag_limit_or_while_kafka_is_silent(
    lags: dict[str, int | None], max_lag: int, silence: float, limit: float
) -> None:
    freshness = Freshness(silence, lags, FreshnessLimits(limit, max_lag))
    silent = silence > limit
    for worker, lag in lags.items():
        behind = lag is not None and lag > max_lag
        assert freshness.stale(worker) is (silent or behind)
    assert freshness.stale_workers() == {w for w in lags if freshness.stale(w)}
    if silent:
        assert freshness.stale_workers() == set(lags)  # the index cannot know: every one
    assert not_ready(caught_up=True, freshness=freshness) == (["broker_silent"] if silent else [])


def test_not_ready_says_every_reason_that_holds() -> None:
    limits = FreshnessLimits(max_broker_silence_s=1.0, max_worker_lag=0)
    behind = Freshness(0.0, {"a": 5, "b": 7}, limits)
    silent = Freshness(2.0, {}, limits)
    assert not_ready(caught_up=True, freshness=behind) == []  # stale workers alone: ready
    assert not_ready(caught_up=False, freshness=behind) == ["catching_up"]
    assert not_ready(caught_up=False, freshness=silent) == ["catching_up", "broker_silent"]


def test_a_record_age_is_never_negative_and_none_without_a_record() -> None:
    assert record_age(100.0, 103.5) == 3.5
    assert record_age(110.0, 103.5) == 0.0  # the engine's clock ran ahead
    assert record_age(None, 103.5) is None


# ----------------------------------------------------------------------------- the books


def read(applier: Applier, event: EventRecord) -> None:
    applier.apply_event(event_key(event.worker, event.group_idx), encode(event), 0)


def stamped(worker: str, seq: int, ts: float, *, group: int = 0) -> EventRecord:
    return EventRecord(worker, 0, seq, ts, group, [stored([seq], group=group)])


def test_the_applied_timestamp_is_the_newest_applied_and_goes_with_the_worker() -> None:
    applier = Applier(KVIndex())
    assert applier.applied_ts("w") is None
    read(applier, stamped("w", 0, 50.0))
    read(applier, stamped("w", 2, 60.0, group=1))
    read(applier, stamped("w", 1, 58.0))  # group 0's partition read later: an older batch
    assert applier.applied_ts("w") == 60.0
    read(applier, stamped("w", 2, 70.0, group=1))  # not applied (a replay): changes nothing
    assert applier.applied_ts("w") == 60.0
    retired = worker_state("w", "retired")
    applier.apply_worker_state(retired.key(), encode(retired), replayed=False)
    assert applier.applied_ts("w") is None


def take(applier: Applier, state: WorkerState | None, worker: str = "w") -> None:
    value = encode(state) if state is not None else None
    applier.apply_worker_state(worker.encode(), value, replayed=False)


def test_the_applier_keeps_the_workers_behind_the_bridge_as_records_and_states_come() -> None:
    applier = Applier(KVIndex(), max_worker_lag=2)
    read(applier, stamped("w", 0, 1.0))
    assert applier.lagging == set()  # no bridge state: nothing to compare with
    take(applier, worker_state("w", "live", last_seq=5))
    assert applier.lagging == {"w"}  # 5 forwarded, 0 applied
    read(applier, stamped("w", 3, 2.0))
    assert applier.lagging == set()  # 2 behind: at the limit, not past it
    ahead = worker_state("w", "live", last_seq=9)
    take(applier, ahead)
    assert applier.lagging == {"w"}
    restored = Applier(applier.index, worker_states=[ahead], max_worker_lag=2)
    assert restored.lagging == {"w"}  # read again from a restored index's progress
    take(applier, worker_state("w", "live", epoch=1, last_seq=1))
    assert applier.lagging == set()  # a new life: 2 of its seqs forwarded, none applied
    take(applier, worker_state("w", "live", epoch=1, last_seq=2))
    assert applier.lagging == {"w"}
    take(applier, None)  # a tombstone
    assert applier.lagging == set() and applier.index.progress_of("w") is None


def test_progress_is_each_workers_epoch_and_newest_applied_seq() -> None:
    index = KVIndex()
    index.apply(record("a", 4, [stored([1])], group=0, epoch=2))
    index.apply(record("a", 9, [stored([2])], group=1, epoch=2))
    index.start_epoch("b", 1)  # a life named, nothing applied in it
    assert index.progress() == {"a": (2, 9), "b": (1, -1)}


# ----------------------------------------------------------------------------- served


@asynccontextmanager
async def serving(clock: Clock) -> AsyncIterator[TestClient[Any, Any]]:
    """An index that never reached Kafka, its clock the test's, holding worker w."""
    limits = FreshnessLimits(max_broker_silence_s=10.0)
    config = FollowerConfig("127.0.0.1:1", Topics("unused"), freshness=limits)
    follower = Follower(config, clock=clock)
    follower.index.apply(record("w", 0, [stored([7])]))
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats)
    async with TestClient(TestServer(build_app(api))) as client:
        yield client


async def test_the_api_answers_from_one_reading_of_the_clock() -> None:
    clock = Clock()
    async with serving(clock) as client:
        score = {"block_hashes": [7]}
        answer = await (await client.post("/v1/score", json=score)).json()
        assert (answer["workers"][0]["stale"], answer["best"]) == (False, "w")
        readiness = await (await client.get("/readyz")).json()
        assert readiness["reasons"] == ["catching_up"]  # never started

        clock.now += 10.5
        answer = await (await client.post("/v1/score", json=score)).json()
        assert (answer["workers"][0]["stale"], answer["best"]) == (True, None)
        workers = await (await client.get("/v1/workers")).json()
        assert workers["broker_silence_s"] == 10.5
        assert workers["workers"][0]["stale"] is True
        response = await client.get("/readyz")
        readiness = await response.json()
        assert response.status == 503
        assert readiness["reasons"] == ["catching_up", "broker_silent"]
        assert (readiness["broker_silence_s"], readiness["stale_workers"]) == (10.5, 1)


# ----------------------------------------------------------------------------- stopping


class AnsweringWorkersConsumer:
    """Stands in for the workers topic's consumer so that Kafka's answer and the cancellation
    arrive in the same turn of the loop, a race a real broker hits only now and then (it hung
    the index's stop for good in CI, twice)."""

    def __init__(self, answer: asyncio.Future[dict[TopicPartition, int]]) -> None:
        self.answer = answer

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("workers", 0)}

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return await self.answer


async def test_the_broker_watch_stops_when_cancelled_as_kafka_answers() -> None:
    config = FollowerConfig("127.0.0.1:1", Topics("unused"))
    follower = Follower(config)
    answer: asyncio.Future[dict[TopicPartition, int]] = asyncio.get_running_loop().create_future()
    follower._workers = AnsweringWorkersConsumer(answer)
    watch = asyncio.create_task(follower._watch_broker())
    await asyncio.sleep(0)  # asking Kafka
    answer.set_result({TopicPartition("workers", 0): 0})
    watch.cancel()
    done, _ = await asyncio.wait([watch], timeout=2.0)
    assert done == {watch} and watch.cancelled(), "the cancellation was swallowed"
