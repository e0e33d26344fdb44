"""The follower against a real Kafka broker, fed records exactly as the bridge writes them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiokafka.errors import CommitFailedError
from aiokafka.structs import TopicPartition
from follower_kit import (
    FULL,
    SWA,
    LogWriter,
    add_partitions,
    cleared,
    committed_offsets,
    follower_config,
    fresh_topics,
    hit_tokens,
    partition_of,
    record,
    removed,
    resident,
    running,
    stored,
    wait_until,
    worker_state,
)
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hmakv.consumers.api import ScoreApi, build_app
from hmakv.consumers.follower import Follower
from hmakv.consumers.index import ApplyOutcome, KVIndex
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.snapshots import FileSnapshotStore
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import EventRecord, encode, event_key
from hmakv.producer.events import GroupSpec

pytestmark = pytest.mark.kafka


def events_consumed(follower: Follower) -> int:
    return follower.stats.consumed.get(follower.config.topics.events, 0)


async def test_records_apply_in_order_and_replays_or_older_epochs_change_nothing(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.events(
            record("w", 0, [stored([1, 2, 3])]),
            record("w", 1, [removed([3])]),
            record("w", 1, [stored([3])]),  # seq 1 again: a replay, whatever it carries
            record("w", 2, [stored([4])]),
        )
        await wait_until(lambda: events_consumed(follower) == 4, "4 records consumed")
        # In order: 3 was stored, then removed; the replayed store of 3 was ignored.
        assert hit_tokens(follower, "w", [1, 2, 3, 4]) == 32
        assert resident(follower, "w") == 3

        await log.events(
            record("w", 0, [stored([7])], epoch=1),  # the engine restarted
            record("w", 3, [stored([1, 2, 3])], epoch=0),  # a late record of its previous life
        )
        await wait_until(lambda: events_consumed(follower) == 6, "6 records consumed")
        assert hit_tokens(follower, "w", [1, 2, 3]) == 0
        assert resident(follower, "w") == 1
        [info] = follower.index.workers()
        assert (info.epoch, info.last_seq) == (1, {0: 0})
        counters = follower.index.counters
        assert (counters.duplicates_ignored, counters.stale_epoch_ignored) == (1, 1)
        assert follower.stats.events_applied == 4


async def test_clears_catalogs_and_degraded_workers_take_effect_at_once(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.events(record("w", 0, [stored([1, 2])]))
        await log.state(worker_state("w", "degraded", last_seq=0, groups={0: SWA}))
        # The follower may not have read anything yet: no worker is not a degraded one.
        await wait_until(
            lambda: [w.health for w in follower.index.workers()] == ["degraded"], "degraded"
        )
        [info] = follower.index.workers()
        assert info.groups == {0: SWA}
        assert follower.worker_state("w") is not None

        await log.state(worker_state("w", "live", last_seq=1))
        await log.events(record("w", 1, [cleared()]))
        await wait_until(lambda: events_consumed(follower) == 2, "the clear consumed")
        # The states topic is read apart from the events topic: wait for it, too.
        await wait_until(lambda: follower.stats.worker_states_applied == 2, "the live state")
        assert follower.index.workers()[0].health == "live"
        assert resident(follower, "w") == 0


async def test_a_retired_worker_is_dropped_and_late_records_of_its_life_are_ignored(
    kafka_bootstrap: str,
) -> None:
    """The bridge retires a worker that left the fleet. Its groups' partitions may be read
    after the workers topic: what they still hold of the retired life must not bring it back.
    Should it return, the bridge follows it as a new life, one epoch later."""
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        stats = follower.stats
        await log.events(record("w", 0, [stored([1, 2])]), record("v", 0, [stored([1])]))
        await wait_until(lambda: stats.events_applied == 2, "both workers")
        await log.state(worker_state("w", "retired", last_seq=0))
        await wait_until(lambda: stats.worker_states_applied == 1, "the retirement")
        assert [info.name for info in follower.index.workers()] == ["v"]
        assert follower.worker_state("w") is None

        await log.events(record("w", 1, [stored([3])]))  # late, from the retired life
        await log.state(worker_state("w", "retired", last_seq=1))  # written again: no change
        await wait_until(lambda: events_consumed(follower) == 3, "the late record")
        await wait_until(
            lambda: stats.worker_states_ignored == {"retired": 1}, "the repeated retirement"
        )
        assert stats.worker_states_applied == 1, "the repeated retirement changed nothing"
        assert [info.name for info in follower.index.workers()] == ["v"]
        counters = follower.index.counters
        assert (counters.workers_retired, counters.retired_ignored) == (1, 1)

        await log.state(worker_state("w", "live", epoch=1))
        await log.events(record("w", 0, [stored([5])], epoch=1))
        await wait_until(lambda: stats.events_applied == 3, "the new life")
        assert hit_tokens(follower, "w", [5]) == 16
        assert hit_tokens(follower, "w", [1, 2]) == 0
        exposition = generate_latest(index_registry(follower, ScoreStats())).decode()
        assert "hmakv_index_workers_retired_total 1.0" in exposition
        assert 'hmakv_index_records_ignored_total{reason="retired"} 1.0' in exposition
        assert 'hmakv_index_worker_states_ignored_total{reason="retired"} 1.0' in exposition


async def test_bad_records_are_counted_by_reason_logged_and_skipped(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    good = record("w", 0, [stored([1])])
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        with caplog.at_level(logging.WARNING, logger="hmakv.consumers.follower"):
            await log.raw(topics.events, b"w/0", b"\xc1 not msgpack")
            await log.raw(topics.events, b"w/0", b"\xc1 again")
            await log.raw(topics.events, b"no-group", encode(good))
            await log.raw(topics.events, event_key("other", 0), encode(good))
            await log.raw(topics.events, b"w/0", None)
            await log.raw(topics.workers, b"w", b"\x93garbage")
            await log.events(good)
            await wait_until(lambda: follower.stats.events_applied == 1, "the good record")
            await wait_until(lambda: sum(follower.stats.bad_records.values()) == 6, "all bad")
        assert follower.stats.bad_records == {
            (topics.events, "undecodable"): 2,
            (topics.events, "bad_key"): 1,
            (topics.events, "key_mismatch"): 1,
            (topics.events, "empty"): 1,
            (topics.workers, "undecodable"): 1,
        }
        assert resident(follower, "w") == 1
        warnings = [r.getMessage() for r in caplog.records if "skipped a" in r.getMessage()]
        # The second undecodable event record is counted, not logged again.
        assert len(warnings) == 5, warnings


async def test_replica_mode_reads_every_partition_in_every_follower(kafka_bootstrap: str) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=3)
    workers = [f"w{n}" for n in range(8)]
    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record(w, 0, [stored([n + 1])]) for n, w in enumerate(workers)))
        for name in ("replica-a", "replica-b"):
            config = follower_config(kafka_bootstrap, topics, follower_id=name)
            async with running(Follower(config)) as follower:
                await wait_until(lambda: follower.ready, f"{name} ready")
                assert [info.name for info in follower.index.workers()] == workers
                assert {
                    tp.partition for tp in follower.positions() if tp.topic == topics.events
                } == {
                    0,
                    1,
                    2,
                }


class _FailingIndex(KVIndex):
    """An index whose apply raises ``failure`` at one seq."""

    def __init__(self, fail_at_seq: int, failure: type[BaseException]) -> None:
        super().__init__(hash_block_size=16)
        self.fail_at_seq = fail_at_seq
        self.failure = failure

    def apply(self, record: EventRecord) -> ApplyOutcome:
        if record.seq == self.fail_at_seq:
            raise self.failure(f"apply failed at seq {record.seq}")
        return super().apply(record)


async def test_replica_mode_reads_partitions_added_while_it_runs(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The bridge looks a new key's partition up, so new workers (llm-d pods) land on partitions
    added after the follower started: they are assigned and read from their beginning, and lag
    and readiness cover them; the partitions read so far go on where they were."""
    topics = await fresh_topics(kafka_bootstrap, partitions=1)
    config = follower_config(kafka_bootstrap, topics, partition_check_interval_s=0.2)
    async with running(Follower(config)) as follower:
        async with LogWriter(kafka_bootstrap, topics) as log:
            await log.events(record("w0", 0, [stored([1, 2])]))
        await wait_until(lambda: follower.stats.events_applied == 1, "w0 applied")
        with caplog.at_level(logging.INFO, logger="hmakv.consumers.follower"):
            await add_partitions(kafka_bootstrap, topics.events, 4)
            newcomer = next(f"w{n}" for n in range(1, 64) if partition_of(f"w{n}", 0, 4) == 3)
            async with LogWriter(kafka_bootstrap, topics) as log:
                await log.events(record(newcomer, 0, [stored([1, 2, 3])]))
            await wait_until(lambda: follower.stats.events_applied == 2, "the newcomer applied")
        assert hit_tokens(follower, newcomer, [1, 2, 3]) == 48
        every = {TopicPartition(topics.events, partition) for partition in range(4)}
        assert follower.assigned_partitions() == every
        assert {tp: follower.stats.start_offsets[tp] for tp in every} == dict.fromkeys(every, 0)
        assert events_consumed(follower) == 2, "partition 0 was not read again"
        assert follower.stats.partitions_added == {topics.events: 3}
        assert scraped(follower, "hmakv_index_partitions_added_total", topic=topics.events) == 3
        assert f"{topics.events} now has 4 partitions" in caplog.text
        await wait_until(lambda: follower.ready and follower.lag() == 0, "ready")


async def test_a_record_the_index_fails_on_is_counted_and_the_follower_goes_on(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No real input is known to make ``KVIndex.apply`` raise once sizes are checked at decoding,
    so the index is made to fail at one seq, as a bug would. Stopping would stop again at the
    same offset after every restart: the record is counted, logged with its traceback, its
    group (maybe half applied) forgotten, and what follows applied."""
    topics = await fresh_topics(kafka_bootstrap)
    follower = Follower(follower_config(kafka_bootstrap, topics))
    follower.index = _FailingIndex(fail_at_seq=1, failure=RuntimeError)
    async with LogWriter(kafka_bootstrap, topics) as log, running(follower):
        with caplog.at_level(logging.WARNING, logger="hmakv.consumers.follower"):
            await log.events(
                record("w", 0, [stored([1, 2])]),
                record("w", 1, [removed([2])]),
                record("w", 2, [stored([3])]),
                record("v", 0, [stored([1, 2])]),
            )
            await wait_until(lambda: follower.stats.events_applied == 3, "the other records")
        assert follower.stats.bad_records == {(topics.events, "apply_error"): 1}
        assert resident(follower, "w") == 1, "w's group was forgotten, then stored 3"
        assert hit_tokens(follower, "w", [3]) == 16
        assert hit_tokens(follower, "v", [1, 2]) == 32
        [warning] = [r for r in caplog.records if "apply_error" in r.getMessage()]
        assert warning.exc_info is not None
        assert str(warning.exc_info[1]) == "apply failed at seq 1"


async def test_group_mode_commits_only_what_was_applied(kafka_bootstrap: str) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    tp = TopicPartition(topics.events, 0)
    config = follower_config(kafka_bootstrap, topics, mode="group", group_id=topics.prefix)
    async with LogWriter(kafka_bootstrap, topics) as log:
        offsets = await log.events(*(record("w", seq, [stored([seq + 1])]) for seq in range(10)))
        async with running(Follower(config)) as follower:
            await wait_until(lambda: follower.stats.events_applied == 10, "10 applied")
            await wait_until(lambda: follower.positions().get(tp) == offsets[-1] + 1, "positioned")
        committed = await committed_offsets(kafka_bootstrap, topics.prefix, topics.events, 1)
        assert committed == {0: offsets[-1] + 1}

        # Small fetches, so that commits happen between the batches before the interrupted one.
        # Applying is cut short at seq 15, mid-batch (a cancellation is the one failure that
        # still ends the consume loop between two records).
        failing = Follower(dataclasses.replace(config, max_records_per_fetch=2))
        failing.index = _FailingIndex(fail_at_seq=15, failure=asyncio.CancelledError)
        offsets = await log.events(
            *(record("w", seq, [stored([seq + 1])]) for seq in range(10, 20))
        )
        await failing.start()
        with pytest.raises(asyncio.CancelledError):
            await failing.run()
        await failing.stop(final_snapshot=False)
    after_failure = await committed_offsets(kafka_bootstrap, topics.prefix, topics.events, 1)
    assert after_failure[0] is not None
    assert after_failure[0] <= offsets[5], "an offset was committed for a record never applied"
    assert after_failure[0] >= offsets[3], "applied batches before the failure were not committed"


async def test_group_rebalance_commits_revoked_partitions_and_marks_their_groups_stale(
    kafka_bootstrap: str,
) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=2)
    keys = [(worker, group) for worker in ("u", "v", "w") for group in (0, 1)]

    def member(name: str) -> Follower:
        return Follower(
            follower_config(
                kafka_bootstrap, topics, mode="group", group_id=topics.prefix, follower_id=name
            )
        )

    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record(w, 0, [stored([9])], group=g) for w, g in keys))
        async with running(member("first")) as first:
            await wait_until(lambda: first.stats.events_applied == len(keys), "all applied")
            assert all(not first.stale_groups(worker) for worker, _ in keys)
            async with running(member("second")) as second:
                await wait_until(
                    lambda: second.ready and len(first.assigned_partitions()) == 1,
                    "the partitions split between the members",
                )
                [taken] = second.assigned_partitions()
                assert taken not in first.assigned_partitions()
                committed = await committed_offsets(
                    kafka_bootstrap, topics.prefix, topics.events, 2
                )
                # The revoked partition was committed at what the first member had applied.
                assert committed[taken.partition] == first.positions()[taken]
                moved = {(w, g) for w, g in keys if g in first.stale_groups(w)}
                assert moved, "some worker group lives in the moved partition"
                for worker, group in keys:
                    assert resident(second, worker, group) == (1 if (worker, group) in moved else 0)
                    assert not second.stale_groups(worker)


async def test_a_key_whose_group_is_no_ascii_number_is_a_bad_record_and_the_rest_apply(
    kafka_bootstrap: str,
) -> None:
    """``int()`` failed on such keys and its ValueError stopped the follower at that offset,
    again after every restart."""
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        good = record("w", 0, [stored([1])])
        await log.raw(topics.events, "w/\N{SUPERSCRIPT TWO}".encode(), encode(good))
        await log.raw(topics.events, b"w/" + b"9" * 5000, encode(good))
        await log.events(good, record("w", 1, [stored([2])]))
        await wait_until(lambda: follower.stats.events_applied == 2, "the good records applied")
        assert follower.stats.bad_records == {(topics.events, "bad_key"): 2}
        assert hit_tokens(follower, "w", [1, 2]) == 32


async def score_over_http(follower: Follower, body: dict[str, Any]) -> tuple[int, Any]:
    """POST /v1/score to the follower's API; the JSON answer, or the text of a failure."""
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats)
    async with TestClient(TestServer(build_app(api))) as client:
        response = await client.post("/v1/score", json=body)
        if response.content_type != "application/json":
            return response.status, await response.text()
        return response.status, await response.json()


def scraped(follower: Follower, name: str, **labels: str) -> float:
    """A sample of the follower's /metrics page (with these labels), as Prometheus reads it."""
    page = generate_latest(index_registry(follower, ScoreStats())).decode()
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"{name} {labels} is not exported")


def answered(answer: dict[str, Any], *fields: str) -> dict[str, tuple[Any, ...]]:
    return {hit["worker"]: tuple(hit[name] for name in fields) for hit in answer["workers"]}


async def test_sizes_no_group_can_have_never_stop_the_others_being_scored(
    kafka_bootstrap: str,
) -> None:
    """A store of block size 0 (vLLM's CPU-offloading stores carry it) keeps its blocks and
    teaches no group spec; a negative block size, or a worker state whose group has block size
    0, does not decode and is counted. Learned, either made every score request fail."""
    topics = await fresh_topics(kafka_bootstrap)
    zero = msgspec.structs.replace(stored([9]), block_size=0)
    negative = msgspec.structs.replace(stored([9]), block_size=-16)
    zero_state = msgspec.structs.replace(
        worker_state("zero", "live"), groups={0: GroupSpec("full_attention", 0)}
    )
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.events(
            record("good", 0, [stored([1, 2, 3])]),
            record("zero", 0, [zero]),
            record("negative", 0, [negative]),
        )
        await log.raw(topics.workers, b"zero", encode(zero_state))
        consumed = follower.stats.consumed
        await wait_until(
            lambda: (consumed.get(topics.events), consumed.get(topics.workers)) == (3, 1),
            "every record consumed",
        )
        status, answer = await score_over_http(follower, {"block_hashes": [1, 2, 3, 9]})
        assert status == 200, answer
        assert answer["best"] == "good"
        assert answered(answer, "hit_tokens", "catalog_ok") == {
            "good": (48, True),
            "zero": (0, False),
        }
        assert follower.stats.bad_records == {
            (topics.events, "undecodable"): 1,
            (topics.workers, "undecodable"): 1,
        }
        assert follower.index.counters.sizeless_stores == 1
        assert scraped(follower, "hmakv_index_sizeless_stores_total") == 1


async def test_a_newer_epoch_on_the_workers_topic_drops_the_old_life_before_its_records(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The bridge writes a worker's state of a new epoch only after Kafka took a record of it:
    the engine restarted, and its old blocks are gone even if that record is not read yet."""
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        stats = follower.stats
        await log.events(record("w", 0, [stored([1, 2, 3])], epoch=1))
        await wait_until(lambda: stats.events_applied == 1, "epoch 1 applied")
        assert hit_tokens(follower, "w", [1, 2, 3]) == 48

        await log.state(worker_state("w", "live", epoch=2))
        await wait_until(lambda: stats.worker_states_applied == 1, "the epoch 2 state")
        assert hit_tokens(follower, "w", [1, 2, 3]) == 0
        assert follower.index.workers()[0].epoch == 2

        await log.events(
            record("w", -1, [cleared()], epoch=2), record("w", 0, [stored([1, 2])], epoch=2)
        )
        await wait_until(lambda: stats.events_applied == 3, "epoch 2 applied")
        assert hit_tokens(follower, "w", [1, 2, 3]) == 32

        with caplog.at_level(logging.WARNING, logger="hmakv.consumers.follower"):
            for _ in range(2):  # a bridge that lost its resume point, writing it again
                await log.state(worker_state("w", "live", epoch=1, last_seq=7))
            await wait_until(
                lambda: stats.worker_states_ignored == {"stale_epoch": 2}, "the epoch 1 states"
            )
        assert stats.worker_states_applied == 1, "only the epoch 2 state took effect"
        assert follower.index.workers()[0].epoch == 2
        assert hit_tokens(follower, "w", [1, 2, 3]) == 32
        warnings = [r for r in caplog.records if "lost its resume point" in r.getMessage()]
        assert len(warnings) == 1, "logged once per worker and epoch"


async def test_an_older_epochs_state_leaves_the_current_lifes_catalog_and_health_alone(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A late state of an older life (an old bridge still writing during a handover) must not
    loosen the hit rule of the blocks held (window blocks counted that the worker does not
    hold) nor make a degraded worker eligible again; it is counted as ignored, not applied."""
    topics = await fresh_topics(kafka_bootstrap)
    async with (
        LogWriter(kafka_bootstrap, topics) as log,
        running(Follower(follower_config(kafka_bootstrap, topics))) as follower,
    ):
        await log.state(worker_state("w", "degraded", epoch=1, groups={0: FULL, 1: SWA}))
        await log.events(
            record("w", 0, [stored([1, 2, 3, 4], group=0)], group=0, epoch=1),
            record("w", 0, [stored([1, 2], group=1, spec=SWA)], group=1, epoch=1),
        )
        await wait_until(lambda: resident(follower, "w", 1) == 2, "epoch 1 applied")
        assert hit_tokens(follower, "w", [1, 2, 3, 4]) == 32  # the window holds blocks 1..2

        stats = follower.stats
        with caplog.at_level(logging.INFO, logger="hmakv.consumers.follower"):
            await log.state(worker_state("w", "live", epoch=0, groups={0: FULL}))
            await wait_until(lambda: stats.worker_states_ignored == {"stale_epoch": 1}, "epoch 0")
        assert "ignored a state of worker w (live, epoch 0, stale_epoch)" in caplog.text
        assert stats.worker_states_applied == 1
        ignored = scraped(follower, "hmakv_index_worker_states_ignored_total", reason="stale_epoch")
        assert ignored == 1
        [info] = follower.index.workers()
        assert (info.epoch, info.health, info.groups) == (1, "degraded", {0: FULL, 1: SWA})
        assert hit_tokens(follower, "w", [1, 2, 3, 4]) == 32


async def test_a_failed_commit_is_counted_retried_and_never_stops_the_follower(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker's rebalance timing cannot be forced from a test, so the member's commits fail
    here as aiokafka fails them during a rebalance (``CommitFailedError``) until the test lets
    them through: applying goes on, a later interval commits, and ``stop()`` still writes the
    final snapshot when its own commit fails."""
    topics = await fresh_topics(kafka_bootstrap)
    config = follower_config(kafka_bootstrap, topics, mode="group", group_id=topics.prefix)
    follower = Follower(config, FileSnapshotStore(tmp_path / "index.snapshot"))
    tp = TopicPartition(topics.events, 0)
    failing = True
    async with LogWriter(kafka_bootstrap, topics) as log:
        await follower.start()
        try:
            really_commit = follower._events.commit

            async def commit(offsets: dict[TopicPartition, int]) -> None:
                if failing:
                    raise CommitFailedError("the group is rebalancing")
                await really_commit(offsets)

            follower._events.commit = commit
            with caplog.at_level(logging.WARNING, logger="hmakv.consumers.follower"):
                offsets = await log.events(*(record("w", s, [stored([s + 1])]) for s in range(5)))
                await wait_until(lambda: follower.stats.events_applied == 5, "all applied")
                await wait_until(lambda: follower.stats.commits_failed >= 2, "commits retried")
            assert any("CommitFailedError" in r.getMessage() for r in caplog.records)
            assert scraped(follower, "hmakv_index_commits_failed_total") == (
                follower.stats.commits_failed
            )

            failing = False

            async def committed() -> bool:
                found = await committed_offsets(kafka_bootstrap, topics.prefix, topics.events, 1)
                return found == {0: offsets[-1] + 1}

            await wait_until(committed, "a later interval committed everything")
            assert follower.positions()[tp] == offsets[-1] + 1
            failing = True
            failed = follower.stats.commits_failed
        finally:
            await follower.stop()
    assert follower.stats.commits_failed == failed + 1, "stop() tried to commit"
    assert follower.stats.snapshots_written == 1, "and still wrote its final snapshot"


async def test_a_worker_with_stale_groups_is_never_the_best(kafka_bootstrap: str) -> None:
    """In group mode a revoked partition's groups are kept but no longer followed: their blocks
    may be gone, so such a worker's hit is shown, marked, and never named best."""
    topics = await fresh_topics(kafka_bootstrap, partitions=2)
    # One worker per partition, each key where the bridge's producer puts it.
    by_partition = {partition_of(name, 0, 2): name for name in (f"w{n}" for n in range(32))}
    workers = [by_partition[0], by_partition[1]]

    def member(name: str) -> Follower:
        return Follower(
            follower_config(
                kafka_bootstrap, topics, mode="group", group_id=topics.prefix, follower_id=name
            )
        )

    async with LogWriter(kafka_bootstrap, topics) as log:
        await log.events(*(record(w, 0, [stored([1, 2, 3])]) for w in workers))
        async with running(member("first")) as first:
            await wait_until(lambda: first.stats.events_applied == 2, "both applied")
            async with running(member("second")) as second:
                await wait_until(
                    lambda: second.ready and len(first.assigned_partitions()) == 1,
                    "the partitions split between the members",
                )
                [stale] = [w for w in workers if first.stale_groups(w)]
                [followed] = [w for w in workers if w != stale]
                # The followed worker now holds less than the stale one is said to.
                await log.events(record(followed, 1, [removed([2, 3])]))
                await wait_until(lambda: first.stats.events_applied == 3, "the removal applied")
                status, answer = await score_over_http(first, {"block_hashes": [1, 2, 3]})
        assert status == 200, answer
        assert answer["best"] == followed
        assert answer["group_blind"]["best"] == followed
        assert answered(answer, "hit_tokens", "stale_groups") == {
            stale: (48, [0]),
            followed: (16, []),
        }
