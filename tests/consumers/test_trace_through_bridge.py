"""vLLM itself through the whole pipeline: ZMQ, the bridge, Kafka, the follower, /v1/score.

The trace's payloads (the bytes vLLM's publisher sent, see trace_kit) go out of a PUB socket
speaking vLLM's protocol, with a ROUTER replay socket behind it as vLLM's has, so the bridge
subscribes, fills the gap a slow subscription leaves by replay, splits batches per group into
Kafka, and the index must answer every probe with vLLM's own hit.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio
from follower_kit import follower_config
from trace_kit import PROBES, Batch, agreement, walk

from hmakv.bridge.config import EngineConfig
from hmakv.bridge.service import BridgeService, BridgeSettings
from hmakv.consumers.service import IndexService, ServiceConfig
from hmakv.kafka import unique_topic
from hmakv.kvlog.records import Topics
from hmakv.producer.protocol import END_MARKER, live_frames, parse_replay_request, reply_frames

WORKER = "vllm-0"
ZMQ_TOPIC = b"kv-events"


class VllmPublisher:
    """vLLM's ``ZmqEventPublisher`` wire protocol, sending recorded payloads byte for byte.

    PUB: ``[topic, seq (8 bytes BE), payload]``. ROUTER replay: ``[b"", start_seq]`` in,
    ``[b"", topic, seq, payload]`` for every kept batch from ``start_seq`` on, then the end
    marker (seq -1). vLLM itself cannot run here (no GPU, no vLLM install), so this stands in
    for its publisher; the payloads are vLLM's own.
    """

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self._pub = context.socket(zmq.PUB)
        self._router = context.socket(zmq.ROUTER)
        self.pub_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._sent: list[Batch] = []
        self._replays: asyncio.Task[None] | None = None

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(
            WORKER,
            f"tcp://127.0.0.1:{self.pub_port}",
            f"tcp://127.0.0.1:{self.replay_port}",
            topic=ZMQ_TOPIC.decode(),
        )

    def start(self) -> None:
        self._replays = asyncio.create_task(self._serve_replays())

    async def publish(self, batches: list[Batch]) -> None:
        for batch in batches:
            self._sent.append(batch)
            await self._pub.send_multipart(live_frames(ZMQ_TOPIC, batch.seq, batch.payload))

    async def _serve_replays(self) -> None:
        while True:
            client, *request = await self._router.recv_multipart()
            start_seq = parse_replay_request(request)
            assert isinstance(start_seq, int), start_seq
            for batch in self._sent:
                if batch.seq >= start_seq:
                    reply = reply_frames(ZMQ_TOPIC, batch.seq, batch.payload)
                    await self._router.send_multipart([client, *reply])
            await self._router.send_multipart([client, b"", *END_MARKER])

    async def close(self) -> None:
        if self._replays is not None:
            self._replays.cancel()
            await asyncio.gather(self._replays, return_exceptions=True)
        self._pub.close(linger=0)
        self._router.close(linger=0)


@pytest.mark.kafka
async def test_vllm_payloads_through_the_bridge_score_as_vllm_hit(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = Topics(unique_topic("hmakv"))
    context = zmq.asyncio.Context()
    publisher = VllmPublisher(context)
    publisher.start()
    bridge = BridgeService(
        BridgeSettings(
            kafka=kafka_bootstrap, topic_prefix=topics.prefix, partitions=3, state_interval=0.2
        ),
        [publisher.engine],
    )
    index = IndexService(
        ServiceConfig(follower=follower_config(kafka_bootstrap, topics), port=0, snapshot_to="none")
    )
    await bridge.start()
    try:
        await index.start()
        try:
            async with aiohttp.ClientSession() as http:
                outcomes = await walk(publisher.publish, WORKER, index.url, http)
        finally:
            await index.stop()
    finally:
        await bridge.stop()
        await publisher.close()
        context.term()

    hma, blind = agreement(outcomes)
    with capsys.disabled():
        print(
            f"\nvLLM trace -> ZMQ -> bridge -> Kafka -> index, {len(outcomes)} probes: "
            f"HMA-aware {hma:.1%}, group-blind {blind:.1%}"
        )
    assert len(outcomes) == PROBES
    assert [o.hit_tokens for o in outcomes] == [o.expected_hit_tokens for o in outcomes]
    assert blind < 1.0
