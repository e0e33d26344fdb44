"""Session-wide Kafka brokers, started once and stopped when the session ends.

Tests that need a broker are marked ``kafka``; those that need Apache Kafka's guarantees
(durability, idempotent producers) are marked ``apache`` too, so ``-m "not apache"`` runs the
rest against any broker given in ``KAFKA_BOOTSTRAP``. Fresh topic names come from
``hmakv.kafka.unique_topic``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator

import pytest

from hmakv.kafka import ApacheKafkaBroker, TansuBroker


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of Apache Kafka: ``KAFKA_BOOTSTRAP`` if set, else one started for the session
    (its jars are fetched with Maven on first use)."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    with ApacheKafkaBroker() as broker:
        yield broker.bootstrap


@pytest.fixture(scope="session")
def tansu_bootstrap() -> Iterator[str]:
    """``host:port`` of a memory-only Tansu broker started for the session."""
    with TansuBroker() as broker:
        yield broker.bootstrap


def _aiokafka_tasks_running() -> list[asyncio.Task[object]]:
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and "aiokafka" in task.get_coro().cr_code.co_filename  # type: ignore[union-attr]
    ]


@pytest.fixture
def aiokafka_tasks() -> Callable[[], list[asyncio.Task[object]]]:
    """The aiokafka tasks still running on this loop: none once every client is closed."""
    return _aiokafka_tasks_running
