"""The demo's clean-up after a run on an existing cluster: its own uniquely prefixed topics,
nothing else."""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient

from hmakv.kvlog.kafka_client import KafkaSecurity

_CLIENT_ID = "hmakv-demo"


def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id=_CLIENT_ID,
        **KafkaSecurity.from_env().client_kwargs(),
    )


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
