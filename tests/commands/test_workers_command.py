"""``hmakv workers`` against a real Kafka broker: list, retire and forget what the bridge wrote,
and what consumers then make of it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from hmakv.bridge.resume import read_worker_states
from hmakv.cli import main
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.kafka import unique_topic
from hmakv.kafka.process import free_port
from hmakv.kvlog.kafka_client import TopicSpec, ensure_topics, start_producer
from hmakv.kvlog.records import EventRecord, Topics, WorkerState, encode, event_key
from hmakv.producer.events import BlockStored, GroupSpec

pytestmark = pytest.mark.kafka

FULL = GroupSpec("full_attention", 16)
SWA = GroupSpec("sliding_window", 16, sliding_window=128)


def state(worker: str, epoch: int, health: str = "live") -> WorkerState:
    return WorkerState(worker, epoch, 7, health, {0: FULL, 1: SWA}, 1_700_000_000.0)  # type: ignore[arg-type]


async def topics_with(bootstrap: str, *states: WorkerState) -> Topics:
    """Fresh topics whose workers topic holds ``states``, as bridges wrote them."""
    topics = Topics(unique_topic("workers"))
    await ensure_topics(
        bootstrap,
        [
            TopicSpec(topics.events, partitions=3),
            TopicSpec(topics.workers, partitions=3, config={"cleanup.policy": "compact"}),
        ],
    )
    producer = (await start_producer(bootstrap, client_id="test-workers")).producer
    try:
        for each in states:
            await producer.send_and_wait(topics.workers, encode(each), key=each.key())
    finally:
        await producer.stop()
    return topics


async def latest(bootstrap: str, topics: Topics) -> dict[str, WorkerState]:
    return await read_worker_states(bootstrap, topics.workers, {0, 1, 2})


def workers(bootstrap: str, topics: Topics, *args: str) -> int:
    action, *rest = args
    return main(["workers", action, "--kafka", bootstrap, "--topic-prefix", topics.prefix, *rest])


def test_list_shows_every_workers_latest_state(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = asyncio.run(topics_with(kafka_bootstrap, state("a", 0), state("b", 2, "degraded")))
    assert workers(kafka_bootstrap, topics, "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["worker", "epoch", "last", "seq"]
    assert lines[1].split()[:4] == ["a", "0", "7", "live"]
    assert lines[2].split()[:4] == ["b", "2", "7", "degraded"]
    assert lines[2].endswith("0:full_attention/16 1:sliding_window/16 w128")
    assert workers(kafka_bootstrap, topics, "list", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["worker"], row["epoch"], row["health"]) for row in rows] == [
        ("a", 0, "live"),
        ("b", 2, "degraded"),
    ]


def test_retire_writes_the_latest_state_again_retired_and_consumers_drop_the_worker(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = asyncio.run(topics_with(kafka_bootstrap, state("a", 0), state("a", 3), state("b", 1)))
    assert workers(kafka_bootstrap, topics, "retire", "a", "a") == 0  # named twice, written once
    assert capsys.readouterr().out == "a: retired at epoch 3\n"
    after = asyncio.run(latest(kafka_bootstrap, topics))
    assert (after["a"].health, after["a"].epoch, after["a"].last_seq) == ("retired", 3, 7)
    assert after["b"].health == "live"
    assert workers(kafka_bootstrap, topics, "retire", "a") == 0  # nothing written twice
    assert capsys.readouterr().out == "a: retired already (epoch 3)\n"
    assert asyncio.run(served_by_a_follower(kafka_bootstrap, topics)) == ["b"]


async def served_by_a_follower(bootstrap: str, topics: Topics) -> list[str]:
    """The workers a follower reading the whole log serves: the retired one's records of its
    retired epoch (written here after the retirement) bring it back in none of them."""
    producer = (await start_producer(bootstrap, client_id="test-workers")).producer
    try:
        for worker, epoch in (("a", 3), ("b", 1)):
            store = BlockStored([1], None, [], 16, None, "GPU", None, group_idx=0)
            late = EventRecord(worker, epoch, 8, 0.0, 0, [store])
            await producer.send_and_wait(topics.events, encode(late), key=event_key(worker, 0))
    finally:
        await producer.stop()
    config = FollowerConfig(
        bootstrap=bootstrap, topics=topics, follower_id="test-workers", snapshot_interval_s=0
    )
    follower = Follower(config)
    await follower.start()
    try:
        stats = follower.stats
        async with asyncio.timeout(60):  # the four states and two records, in whatever order
            # (a state of a life the records moved past is read, and ignored: not "applied")
            while (stats.consumed.get(topics.workers), stats.consumed.get(topics.events)) != (4, 2):
                await asyncio.sleep(0.05)
        return [info.name for info in follower.index.workers()]
    finally:
        await follower.stop()


def test_forget_writes_a_tombstone(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = asyncio.run(topics_with(kafka_bootstrap, state("a", 0, "retired"), state("b", 0)))
    assert workers(kafka_bootstrap, topics, "forget", "a") == 0
    assert capsys.readouterr().out == "a: forgotten\n"
    assert set(asyncio.run(latest(kafka_bootstrap, topics))) == {"b"}


def test_unknown_workers_change_nothing_and_say_so(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = asyncio.run(topics_with(kafka_bootstrap, state("a", 0)))
    assert workers(kafka_bootstrap, topics, "retire", "a", "typo") == 2
    assert "not in the workers topic: typo" in capsys.readouterr().err
    assert asyncio.run(latest(kafka_bootstrap, topics))["a"].health == "live"
    absent = unique_topic("absent")
    assert main(["workers", "list", "--kafka", kafka_bootstrap, "--topic-prefix", absent]) == 2
    assert f"no topic {absent}.workers" in capsys.readouterr().err
    # Asking did not make the broker create it (it creates topics on demand).
    assert main(["workers", "list", "--kafka", kafka_bootstrap, "--topic-prefix", absent]) == 2


def test_bad_kafka_settings_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the bridge and the index say them: one line and exit 2, before any connection."""
    monkeypatch.setenv("HMAKV_KAFKA_SECURITY_PROTOCOL", "bogus")
    assert main(["workers", "list", "--kafka", "127.0.0.1:1"]) == 2
    assert "security_protocol 'BOGUS'" in capsys.readouterr().err
    monkeypatch.delenv("HMAKV_KAFKA_SECURITY_PROTOCOL")
    with pytest.raises(SystemExit) as exit_:
        main(["workers", "list", "--kafka", "host:abc"])
    assert exit_.value.code == 2
    assert "invalid HOST[:PORT][,...] value: 'host:abc'" in capsys.readouterr().err


def test_kafka_out_of_reach_is_one_line_and_leaves_no_client_open() -> None:
    """The metadata consumer that failed to start is stopped too: asyncio complained about an
    unclosed client (a log line, and sockets left to the garbage collector)."""
    nobody = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "hmakv.cli", "workers", "list", "--kafka", nobody],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "hmakv workers: Kafka at" in done.stderr
    assert "Unclosed" not in done.stderr and "Traceback" not in done.stderr
