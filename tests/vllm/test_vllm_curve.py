"""Real vLLM publishing under CURVE through hmakv's plugin (issue 16): the bridge, holding the
engine's public key, follows it into Kafka and the index; a client the engine does not admit,
and one that speaks no CURVE, read nothing.

One vLLM 0.32.0 server on the CPU with ``HMAKV_VLLM_PUBLISHER=1`` and the
``HMAKV_VLLM_CURVE_*`` variables, as a user sets them; only the model is a stand-in.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from vllm_kit import Fleet, ServerSpec, start_fleet

from hmakv.demo.client import Http, VllmClient
from hmakv.kafka import unique_topic
from hmakv.producer.curve import connect_to, load_key_pair
from hmakv.producer.vllm_plugin import CURVE_CLIENTS_ENV, CURVE_SECRET_KEY_ENV
from hmakv.vllm.server import SERVED_MODEL_NAME

pytestmark = [pytest.mark.kafka, pytest.mark.vllm, pytest.mark.timeout(900)]

SERVER = ServerSpec("vllm-curve", "gemma3-swa64", hmakv_publisher=True)
WAIT_S = 120.0


def test_real_vllm_under_curve_is_followed_by_the_bridge_and_read_by_no_one_else(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("engine", "bridge", "stranger"):
        zmq.auth.create_certificates(keys, name)
    with pytest.MonkeyPatch.context() as env:  # the server inherits it, as from a user's shell
        env.setenv(CURVE_SECRET_KEY_ENV, str(keys / "engine.key_secret"))
        env.setenv(CURVE_CLIENTS_ENV, str(keys / "bridge.key"))
        fleet = start_fleet(
            [SERVER],
            kafka_bootstrap,
            unique_topic("vllm-curve"),
            tmp_path,
            bridge_options=("--curve-secret-key", str(keys / "bridge.key_secret")),
            public_keys={SERVER.name: keys / "engine.key"},
        )
    try:
        outsiders = asyncio.run(serve_and_watch(fleet, keys))
    finally:
        fleet.stop()
    assert outsiders == {"stranger": 0, "plain": 0}


async def serve_and_watch(fleet: Fleet, keys: Path) -> dict[str, int]:
    """Serve prompts until the index has the engine's batches; what the outsiders read."""
    server = fleet.servers[0]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stranger, plain = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    engine_key = load_key_pair(keys / "engine.key_secret").public
    connect_to(stranger, load_key_pair(keys / "stranger.key_secret"), engine_key)
    for sub in (stranger, plain):
        sub.connect(server.events)
        sub.subscribe(b"")
    http = Http(timeout_s=60.0)
    vllm = VllmClient(http, server.spec.name, server.api_url, SERVED_MODEL_NAME)
    try:
        deadline = time.monotonic() + WAIT_S
        prompt = 0
        while not await index_has_batches(fleet, http, server.spec.name):
            assert time.monotonic() < deadline, "the index never got the engine's batches"
            await vllm.complete([(prompt * 7 + i) % 200 + 1 for i in range(96)])
            prompt += 1
        return {"stranger": received(stranger), "plain": received(plain)}
    finally:
        await http.close()
        ctx.destroy(linger=0)


async def index_has_batches(fleet: Fleet, http: Http, worker: str) -> bool:
    workers = await fleet.index(http).workers()
    return any(
        view.worker == worker and any(view.resident_blocks.values()) for view in workers.workers
    )


def received(sub: zmq.Socket[bytes]) -> int:
    count = 0
    while sub.poll(200):
        sub.recv_multipart()
        count += 1
    return count
