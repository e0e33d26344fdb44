"""CURVE between engines and the bridge, against real Kafka (issue 16): in both topologies only
an engine holding its key pair can write its worker, and what else tries is counted.

* The bridge connects: it checks each engine's sockets (PUB and replay ROUTER) by the engine's
  public key, and the engine admits only the bridge's key.
* Engines connect to ``--bind-sub``: the bridge serves, admits only the keys it knows, and
  takes a topic only from the key of the engine it belongs to.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq.auth
from bridge_harness import (
    EngineThread,
    KafkaLog,
    engines_running,
    metric,
    metric_reaches,
    publish_steps,
    running_bridge,
    settings_for,
)

from hmakv.bridge.config import EngineConfig
from hmakv.kafka.process import free_port
from hmakv.producer.curve import CurveSettings, KeyPair, load_key_pair
from hmakv.producer.publisher import ZmqEventPublisher


def key_pairs(directory: Path, *names: str) -> list[KeyPair]:
    pairs = []
    for name in names:
        _, secret = zmq.auth.create_certificates(directory, name)
        pairs.append(load_key_pair(secret))
    return pairs


async def test_a_bridge_that_connects_reads_and_replays_only_the_engine_with_its_key(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    bridge, real, impostor = key_pairs(tmp_path, "bridge", "engine-a", "impostor")
    admits_bridge = frozenset({bridge.public})
    engine_a = EngineThread("engine-a", curve=CurveSettings(real, clients=admits_bridge))
    # engine-b's endpoint is served by someone without engine-b's key pair
    engine_b = EngineThread("engine-b", curve=CurveSettings(impostor, clients=admits_bridge))
    expected_b = EngineConfig(
        "engine-b",
        engine_b.config.endpoint,
        engine_b.config.replay,
        topic=engine_b.topic,
        public_key=key_pairs(tmp_path, "engine-b")[0].public,
    )
    settings = settings_for(kafka_bootstrap, curve_keys=bridge)
    log = KafkaLog(kafka_bootstrap, settings.topics)
    with engines_running(engine_a, engine_b):
        async with running_bridge(settings, [engine_a.config, expected_b]) as service:
            await engine_b.published_all(20)
            await engine_a.published_all(20)
            await log.wait_for(lambda log: log.has_seq("engine-a", 20), "engine-a's 20 steps")
            # the catch-up replay of a fresh worker went over CURVE too
            await metric_reaches(
                service, "hmakv_bridge_replays_total", 1, kind="replay", outcome="ended"
            )
            states = service.readiness().sources
            failed = metric(service, "hmakv_bridge_engine_handshakes_failed_total")
    assert {record.worker for record in log.events} == {"engine-a"}
    assert sorted({r.seq for r in log.records_of("engine-a")}) == list(range(21))
    assert states["engine-b"] == "connecting"  # the handshake never completes
    assert failed >= 1


async def test_on_bind_sub_a_topic_is_taken_only_from_its_engines_key(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    bridge, key_a, key_b, stranger = key_pairs(tmp_path, "bridge", "a", "b", "stranger")
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    engines = [
        EngineConfig("engine-a", None, None, topic="kv-a", public_key=key_a.public),
        EngineConfig("engine-b", None, None, topic="kv-b", public_key=key_b.public),
    ]
    settings = settings_for(kafka_bootstrap, bind_sub=endpoint, curve_keys=bridge)
    log = KafkaLog(kafka_bootstrap, settings.topics)

    def publisher(keys: KeyPair, topic: str) -> ZmqEventPublisher:
        curve = CurveSettings(keys, server_key=bridge.public)
        return ZmqEventPublisher(0, endpoint, None, topic=topic, curve=curve)

    async with running_bridge(settings, engines) as service:
        # engine-b posing as engine-a, and a key the bridge does not know at all
        publishers = [
            publisher(key_a, "kv-a"),
            publisher(key_b, "kv-a"),
            publisher(stranger, "kv-b"),
        ]
        try:
            await asyncio.sleep(0.5)  # their connections to the bridge are made
            await asyncio.to_thread(publish_steps, publishers, 20)
            await log.wait_for(lambda log: log.has_seq("engine-a", 20), "engine-a's 20 steps")
            await log.wait_for(
                lambda log: len(log.dead_letters) >= 20, "the posing engine's letters"
            )
            await metric_reaches(service, "hmakv_bridge_curve_handshakes_refused_total", 1)
            mismatched = metric(
                service, "hmakv_bridge_frames_rejected_total", reason="key_mismatch"
            )
        finally:
            for each in publishers:
                each.shutdown()
    assert {record.worker for record in log.events} == {"engine-a"}
    assert {r.seq for r in log.records_of("engine-a")} >= set(range(1, 21))
    # the 20 steps, each refused (the leading clear went out before the connection was made)
    assert mismatched == 20
    assert {letter.reason for letter in log.dead_letters} == {"key_mismatch"}
    assert log.state("engine-b") is not None and not log.records_of("engine-b")
