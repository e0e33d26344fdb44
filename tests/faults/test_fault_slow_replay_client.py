"""Scenario 7: a replay client that asks an engine for its whole ring and never reads.

vLLM's replay ROUTER would block or drop; hmakv's publisher sends replies without blocking and
abandons one that makes no progress for its reply timeout (5 s). Meanwhile the engine publishes
on, and the bridge's own replays of the gaps a tiny HWM makes (as in the overload scenario)
through the same ROUTER are answered: the index agrees with the engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from fault_kit import BRIDGE, ENGINES, Pipeline, pipeline

from hmakv.kafka.process import LOOPBACK
from hmakv.producer.protocol import replay_request

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

RING_BATCHES = 1000
SLOW_REQUESTS = 16
"""Replays of the whole ring the slow client asks for at once (the publisher serves 64): far
more than the ROUTER's send queue to it (1,000 messages) and the kernel's buffers hold."""
BURST_BATCHES = 400


@contextmanager
def slow_replay_client(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER that asks for replays from seq 0 and then reads nothing, ever."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    try:
        dealer.connect(endpoint)
        for _ in range(SLOW_REQUESTS):
            dealer.send_multipart(replay_request(0))
        yield dealer
    finally:
        context.destroy(linger=0)


async def publisher_stat(fleet: Pipeline, name: str, stat: str) -> int:
    return (await fleet.activity(name)).publisher[stat]


async def gaps_replayed(fleet: Pipeline) -> dict[str, float]:
    page = await fleet.bridge_metrics()
    return page.by_label(f"{BRIDGE}_gaps_replayed_total", "worker", by="replay")


async def test_a_replay_client_that_never_reads_holds_up_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    args = ("--hwm", "2", "--token-budget", "32")
    engines = tuple(dataclasses.replace(e, args=args) for e in ENGINES)
    async with pipeline(tmp_path, kafka_bootstrap, engines, bridge_args=("--rcvhwm", "1")) as fleet:
        async with fleet.streaming(concurrency=8):

            async def ring_filled() -> bool:
                return await fleet.seq("engine-a") >= RING_BATCHES

            await fleet.until(ring_filled, f"engine-a's ring holds {RING_BATCHES} batches")
        await fleet.settle()
        replay_endpoint = f"tcp://{LOOPBACK}:{fleet.ports['engine-a'].replay}"
        requests = await publisher_stat(fleet, "engine-a", "replay_requests")
        with slow_replay_client(replay_endpoint):

            async def asked() -> bool:
                taken = await publisher_stat(fleet, "engine-a", "replay_requests")
                return taken >= requests + SLOW_REQUESTS

            await fleet.until(asked, "engine-a took the slow client's requests")
            replayed = await gaps_replayed(fleet)
            async with fleet.streaming(concurrency=8):
                start = await fleet.seq("engine-a")

                async def burst_done() -> bool:
                    return await fleet.seq("engine-a") >= start + BURST_BATCHES

                await fleet.until(burst_done, f"{BURST_BATCHES} more batches from engine-a")
            during = await gaps_replayed(fleet)
            stats = (await fleet.activity("engine-a")).publisher
            await fleet.settle()
            await fleet.assert_agreement()

            async def abandoned() -> bool:
                return await publisher_stat(fleet, "engine-a", "replays_abandoned") >= 1

            # Proof that the client really stalled its replies: the publisher gave up on them.
            await fleet.until(abandoned, "engine-a abandoned the slow client's replies")
        page = await fleet.bridge_metrics()
    assert stats["replays_abandoned"] == 0, "the burst outlasted the stall: nothing tested"
    assert during["engine-a"] > replayed["engine-a"], "the bridge replayed while it stalled"
    assert stats["published"] == stats["sent"], "every live batch went out meanwhile"
    assert stats["dropped_queue_full"] == stats["replay_requests_refused"] == 0
    assert page.total(f"{BRIDGE}_gaps_unrecoverable_total") == 0
    assert page.total(f"{BRIDGE}_batches_lost_total") == 0
    assert page.total(f"{BRIDGE}_replays_total", kind="replay", outcome="failed") == 0
