"""The bridge's small pure parts: configuration, frame parsing, the worker board, logs, relay."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import zmq.auth

from hmakv.bridge.board import BoardEntry, WorkerBoard
from hmakv.bridge.catalog import GroupCatalog
from hmakv.bridge.config import (
    ConfigError,
    EngineConfig,
    Shard,
    WorkerAddress,
    check_unique,
    load_engines_file,
    parse_engine_flag,
)
from hmakv.bridge.frames import (
    EventLimits,
    Rejected,
    RejectReason,
    decode_payload,
    over_limit,
    split_live,
    split_reply,
)
from hmakv.bridge.outbox import Outgoing
from hmakv.bridge.relay import Handled, WorkerRelay
from hmakv.bridge.roster import llmd_pod
from hmakv.bridge.service import BridgeSettings, check_topology
from hmakv.bridge.tracking import (
    Clear,
    Fetch,
    Forward,
    GapUnrecoverable,
    HealthChanged,
    SequenceTracker,
)
from hmakv.consumers.index import KVIndex
from hmakv.kvlog import records
from hmakv.kvlog.logs import JsonFormatter, RateLimitedLog
from hmakv.kvlog.records import EventRecord, Topics
from hmakv.producer.curve import load_key_pair
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVEventBatch,
    encode,
)
from hmakv.producer.protocol import END_SEQ_FRAME, ReplyEnd, SeqFrames, encode_seq

# --- configuration -------------------------------------------------------------------------------


def test_an_engine_flag_with_every_option() -> None:
    engine = parse_engine_flag("gpu-a=tcp://h:5557,replay=tcp://h:5560,topic=kv,dp=2,shard=1")
    assert engine == EngineConfig("gpu-a", "tcp://h:5557", "tcp://h:5560", "kv", (0, 1), shard=1)
    assert engine.workers() == [
        WorkerAddress("gpu-a-dp0", 0, "tcp://h:5557", "tcp://h:5560"),
        WorkerAddress("gpu-a-dp1", 1, "tcp://h:5558", "tcp://h:5561"),  # vLLM's port offset
    ]
    assert engine.worker_for_rank(1) == engine.workers()[1]
    assert engine.worker_for_rank(2) is None


def test_a_single_rank_engine_is_one_worker_named_as_configured() -> None:
    engine = parse_engine_flag("gpu-a=tcp://h:5557")
    assert engine.workers() == [WorkerAddress("gpu-a", None, "tcp://h:5557", None)]
    assert engine.worker_for_rank(0) == engine.workers()[0]
    assert engine.worker_for_rank(None) == engine.workers()[0]
    assert engine.worker_for_rank(1) is None


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("gpu-a", "expected NAME=ENDPOINT"),
        ("gpu-a=", "expected NAME=ENDPOINT"),
        ("gpu-a=tcp://h:1,color=red", "unknown option"),
        ("gpu-a=tcp://h:1,dp=0", "positive integer"),
        ("gpu-a=tcp://h:1,shard=-1", "shard must be a non-negative integer"),
        ("gpu/a=tcp://h:1", "no '/'"),
        ("gpu-a=h:1", "not a ZMQ endpoint"),
        ("gpu-a=ipc:///tmp/a,dp=2", "cannot offset"),  # vLLM offsets TCP ports by DP rank
        ("gpu-a=tcp://h:1,dp=\u00b2", "dp must be a positive integer"),  # isdigit, not int
        ("gpu-a=tcp://*:5557", "wildcard the engine binds; name the engine's host"),
        ("gpu-a=tcp://h:1,replay=tcp://*:5560", r"'tcp://\*:5560' is a wildcard"),
        ("gpu-a=tcp://h:65535,dp=2", "tcp://h:65536 is past port 65535 .DP rank 1"),
        ("gpu-a=tcp://h:1,replay=tcp://h:65534,dp=3", "tcp://h:65536 is past port 65535"),
    ],
)
def test_bad_engine_flags_say_what_is_wrong(flag: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_engine_flag(flag)


def test_an_engines_file_with_groups(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(
        '[[engines]]\nname = "a"\nendpoint = "tcp://h:1"\nreplay = "tcp://h:2"\n'
        "dp_ranks = [0, 3]\nshard = 2\n"
        'groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk_size = 64 } }\n'
        '[[engines]]\nname = "b"\ntopic = "kv@b@m"\n'
    )
    a, b = load_engines_file(path)
    assert (a.dp_ranks, a.shard, b.shard) == ((0, 3), 2, None)
    assert a.groups == {2: GroupSpec("chunked_local_attention", 16, None, 64)}
    assert [w.endpoint for w in a.workers()] == ["tcp://h:1", "tcp://h:4"]
    assert (b.endpoint, b.topic) == (None, "kv@b@m")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engines = 1", "array of tables"),
        ('[[engines]]\nname = "a"\nport = 1', "unknown keys"),
        ("[[engines]]\nname = 1", "name must be a string"),
        ('[[engines]]\nname = "a"\ndp_ranks = "0"', "dp_ranks"),
        ('[[engines]]\nname = "a"\nshard = "1"', "shard must be an integer"),
        ('[[engines]]\nname = "a"\nshard = -1', "shard must be non-negative"),
        ('[[engines]]\nname = "a"\ngroups = { x = { kind = "mamba", block_size = 1 } }', "index"),
        ('[[engines]]\nname = "a"\ngroups = { 1 = { kind = "nope", block_size = 1 } }', "kind"),
        ("[[engines]\n", "engines.toml"),
        ('[[engines]]\nname = "a"\ndp_ranks = [true]', "dp_ranks must be a list of integers"),
        ('[[engines]]\nname = "a"\ndp_ranks = [0, 0]', r"dp_ranks \[0, 0\] repeat a rank"),
        ('[[engines]]\nname = "a"\nendpoint = "tcp://*:5557"', "wildcard"),
        (
            '[[engines]]\nname = "a"\ngroups = { "\u00b2" = { kind = "mamba", block_size = 1 } }',
            "groups.\u00b2 must be a group index",
        ),
        (
            '[[engines]]\nname = "a"\n'
            'groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk = 64 } }',
            r"groups.2: unknown keys \['chunk'\] \(allowed: kind, block_size, sliding_window, "
            "chunk_size",
        ),
        ("a = " + "[" * 10_000, "nested too deeply"),
        (
            '[[engines]]\nname = "a"\ngroups = { 1000000000 = { kind = "mamba", block_size = 1 } }',
            r"groups.1000000000 must be a group index \(at most 999999999\)",
        ),
    ],
)
def test_bad_engines_files_say_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_engines_file(path)


def test_engine_names_are_unique() -> None:
    engines = [parse_engine_flag("a=tcp://h:1"), parse_engine_flag("a=tcp://h:2")]
    with pytest.raises(ConfigError, match="unique: a"):
        check_unique(engines)


def test_an_engines_file_that_is_not_utf8_says_which(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_bytes(b'[[engines]]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match=r"engines\.toml: 'utf-8' codec can't decode"):
        load_engines_file(path)


def test_worker_ids_are_unique_across_engines() -> None:
    """``a`` with DP ranks is workers a-dp0 and a-dp1: an engine named ``a-dp1`` would share
    the second's records, tracking and resume point."""
    engines = [parse_engine_flag("a=tcp://h:1,dp=2"), parse_engine_flag("a-dp1=tcp://g:1")]
    with pytest.raises(ConfigError, match=r"worker ids must be unique: a-dp1 \(engines a, a-dp1\)"):
        check_unique(engines)
    assert check_unique([engines[0], parse_engine_flag("a-dp2=tcp://g:1")])


@pytest.mark.parametrize("ranks", [(0, 0), (True,), (0, 1, 1), ()])
def test_dp_ranks_name_distinct_workers(ranks: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="dp_ranks"):
        EngineConfig("a", "tcp://h:1", dp_ranks=ranks)


def test_shards_split_a_fleet_into_disjoint_parts_that_survive_a_reload() -> None:
    fleet = [EngineConfig(f"engine-{i}", f"tcp://h:{5000 + i}") for i in range(40)]
    parts = [Shard(index, 3).select(fleet) for index in range(3)]
    assert sorted(e.name for part in parts for e in part) == sorted(e.name for e in fleet)
    assert all(len(part) >= 5 for part in parts), "every shard gets a share of 40 engines"
    # Adding and removing engines never moves the others: the hash is the name's alone.
    changed = fleet[5:] + [EngineConfig(f"new-{i}", f"tcp://h:{6000 + i}") for i in range(10)]
    for index, part in enumerate(parts):
        kept = {e.name for e in Shard(index, 3).select(changed)} & {e.name for e in fleet}
        assert kept == {e.name for e in part} - {e.name for e in fleet[:5]}
    assert Shard().select(fleet) == fleet


def test_an_engine_pinned_to_a_shard_goes_there_whatever_its_name() -> None:
    fleet = [EngineConfig(f"engine-{i}", f"tcp://h:{5000 + i}", shard=i % 2) for i in range(8)]
    assert [e.name for e in Shard(1, 2).select(fleet)] == [f"engine-{i}" for i in (1, 3, 5, 7)]
    assert Shard(0, 1).select(fleet) == fleet, "one bridge follows every engine"
    fleet.append(EngineConfig("engine-8", "tcp://h:5008", shard=2))
    with pytest.raises(ConfigError, match="pinned to shard 2, but there are 2 shards"):
        Shard(0, 2).select(fleet)


@pytest.mark.parametrize("text", ["2/2", "1", "a/2", "-1/2", "0/0", "", "\u00b2/3"])
def test_bad_shards_say_what_is_wrong(text: str) -> None:
    with pytest.raises(ConfigError, match="shard"):
        Shard.parse(text)


# --- frames --------------------------------------------------------------------------------------

PAYLOAD = encode(KVEventBatch(1.0, [AllBlocksCleared()], 0))


def seq(number: int) -> bytes:
    return encode_seq(number)


def test_live_frames() -> None:
    assert split_live([b"kv", seq(5), PAYLOAD], b"kv") == SeqFrames(b"kv", 5, PAYLOAD)
    assert split_live([b"any", seq(5), PAYLOAD], None) == SeqFrames(b"any", 5, PAYLOAD)
    cases = {
        RejectReason.FRAME_COUNT: [b"kv", seq(5)],
        RejectReason.SEQ_SIZE: [b"kv", b"\x05", PAYLOAD],
        RejectReason.TOPIC_MISMATCH: [b"kv2", seq(5), PAYLOAD],
    }
    for reason, frames in cases.items():
        rejected = split_live(frames, b"kv")
        assert isinstance(rejected, Rejected)
        assert (rejected.reason, rejected.frames) == (reason, frames)
    mismatch = split_live([b"kv2", seq(5), PAYLOAD], b"kv")
    assert isinstance(mismatch, Rejected) and mismatch.seq == 5


def test_reply_frames_with_and_without_the_topic_frame() -> None:
    assert split_reply([b"", b"kv", seq(7), PAYLOAD]) == SeqFrames(b"kv", 7, PAYLOAD)
    assert split_reply([b"", seq(7), PAYLOAD]) == SeqFrames(b"", 7, PAYLOAD)  # before #45177
    assert split_reply([b"", b"", END_SEQ_FRAME, b""]) == ReplyEnd()
    assert split_reply([b"", END_SEQ_FRAME, b""]) == ReplyEnd()
    for frames in ([b"x", seq(1), PAYLOAD], [b"", b"kv", b"\x01", PAYLOAD], [b""]):
        assert isinstance(split_reply(frames), Rejected)


def test_payload_decoding_rejects_oversize_before_decoding() -> None:
    message = SeqFrames(b"", 3, PAYLOAD)
    assert not isinstance(decode_payload(message, [], 1024), Rejected)
    oversize = decode_payload(message, [], 4)
    assert isinstance(oversize, Rejected) and oversize.reason is RejectReason.PAYLOAD_OVERSIZE
    garbage = decode_payload(SeqFrames(b"", 3, b"\xc1"), [b"\xc1"], 1024)
    assert isinstance(garbage, Rejected) and garbage.reason is RejectReason.PAYLOAD_UNDECODABLE
    assert garbage.seq == 3


def test_llmd_topics_name_the_pod() -> None:
    assert llmd_pod(b"kv@pod-7@meta-llama/Llama-3.1-8B") == "pod-7"
    for topic in (b"kv-events", b"kv@@m", b"kv@pod", b"kv@a/b@m", b""):
        assert llmd_pod(topic) is None


# --- the board -----------------------------------------------------------------------------------


def test_the_board_writes_changes_at_once_and_resume_points_per_interval() -> None:
    board = WorkerBoard(interval=10.0)
    board.add("w", BoardEntry(groups={0: GroupSpec("full_attention", 16)}))
    assert [s.last_seq for s in board.due(now=100.0)] == [-1]  # new: written at once
    board.acknowledged("w", 0, 5, 55.0, resumable=True)
    assert board.due(now=101.0) == []  # only the resume point moved: wait for the interval
    [state] = board.due(now=110.0)
    assert (state.epoch, state.last_seq, state.ts) == (0, 5, 55.0)
    board.acknowledged("w", 0, 6, 56.0, resumable=False)  # a clear: no resume point
    board.acknowledged("w", 0, 7, 57.0, resumable=True)
    assert [s.last_seq for s in board.due(now=111.0, flush=True)] == [7]
    board.set_health("w", "degraded")
    [state] = board.due(now=112.0)
    assert state.health == "degraded"
    board.acknowledged("w", 1, -1, 60.0, resumable=False)  # a new epoch's clear
    [state] = board.due(now=113.0)
    assert (state.epoch, state.last_seq) == (1, -1)
    board.acknowledged("w", 0, 8, 58.0, resumable=True)  # the old epoch, acknowledged late
    assert [(s.epoch, s.last_seq) for s in board.due(now=200.0, flush=True)] == []
    board.acknowledged("gone", 0, 1, 1.0, resumable=True)  # removed workers are ignored
    assert board.due(now=200.0, flush=True) == []


def test_a_new_epoch_is_announced_with_where_a_restart_would_resume_it() -> None:
    board = WorkerBoard()
    board.add("w", BoardEntry())
    board.acknowledged("w", 0, 5, 55.0, resumable=True)
    board.due(now=1.0, flush=True)
    assert board.opens_epoch("w", 1) and not board.opens_epoch("w", 0)
    assert not board.opens_epoch(None, 1) and not board.opens_epoch("gone", 1)
    board.begin_epoch("w", 1, new_life=False)  # a refusal: the same engine life goes on
    [state] = board.due(now=2.0)
    assert (state.epoch, state.last_seq, state.ts) == (1, 5, 55.0)
    board.begin_epoch("w", 2, new_life=True)  # a restart: the new life starts at seq 0
    [state] = board.due(now=3.0)
    assert (state.epoch, state.last_seq, state.ts) == (2, -1, 0.0)
    board.begin_epoch("w", 1, new_life=True)  # an older epoch: nothing
    assert board.due(now=4.0) == []


def test_a_released_worker_has_what_is_not_written_yet_written_then_is_forgotten() -> None:
    board = WorkerBoard(interval=10.0)
    board.add("moved", BoardEntry())
    board.add("idle", BoardEntry())
    board.due(now=1.0)
    board.acknowledged("moved", 0, 5, 55.0, resumable=True)  # not due for 10 s
    board.release("moved", now=2.0)  # another bridge takes it over: it must resume at 5
    board.release("idle", now=2.0)  # the topic says all there is of it
    [state] = board.due(now=2.0)
    assert (state.worker, state.health, state.last_seq, state.ts) == ("moved", "live", 5, 55.0)
    assert board.due(now=20.0, flush=True) == [] and not board.views


def test_a_retired_worker_is_written_once_in_its_trackers_newest_epoch_then_forgotten() -> None:
    board = WorkerBoard()
    board.add("w", BoardEntry())
    board.acknowledged("w", 0, 5, 55.0, resumable=True)
    board.due(now=1.0, flush=True)
    assert board.retire("w", epoch=1, now=2.0) is not None  # its tracker saw a restart
    assert board.dirty and "w" not in board.views
    [state] = board.due(now=3.0)
    assert (state.worker, state.health, state.epoch) == ("w", "retired", 1)
    board.acknowledged("w", 1, -1, 60.0, resumable=False)  # its queued clear, acknowledged
    assert not board.dirty and board.due(now=4.0, flush=True) == []
    assert board.retire("w", epoch=1, now=5.0) is None  # not followed any more


# --- logs ----------------------------------------------------------------------------------------


def test_incidents_are_logged_once_per_interval_with_the_count_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    incidents = RateLimitedLog(logging.getLogger("test.incidents"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.incidents"):
        for _ in range(3):
            incidents.warning("gap", "gap %d", 1)
        incidents.warning("lost", "lost")
        now[0] = 11.0
        incidents.warning("gap", "gap %d", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "gap 1",
        "lost",
        "gap 2 (2 more like it in the last 10 s)",
    ]


def test_json_log_lines_carry_the_extra_fields() -> None:
    record = logging.makeLogRecord(
        {"name": "bridge", "levelname": "WARNING", "msg": "lost %d", "args": (3,), "worker": "w"}
    )
    line = json.loads(JsonFormatter().format(record))
    assert (line["message"], line["worker"], line["level"]) == ("lost 3", "w", "WARNING")


# --- the relay -----------------------------------------------------------------------------------


def store(group: int) -> BlockStored:
    return BlockStored([group], None, [1] * 16, 16, None, "GPU", None, group_idx=group)


def relay(max_record_bytes: int = 1 << 20, *, can_fetch: bool = False) -> WorkerRelay:
    return WorkerRelay(
        "w",
        SequenceTracker(can_fetch=can_fetch),
        GroupCatalog(),
        topics=Topics("t"),
        data_parallel_rank=0,
        max_record_bytes=max_record_bytes,
    )


def test_forwarded_batches_become_keyed_encoded_records() -> None:
    worker = relay()
    batch = KVEventBatch(2.0, [store(0), store(1)], 0)
    handled = worker.handle([Forward(0, 4, batch)], now=9.0)
    [outgoing] = handled.outgoing
    assert (outgoing.seq, outgoing.ts, outgoing.engine_batch) == (4, 2.0, True)
    assert [r.key for r in outgoing.records] == [b"w/0", b"w/1"]
    assert {r.topic for r in outgoing.records} == {"t.events"}
    assert records.decode_event_record(outgoing.records[1].value).events == [store(1)]
    assert handled.catalog_changed
    cleared = worker.handle([Clear(0, 5, "lost")], now=9.0).outgoing[0]
    assert (cleared.ts, cleared.engine_batch) == (9.0, False)
    assert [records.decode_event_record(r.value).group_idx for r in cleared.records] == [0, 1]


def test_a_group_too_large_for_one_record_is_split_over_parts_of_its_seq() -> None:
    """An engine's snapshot of a large cache: forwarded whole, in parts, the worker live."""
    big = [store(0) for _ in range(40)]
    limit = len(records.encode(EventRecord("w", 0, 1, 2.0, 0, big[:10], 0))) + 8
    worker = relay(max_record_bytes=limit)
    worker.on_live(0, KVEventBatch(1.0, [], 0), 1.0)
    handled = worker.on_live(1, KVEventBatch(2.0, [*big, store(1)], 0), 3.0)
    assert [type(e) for e in handled.events] == [Forward]
    [outgoing] = handled.outgoing
    assert (outgoing.seq, outgoing.engine_batch) == (1, True)
    written = [records.decode_event_record(r.value) for r in outgoing.records]
    assert [(r.group_idx, r.first_event) for r in written] == [
        (0, 0),
        (0, 10),
        (0, 20),
        (0, 30),
        (1, 0),
    ]
    assert [e for r in written if r.group_idx == 0 for e in r.events] == big
    assert all(len(r.value) <= limit for r in outgoing.records)
    firsts = [dict(r.headers).get("first_event") for r in outgoing.records]
    assert firsts == [None, b"10", b"20", b"30", None]
    assert worker.health == "live"


def test_a_batch_with_an_event_too_large_for_kafka_is_lost_and_clears_the_worker() -> None:
    worker = relay(max_record_bytes=64)
    worker.on_live(0, KVEventBatch(1.0, [], 0), 1.0)
    handled = worker.on_live(1, KVEventBatch(2.0, [store(0)], 0), now=3.0)
    assert [type(e) for e in handled.events] == [Forward, GapUnrecoverable, Clear, HealthChanged]
    [outgoing] = handled.outgoing
    assert (outgoing.seq, outgoing.engine_batch) == (1, False)
    assert worker.health == "degraded"


def fetch_of(fetches: list[Fetch]) -> Fetch:
    [fetch] = fetches
    return fetch


HUGE = BlockStored([9], None, [1] * 500, 16, None, "GPU", None)  # over 300 bytes alone


def replaying_relay(max_record_bytes: int) -> tuple[WorkerRelay, Fetch]:
    """A relay whose tracker forwarded seq 0 and replays seq 1, holding what comes live."""
    worker = relay(max_record_bytes, can_fetch=True)
    worker.on_live(0, batch_at(0), 0.0)
    replay = fetch_of(worker.on_live(2, batch_at(2), 0.0).fetches)
    return worker, replay


def reply(worker: WorkerRelay, replay: Fetch) -> None:
    for seq in range(3):
        worker.on_fetched(replay.fetch_id, seq, batch_at(seq), 0.0)


def batch_at(seq: int) -> KVEventBatch:
    return KVEventBatch(float(seq), [], 0)


def test_a_batch_lost_after_a_replay_leaves_the_worker_reported_degraded() -> None:
    """The tracker ends the replay's answer with "live" before the relay finds a held batch
    unwritable: the shell must be told the health that holds after it, last."""
    worker, replay = replaying_relay(max_record_bytes=300)
    worker.on_live(3, KVEventBatch(3.0, [HUGE], 0), 0.0)
    reply(worker, replay)
    handled = worker.on_fetch_end(replay.fetch_id, 0.0)
    health = [e.health for e in handled.events if isinstance(e, HealthChanged)]
    assert health == ["degraded"]
    assert worker.health == "degraded"
    assert [(o.seq, o.engine_batch) for o in handled.outgoing] == [(3, False)]


def test_an_engine_clear_after_a_lost_batch_in_the_same_answer_makes_the_worker_whole() -> None:
    worker, replay = replaying_relay(max_record_bytes=300)
    worker.on_live(3, KVEventBatch(3.0, [HUGE], 0), 0.0)
    worker.on_live(4, KVEventBatch(4.0, [AllBlocksCleared()], 0), 0.0)
    reply(worker, replay)
    handled = worker.on_fetch_end(replay.fetch_id, 0.0)
    assert [e.health for e in handled.events if isinstance(e, HealthChanged)] == ["live"]
    assert worker.health == "live"
    assert [(o.seq, o.engine_batch) for o in handled.outgoing] == [(3, False), (4, True)]
    later = worker.on_live(5, KVEventBatch(5.0, [], 0), 0.0)
    assert [e for e in later.events if isinstance(e, HealthChanged)] == []


def test_a_snapshot_after_a_refusals_clear_at_its_seq_rebuilds_the_index() -> None:
    """An idle engine's snapshot comes at the seq of the refusal's clear; consumers take the
    record at a seq they applied from the first event not applied, past the snapshot's own
    clear. Its position is no resume point: a restart checks a resumed seq's ts against the
    engine's batch at that seq, and the snapshot's ts is another."""
    worker = relay(can_fetch=True)
    index = KVIndex()
    out: list[Outgoing] = []

    def run(handled: Handled) -> Handled:
        out.extend(handled.outgoing)
        return handled

    run(worker.on_live(0, KVEventBatch(0.0, [store(0), store(1)], 0), 5.0))
    run(worker.on_live(1, KVEventBatch(1.0, [], 0), 5.0))
    snapshot = fetch_of(run(worker.on_delivery_failed(0, 1, 5.0)).fetches)
    stored = [store(0), store(1)]
    snapshot_batch = KVEventBatch(9.0, [AllBlocksCleared(), *stored], 0)
    run(worker.on_fetched(snapshot.fetch_id, 1, snapshot_batch, 5.0))
    run(worker.on_fetch_end(snapshot.fetch_id, 5.0))
    for item in out:
        for record in item.records:
            index.apply(records.decode_event_record(record.value))
    assert [(o.epoch, o.seq, o.engine_batch, o.resumable) for o in out[2:]] == [
        (1, 1, False, True),
        (1, 1, True, False),
    ]
    [held] = index.workers()
    assert (held.epoch, held.resident) == (1, {0: {"GPU": 1}, 1: {"GPU": 1}})


def test_a_bound_engines_dp_ranks_need_their_ports_bound() -> None:
    """vLLM's rank 1 connects to --bind-sub's port + 1: a bound engine with rank 1 and a bridge
    that binds one port would have a worker that never hears from its engine."""
    engine = EngineConfig("a", None, None, topic="kv-a", dp_ranks=(0, 1))
    settings = BridgeSettings(kafka="k:9092", bind_sub="tcp://*:5557")
    with pytest.raises(ConfigError, match=r"has DP rank 1, .* give --bind-sub-ranks 2"):
        check_topology(settings, [engine])
    check_topology(dataclasses.replace(settings, bind_sub_ranks=2), [engine])
    ipc = BridgeSettings(kafka="k:9092", bind_sub="ipc:///tmp/kv", bind_sub_ranks=2)
    with pytest.raises(ConfigError, match="cannot offset"):
        check_topology(ipc, [])


def test_engine_keys_come_from_flags_and_files_and_curve_is_all_or_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "keys").mkdir()
    public_file, secret_file = zmq.auth.create_certificates(tmp_path / "keys", "a")
    pair = load_key_pair(secret_file)
    by_file = parse_engine_flag(f"a=tcp://h:1,key={public_file}")
    by_z85 = parse_engine_flag(f"a=tcp://h:1,key={pair.public.decode()}")
    assert by_file.public_key == by_z85.public_key == pair.public
    engines_file = tmp_path / "engines.toml"
    engines_file.write_text('[[engines]]\nname = "a"\ntopic = "kv-a"\npublic_key = "keys/a.key"\n')
    assert load_engines_file(engines_file)[0].public_key == pair.public  # relative to the file
    with pytest.raises(ConfigError, match=r"engines\[0\]: public_key: .*neither"):
        engines_file.write_text('[[engines]]\nname = "a"\npublic_key = "keys/b.key"\n')
        load_engines_file(engines_file)
    with pytest.raises(ConfigError, match=r"--engine .*z85"):
        parse_engine_flag("a=tcp://h:1,key=" + "~" * 40)

    curve = BridgeSettings(kafka="k:9092", curve_keys=pair)
    check_topology(curve, [by_file])
    with pytest.raises(ConfigError, match="has no public_key"):
        check_topology(curve, [parse_engine_flag("a=tcp://h:1")])
    with pytest.raises(ConfigError, match="there is no --curve-secret-key"):
        check_topology(BridgeSettings(kafka="k:9092"), [by_file])
    joining = dataclasses.replace(curve, join_keys=frozenset({pair.public}))
    with pytest.raises(ConfigError, match="--join-keys needs"):
        check_topology(joining, [by_file])
    check_topology(dataclasses.replace(joining, join_by_topic=True), [by_file])
    assert pair.secret.decode() not in repr(curve)


def test_event_limits_take_a_batch_at_each_limit_and_refuse_one_past_it() -> None:
    limits = EventLimits(
        max_hashes_per_event=3, max_hashes_per_batch=5, max_token_ids_per_event=6, max_items=2
    )

    def stored(hashes: int, **fields: object) -> BlockStored:
        return BlockStored(
            list(range(hashes)), None, [0] * fields.pop("tokens", 0), 2, None, "GPU", None, **fields
        )  # type: ignore[arg-type]

    at_limits = KVEventBatch(
        0.0,
        [
            stored(
                3, tokens=6, extra_keys=[("a", "b"), None, ()], lookahead_token_ids=[[1, 2]] * 3
            ),
            BlockRemoved([1, 2], "GPU"),
            AllBlocksCleared(),
        ],
    )
    assert over_limit(at_limits, limits) is None
    past = {
        RejectReason.HASHES_OVER_LIMIT: [stored(4)],
        RejectReason.TOKEN_IDS_OVER_LIMIT: [stored(1, tokens=7)],
        RejectReason.EXTRA_KEYS_OVER_LIMIT: [stored(1, extra_keys=[(1, 2, 3)])],
        RejectReason.LOOKAHEAD_OVER_LIMIT: [stored(1, lookahead_token_ids=[[1]] * 4)],
    }
    for reason, events in past.items():
        refused = over_limit(KVEventBatch(0.0, events), limits)
        assert refused is not None and refused[0] is reason, reason
    batch_past = KVEventBatch(0.0, [stored(3), BlockRemoved([1, 2, 3], "GPU")])
    refused = over_limit(batch_past, limits)
    assert refused is not None and "the batch 6 so far" in refused[1]
