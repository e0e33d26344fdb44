"""Scenario 3: Kafka unreachable (its process frozen: connections open, nothing answered) for
longer than the bridge's queue, the SUB socket and the engines' PUB queues hold, so that the
engines' publishers drop batches, shorter or longer than the engines' replay rings.

Shorter than the rings: each gap is replayed when Kafka answers again, nothing is lost. Longer:
the ring no longer reaches back, and the bridge resyncs the worker from the engine's snapshot
(or, without one, would clear it and mark it degraded); either way the index never claims a
block the engine does not hold, and here, with the reference engine's snapshots, it agrees
exactly once settled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_kit import BRIDGE, ENGINES, EngineSetup, Pipeline, pipeline

from hmakv.kafka import ApacheKafkaBroker
from hmakv.kafka.process import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.apache, pytest.mark.timeout(240)]

OUTAGE_BATCHES = 1500
"""Batches each engine publishes while Kafka does not answer: past what the pipe holds (the
bridge's queue, its SUB socket, the kernel's buffers, the PUB queue) and a long ring, well
below the default ring of 10,000."""
SHORT_RING = 64


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafkaBroker]:
    with ApacheKafkaBroker(port=free_port(), data_dir=tmp_path_factory.mktemp("kafka")) as b:
        yield b


@contextlib.contextmanager
def frozen(broker: ApacheKafkaBroker) -> Iterator[None]:
    os.killpg(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(broker.pid, signal.SIGCONT)


def engines(ring: int) -> tuple[EngineSetup, ...]:
    """Small PUB queues, a small token budget (a step per 32 prompt tokens: many batches)."""
    args = ("--hwm", "10", "--buffer-steps", str(ring), "--token-budget", "32")
    return tuple(dataclasses.replace(e, args=args) for e in ENGINES)


async def counted(fleet: Pipeline, metric: str, **labels: str) -> dict[str, float]:
    page = await fleet.bridge_metrics()
    return {n: page.total(f"{BRIDGE}_{metric}", worker=n, **labels) for n in fleet.setups}


async def replayed_from_rings(fleet: Pipeline) -> dict[str, int]:
    """Batches each engine's publisher has sent in replies to replays so far."""
    return {n: (await fleet.activity(n)).publisher["replay_batches_sent"] for n in fleet.setups}


@pytest.mark.parametrize(
    ("ring", "by"), [(10_000, "replay"), (SHORT_RING, "snapshot")], ids=["within", "beyond"]
)
async def test_kafka_unreachable_within_or_beyond_the_rings(
    broker: ApacheKafkaBroker, tmp_path: Path, ring: int, by: str
) -> None:
    bridge_args = ("--rcvhwm", "10", "--queue-size", "50")
    index_args = ("--snapshot-to", "none", "--max-broker-silence", "2")
    async with pipeline(
        tmp_path, broker.bootstrap, engines(ring), bridge_args=bridge_args, index_args=index_args
    ) as fleet:
        await fleet.serve(30)
        await fleet.settle()
        gaps = await counted(fleet, "gaps_detected_total")
        repairs = await counted(fleet, "gaps_replayed_total", by=by)
        ring_reads = await replayed_from_rings(fleet)
        async with fleet.streaming(concurrency=8):
            with frozen(broker):
                paused_at = {name: await fleet.seq(name) for name in fleet.setups}

                async def outage_long_enough() -> bool:
                    seqs = {name: await fleet.seq(name) for name in fleet.setups}
                    return all(seqs[n] >= paused_at[n] + OUTAGE_BATCHES for n in seqs)

                await fleet.until(outage_long_enough, f"{OUTAGE_BATCHES} batches published")
        # The batches dropped last show as a gap only with the engine's next one.
        await fleet.settle()
        await fleet.assert_agreement()
        detected = await counted(fleet, "gaps_detected_total")
        replayed = await counted(fleet, "gaps_replayed_total", by=by)
        snapshots = await counted(fleet, "gaps_replayed_total", by="snapshot")
        unrecoverable = await counted(fleet, "gaps_unrecoverable_total")
        lost = await counted(fleet, "batches_lost_total")
        views = await fleet.workers()
        ring_reads = {n: v - ring_reads[n] for n, v in (await replayed_from_rings(fleet)).items()}
    for name in fleet.setups:
        assert detected[name] > gaps[name], f"{name} lost nothing on the way: nothing tested"
        assert replayed[name] > repairs[name], f"no gap of {name} was repaired by {by}"
        if by == "replay":
            assert snapshots[name] == 0, "every gap within the ring replayed from it"
            # Most of what the engines published meanwhile came from their rings.
            assert ring_reads[name] >= OUTAGE_BATCHES // 2
        assert unrecoverable[name] == lost[name] == 0
        assert views[name].health == "live"
        assert views[name].epoch == 0
