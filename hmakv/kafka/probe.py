"""Is a Kafka broker ready? Ready means it answers a metadata request listing a broker.

An open port is not enough: Apache Kafka listens before it has registered with its controller,
and a client connecting then gets metadata without brokers. The plain TCP check comes first only
so that waiting for a starting broker does not fill the log with aiokafka's connection errors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context

from hmakv.kafka.process import port_accepts

_PROBE_TIMEOUT_MS = 5000


def broker_answers(bootstrap: str, *, ssl_cafile: Path | None = None) -> bool:
    """Whether the broker at ``host:port`` answers metadata; blocks, so not for event loops.

    With ``ssl_cafile`` the listener is asked over TLS, trusting that CA: a broker whose only
    client listener is SSL has no plaintext one to ask.
    """
    host, _, port = bootstrap.rpartition(":")
    if not port_accepts(host, int(port)):
        return False
    return asyncio.run(_metadata_lists_a_broker(bootstrap, ssl_cafile))


async def _metadata_lists_a_broker(bootstrap: str, ssl_cafile: Path | None) -> bool:
    tls: dict[str, Any] = {}
    if ssl_cafile is not None:
        tls = {
            "security_protocol": "SSL",
            "ssl_context": create_ssl_context(cafile=str(ssl_cafile)),
        }
    client = AIOKafkaClient(
        bootstrap_servers=bootstrap, request_timeout_ms=_PROBE_TIMEOUT_MS, **tls
    )
    try:
        await client.bootstrap()
        return bool(client.cluster.brokers())
    except (KafkaError, OSError, TimeoutError):
        return False
    finally:
        await client.close()
