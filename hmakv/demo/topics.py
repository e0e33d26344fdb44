"""The demo's admin calls: how many partitions a topic has, and cleaning up after a run on an
existing cluster (its own uniquely prefixed topics, nothing else)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient

from bridge.kafka_client import KafkaSecurity

_CLIENT_ID = "hmakv-demo"
_RETRY_S = 0.2


def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id=_CLIENT_ID,
        **KafkaSecurity.from_env().client_kwargs(),
    )


async def topic_partitions(bootstrap: str, topic: str, timeout_s: float) -> list[int]:
    """The topic's partition ids, waiting while a just-created topic has no leaders yet."""
    admin = _admin(bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        await admin.start()
        while True:
            described = await admin.describe_topics([topic])
            partitions = sorted(
                p["partition"] for t in described if t["topic"] == topic for p in t["partitions"]
            )
            if partitions:
                return partitions
            if time.monotonic() >= deadline:
                raise TimeoutError(f"topic {topic} has no partitions after {timeout_s:.0f} s")
            await asyncio.sleep(_RETRY_S)
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    """Delete those of ``topics`` that exist."""
    admin = _admin(bootstrap)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        doomed = [topic for topic in topics if topic in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()
