"""What reaches the bridge from outside: vLLM's own frames, bad frames, engines that connect to
the bridge (bound SUB), and the operator's view (/healthz, /readyz, /metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from bridge_harness import (
    TOPIC,
    EngineThread,
    KafkaLog,
    by_group,
    engines_running,
    expected_records,
    free_port,
    metric,
    metric_reaches,
    publish_steps,
    running_bridge,
    settings_for,
    step_batch,
)

import hmakv.bridge.roster as bridge_roster
from hmakv.bridge.config import EngineConfig
from hmakv.bridge.frames import EventLimits
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode
from hmakv.producer.protocol import encode_seq
from hmakv.producer.publisher import ZmqEventPublisher

pytestmark = pytest.mark.kafka

WIRE_VECTORS = Path(__file__).parent.parent / "data" / "vllm-wire.jsonl"


class RawPublisher:
    """A plain socket speaking vLLM's PUB protocol, whatever frames the test gives it.

    XPUB rather than PUB only to see the bridge's subscription arrive, so nothing is sent into
    the void before it (the slow-joiner problem, which a raw socket has no replay ring to fix).
    """

    def __init__(self) -> None:
        self.port = free_port()
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.XPUB)
        self._socket.bind(f"tcp://127.0.0.1:{self.port}")

    async def subscribed(self) -> None:
        """Wait (off the event loop, where the bridge subscribes) for the subscription."""
        assert await asyncio.to_thread(self._socket.poll, 10_000), "the bridge never subscribed"
        self._socket.recv()

    def send(self, *frames: bytes) -> None:
        self._socket.send_multipart(list(frames))

    def close(self) -> None:
        self._socket.close(linger=1000)
        self._ctx.term()

    def config(self, name: str, topic: str = TOPIC) -> EngineConfig:
        return EngineConfig(name, f"tcp://127.0.0.1:{self.port}", None, topic=topic)


def seq(number: int) -> bytes:
    return encode_seq(number)


def retired(log: KafkaLog) -> list[str]:
    """The workers whose latest state says retired."""
    latest = {state.worker: state for state in log.states}
    return [worker for worker, state in latest.items() if state.health == "retired"]


def wire_event(event: dict[str, object]) -> dict[str, object]:
    """An expected event of the vectors with bytes as bytes, as the structs hold them."""

    def value(item: object) -> object:
        if isinstance(item, dict) and set(item) == {"bytes"}:
            return bytes.fromhex(str(item["bytes"]))
        if isinstance(item, list):
            return [value(x) for x in item]
        return item

    return {key: value(item) for key, item in event.items()}


def as_dict(event: object) -> dict[str, object]:
    fields = msgspec.structs.asdict(event)  # type: ignore[arg-type]
    return {"type": type(event).__name__, **fields}


def groups_per_vector(vectors: list[dict[str, Any]]) -> list[set[int]]:
    """The groups each vector's batch must reach: its events' groups, and for a clear every
    group seen before it (or group 0, before any)."""
    seen: set[int] = set()
    reached: list[set[int]] = []
    for vector in vectors:
        groups: set[int] = set()
        for event in vector["expected"]["events"]:
            if event["type"] == "AllBlocksCleared":
                groups |= seen or {0}
            else:
                groups.add(int(event.get("group_idx") or 0))
        seen |= groups
        reached.append(groups)
    return reached


async def test_frames_of_every_vllm_generation_are_forwarded(kafka_bootstrap: str) -> None:
    vectors = [json.loads(line) for line in WIRE_VECTORS.read_text().splitlines()]
    groups = groups_per_vector(vectors)
    raw = RawPublisher()
    settings = settings_for(kafka_bootstrap)

    def every_record(log: KafkaLog) -> bool:
        """Each group is its own partition, read at its own pace: wait for every record."""
        read = {(r.seq, r.group_idx) for r in log.records_of("vllm")}
        return all((seq, g) in read for seq, gs in enumerate(groups) for g in gs)

    try:
        async with running_bridge(settings, [raw.config("vllm", topic="")]):
            await raw.subscribed()
            for number, vector in enumerate(vectors):
                raw.send(b"", seq(number), bytes.fromhex(vector["payload_hex"]))
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(every_record, "every vector's records")
    finally:
        raw.close()
    assert not log.dead_letters
    for number, vector in enumerate(vectors):
        records = {r.group_idx: r for r in log.records_of("vllm") if r.seq == number}
        assert set(records) == groups[number], vector["case"]
        for event in [wire_event(e) for e in vector["expected"]["events"]]:
            if event["type"] == "AllBlocksCleared":
                assert all(AllBlocksCleared() in r.events for r in records.values())
                continue
            group = int(event.get("group_idx") or 0)  # type: ignore[call-overload]
            forwarded = [as_dict(e) for e in records[group].events]
            assert any(event.items() <= f.items() for f in forwarded), (vector["case"], event)
        for record in records.values():
            assert record.ts == vector["expected"]["ts"]
            assert record.data_parallel_rank == vector["expected"]["data_parallel_rank"]


@pytest.mark.kafka
async def test_a_replay_endpoint_zmq_cannot_use_fails_its_fetches_and_live_steps_flow(
    kafka_bootstrap: str,
) -> None:
    """A replay endpoint without a port passes the configuration's check but not ZMQ's: each
    fetch fails as one without an answer does (its gap lost, the worker degraded), instead of
    the worker staying ``replaying`` with every live batch held."""
    engine = EngineThread("engine-a")
    config = dataclasses.replace(engine.config, replay="tcp://127.0.0.1")
    settings = settings_for(kafka_bootstrap)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(engine):
        async with running_bridge(settings, [config]) as bridge:
            await metric_reaches(
                bridge, "hmakv_bridge_replays_total", 1, kind="replay", outcome="failed"
            )
            await engine.published_all(5)
            await log.wait_for(lambda log: log.has_seq("engine-a", 5), "the live steps")
            assert bridge.readiness().sources == {"engine-a": "connected"}
            health = "hmakv_bridge_worker_health"
            assert metric(bridge, health, worker="engine-a", health="replaying") == 0
            not_kept = "hmakv_bridge_batches_not_kept_total"
            assert metric(bridge, not_kept, worker="engine-a", reason="buffer_full") == 0


async def test_every_kind_of_bad_frame_is_dead_lettered_and_counted_while_good_traffic_flows(
    kafka_bootstrap: str,
) -> None:
    good = EngineThread("good")
    raw = RawPublisher()
    settings = settings_for(kafka_bootstrap, max_payload_bytes=2000)
    topic = TOPIC.encode()
    unknown_type = msgspec.msgpack.encode(
        [
            1.5,
            [
                {"type": "BlockInactive", "block_hashes": [1]},
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            ],
            0,
        ]
    )
    bad_frames = {
        "frame_count": [topic, seq(9)],
        "seq_size": [topic, b"\x00\x01", encode(step_batch(9))],
        "payload_undecodable": [topic, seq(1), b"\xc1 not msgpack"],
        "payload_oversize": [topic, seq(2), b"\x00" * 3000],
        "topic_mismatch": [b"kv-events-other", seq(99), encode(step_batch(99))],
        "unknown_event_type": [topic, seq(3), unknown_type],
    }
    with engines_running(good):
        try:
            async with running_bridge(settings, [good.config, raw.config("raw")]) as bridge:
                await raw.subscribed()
                raw.send(topic, seq(0), encode(step_batch(0)))
                for frames in bad_frames.values():
                    good.publish(2)
                    raw.send(*frames)
                raw.send(topic, seq(4), encode(step_batch(4)))
                await good.published_all(2)
                log = KafkaLog(kafka_bootstrap, settings.topics)

                def all_in(log: KafkaLog) -> bool:
                    reasons = {d.reason for d in log.dead_letters}
                    raw_state = log.state("raw")
                    return (
                        reasons == set(bad_frames)
                        and log.has_seq("good", good.last_seq)
                        and log.has_seq("raw", 4)
                        and raw_state is not None
                        and raw_state.health == "degraded"
                    )

                await log.wait_for(all_in, "every dead letter and all good traffic")
                counts = {
                    reason: metric(bridge, "hmakv_bridge_frames_rejected_total", reason=reason)
                    for reason in bad_frames
                }
                raw_events = {
                    kind: bridge.metrics.registry.get_sample_value(
                        "hmakv_bridge_events_received_total", {"worker": "raw", "type": kind}
                    )
                    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown")
                }
        finally:
            raw.close()
    assert counts == dict.fromkeys(bad_frames, 1.0)
    # the raw worker's live batches that decoded: seq 0 (two stores), seq 3 (an unknown event
    # and a removal), seq 4 (two stores, two removals); every type is exported, 0 included
    assert raw_events == {
        "BlockStored": 4.0,
        "BlockRemoved": 3.0,
        "AllBlocksCleared": 0.0,
        "unknown": 1.0,
    }
    letters = {d.reason: d for d in log.dead_letters}
    assert letters["frame_count"].frames == bad_frames["frame_count"]
    assert letters["payload_undecodable"].frames == bad_frames["payload_undecodable"]
    assert letters["unknown_event_type"].frames == bad_frames["unknown_event_type"]
    assert "BlockInactive" in letters["unknown_event_type"].detail
    assert sorted(h["reason"].decode() for h in log.dead_letter_headers) == sorted(bad_frames)
    rest = [r for r in log.records_of("good") if r.seq > 0]
    assert by_group(rest) == by_group(expected_records("good", 0, good))
    # the raw worker lost seqs 1 and 2 (undecodable), so it is cleared and degraded (waited
    # for above); its batch with an unknown event type still carries the event this bridge knows
    raw_records: dict[int, list[EventRecord]] = {}
    for record in log.records_of("raw"):
        raw_records.setdefault(record.seq, []).append(record)
    assert sorted(raw_records) == [0, 1, 2, 3, 4]
    assert all(r.events == [AllBlocksCleared()] for s in (1, 2) for r in raw_records[s])
    assert [r.events for r in raw_records[3]] == [[BlockRemoved([7], "GPU", group_idx=0)]]


async def test_engines_that_connect_to_the_bridge_are_told_apart_by_topic(
    kafka_bootstrap: str,
) -> None:
    """vLLM connects when its endpoint names a host: llm-d's kv@<pod>@<model> names the worker,
    and an engine configured by topic gets its gaps replayed."""
    bind_port, replay_port = free_port(), free_port()
    configured = EngineConfig(
        "engine-c", None, f"tcp://127.0.0.1:{replay_port}", topic="kv@engine-c@m"
    )
    settings = settings_for(
        kafka_bootstrap, bind_sub=f"tcp://127.0.0.1:{bind_port}", join_by_topic=True
    )
    async with running_bridge(settings, [configured]) as bridge:
        publishers = {
            topic: ZmqEventPublisher(
                0,
                f"tcp://127.0.0.1:{bind_port}",
                f"tcp://127.0.0.1:{replay_port}" if topic == "kv@engine-c@m" else None,
                topic=topic,
            )
            for topic in ("kv@pod-a@llama", "kv@pod-b@llama", "kv@engine-c@m", "not-llmd")
        }
        try:
            # Spread out: the llm-d workers have no replay to recover what is sent before the
            # bridge's subscription reaches them.
            await asyncio.to_thread(publish_steps, list(publishers.values()), 50)
            log = KafkaLog(kafka_bootstrap, settings.topics)

            def all_there(log: KafkaLog) -> bool:
                states = [log.state(w) for w in ("pod-a", "pod-b", "engine-c")]
                return all(s is not None and s.last_seq == 50 for s in states)

            await log.wait_for(all_there, "three workers' 50 steps")
            unknown = metric(bridge, "hmakv_bridge_frames_rejected_total", reason="worker_unknown")
        finally:
            for publisher in publishers.values():
                publisher.shutdown()
    assert {r.worker for r in log.events} == {"pod-a", "pod-b", "engine-c"}
    assert unknown >= 1
    assert {d.reason for d in log.dead_letters} == {"worker_unknown"}
    # the configured engine has a replay endpoint: its seq 0, sent before the bridge's
    # subscription could have reached it, is replayed; the others have no way to get it back
    engine_c = sorted({r.seq for r in log.records_of("engine-c")})
    assert engine_c == list(range(51))
    assert [r.events for r in log.records_of("engine-c") if r.seq == 0] == [[AllBlocksCleared()]]
    assert log.records_of("pod-a")[-1].seq == 50


def store(**fields: Any) -> BlockStored:
    values: dict[str, Any] = {"block_hashes": [1], "token_ids": [1, 2, 3, 4], "group_idx": 0}
    values.update(fields)
    return BlockStored(
        parent_block_hash=None, block_size=4, lora_id=None, medium="GPU", lora_name=None, **values
    )


async def test_a_batch_that_lists_more_than_the_limits_is_a_counted_loss_not_index_memory(
    kafka_bootstrap: str,
) -> None:
    """A 28.8 MB batch once grew the index by 12x its size (issue 16): the bridge caps what one
    batch may list, and a configured engine's batch past a cap is dead-lettered by reason and
    counted as the worker's loss (cleared, degraded), as an undecodable one is."""
    raw = RawPublisher()
    limits = EventLimits(
        max_hashes_per_event=4, max_hashes_per_batch=6, max_token_ids_per_event=8, max_items=2
    )
    settings = settings_for(kafka_bootstrap, limits=limits)
    topic = TOPIC.encode()
    over = {
        "hashes_over_limit": [BlockRemoved([1, 2, 3, 4, 5], "GPU", 0)],
        "token_ids_over_limit": [store(token_ids=list(range(9)))],
        "extra_keys_over_limit": [store(extra_keys=[("a", "b", "c")])],
        "lookahead_over_limit": [store(lookahead_token_ids=[[1], [2], [3], [4], [5]])],
    }
    within = [store(block_hashes=[1, 2, 3, 4]), BlockRemoved([5, 6], "GPU", 0)]  # 6 in all
    try:
        async with running_bridge(settings, [raw.config("raw")]) as bridge:
            await raw.subscribed()
            raw.send(topic, seq(0), encode(KVEventBatch(1.0, within)))
            for index, events in enumerate(over.values(), start=1):
                raw.send(topic, seq(index), encode(KVEventBatch(1.0, events)))
            raw.send(topic, seq(5), encode(KVEventBatch(1.0, within)))
            log = KafkaLog(kafka_bootstrap, settings.topics)

            def all_in(log: KafkaLog) -> bool:
                state = log.state("raw")
                return (
                    {d.reason for d in log.dead_letters} == set(over)
                    and log.has_seq("raw", 5, groups=(0,))
                    and state is not None
                    and state.health == "degraded"
                )

            await log.wait_for(all_in, "the four dead letters and the last batch")
            counts = {
                reason: metric(bridge, "hmakv_bridge_frames_rejected_total", reason=reason)
                for reason in over
            }
    finally:
        raw.close()
    assert counts == dict.fromkeys(over, 1.0)
    stores = [e for r in log.records_of("raw") for e in r.events if isinstance(e, BlockStored)]
    assert [s.block_hashes for s in stores] == [[1, 2, 3, 4], [1, 2, 3, 4]]  # only the two within


async def test_without_join_by_topic_a_made_up_pod_cannot_write_the_index(
    kafka_bootstrap: str,
) -> None:
    """Anyone who reaches --bind-sub could once make up an llm-d topic and become a live worker
    that /v1/score named best (issue 16): by default only configured engines are followed, and
    the rest is dead-lettered and counted."""
    bind_port = free_port()
    configured = EngineConfig("engine-c", None, None, topic="kv@engine-c@m")
    settings = settings_for(kafka_bootstrap, bind_sub=f"tcp://127.0.0.1:{bind_port}")
    async with running_bridge(settings, [configured]) as bridge:
        publishers = [
            ZmqEventPublisher(0, f"tcp://127.0.0.1:{bind_port}", None, topic=topic)
            for topic in ("kv@intruder@llama", "kv@engine-c@m")
        ]
        try:
            await asyncio.sleep(0.5)  # their connections to the bridge are made
            await asyncio.to_thread(publish_steps, publishers, 20)
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(lambda log: log.has_seq("engine-c", 20), "engine-c's 20 steps")
            await log.wait_for(lambda log: bool(log.dead_letters), "the intruder's dead letters")
            unknown = metric(bridge, "hmakv_bridge_frames_rejected_total", reason="worker_unknown")
        finally:
            for publisher in publishers:
                publisher.shutdown()
    assert {r.worker for r in log.events} == {"engine-c"}
    assert log.state("intruder") is None
    assert unknown >= 1
    assert {d.reason for d in log.dead_letters} == {"worker_unknown"}


async def test_reloading_away_a_connected_engine_keeps_a_bound_engine_of_its_topic(
    kafka_bootstrap: str,
) -> None:
    """Topics need only tell bound engines apart: a connected engine may share a bound one's
    topic, and a reload that removes it must leave the bound engine's route in place."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = settings_for(kafka_bootstrap, bind_sub=endpoint)
    connected = EngineThread("engine-a")
    bound = EngineConfig("engine-b", None, None, topic=connected.topic)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(connected):
        async with running_bridge(settings, [connected.config, bound]) as bridge:
            publisher = ZmqEventPublisher(0, endpoint, None, topic=bound.topic)
            try:
                await asyncio.sleep(0.5)  # its connection to the bridge is made
                await asyncio.to_thread(publish_steps, [publisher], 5)
                await log.wait_for(lambda log: log.has_seq("engine-b", 5), "engine-b's steps")
                await bridge.reload([bound])
                await asyncio.to_thread(publish_steps, [publisher], 5, 6)
                await log.wait_for(lambda log: log.has_seq("engine-b", 10), "the later steps")
            finally:
                publisher.shutdown()
    assert not log.dead_letters


async def connected_to(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A raw engine socket connected to the bridge's bound SUB, as vLLM connects: XPUB rather
    than PUB only to see the bridge's subscription arrive before anything is sent."""
    engine = ctx.socket(zmq.XPUB)
    engine.connect(endpoint)
    assert await asyncio.to_thread(engine.poll, 10_000), "the bridge never subscribed"
    engine.recv()
    return engine


async def test_every_dp_rank_of_an_engine_that_connects_reaches_the_bridge(
    kafka_bootstrap: str,
) -> None:
    """vLLM offsets each DP rank's port, connect endpoints too: with --bind-sub-ranks 2 the
    bridge binds the port and the next, and rank 1 becomes its own worker."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = settings_for(
        kafka_bootstrap, bind_sub=endpoint, bind_sub_ranks=2, join_by_topic=True
    )
    log = KafkaLog(kafka_bootstrap, settings.topics)
    async with running_bridge(settings, []):
        ranks = [ZmqEventPublisher(rank, endpoint, None, topic="kv@p@m") for rank in (0, 1)]
        try:
            await asyncio.sleep(0.5)  # their connections to the bridge are made
            for step in range(1, 6):
                for rank, publisher in enumerate(ranks):
                    publisher.publish(step_batch(step, rank))
                await asyncio.sleep(0.005)
            await log.wait_for(
                lambda log: log.has_seq("p", 5) and log.has_seq("p-dp1", 5), "both ranks"
            )
        finally:
            for publisher in ranks:
                publisher.shutdown()
    assert {r.data_parallel_rank for r in log.records_of("p-dp1")} == {1}


async def test_two_pods_whose_ranks_give_one_worker_id_are_not_mixed(kafka_bootstrap: str) -> None:
    """Pod "p" at DP rank 1 and pod "p-dp1" at rank 0 would both be worker "p-dp1": the second
    to speak is refused (dead-lettered, counted) instead of mixing its seqs into the first's."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = settings_for(kafka_bootstrap, bind_sub=endpoint, join_by_topic=True)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    ctx = zmq.Context()
    try:
        async with running_bridge(settings, []) as bridge:
            first, second = await connected_to(ctx, endpoint), await connected_to(ctx, endpoint)
            for number in range(3):
                ranked = step_batch(number)
                ranked.data_parallel_rank = 1
                first.send_multipart([b"kv@p@m", seq(number), encode(ranked)])
            await log.wait_for(lambda log: log.has_seq("p-dp1", 2), "pod p's rank 1")
            second.send_multipart([b"kv@p-dp1@m", seq(0), encode(step_batch(0))])
            await metric_reaches(
                bridge, "hmakv_bridge_frames_rejected_total", 1, reason="worker_unknown"
            )
            await log.wait_for(lambda log: bool(log.dead_letters), "the refused frame")
    finally:
        ctx.destroy(linger=0)
    assert [r.seq for r in log.applied("p-dp1")[0]] == [0, 1, 2]
    assert {r.epoch for r in log.records_of("p-dp1")} == {0}
    assert {r.data_parallel_rank for r in log.records_of("p-dp1")} == {1}


async def test_an_undecodable_batch_on_the_bound_socket_is_its_engines_loss_at_once(
    kafka_bootstrap: str,
) -> None:
    """A payload that does not decode has no DP rank to route it by; an engine configured by
    topic with one worker is still told of the loss then (it has no replay: cleared, degraded),
    not at its next batch, which an idle engine may never send."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = settings_for(kafka_bootstrap, bind_sub=endpoint)
    bound = EngineConfig("engine-b", None, None, topic="kv-b")
    log = KafkaLog(kafka_bootstrap, settings.topics)
    ctx = zmq.Context()
    try:
        async with running_bridge(settings, [bound]):
            engine = await connected_to(ctx, endpoint)
            engine.send_multipart([b"kv-b", seq(0), encode(step_batch(0))])
            engine.send_multipart([b"kv-b", seq(1), b"\xc1 not msgpack"])

            def cleared_and_degraded(log: KafkaLog) -> bool:
                state = log.state("engine-b")
                return state is not None and state.health == "degraded"

            await log.wait_for(cleared_and_degraded, "engine-b degraded")
    finally:
        ctx.destroy(linger=0)
    assert [d.reason for d in log.dead_letters] == ["payload_undecodable"]
    lost = [r for r in log.records_of("engine-b") if r.seq == 1]
    assert lost and all(r.events == [AllBlocksCleared()] for r in lost)  # in each of its groups


async def test_health_readiness_and_metrics_endpoints(kafka_bootstrap: str) -> None:
    engine = EngineThread("engine-a")
    port = free_port()
    unreachable = EngineConfig("nobody", f"tcp://127.0.0.1:{free_port()}", topic=TOPIC)
    settings = settings_for(kafka_bootstrap, listen=("127.0.0.1", port))
    base = f"http://127.0.0.1:{port}"
    with engines_running(engine):
        await engine.published_all(10)  # before the bridge: a gap its catch-up replay fills
        async with running_bridge(settings, [engine.config, unreachable]) as bridge:
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(lambda log: log.has_seq("engine-a", 10), "ten steps")
            await metric_reaches(bridge, "hmakv_bridge_records_produced_total", 1, topic="events")
            await engine.published_all(5)  # and five live ones
            await log.wait_for(lambda log: log.has_seq("engine-a", 15), "five more steps")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/healthz") as response:
                    assert (response.status, await response.text()) == (200, "ok\n")
                async with http.get(f"{base}/readyz") as response:
                    not_ready = (response.status, await response.json())
                await bridge.reload([engine.config])  # the engine that never answers is gone
                async with http.get(f"{base}/readyz") as response:
                    ready = (response.status, await response.json())
                async with http.get(f"{base}/metrics") as response:
                    assert response.status == 200
                    exposition = await response.text()
    assert not_ready == (
        503,
        {
            "ready": False,
            "started": True,
            "kafka": True,
            "sources": {"engine-a": "connected", "nobody": "connecting"},
        },
    )
    assert ready == (
        200,
        {"ready": True, "started": True, "kafka": True, "sources": {"engine-a": "connected"}},
    )
    for line in (
        'hmakv_bridge_batches_received_total{worker="engine-a"}',
        'hmakv_bridge_gaps_detected_total{worker="engine-a"} 1.0',
        # incident counters are exported from the source's start, at 0 until the first one
        'hmakv_bridge_gaps_unrecoverable_total{worker="engine-a"} 0.0',
        'hmakv_bridge_gaps_replayed_total{by="snapshot",worker="engine-a"} 0.0',
        'hmakv_bridge_batches_lost_total{worker="engine-a"} 0.0',
        'hmakv_bridge_delivery_failures_total{worker="engine-a"} 0.0',
        'hmakv_bridge_epochs_started_total{worker="engine-a"}',
        'hmakv_bridge_events_received_total{type="AllBlocksCleared",worker="engine-a"}',
        'hmakv_bridge_events_received_total{type="unknown",worker="engine-a"} 0.0',
        'hmakv_bridge_gaps_replayed_total{by="replay",worker="engine-a"} 1.0',
        'hmakv_bridge_replays_total{kind="replay",outcome="ended"}',
        'hmakv_bridge_worker_health{health="live",worker="engine-a"} 1.0',
        "hmakv_bridge_kafka_send_latency_seconds_bucket",
        "hmakv_bridge_end_to_end_age_seconds_count",
        "hmakv_bridge_sources_connected 1.0",
        'hmakv_bridge_records_produced_total{topic="events"}',
    ):
        assert line in exposition, line
    # every live batch's age on arrival, engine timestamp to the bridge reading it
    intake = re.search(r"^hmakv_bridge_intake_age_seconds_count (\S+)$", exposition, re.M)
    assert intake is not None and float(intake[1]) >= 5
    assert 'worker="nobody"' not in exposition  # a removed worker's series go with it


async def test_a_pod_past_max_workers_waits_for_a_silent_one_to_be_retired(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm-d replaces pods under new names: at ``--max-workers`` a new pod is dead-lettered
    while every known one is recent, and takes the place of one silent long enough (shortened
    here from minutes)."""
    bind_port = free_port()
    settings = settings_for(
        kafka_bootstrap, bind_sub=f"tcp://127.0.0.1:{bind_port}", max_workers=2, join_by_topic=True
    )
    endpoint = f"tcp://127.0.0.1:{bind_port}"
    async with running_bridge(settings, []) as bridge:
        pods = {
            pod: ZmqEventPublisher(0, endpoint, None, topic=f"kv@{pod}@llama")
            for pod in ("pod-a", "pod-b", "pod-c")
        }
        try:
            await asyncio.sleep(0.5)  # the pods' connections to the bridge are made
            await asyncio.to_thread(publish_steps, [pods["pod-a"], pods["pod-b"]], 20)
            await asyncio.to_thread(publish_steps, [pods["pod-c"]], 20)
            unknown = "hmakv_bridge_frames_rejected_total"
            await metric_reaches(bridge, unknown, 1, reason="worker_unknown")
            monkeypatch.setattr(bridge_roster, "RETIRE_SILENT_AFTER_S", 0.5)
            await asyncio.sleep(1.0)  # pod-a and pod-b fall silent
            await asyncio.to_thread(publish_steps, [pods["pod-c"]], 20)
            log = KafkaLog(kafka_bootstrap, settings.topics)
            await log.wait_for(lambda log: log.has_seq("pod-c", 40), "pod-c's later steps")
            # The pod it replaced is retired, for consumers to drop: nothing follows it now.
            await log.wait_for(lambda log: len(retired(log)) == 1, "one pod retired")
            [gone] = retired(log)
            assert gone in ("pod-a", "pod-b")
            assert metric(bridge, "hmakv_bridge_workers_retired_total") == 1
            # Should it speak again, it comes back as a new life, replacing the other silent one.
            await asyncio.sleep(1.0)
            await asyncio.to_thread(publish_steps, [pods[gone]], 5, 21)
            await log.wait_for(lambda log: log.has_seq(gone, 25), f"{gone} back")
        finally:
            for publisher in pods.values():
                publisher.shutdown()
    assert {r.worker for r in log.events} == {"pod-a", "pod-b", "pod-c"}
    assert {r.epoch for r in log.records_of(gone) if r.seq > 20} == {1}
    # its first 20 steps were dead-lettered: it joined with them lost, cleared and degraded
    early = [r.events for r in log.records_of("pod-c") if r.seq <= 20]
    assert early and all(events == [AllBlocksCleared()] for events in early)


async def test_without_curve_each_peer_address_has_its_own_rate_of_joins(
    kafka_bootstrap: str,
) -> None:
    """Without CURVE a message's source is its sender's IP address (ZMQ's ``Peer-Address``):
    one address past --max-joins-per-minute is dead-lettered as ``join_rate_exceeded``, while a
    pod at another address still joins. The two addresses are loopback's 127.0.0.2 and .3."""
    port = free_port()
    settings = settings_for(
        kafka_bootstrap,
        bind_sub=f"tcp://0.0.0.0:{port}",
        join_by_topic=True,
        max_joins_per_minute=2,
    )
    log = KafkaLog(kafka_bootstrap, settings.topics)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    async with running_bridge(settings, []) as bridge:
        try:
            flood = await connected_to(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{port}")
            other = await connected_to(ctx, f"tcp://127.0.0.3:0;127.0.0.1:{port}")
            for pod in ("a0", "a1", "a2", "a3"):
                flood.send_multipart([f"kv@{pod}@m".encode(), encode_seq(1), encode(step_batch(1))])
            other.send_multipart([b"kv@b0@m", encode_seq(1), encode(step_batch(1))])
            await log.wait_for(lambda log: log.has_seq("b0", 1), "the other address's pod")
            await metric_reaches(
                bridge, "hmakv_bridge_frames_rejected_total", 2, reason="join_rate_exceeded"
            )
        finally:
            ctx.destroy(linger=0)
    assert {r.worker for r in log.events} == {"a0", "a1", "b0"}
    assert [d.reason for d in log.dead_letters] == ["join_rate_exceeded"] * 2
