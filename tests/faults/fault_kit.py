"""The fault suite's harness: the pipeline as operators run it, and the engines' ground truth.

Every part is the ``hmakv`` process a deployment runs (``hmakv engine --no-model``, ``hmakv
bridge``, ``hmakv index``), started with the demo's own pieces (``hmakv.demo.processes``: each
in its own process group, its log in the test's directory, killed with the test if the test
dies), on Apache Kafka. The engines serve no workload of their own: the test sends them
requests through their API (prompts shaped like the demo's traffic, ``hmakv.demo.prompts``),
so that once it stops sending, they go idle and the whole pipeline can settle.

Settled means: every engine idle, the bridge has Kafka's acknowledgement of each engine's last
seq, and the index holds exactly each worker's state at that seq (the demo probe's rule,
``hmakv.demo.probe.holds_exactly``, over the record map of ``hmakv.demo.recordlog``). Then every
index answer is compared with the engine's own lookup of what it holds (``/v1/lookup``, which
admits nothing): the two must be equal, prompt by prompt and worker by worker.

Waits are polls until a condition holds, bounded by ``WAIT_S``; nothing sleeps a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from aiokafka.structs import TopicPartition

from hmakv.demo.checks import acknowledged, answers, forwarded, ready
from hmakv.demo.client import EngineClient, Http, IndexClient, ServiceError
from hmakv.demo.config import EngineSpec
from hmakv.demo.probe import Comparison, applied_seq, by_worker, holds_exactly
from hmakv.demo.processes import Child, Children, hmakv_command
from hmakv.demo.prompts import PromptSource
from hmakv.demo.promtext import MetricsPage
from hmakv.demo.recordlog import RecordLog
from hmakv.kafka import unique_topic
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.kvlog.answers import WorkerView
from hmakv.kvlog.kafka_client import create_consumer, wait_for_partitions
from hmakv.kvlog.records import Topics

WAIT_S = 60.0
"""Bound on every wait for a condition."""
POLL_S = 0.05
STOP_GRACE_S = 10.0
MAX_TOKENS = 16
"""Tokens each request generates: a block or so of decode after its prefill."""
COMPARED_PROMPTS = 120
"""How many of the prompts served are compared after settling (the newest), besides fresh ones."""
FRESH_PROMPTS = 40

BRIDGE = "hmakv_bridge"
INDEX = "hmakv_index"


class FaultSuiteError(AssertionError):
    """A condition was not reached in time; the message carries the services' log tails."""


@dataclass(frozen=True)
class EngineSetup:
    """One reference engine: its worker name, cache layout, the traffic its prompts look like,
    and any further ``hmakv engine`` flags (ring size, high-water mark, CURVE keys)."""

    name: str
    profile: str
    workload: str
    seed: int
    num_blocks: int
    args: tuple[str, ...] = ()
    topic: str = ""
    connect_to: str | None = None
    """The bridge's ``--bind-sub`` endpoint, when this engine connects to the bridge."""
    public_key: Path | None = None
    """Its CURVE certificate, for the bridge's engines file."""
    subscribe_at: str | None = None
    """Where the bridge subscribes, when not at the engine's PUB socket (a relay between)."""

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.name, self.profile, self.workload, self.seed, self.num_blocks)


# Two layouts the index must tell apart: gpt-oss-like (full attention + a 128-token window) and
# swa-small (full attention + windows of 32 and 64 tokens). Small pools, so the cache evicts,
# window blocks first, within a few dozen requests.
ENGINES = (
    EngineSetup("engine-a", "gpt-oss-like", "chat", seed=1, num_blocks=160),
    EngineSetup("engine-b", "swa-small", "documents", seed=2, num_blocks=160),
)


@dataclass(frozen=True)
class EnginePorts:
    pub: int
    replay: int
    api: int

    @classmethod
    def free(cls) -> EnginePorts:
        return cls(free_port(), free_port(), free_port())


class Activity(msgspec.Struct, frozen=True):
    """What ``/v1/status`` says of an engine's work and its publisher."""

    seq: int
    running: int
    waiting: int
    publisher: dict[str, int]


def kill(child: Child) -> None:
    """SIGKILL the child's process group, as a crash does: no flush, no goodbye."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.process.wait(STOP_GRACE_S)


async def wait_until(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() >= deadline:
            raise FaultSuiteError(f"timed out after {timeout_s:.0f} s waiting until {what}")
        await asyncio.sleep(POLL_S)


@dataclass
class Agreement:
    """Every comparison of one check after settling; ``wrong`` are those that differ."""

    comparisons: list[Comparison] = field(default_factory=list)
    by_prompt: dict[tuple[int, ...], dict[str, Comparison]] = field(default_factory=dict)
    """Each prompt's comparisons by worker."""

    def add(self, prompt: tuple[int, ...], comparison: Comparison) -> None:
        self.comparisons.append(comparison)
        self.by_prompt.setdefault(prompt, {})[comparison.worker] = comparison

    @property
    def wrong(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.hma != c.actual]

    @property
    def claimed_too_much(self) -> list[Comparison]:
        """Answers naming blocks the engine does not hold: the one thing never allowed."""
        return [c for c in self.comparisons if c.hma > c.actual]

    def hits(self, worker: str) -> int:
        """Prompts the engine really had a prefix hit for: the check is about something."""
        return sum(1 for c in self.comparisons if c.worker == worker and c.actual > 0)

    def summary(self) -> str:
        lines = [f"{len(self.wrong)} of {len(self.comparisons)} answers differ from the engines"]
        lines += [
            f"  {c.worker} seq {c.seq}: {c.prompt_tokens}-token prompt, engine {c.actual}, "
            f"index {c.hma}"
            for c in self.wrong[:10]
        ]
        return "\n".join(lines)


class Pipeline:
    """Engines, a bridge and an index as processes on loopback, and the test's view of them.

    Each service listens where it did before when restarted (fixed ports), so a restart is
    what a supervisor's is. ``close()`` stops whatever still runs.
    """

    def __init__(
        self,
        workdir: Path,
        bootstrap: str,
        engines: Sequence[EngineSetup] = ENGINES,
        *,
        seed: int = 0,
    ) -> None:
        self.workdir = workdir
        self.bootstrap = bootstrap
        self.setups = {setup.name: setup for setup in engines}
        self.ports = {name: EnginePorts.free() for name in self.setups}
        self.topics = Topics(unique_topic("hmakv-faults"))
        self.children = Children(workdir)
        self.http = Http()
        self.bridge_url = f"http://{LOOPBACK}:{free_port()}"
        self.index_url = f"http://{LOOPBACK}:{free_port()}"
        self.index = IndexClient(self.http, self.index_url)
        self.engines = {
            name: EngineClient(self.http, name, f"http://{LOOPBACK}:{ports.api}")
            for name, ports in self.ports.items()
        }
        self.prompts = PromptSource([setup.spec for setup in engines], seed=seed)
        self.served: list[tuple[int, ...]] = []
        self.rng = random.Random(seed)
        self.processes: dict[str, Child] = {}
        self._lives: dict[str, int] = {}
        self._record_log: RecordLog | None = None
        self._following: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ processes

    def _spawn(self, role: str, argv: Sequence[str]) -> Child:
        """Start ``role`` (an engine's name, ``bridge``, ``index``); each life logs apart."""
        self._lives[role] = self._lives.get(role, 0) + 1
        life = self._lives[role]
        child = self.children.spawn(role if life == 1 else f"{role}.{life}", argv)
        self.processes[role] = child
        return child

    def engine_argv(self, name: str) -> list[str]:
        setup, ports = self.setups[name], self.ports[name]
        endpoint = setup.connect_to or f"tcp://*:{ports.pub}"
        return [
            *hmakv_command(), "engine",
            "--profile", setup.profile,
            "--num-blocks", str(setup.num_blocks),
            "--no-model",
            "--workload", "none",
            "--seed", str(setup.seed),
            "--worker-name", name,
            "--topic", setup.topic,
            "--endpoint", endpoint,
            "--replay-endpoint", f"tcp://{LOOPBACK}:{ports.replay}",
            "--api", f"{LOOPBACK}:{ports.api}",
            "--status-interval", "0",
            *setup.args,
        ]  # fmt: skip

    async def start_engine(self, name: str) -> Child:
        child = self._spawn(name, self.engine_argv(name))
        await self._until(answers(self.engines[name].status), f"{name}'s API answers")
        return child

    def engines_toml(self) -> str:
        lines = []
        for name, setup in self.setups.items():
            ports = self.ports[name]
            lines += ["[[engines]]", f'name = "{name}"', f'topic = "{setup.topic}"']
            if setup.connect_to is None:
                endpoint = setup.subscribe_at or f"tcp://{LOOPBACK}:{ports.pub}"
                lines.append(f'endpoint = "{endpoint}"')
            lines.append(f'replay = "tcp://{LOOPBACK}:{ports.replay}"')
            if setup.public_key is not None:
                lines.append(f'public_key = "{setup.public_key}"')
            lines.append("")
        return "\n".join(lines)

    def bridge_argv(self, *args: str) -> list[str]:
        engines_file = self.workdir / "engines.toml"
        engines_file.write_text(self.engines_toml())
        return [
            *hmakv_command(), "bridge",
            "--kafka", self.bootstrap,
            "--topic-prefix", self.topics.prefix,
            "--engines", str(engines_file),
            "--listen", self.bridge_url.removeprefix("http://"),
            "--partitions", "2",
            "--state-interval", "0.2",
            "--quiet-catch-up", "1",  # 5 s by default: the suite would wait that long
            *args,
        ]  # fmt: skip

    async def start_bridge(self, *args: str) -> Child:
        child = self._spawn("bridge", self.bridge_argv(*args))
        await self._until(ready(self.http, f"{self.bridge_url}/readyz"), "the bridge is ready")
        return child

    def index_argv(self, *args: str) -> list[str]:
        return [
            *hmakv_command(), "index",
            "--kafka", self.bootstrap,
            "--topic-prefix", self.topics.prefix,
            "--listen", self.index_url.removeprefix("http://"),
            "--follower-id", "hmakv-faults",
            "--ready-max-lag", "0",
            *(args or ("--snapshot-to", "none")),
        ]  # fmt: skip

    async def start_index(self, *args: str) -> Child:
        child = self._spawn("index", self.index_argv(*args))
        await self._until(ready(self.http, f"{self.index_url}/readyz"), "the index is ready")
        return child

    async def start(
        self, *, bridge_args: Sequence[str] = (), index_args: Sequence[str] = ()
    ) -> None:
        """Engines, then the bridge, then the index, each once the one before answers."""
        for name in self.setups:
            await self.start_engine(name)
        await self.start_bridge(*bridge_args)
        await self.start_index(*index_args)
        self._record_log = RecordLog(
            self.bootstrap, self.topics.events, acknowledged(self.http, self.bridge_url)
        )
        await self._record_log.start()
        self._following = asyncio.create_task(self._record_log.run())

    async def close(self) -> None:
        if self._following is not None:
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
        if self._record_log is not None:
            await self._record_log.stop()
        await self.http.close()
        await asyncio.to_thread(self.children.stop_all, STOP_GRACE_S)

    def log_tails(self) -> str:
        return "\n".join(
            f"--- {child.name} (exit {child.exit_code()}):\n{child.log_tail(15)}"
            for child in self.children.started
        )

    async def _until(
        self, condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
    ) -> None:
        try:
            await wait_until(condition, what, timeout_s)
        except FaultSuiteError as error:
            raise FaultSuiteError(
                f"{error}\n{await self.diagnostics()}\n{self.log_tails()}"
            ) from None

    async def diagnostics(self) -> str:
        """Where each part stands, for a failure's message (whatever still answers)."""
        lines = []
        for name in self.setups:
            try:
                status = await self.activity(name)
            except (ServiceError, OSError, TimeoutError) as error:
                lines.append(f"{name}: {error}")
                continue
            sent = {k: v for k, v in status.publisher.items() if v}
            lines.append(f"{name}: seq {status.seq}, running {status.running}, {sent}")
        try:
            page = await self.bridge_metrics()
        except (ServiceError, OSError, TimeoutError) as error:
            lines.append(f"bridge: {error}")
        else:
            for metric in ("worker_last_seq", "batches_received_total", "gaps_detected_total"):
                values = page.by_label(f"{BRIDGE}_{metric}", "worker")
                lines.append(f"bridge {metric}: {values}")
            lines.append(f"bridge queue_depth: {page.total(f'{BRIDGE}_queue_depth')}")
        try:
            views = await self.workers()
        except (ServiceError, OSError, TimeoutError) as error:
            lines.append(f"index: {error}")
        else:
            lines += [
                f"index {v.worker}: epoch {v.epoch} {v.health} last_seq {v.last_seq}"
                for v in views.values()
            ]
        return "\n".join(lines)

    async def until(
        self, condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
    ) -> None:
        """Wait for ``condition``; a service's call failing meanwhile counts as not yet."""

        async def check() -> bool:
            try:
                return await condition()
            except (ServiceError, OSError, TimeoutError):
                return False

        await self._until(check, what, timeout_s)

    # ------------------------------------------------------------------ traffic

    async def serve(
        self, count: int, *, to: Sequence[str] | None = None, concurrency: int = 8
    ) -> None:
        """Send ``count`` prompts, each to one engine in turn, at most ``concurrency`` at once;
        returns once every one was admitted (an engine that is down fails it: not sent)."""
        targets = list(to or self.setups)
        queue = [(targets[n % len(targets)], self.prompts.next_prompt()) for n in range(count)]
        gate = asyncio.Semaphore(concurrency)

        async def send(name: str, prompt: tuple[int, ...]) -> None:
            async with gate:
                await self.engines[name].request(prompt, MAX_TOKENS)
            self.prompts.routed(prompt)
            self.served.append(prompt)

        await asyncio.gather(*(send(name, prompt) for name, prompt in queue))

    @asynccontextmanager
    async def streaming(
        self, *, to: Sequence[str] | None = None, concurrency: int = 4
    ) -> AsyncIterator[None]:
        """Requests without pause while the block runs, as a router sends them; an engine that
        is down meanwhile is tried again until it answers."""
        stop = asyncio.Event()

        async def stream(name: str) -> None:
            while not stop.is_set():
                prompt = self.prompts.next_prompt()
                try:
                    await self.engines[name].request(prompt, MAX_TOKENS)
                except (ServiceError, OSError, TimeoutError):
                    await asyncio.sleep(POLL_S)
                    continue
                self.prompts.routed(prompt)
                self.served.append(prompt)

        names = list(to or self.setups)
        tasks = [asyncio.create_task(stream(names[n % len(names)])) for n in range(concurrency)]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ ground truth

    async def activity(self, name: str) -> Activity:
        return await self.http.get(f"{self.engines[name].base_url}/v1/status", Activity)

    async def seq(self, name: str) -> int:
        return (await self.activity(name)).seq

    async def idle_seqs(self) -> dict[str, int]:
        """Each engine's last seq once none has a request left (they finish on their own)."""
        seqs: dict[str, int] = {}

        async def idle() -> bool:
            for name in self.setups:
                status = await self.activity(name)
                if status.running or status.waiting:
                    return False
                seqs[name] = status.seq
            return True

        await self.until(idle, "every engine is idle")
        return seqs

    async def settle(self) -> dict[str, int]:
        """Wait until the pipeline is at rest (see the module docstring); each engine's seq.

        A batch lost on the way at the very end of a stream shows as no gap (nothing on vLLM's
        wire says a stream ended): the bridge's quiet catch-up (``--quiet-catch-up``, 1 s here)
        replays it.
        """
        seqs = await self.idle_seqs()
        await self.until(forwarded(self.http, self.bridge_url, seqs), f"forwarded {seqs}")
        await self.until(lambda: self._index_holds(seqs), f"the index holds the engines at {seqs}")
        return seqs

    async def _index_holds(self, seqs: Mapping[str, int]) -> bool:
        views = by_worker(await self.index.workers())
        log = self._record_log
        assert log is not None, "start() first"
        if any(log.complete_through(name) < seq for name, seq in seqs.items()):
            await log.sync()
        return all(
            name in views
            and applied_seq(views[name]) == seq
            and holds_exactly(views[name], seq, log)
            for name, seq in seqs.items()
        )

    async def workers(self) -> dict[str, WorkerView]:
        return by_worker(await self.index.workers())

    async def compare(self, prompts: Sequence[tuple[int, ...]] = ()) -> Agreement:
        """Every index answer beside every engine's own lookup, on a settled pipeline: the
        prompts given, the newest ones served and fresh ones (follow-ups, branches, new ones)."""
        chosen = [*prompts, *self.served[-COMPARED_PROMPTS:]]
        chosen += [self.prompts.next_prompt() for _ in range(FRESH_PROMPTS)]
        before = await self.idle_seqs()
        agreement = Agreement()
        names = sorted(self.setups)
        for prompt in chosen:
            lookups = await asyncio.gather(*(self.engines[n].lookup(prompt) for n in names))
            answer = {hit.worker: hit for hit in (await self.index.score(prompt)).workers}
            for name, lookup in zip(names, lookups, strict=True):
                hit = answer.get(name)
                agreement.add(
                    prompt,
                    Comparison(
                        at_s=time.monotonic(),
                        worker=name,
                        seq=lookup.seq,
                        prompt_tokens=len(prompt),
                        actual=lookup.num_cached_tokens,
                        hma=-1 if hit is None else hit.hit_tokens,
                        group_blind=-1 if hit is None else hit.group_blind_hit_tokens,
                    ),
                )
        assert await self.idle_seqs() == before, "an engine moved while the answers were compared"
        return agreement

    async def assert_agreement(self, prompts: Sequence[tuple[int, ...]] = ()) -> Agreement:
        agreement = await self.compare(prompts)
        assert not agreement.wrong, agreement.summary()
        for name in self.setups:
            assert agreement.hits(name) > 0, f"no prompt hit {name}'s cache: nothing was checked"
        return agreement

    async def read_topic(self, topic: str) -> list[bytes]:
        """Every record value the topic holds now, partition by partition."""
        return await read_topic(self.bootstrap, topic)

    # ------------------------------------------------------------------ metrics

    async def bridge_metrics(self) -> MetricsPage:
        return MetricsPage.parse(await self.http.text(f"{self.bridge_url}/metrics"))

    async def index_metrics(self) -> MetricsPage:
        return MetricsPage.parse(await self.http.text(f"{self.index_url}/metrics"))


async def read_topic(bootstrap: str, topic: str) -> list[bytes]:
    """Every record value ``topic`` holds now (up to its end offsets), partition by partition."""
    partitions = await wait_for_partitions(bootstrap, topic, retry_s=POLL_S, timeout_s=WAIT_S)
    tps = [TopicPartition(topic, partition) for partition in sorted(partitions)]
    consumer = create_consumer(bootstrap, client_id="hmakv-faults")
    await consumer.start()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        positions = dict.fromkeys(tps, 0)
        values: list[bytes] = []
        async with asyncio.timeout(WAIT_S):
            while any(positions[tp] < end for tp, end in ends.items()):
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    values += [r.value for r in records if r.value is not None]
                    positions[tp] = records[-1].offset + 1
        return values
    finally:
        await consumer.stop()


@asynccontextmanager
async def pipeline(
    workdir: Path,
    bootstrap: str,
    engines: Sequence[EngineSetup] = ENGINES,
    *,
    bridge_args: Sequence[str] = (),
    index_args: Sequence[str] = (),
) -> AsyncIterator[Pipeline]:
    """A started pipeline, stopped afterwards whatever happened."""
    running = Pipeline(workdir, bootstrap, engines)
    try:
        await running.start(bridge_args=bridge_args, index_args=index_args)
        yield running
    finally:
        await running.close()
