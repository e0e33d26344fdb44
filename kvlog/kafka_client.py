"""The one place that builds aiokafka clients for hmakv's services.

Every producer, consumer and admin client gets the same security settings from here, and every
producer the same delivery guarantees: ``acks="all"`` and, where the broker supports it,
idempotence, so a retried batch is never written twice.

Some Kafka-compatible brokers (Tansu) do not implement InitProducerId, which an idempotent
producer needs: aiokafka's ``start()`` then raises the broker's error (``UnknownError`` on Tansu).
``start_producer`` logs that once and falls back to a plain producer. That loses no ordering:
aiokafka keeps at most one request in flight per broker connection and one batch per partition,
which is what ``max.in.flight.requests.per.connection=1`` buys in the Java client. It can write a
retried batch twice, which consumers already tolerate (they skip seqs they have applied).

A broker that refuses the security settings (SASL credentials, a certificate the client does not
trust) looks like an outage to aiokafka: its clients log the reason and raise "Unable to
bootstrap", which retrying never cures. ``check_access`` asks one connection first and raises
``KafkaRefusedError`` with the reason, so the services can stop with one line that says it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    BrokerResponseError,
    IllegalSaslStateError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAlreadyExistsError,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.partitioner import DefaultPartitioner

log = logging.getLogger(__name__)

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS_WITH_PASSWORD = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_ENV_PREFIX = "HMAKV_KAFKA_"
# The security settings, each an HMAKV_KAFKA_<NAME> variable and a --kafka-<name> flag.
SECURITY_SETTINGS = (
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
)
_METADATA_WAIT_S = 5.0  # for a just-created topic's partitions to have leaders
# Broker errors that start() can raise before it asks for a producer id: never a reason to drop
# idempotence, since a plain producer would fail the same way.
_AUTHENTICATION_ERRORS = (
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
    IllegalSaslStateError,
)
_ACCESS_CHECK_TIMEOUT_MS = 10_000
# TLS errors that say the connection went away, not that either side refused the other.
_TLS_CUT_SHORT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


@dataclass(frozen=True)
class KafkaSecurity:
    """How to reach a secured cluster; the default is plaintext, as a local broker needs."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        """Reject a half-configured setting now, not as a handshake failure at first connect."""
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ValueError(
                f"security_protocol {self.security_protocol!r} is not one of {SECURITY_PROTOCOLS}"
            )
        if self._needs_password and not (self.sasl_plain_username and self.sasl_plain_password):
            raise ValueError(f"SASL {self.sasl_mechanism} needs a username and a password")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("an SSL key file needs its certificate file")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol.endswith("SSL")

    @property
    def _needs_password(self) -> bool:
        return self.uses_sasl and self.sasl_mechanism in _SASL_MECHANISMS_WITH_PASSWORD

    @classmethod
    def from_settings(
        cls,
        *,
        security_protocol: str | None,
        sasl_mechanism: str | None,
        sasl_username: str | None,
        sasl_password: str | None,
        ssl_cafile: str | None,
        ssl_certfile: str | None,
        ssl_keyfile: str | None,
    ) -> KafkaSecurity:
        """The settings as an operator writes them: empty means unset, protocol and mechanism
        in any case."""
        return cls(
            security_protocol=(security_protocol or "PLAINTEXT").upper(),
            sasl_mechanism=(sasl_mechanism or "PLAIN").upper(),
            sasl_plain_username=sasl_username or None,
            sasl_plain_password=sasl_password or None,
            ssl_cafile=ssl_cafile or None,
            ssl_certfile=ssl_certfile or None,
            ssl_keyfile=ssl_keyfile or None,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KafkaSecurity:
        """Read ``HMAKV_KAFKA_SECURITY_PROTOCOL``, ``..._SASL_MECHANISM``, ``..._SASL_USERNAME``,
        ``..._SASL_PASSWORD``, ``..._SSL_CAFILE``, ``..._SSL_CERTFILE``, ``..._SSL_KEYFILE``."""
        return cls.from_settings(
            **{name: environ.get(_ENV_PREFIX + name.upper()) for name in SECURITY_SETTINGS}
        )

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every aiokafka client (producer, consumer, admin) takes."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_ssl:
            kwargs["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        if self.uses_sasl:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_plain_username
            kwargs["sasl_plain_password"] = self.sasl_plain_password
        return kwargs


def _security_kwargs(security: KafkaSecurity | None) -> dict[str, Any]:
    return (security or KafkaSecurity()).client_kwargs()


class KafkaRefusedError(Exception):
    """A broker refused the security settings: the SASL login, or the TLS handshake (its
    certificate not trusted, say). Unlike an outage, waiting cannot help; the message says what
    was refused, never the password."""


async def check_access(bootstrap: str, security: KafkaSecurity | None = None) -> None:
    """Connect to the first bootstrap server that answers, as every client will, and raise
    ``KafkaRefusedError`` if it refuses the settings.

    Returns once one accepts them, and also when none answers at all: an outage, which the
    caller's own clients then report or wait out as they always have. Plaintext has nothing to
    refuse: no connection is made for it.
    """
    settings = security or KafkaSecurity()
    if not (settings.uses_ssl or settings.uses_sasl):
        return
    kwargs = settings.client_kwargs()  # an unreadable CA file fails here, as in every client
    for host, port, _ in collect_hosts(bootstrap, randomize=False):
        try:
            connection = await create_conn(
                host,
                port,
                client_id="hmakv-access-check",
                request_timeout_ms=_ACCESS_CHECK_TIMEOUT_MS,
                **kwargs,
            )
        except _TLS_CUT_SHORT:
            continue  # the connection ended mid-handshake (a broker going down): an outage
        except (*_AUTHENTICATION_ERRORS, ssl.SSLError) as refusal:
            raise KafkaRefusedError(_refusal(f"{host}:{port}", settings, refusal)) from None
        except (OSError, TimeoutError, KafkaError):
            continue  # not listening, or not answering: try the next one
        connection.close()
        return


def _refusal(server: str, security: KafkaSecurity, error: Exception) -> str:
    """One line: where, what was refused, and the setting to look at."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"Kafka at {server}: its certificate was not accepted ({error.verify_message}); "
            f"--kafka-ssl-cafile (HMAKV_KAFKA_SSL_CAFILE) must hold the CA that signed it"
        )
    if isinstance(error, ssl.SSLError):
        return f"Kafka at {server}: the TLS handshake failed ({error.reason or error})"
    if isinstance(error, UnsupportedSaslMechanismError):
        return (
            f"Kafka at {server} does not offer SASL {security.sasl_mechanism} ({error}); "
            f"check --kafka-sasl-mechanism (HMAKV_KAFKA_SASL_MECHANISM)"
        )
    return (
        f"Kafka at {server} refused the SASL {security.sasl_mechanism} login of user "
        f"{security.sasl_plain_username!r} ({error}); check the user name and the password"
    )


@dataclass(frozen=True)
class StartedProducer:
    """A started producer and whether the broker let it be idempotent."""

    producer: AIOKafkaProducer
    idempotent: bool


async def start_producer(
    bootstrap: str,
    *,
    client_id: str,
    compression: str | None = None,
    security: KafkaSecurity | None = None,
    linger_ms: int = 5,
    max_batch_size: int = 16384,
    request_timeout_ms: int = 40000,
) -> StartedProducer:
    """Start an ``acks="all"`` producer, idempotent unless the broker refuses (see the module).

    ``security=None`` means plaintext; services pass ``KafkaSecurity.from_env()``.
    """
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "client_id": client_id,
        "acks": "all",
        "compression_type": compression,
        "linger_ms": linger_ms,
        "max_batch_size": max_batch_size,
        "request_timeout_ms": request_timeout_ms,
        **_security_kwargs(security),
    }
    try:
        producer = await _started(AIOKafkaProducer(enable_idempotence=True, **settings))
    except BrokerResponseError as refusal:
        if isinstance(refusal, _AUTHENTICATION_ERRORS):
            raise
        log.warning(
            "Kafka at %s refused an idempotent producer (InitProducerId failed: %s: %s); "
            "producing without idempotence: per-key order holds, a retried batch may repeat",
            bootstrap,
            type(refusal).__name__,
            refusal.description or refusal,
        )
    else:
        return StartedProducer(producer, idempotent=True)
    producer = await _started(AIOKafkaProducer(enable_idempotence=False, **settings))
    return StartedProducer(producer, idempotent=False)


async def _started(producer: AIOKafkaProducer) -> AIOKafkaProducer:
    """Start it, or close what a failed start left open (connections, the metadata task)."""
    try:
        await producer.start()
    except Exception:
        await producer.stop()
        raise
    return producer


def create_consumer(
    bootstrap: str,
    *topics: str,
    client_id: str,
    group_id: str | None = None,
    security: KafkaSecurity | None = None,
    auto_offset_reset: str = "earliest",
    enable_auto_commit: bool = False,
    **options: Any,
) -> AIOKafkaConsumer:
    """A not yet started consumer with the services' security settings.

    Reads from the earliest offset and commits nothing unless asked: a consumer that rebuilds its
    state from the log decides itself when a position is safe to keep. ``options`` go to aiokafka
    unchanged.
    """
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        client_id=client_id,
        group_id=group_id,
        auto_offset_reset=auto_offset_reset,
        enable_auto_commit=enable_auto_commit,
        **_security_kwargs(security),
        **options,
    )


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop a consumer, also while its broker is away; a cancellation of the caller still
    propagates.

    aiokafka (0.14) closes its fetcher by cancelling the fetch requests in flight and awaiting
    each: one sleeping out its retry backoff after a refused connection ends cancelled, and that
    CancelledError escapes ``stop()`` before the other requests are awaited and the client is
    closed. A service stopping during an outage would then raise from its shutdown and leave
    connections and tasks behind, so the rest of the close is done here: the fetcher's tasks
    cancelled and awaited, the client closed.
    """
    caller = asyncio.current_task()
    cancellations = caller.cancelling() if caller is not None else 0
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        if caller is None or caller.cancelling() > cancellations:
            raise
        await _finish_stop(consumer)


async def _finish_stop(consumer: AIOKafkaConsumer) -> None:
    fetcher = consumer._fetcher
    tasks = [fetcher._fetch_task, *fetcher._pending_tasks] if fetcher is not None else []
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await consumer._client.close()


@dataclass(frozen=True)
class TopicSpec:
    """A topic to create: its partitions, replication factor and topic-level config."""

    name: str
    partitions: int = 1
    replication: int = 1
    config: Mapping[str, str] = field(default_factory=dict)


async def ensure_topics(
    bootstrap: str,
    topics: Sequence[TopicSpec],
    *,
    client_id: str = "hmakv-admin",
    security: KafkaSecurity | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names this call created.

    An existing topic is left as it is (its partitions and config are not reconciled), so calling
    this at every service start is safe.
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id=client_id, **_security_kwargs(security)
    )
    try:
        await admin.start()
        response = await admin.create_topics([_new_topic(spec) for spec in topics])
    finally:
        await admin.close()
    return _created_topic_names(response.topic_errors)


_partitioner = DefaultPartitioner()


def partition_for(key: bytes, partitions: Iterable[int]) -> int:
    """The partition a key's records go to: the producer's default rule (murmur2 of the key over
    the sorted partitions, as Kafka's Java producer does), so that a reader can tell, without
    reading, which partition holds a worker's group."""
    every = sorted(partitions)
    return int(_partitioner(key, every, every))


async def topic_partitions(
    bootstrap: str, topic: str, security: KafkaSecurity | None = None
) -> set[int]:
    """The topic's partitions; empty while it does not exist or has no leaders yet.

    A started aiokafka consumer holds metadata only for the topics it reads, so this one first
    asks whether the topic exists (a request that never auto-creates it: asking for a named
    topic's metadata would make a broker that creates topics on demand create a mistyped one),
    then subscribes to it to have its partitions fetched, and stops before reading anything.
    """
    consumer = create_consumer(bootstrap, client_id="hmakv-metadata", security=security)
    try:  # stopped even when start fails: it holds a client and its connections
        await consumer.start()
        if topic not in await consumer.topics():
            return set()
        consumer.subscribe([topic])
        deadline = time.monotonic() + _METADATA_WAIT_S
        while not consumer.partitions_for_topic(topic) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        partitions: set[int] | None = consumer.partitions_for_topic(topic)
    finally:
        await stop_consumer(consumer)
    return set(partitions or ())


async def wait_for_partitions(
    bootstrap: str,
    topic: str,
    security: KafkaSecurity | None = None,
    *,
    retry_s: float = 2.0,
    timeout_s: float | None = None,
) -> set[int]:
    """The topic's partitions once it exists: readers start before or beside the bridge, which
    creates the topics. Says once that it waits; ``TimeoutError`` after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waited = False
    while not (partitions := await topic_partitions(bootstrap, topic, security)):
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"topic {topic} has no partitions after {timeout_s:.0f} s")
        if not waited:
            log.warning("topic %s does not exist yet; waiting for the bridge to create it", topic)
            waited = True
        await asyncio.sleep(retry_s)
    return partitions


def _new_topic(spec: TopicSpec) -> NewTopic:
    return NewTopic(spec.name, spec.partitions, spec.replication, topic_configs=dict(spec.config))


def _created_topic_names(topic_errors: Sequence[tuple[Any, ...]]) -> list[str]:
    """Names created by this request; raises the first error other than "already exists"."""
    created = []
    for name, error_code, *error_message in topic_errors:
        if error_code == 0:
            created.append(name)
            continue
        error = for_code(error_code)
        if error is not TopicAlreadyExistsError:
            raise error(f"creating topic {name!r}: {error_message[0] if error_message else ''}")
    return created
