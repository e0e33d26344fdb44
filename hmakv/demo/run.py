"""The demo's life: start everything, probe and watch for ``duration``, drain, stop, summarise.

Services start in dependency order, each only once the one before answers: broker, engines
(their ``/v1/status``), bridge (``/readyz``), index (``/readyz`` and every worker's catalog).
The end runs the other way: the probe stops, engines stop (their publishers drain), the bridge
forwards each engine's last seq, the index applies it, and only then are the index, the bridge
and the broker stopped, so the summary counts every event. The first Ctrl-C (or SIGTERM) ends
the run that way; a second one skips the waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import zmq.asyncio
from aiokafka.errors import KafkaError

from hmakv.demo.checks import acknowledged, answers, applied, catalogs, forwarded, ready
from hmakv.demo.client import EngineClient, Http, IndexClient, ServiceError, VllmClient
from hmakv.demo.comparison import RoutingComparison, compare_routers
from hmakv.demo.config import VLLM, DemoConfig, EngineSpec
from hmakv.demo.live import LiveView
from hmakv.demo.monitor import Monitor, StatusSource, Tick
from hmakv.demo.probe import Prober
from hmakv.demo.processes import ChildExited, Children, hmakv_command
from hmakv.demo.prompts import PromptSource
from hmakv.demo.recordlog import RecordLog
from hmakv.demo.services import Services, write_services
from hmakv.demo.summary import (
    EngineExit,
    RunFacts,
    Summary,
    build_summary,
    encode_json,
    read_engine_exit,
    render_text,
)
from hmakv.demo.topics import delete_topics
from hmakv.demo.vllm_probe import FINAL_QUIET_S, VllmEngine, VllmProber
from hmakv.kafka import BrokerStartError, JarFetchError, LocalBroker, local_broker
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.producer.engine.profiles import get_profile
from hmakv.vllm.profiles import CPU_BLOCK_SIZE
from hmakv.vllm.profiles import PROFILES as VLLM_PROFILES
from hmakv.vllm.server import DEFAULT_TOPIC as VLLM_TOPIC
from hmakv.vllm.server import SERVED_MODEL_NAME
from hmakv.vllm.witness import EventWitness
from hmakv.vllm.workload import VllmPrompts

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_USAGE = 2
EXIT_INTERRUPTED = 130

STARTUP_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 30.0
STOP_GRACE_S = 20.0
ENGINE_STOP_GRACE_S = 10.0
VLLM_STARTUP_TIMEOUT_S = 400.0  # two servers starting at once on two cores
VLLM_STOP_GRACE_S = 30.0
POLL_S = 0.1
INDEX_READY_MAX_LAG = 0
MIN_COMPARED = 1


class Interrupted(Exception):
    """Ctrl-C or SIGTERM before the run phase began: stop everything, no summary."""


class DemoFailed(RuntimeError):
    """A service did not become ready, or the probe client broke; the message says which."""


@dataclass(frozen=True)
class EngineEndpoints:
    pub_port: int
    replay_port: int
    api_port: int

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.api_port}"


def torch_available() -> bool:
    """Whether the engines can run their model (checked without importing torch here)."""
    return importlib.util.find_spec("torch") is not None


class Signals:
    """The first SIGINT/SIGTERM sets ``stop``; the second sets ``hurry`` (skip the draining)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()

    def __call__(self) -> None:
        if self.stop.is_set():
            self.hurry.set()
        self.stop.set()

    @contextlib.contextmanager
    def installed(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self)
        try:
            yield
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)


class Demo:
    """One run of ``hmakv demo``; ``run()`` returns the exit code."""

    def __init__(self, config: DemoConfig, out: TextIO = sys.stdout) -> None:
        self.config = config
        self.out = out
        self.workdir = config.workdir
        self.children = Children(self.workdir)
        self.signals = Signals()
        self.broker: LocalBroker | None = None
        self.bootstrap = ""
        self.topic_prefix = "hmakv"
        self.endpoints = {spec.name: _engine_endpoints() for spec in config.engines}
        self.bridge_url = f"http://{LOOPBACK}:{free_port()}"
        self.index_url = f"http://{LOOPBACK}:{free_port()}"
        self.use_model = config.real_vllm or (config.use_model and torch_available())
        self._started = time.time()
        self._run_started = time.monotonic()

    def _unusable_path(self) -> str:
        """The user's paths are made before anything starts, so a typo costs no run: what is
        wrong with the first that cannot be, or nothing."""
        json_path, report_dir = self.config.json_path, self.config.report_dir
        wanted = [(self.workdir, "the workdir")]
        wanted += [(json_path.parent, "the directory of --json")] if json_path else []
        wanted += [(report_dir, "the --report directory")] if report_dir else []
        for directory, what in wanted:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:  # a file there, no permission: the user's path to fix
                return f"cannot use {directory} as {what}: {error}"
        if json_path is not None and json_path.is_dir():
            return f"--json {json_path} is a directory: it names the summary file"
        return ""

    def say(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    def clock(self) -> float:
        return time.monotonic() - self._run_started

    async def run(self) -> int:
        unusable = self._unusable_path()
        if unusable:
            print(f"hmakv demo: {unusable}", file=sys.stderr)
            return EXIT_BAD_USAGE
        self.say(f"hmakv demo: logs in {self.workdir}")
        if self.config.use_model and not self.use_model:
            self.say("torch is not installed: the engines run without their model (--no-model)")
        http = Http()
        # The handlers stay through the clean-up: a second Ctrl-C (or a SIGTERM) while children
        # stop would otherwise raise in the middle of it, leaving the broker and its files.
        with self.signals.installed(asyncio.get_running_loop()):
            try:
                return await self._run(http)
            except Interrupted:
                self.say("interrupted while starting: stopping everything")
                return EXIT_INTERRUPTED
            except (
                DemoFailed,
                ChildExited,
                BrokerStartError,
                JarFetchError,
                ServiceError,
                KafkaError,
                TimeoutError,
            ) as error:
                self.say(f"hmakv demo failed: {error or type(error).__name__}")
                return EXIT_FAILED
            finally:
                await http.close()
                self._stop_everything()
                await self._delete_topics()  # a failed or interrupted run's topics too

    async def _run(self, http: Http) -> int:
        index = IndexClient(http, self.index_url)
        if self.config.real_vllm:
            return await self._run_vllm(http, index)
        engines = [
            EngineClient(http, s.name, self.endpoints[s.name].api_url) for s in self.config.engines
        ]
        await self._start_services(http, engines, index)
        monitor = self._monitor(http, index, engines)
        record_log = RecordLog(
            self.bootstrap, f"{self.topic_prefix}.events", acknowledged(http, self.bridge_url)
        )
        prober = Prober(
            engines,
            index,
            record_log,
            PromptSource(self.config.engines, seed=self.config.seed),
            clock=self.clock,
            pause_s=self.config.probe_pause_s,
            seed=self.config.seed,
        )
        following: asyncio.Task[None] | None = None
        try:
            await record_log.start()  # up to 30 s: a Ctrl-C here is still one while starting
            self._raise_if_interrupted()
            following = asyncio.create_task(record_log.run())
            first = await self._first_sample(monitor)
            await self._run_phase(monitor, prober)
        finally:
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            await record_log.stop()
        run_s = self.clock()
        exits = await self._drain(http, engines, index)
        last = await monitor.sample(engines_running=False)
        await asyncio.to_thread(self._stop_everything)
        self.say(f"replaying {len(prober.stats.traffic)} routed prompts behind each router")
        comparison = await asyncio.to_thread(
            compare_routers,
            self.config.engines,
            prober.stats.traffic,
            self.config.engine_rate,
        )
        summary = self._summarise(first, last, prober, run_s, exits, comparison)
        return self._finish(summary, monitor, prober)

    async def _run_vllm(self, http: Http, index: IndexClient) -> int:
        """The same run on real vLLM servers: their witnesses stand in for the engines' own
        status and exit summaries, and the probe serves real requests (``VllmProber``)."""
        context = zmq.asyncio.Context()
        try:
            engines = await self._start_vllm_services(http, index, context)
            try:
                monitor = self._monitor(http, index, engines)
                prober = VllmProber(
                    engines,
                    index,
                    VllmPrompts(seed=self.config.seed),
                    clock=self.clock,
                    pause_s=self.config.probe_pause_s,
                )
                first = await self._first_sample(monitor)
                await self._run_phase(monitor, prober)
                run_s = self.clock()
                exits = await self._drain_vllm(http, engines, index)
            finally:
                for engine in engines:
                    await engine.witness.close()
        finally:
            context.destroy(linger=0)
        last = await monitor.sample(engines_running=False)
        summary = self._summarise(first, last, prober, run_s, exits)
        await asyncio.to_thread(self._stop_everything)
        return self._finish(summary, monitor, prober)

    def _monitor(self, http: Http, index: IndexClient, engines: Sequence[StatusSource]) -> Monitor:
        return Monitor(
            http=http,
            bridge_url=self.bridge_url,
            index=index,
            engines=engines,
            clock=self.clock,
            interval_s=self.config.sample_interval_s,
        )

    async def _first_sample(self, monitor: Monitor) -> Tick:
        self._run_started = time.monotonic()
        first = await monitor.sample()
        self._raise_if_interrupted()
        return first

    def _raise_if_interrupted(self) -> None:
        if self.signals.stop.is_set():
            raise Interrupted

    # ------------------------------------------------------------------------------ start

    async def _start_services(
        self, http: Http, engines: list[EngineClient], index: IndexClient
    ) -> None:
        await self._start_broker()
        for spec in self.config.engines:
            self.children.spawn(spec.name, self._engine_argv(spec))
        for engine in engines:
            await self._wait_for(f"{engine.name}'s API", answers(engine.status))
        self.say(f"engines up: {', '.join(self._engine_line(s) for s in self.config.engines)}")
        self.children.spawn("bridge", self._bridge_argv())
        await self._wait_for("the bridge's /readyz", ready(http, f"{self.bridge_url}/readyz"))
        self.children.spawn("index", self._index_argv())
        await self._wait_for("the index's /readyz", ready(http, f"{self.index_url}/readyz"))
        names = {spec.name for spec in self.config.engines}
        await self._wait_for("every worker's catalog in the index", catalogs(index, names))
        self._write_services()
        self.say(
            f"bridge {self.bridge_url}/metrics, index {self.index_url} (/v1/score, /metrics); "
            f"probing for {self.config.duration_s:g} s"
        )

    async def _start_vllm_services(
        self, http: Http, index: IndexClient, context: zmq.asyncio.Context
    ) -> list[VllmEngine]:
        """vLLM servers first (about a minute), their witnesses before any request, then the
        bridge and the index; vLLM publishes nothing before its first request, so no catalog
        is awaited."""
        await self._start_broker()
        for spec in self.config.engines:
            self.children.spawn(spec.name, self._vllm_argv(spec))
        clients = [
            VllmClient(http, s.name, self.endpoints[s.name].api_url, SERVED_MODEL_NAME)
            for s in self.config.engines
        ]
        for client in clients:
            await self._wait_for(f"{client.name}'s vLLM", client.healthy, VLLM_STARTUP_TIMEOUT_S)
        engines = [self._vllm_engine(spec, client, context) for spec, client in
                   zip(self.config.engines, clients, strict=True)]  # fmt: skip
        for engine in engines:
            engine.witness.start()
        self.say(f"vLLM up: {', '.join(self._engine_line(s) for s in self.config.engines)}")
        self.children.spawn("bridge", self._bridge_argv())
        await self._wait_for("the bridge's /readyz", ready(http, f"{self.bridge_url}/readyz"))
        self.children.spawn("index", self._index_argv())
        await self._wait_for("the index's /readyz", ready(http, f"{self.index_url}/readyz"))
        self._write_services()
        self.say(
            f"bridge {self.bridge_url}/metrics, index {self.index_url} (/v1/score, /metrics); "
            f"probing for {self.config.duration_s:g} s with real requests"
        )
        return engines

    def _vllm_engine(
        self, spec: EngineSpec, client: VllmClient, context: zmq.asyncio.Context
    ) -> VllmEngine:
        ports = self.endpoints[spec.name]
        witness = EventWitness(
            spec.name,
            f"tcp://{LOOPBACK}:{ports.pub_port}",
            f"tcp://{LOOPBACK}:{ports.replay_port}",
            VLLM_TOPIC,
            context,
        )
        profile = VLLM_PROFILES[spec.profile]
        return VllmEngine(client, witness, profile, spec.num_blocks or profile.num_gpu_blocks)

    def _vllm_argv(self, spec: EngineSpec) -> list[str]:
        ports = self.endpoints[spec.name]
        argv = [
            *hmakv_command(), "vllm", "serve",
            "--profile", spec.profile,
            "--port", str(ports.api_port),
            "--events-port", str(ports.pub_port),
            "--replay-port", str(ports.replay_port),
            "--topic", VLLM_TOPIC,
        ]  # fmt: skip
        if spec.num_blocks is not None:
            argv += ["--num-gpu-blocks", str(spec.num_blocks)]
        if spec.hmakv_publisher:
            argv.append("--hmakv-publisher")
        return argv

    def _write_services(self) -> None:
        write_services(
            self.workdir,
            Services(
                kafka=self.bootstrap,
                topic_prefix=self.topic_prefix,
                broker_pid=self.broker.pid if self.broker is not None else None,
                bridge=self.bridge_url,
                index=self.index_url,
                engines={name: ports.api_url for name, ports in self.endpoints.items()},
                pids={child.name: child.pid for child in self.children.started},
            ),
        )

    async def _start_broker(self) -> None:
        embedded = self.config.embedded_broker
        if embedded is None:
            self.bootstrap = self.config.kafka
            self.topic_prefix = f"hmakv-demo-{secrets.token_hex(4)}"
            self.say(f"Kafka: {self.bootstrap} (topics {self.topic_prefix}.*)")
            return
        broker = local_broker(embedded)
        self.broker = broker
        # Blocking, so on a worker thread; it lives as long as the event loop, and the broker
        # (started with the parent-death signal) dies with it if the demo is killed outright.
        await asyncio.to_thread(broker.start)
        self.bootstrap = broker.bootstrap
        self.say(f"Kafka: embedded {embedded} at {self.bootstrap}")

    def _engine_argv(self, spec: EngineSpec) -> list[str]:
        ports = self.endpoints[spec.name]
        argv = [
            *hmakv_command(),
            "engine",
            "--profile", spec.profile,
            "--workload", spec.workload,
            "--rate", f"{self.config.engine_rate:g}",
            "--seed", str(spec.seed),
            "--worker-name", spec.name,
            # vLLM's rule: a wildcard endpoint binds (the bridge connects), a host connects.
            "--endpoint", f"tcp://*:{ports.pub_port}",
            "--replay-endpoint", f"tcp://{LOOPBACK}:{ports.replay_port}",
            "--api", f"{LOOPBACK}:{ports.api_port}",
            "--status-interval", "5",
        ]  # fmt: skip
        if spec.num_blocks is not None:
            argv += ["--num-blocks", str(spec.num_blocks)]
        if not self.use_model:
            argv.append("--no-model")
        return argv

    def _bridge_argv(self) -> list[str]:
        engines_file = self.workdir / "bridge-engines.toml"
        topic = VLLM_TOPIC if self.config.real_vllm else ""
        engines_file.write_text(bridge_engines_toml(self.config.engines, self.endpoints, topic))
        return [
            *hmakv_command(),
            "bridge",
            "--kafka", self.bootstrap,
            "--topic-prefix", self.topic_prefix,
            "--engines", str(engines_file),
            "--listen", self.bridge_url.removeprefix("http://"),
        ]  # fmt: skip

    def _index_argv(self) -> list[str]:
        return [
            *hmakv_command(),
            "index",
            "--kafka", self.bootstrap,
            "--topic-prefix", self.topic_prefix,
            "--listen", self.index_url.removeprefix("http://"),
            "--snapshot-to", "none",
            "--follower-id", "hmakv-demo",
            "--ready-max-lag", str(INDEX_READY_MAX_LAG),
            *(["--block-size", str(CPU_BLOCK_SIZE)] if self.config.real_vllm else []),
        ]  # fmt: skip

    def _engine_line(self, spec: EngineSpec) -> str:
        return f"{spec.name} ({spec.profile}, {spec.workload}, {self.endpoints[spec.name].api_url})"

    async def _wait_for(
        self, what: str, ready: Callable[[], Awaitable[bool]], timeout_s: float = STARTUP_TIMEOUT_S
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not await ready():
            self._raise_if_interrupted()
            self.children.check_alive()
            if time.monotonic() >= deadline:
                raise DemoFailed(f"{what} did not answer within {timeout_s:.0f} s")
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------------------------ run

    async def _run_phase(self, monitor: Monitor, prober: Prober | VllmProber) -> None:
        stop_probe, stop_watch = asyncio.Event(), asyncio.Event()
        live = LiveView(
            monitor,
            prober.stats,
            [spec.name for spec in self.config.engines],
            clock=self.clock,
            duration_s=self.config.duration_s,
            refresh=self.config.refresh,
            interval_s=self.config.interval_s,
            out=self.out,
        )
        watchers = [
            asyncio.create_task(monitor.run(stop_watch)),
            asyncio.create_task(live.run(stop_watch)),
        ]
        probing = asyncio.create_task(prober.run(stop_probe))
        try:
            await self._until_done(probing)
        except BaseException:
            probing.cancel()  # a service died: the probe in flight would wait out its retries
            raise
        finally:
            stop_probe.set()
            stop_watch.set()
            await self._let_finish(probing)
            await asyncio.gather(probing, *watchers, return_exceptions=True)
            live.show()
            live.finish()
        if probing.done() and not probing.cancelled() and probing.exception() is not None:
            raise DemoFailed(f"the probe client failed: {probing.exception()}")

    async def _let_finish(self, probing: asyncio.Task[None]) -> None:
        """The probe in flight finishes (its answers count), unless a second signal hurries."""
        hurry = asyncio.ensure_future(self.signals.hurry.wait())
        await asyncio.wait({probing, hurry}, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        probing.cancel()  # nothing if it finished

    async def _until_done(self, probing: asyncio.Task[None]) -> None:
        """Until ``duration`` is up, a signal arrives, a service dies or the probe fails."""
        deadline = time.monotonic() + self.config.duration_s
        while time.monotonic() < deadline and not self.signals.stop.is_set():
            self.children.check_alive()
            if probing.done():
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, deadline - time.monotonic())):
                    await self.signals.stop.wait()

    # ------------------------------------------------------------------------------ end

    async def _drain(
        self, http: Http, engines: list[EngineClient], index: IndexClient
    ) -> dict[str, EngineExit]:
        """Stop the engines, then wait until their last events are forwarded and applied."""
        engine_children = [c for c in self.children.started if c.name in self.endpoints]
        codes = await asyncio.to_thread(self.children.stop, engine_children, ENGINE_STOP_GRACE_S)
        exits = {
            child.name: read_engine_exit(child.log_path, codes[child.name])
            for child in engine_children
        }
        last_seqs = {
            name: exit_.last_seq for name, exit_ in exits.items() if exit_.last_seq is not None
        }
        self.say(
            "engines stopped; waiting for the bridge and the index to deliver their last events"
        )
        await self._deliver(http, index, last_seqs)
        return exits

    async def _drain_vllm(
        self, http: Http, engines: Sequence[VllmEngine], index: IndexClient
    ) -> dict[str, EngineExit]:
        """Probing has stopped: wait until the bridge forwarded and the index applied every seq
        the witnesses saw, then stop the servers. What each published is the witness's count."""
        last_seqs = {engine.name: await engine.witness.settle(FINAL_QUIET_S) for engine in engines}
        self.say("probing stopped; waiting for the bridge and the index to deliver every event")
        await self._deliver(http, index, last_seqs)
        servers = [c for c in self.children.started if c.name in self.endpoints]
        codes = await asyncio.to_thread(self.children.stop, servers, VLLM_STOP_GRACE_S)
        return {
            engine.name: EngineExit(
                code=vllm_exit_code(codes[engine.name]),
                events=engine.witness.state.events,
                last_seq=engine.witness.state.last_seq,
                dropped=None,
            )
            for engine in engines
        }

    async def _deliver(self, http: Http, index: IndexClient, last_seqs: dict[str, int]) -> None:
        """Until the bridge forwarded and the index applied each worker's last seq (bounded)."""
        try:
            await self._wait_drained(
                "the bridge to forward", forwarded(http, self.bridge_url, last_seqs)
            )
            await self._wait_drained("the index to apply", applied(index, last_seqs))
        except ChildExited as error:
            self.say(f"while draining: {error}")

    async def _wait_drained(self, what: str, done: Callable[[], Awaitable[bool]]) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not self.signals.hurry.is_set():
            if await done():
                return
            if time.monotonic() >= deadline:
                self.say(f"gave up waiting for {what} every event after {DRAIN_TIMEOUT_S:.0f} s")
                return
            await asyncio.sleep(POLL_S)

    def _summarise(
        self,
        first: Tick,
        last: Tick,
        prober: Prober | VllmProber,
        run_s: float,
        exits: dict[str, EngineExit],
        comparison: RoutingComparison | None = None,
    ) -> Summary:
        facts = RunFacts(
            started_at=self._started,
            run_s=run_s,
            interrupted=self.signals.stop.is_set(),
            kafka=self._kafka_description(),
            model=self.use_model,
            workdir=self.workdir,
            engines=self.config.engines,
            exits=exits,
        )
        return build_summary(facts, first, last, prober.stats, MIN_COMPARED, comparison)

    def _kafka_description(self) -> str:
        embedded = self.config.embedded_broker
        return f"{embedded} (embedded) at {self.bootstrap}" if embedded else self.bootstrap

    def _finish(self, summary: Summary, monitor: Monitor, prober: Prober | VllmProber) -> int:
        self.say(render_text(summary))
        saved = self.config.json_path is None or self._save_json(summary, self.config.json_path)
        reported = self.config.report_dir is None or self._report(summary, monitor, prober)
        self.say(f"logs: {self.workdir}")
        return EXIT_OK if summary.ok and saved and reported else EXIT_FAILED

    def _save_json(self, summary: Summary, path: Path) -> bool:
        try:
            path.write_bytes(encode_json(summary))
        except OSError as error:  # checked at the start; a full disk or a path gone since
            self.say(f"no summary JSON: cannot write {path}: {error}")
            return False
        self.say(f"summary JSON: {path}")
        return True

    def _report(self, summary: Summary, monitor: Monitor, prober: Prober | VllmProber) -> bool:
        assert self.config.report_dir is not None
        try:
            from hmakv.demo.report import write_report  # matplotlib only when a report is asked
        except ImportError as error:
            self.say(f"no report: it needs matplotlib ({error}); pip install 'hmakv[local]'")
            return False
        try:
            written = write_report(self.config.report_dir, summary, monitor.ticks, prober.stats)
        except OSError as error:
            self.say(f"no report: cannot write it in {self.config.report_dir}: {error}")
            return False
        self.say(f"report: {written}")
        return True

    def _stop_everything(self) -> None:
        """Every child group (reverse start order), then the embedded broker, whatever the
        children's stop raised."""
        try:
            if self.children.started:
                self.children.stop_all(STOP_GRACE_S)
        finally:
            if self.broker is not None:
                self._keep_broker_log(self.broker)
                self.broker.stop()
                self.broker = None

    async def _delete_topics(self) -> None:
        """On an existing cluster, remove the topics this run created (its prefix is its own),
        however the run ended: nobody else would ever delete them."""
        if self.config.embedded_broker is not None or not self.bootstrap:
            return
        topics = [f"{self.topic_prefix}.{kind}" for kind in ("events", "workers", "deadletter")]
        try:
            await delete_topics(self.bootstrap, topics)
        except Exception as error:  # the run's results stand; say what is left behind
            self.say(f"could not delete the demo's topics {', '.join(topics)}: {error}")

    def _keep_broker_log(self, broker: LocalBroker) -> None:
        """The broker's data dir is temporary; its log goes to the workdir with the others."""
        with contextlib.suppress(OSError, RuntimeError):
            shutil.copyfile(broker.log_path, self.workdir / "kafka.log")


def bridge_engines_toml(
    specs: Sequence[EngineSpec], endpoints: Mapping[str, EngineEndpoints], topic: str = ""
) -> str:
    """The bridge's engines file: each engine's endpoints and, for chunked local attention, the
    chunk size, which never travels on the wire (without it the index falls back to the
    full-attention rule for that group and under-reports hits once early chunks are evicted)."""
    lines = []
    for spec in specs:
        ports = endpoints[spec.name]
        lines += [
            "[[engines]]",
            f"name = {json.dumps(spec.name)}",
            f'endpoint = "tcp://{LOOPBACK}:{ports.pub_port}"',
            f'replay = "tcp://{LOOPBACK}:{ports.replay_port}"',
        ]
        if topic:
            lines.append(f"topic = {json.dumps(topic)}")
        groups = get_profile(spec.profile).groups if spec.workload != VLLM else ()
        chunked = [
            f"{group} = {{ kind = {json.dumps(g.kind)}, block_size = {g.block_size}, "
            f"chunk_size = {g.chunk_size} }}"
            for group, g in enumerate(groups)
            if g.chunk_size is not None
        ]
        if chunked:
            lines.append(f"groups = {{ {', '.join(chunked)} }}")
        lines.append("")
    return "\n".join(lines)


def vllm_exit_code(code: int | None) -> int | None:
    """vLLM's API server ends on the demo's SIGTERM by re-raising it: that is a clean stop."""
    return 0 if code == -signal.SIGTERM else code


def _engine_endpoints() -> EngineEndpoints:
    return EngineEndpoints(pub_port=free_port(), replay_port=free_port(), api_port=free_port())


def run_demo(config: DemoConfig, out: TextIO = sys.stdout) -> int:
    # The probe's own Kafka client would narrate its assignments at INFO among the progress.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    return asyncio.run(Demo(config, out).run())
