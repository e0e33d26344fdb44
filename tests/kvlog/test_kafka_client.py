"""kvlog.kafka_client against real brokers: Apache Kafka (idempotent) and Tansu (not)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import InvalidReplicationFactorError

from hmakv.kafka import ApacheKafkaBroker, unique_topic
from hmakv.kafka.process import free_port
from hmakv.kvlog.kafka_client import (
    KafkaSecurity,
    TopicSpec,
    create_consumer,
    ensure_topics,
    start_producer,
    stop_consumer,
    topic_partitions,
    wait_for_partitions,
)

KEYS = (b"worker-a/0", b"worker-a/1", b"worker-b/0")
RECORDS_PER_KEY = 50

# A self-signed EC certificate and its key (CN=hmakv-test-ca), made once with openssl for the
# SSL mapping test: create_ssl_context must load them as CA, client certificate and key.
TEST_CERTIFICATE = """\
-----BEGIN CERTIFICATE-----
MIIBhzCCAS2gAwIBAgIUSnB8NwuGZUIqCCHhqVIeccsgHvwwCgYIKoZIzj0EAwIw
GDEWMBQGA1UEAwwNaG1ha3YtdGVzdC1jYTAgFw0yNjExMjkxNDIxNDZaGA8yMTI2
MTEwNTE0MjE0NlowGDEWMBQGA1UEAwwNaG1ha3YtdGVzdC1jYTBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABMPx7sw9HUigTWI6CvaIQrjbYsPk4kd9ixFUu86Ur3Gm
NxflhHdB1K082xn04WwIG59Oi1gd1/tLauqHKqmCwFSjUzBRMB0GA1UdDgQWBBSi
QqRH2lOsvtmqR4kUjzjpbjfRjTAfBgNVHSMEGDAWgBSiQqRH2lOsvtmqR4kUjzjp
bjfRjTAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCIQDpslhzz9IX
qcp3sDyYVpkOHfxBz7WjpvqxDW/mdI0QmQIgRi3RIowGW9PepozEkSQb71q6M9Cc
ISMz1fzrEOybSEU=
-----END CERTIFICATE-----
"""
TEST_PRIVATE_KEY = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgPZnyLyByRZJEiHWt
uSmn2nycs5qlmMaOVWeo/9MvVk6hRANCAATD8e7MPR1IoE1iOgr2iEK422LD5OJH
fYsRVLvOlK9xpjcX5YR3QdStPNsZ9OFsCBufTotYHdf7S2rqhyqpgsBU
-----END PRIVATE KEY-----
"""


async def _produce_interleaved(bootstrap: str, topic: str) -> None:
    """Send RECORDS_PER_KEY numbered values per key, keys interleaved, without awaiting each."""
    started = await start_producer(bootstrap, client_id="test-producer")
    try:
        deliveries = [
            await started.producer.send(topic, str(number).encode(), key=key)
            for number in range(RECORDS_PER_KEY)
            for key in KEYS
        ]
        for delivery in deliveries:
            await delivery
    finally:
        await started.producer.stop()


async def _consume_by_key(bootstrap: str, topic: str) -> dict[bytes, list[int]]:
    consumer = create_consumer(bootstrap, topic, client_id="test-consumer")
    await consumer.start()
    values: dict[bytes, list[int]] = defaultdict(list)
    try:
        while sum(map(len, values.values())) < RECORDS_PER_KEY * len(KEYS):
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    values[record.key].append(int(record.value))
    finally:
        await consumer.stop()
    return dict(values)


async def _create_three_partitions(bootstrap: str, topic: str) -> None:
    await ensure_topics(bootstrap, [TopicSpec(topic, partitions=3)])


def _expected_by_key() -> dict[bytes, list[int]]:
    return {key: list(range(RECORDS_PER_KEY)) for key in KEYS}


@pytest.mark.kafka
@pytest.mark.apache
async def test_apache_producer_is_idempotent_and_keeps_per_key_order(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    started = await start_producer(kafka_bootstrap, client_id="test-idempotence")
    await started.producer.stop()
    assert started.idempotent
    assert not [r for r in caplog.records if r.name == "hmakv.kvlog.kafka_client"]

    topic = unique_topic("order")
    await _create_three_partitions(kafka_bootstrap, topic)
    await _produce_interleaved(kafka_bootstrap, topic)
    assert await _consume_by_key(kafka_bootstrap, topic) == _expected_by_key()


@pytest.mark.kafka
async def test_tansu_refuses_idempotence_once_and_records_still_round_trip(
    tansu_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hmakv.kvlog.kafka_client"):
        started = await start_producer(tansu_bootstrap, client_id="test-fallback")
    await started.producer.stop()
    assert not started.idempotent
    warnings = [r for r in caplog.records if r.name == "hmakv.kvlog.kafka_client"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert tansu_bootstrap in warnings[0].getMessage()
    assert "InitProducerId" in warnings[0].getMessage()

    topic = unique_topic("fallback")
    await _create_three_partitions(tansu_bootstrap, topic)
    await _produce_interleaved(tansu_bootstrap, topic)
    assert await _consume_by_key(tansu_bootstrap, topic) == _expected_by_key()


async def _topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    (resource,) = responses[0].resources
    return {entry[0]: entry[1] for entry in resource[4]}


async def _partition_count(bootstrap: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (description,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return len(description["partitions"])


@pytest.mark.kafka
@pytest.mark.apache
async def test_ensure_topics_creates_a_compacted_topic_once(kafka_bootstrap: str) -> None:
    compacted = TopicSpec(
        unique_topic("workers"), partitions=4, config={"cleanup.policy": "compact"}
    )
    plain = TopicSpec(unique_topic("events"), partitions=2)

    assert await ensure_topics(kafka_bootstrap, [compacted, plain]) == [compacted.name, plain.name]
    assert await ensure_topics(kafka_bootstrap, [compacted, plain]) == []

    assert (await _topic_config(kafka_bootstrap, compacted.name))["cleanup.policy"] == "compact"
    assert (await _topic_config(kafka_bootstrap, plain.name))["cleanup.policy"] == "delete"
    assert await _partition_count(kafka_bootstrap, compacted.name) == 4
    assert await _partition_count(kafka_bootstrap, plain.name) == 2


@pytest.mark.kafka
@pytest.mark.apache
async def test_waiting_for_a_topic_times_out_without_creating_it_and_ends_once_it_exists(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Readers start before the bridge has made its topics: they wait, and never make one."""
    missing = unique_topic("missing")
    with (
        caplog.at_level(logging.WARNING, logger="hmakv.kvlog.kafka_client"),
        pytest.raises(TimeoutError, match=missing),
    ):
        await wait_for_partitions(kafka_bootstrap, missing, retry_s=0.1, timeout_s=0.5)
    assert await topic_partitions(kafka_bootstrap, missing) == set()  # Kafka 4 made none
    assert sum("does not exist yet" in r.getMessage() for r in caplog.records) == 1

    later = TopicSpec(unique_topic("later"), partitions=3)
    waiting = asyncio.create_task(
        wait_for_partitions(kafka_bootstrap, later.name, retry_s=0.1, timeout_s=30)
    )
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await ensure_topics(kafka_bootstrap, [later])
    assert await waiting == {0, 1, 2}


@pytest.mark.kafka
@pytest.mark.apache
async def test_ensure_topics_raises_what_the_broker_rejects(kafka_bootstrap: str) -> None:
    too_many_replicas = TopicSpec(unique_topic("replicas"), replication=3)
    with pytest.raises(InvalidReplicationFactorError, match=too_many_replicas.name):
        await ensure_topics(kafka_bootstrap, [too_many_replicas])


@pytest.mark.kafka
@pytest.mark.apache
async def test_consumers_stop_cleanly_while_their_broker_is_away(
    tmp_path: Path, aiokafka_tasks: Callable[[], list[asyncio.Task[object]]]
) -> None:
    """With the broker gone, a consumer's fetch requests fail and sleep out their retry backoff;
    aiokafka 0.14's own ``stop()`` then raised CancelledError out of every such consumer (20 of
    20 in a trial), skipping the close of its client, and once out of the index's shutdown in
    CI. ``stop_consumer`` must return and leave no aiokafka task running."""
    broker = ApacheKafkaBroker(port=free_port(), data_dir=tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    try:
        topic = TopicSpec(unique_topic("outage"), partitions=1)
        await ensure_topics(broker.bootstrap, [topic])
        consumers = [create_consumer(broker.bootstrap, client_id=f"test-{n}") for n in range(3)]
        partition = TopicPartition(topic.name, 0)
        for consumer in consumers:
            await consumer.start()
            consumer.assign([partition])
            await consumer.getmany(partition, timeout_ms=200)
    finally:
        await asyncio.to_thread(broker.stop)
    await asyncio.sleep(1.0)  # every fetcher has met the refused connection by now
    assert aiokafka_tasks()

    for consumer in consumers:
        await stop_consumer(consumer)
    assert aiokafka_tasks() == []


class _NeverStops:
    """Stands in for a consumer whose stop is still under way when its caller is cancelled. A
    real one's stop takes a few loop turns, and some of aiokafka's awaits there swallow a
    cancellation themselves, so where a real cancellation lands would vary from run to run;
    this stop waits forever, so the cancellation always reaches ``stop_consumer``'s own check.
    """

    async def stop(self) -> None:
        await asyncio.Event().wait()


async def test_a_cancelled_stop_of_a_consumer_is_still_cancelled() -> None:
    stopping = asyncio.create_task(stop_consumer(_NeverStops()))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping


def test_plaintext_is_the_default_and_maps_to_plaintext_only() -> None:
    assert KafkaSecurity().client_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert KafkaSecurity.from_env({}) == KafkaSecurity()


def test_sasl_ssl_from_env_maps_to_sasl_kwargs_and_a_loaded_ssl_context(tmp_path: Path) -> None:
    certificate = tmp_path / "client.pem"
    certificate.write_text(TEST_CERTIFICATE)
    key = tmp_path / "client.key"
    key.write_text(TEST_PRIVATE_KEY)
    security = KafkaSecurity.from_env(
        {
            "HMAKV_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
            "HMAKV_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "HMAKV_KAFKA_SASL_USERNAME": "bridge",
            "HMAKV_KAFKA_SASL_PASSWORD": "s3cret",
            "HMAKV_KAFKA_SSL_CAFILE": str(certificate),
            "HMAKV_KAFKA_SSL_CERTFILE": str(certificate),
            "HMAKV_KAFKA_SSL_KEYFILE": str(key),
        }
    )

    kwargs = security.client_kwargs()
    context = kwargs.pop("ssl_context")

    assert kwargs == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "bridge",
        "sasl_plain_password": "s3cret",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert [cert["subject"] for cert in context.get_ca_certs()] == [
        ((("commonName", "hmakv-test-ca"),),)
    ]
    assert "s3cret" not in repr(security)


def test_sasl_plaintext_defaults_to_plain_and_builds_no_ssl_context() -> None:
    security = KafkaSecurity.from_env(
        {
            "HMAKV_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "HMAKV_KAFKA_SASL_USERNAME": "bridge",
            "HMAKV_KAFKA_SASL_PASSWORD": "s3cret",
        }
    )
    assert security.client_kwargs() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "bridge",
        "sasl_plain_password": "s3cret",
    }


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        ({"security_protocol": "TLS"}, "not one of"),
        ({"security_protocol": "SASL_SSL", "sasl_plain_username": "u"}, "username and a password"),
        ({"security_protocol": "SSL", "ssl_keyfile": "client.key"}, "certificate file"),
    ],
)
def test_half_configured_security_is_rejected(settings: dict[str, str], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        KafkaSecurity(**settings)
