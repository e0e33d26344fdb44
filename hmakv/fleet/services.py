"""The services under measurement, each its own ``hmakv`` process as deployed, so that its CPU
time and memory are its own: read from ``/proc``, and its state from its HTTP endpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hmakv.demo.promtext import MetricsPage
from hmakv.fleet.engines import EngineSpec, free_ports, status_mib
from hmakv.kafka import ApacheKafkaBroker

PARTITIONS = 6
READY_TIMEOUT_S = 120.0


@contextmanager
def apache_kafka(bootstrap: str | None) -> Iterator[str]:
    """``bootstrap`` if given, else an Apache Kafka started from its jars for the block."""
    if bootstrap:
        yield bootstrap
        return
    with ApacheKafkaBroker() as broker:
        yield broker.bootstrap


class ServiceProcess:
    """One ``hmakv`` subcommand listening on a free loopback port, optionally pinned to CPUs."""

    def __init__(self, argv: Sequence[str], cpus: frozenset[int] | None = None) -> None:
        self.listen = free_ports(1)[0]
        command = [sys.executable, "-m", "hmakv.cli", "--log-level", "WARNING", *argv]
        command += ["--listen", f"127.0.0.1:{self.listen}"]
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.name = argv[0]
        # Its log (the start-up replays, Kafka's leader moves) says why when something fails.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=pin
        )

    def log_tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return b"\n".join(self.log.read().splitlines()[-lines:]).decode(errors="replace")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen}{path}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``/readyz`` answers 200: an index has caught up with its log."""
        self._wait_for("/readyz", timeout)

    def wait_up(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``/healthz`` answers 200: serving, whatever it has read so far."""
        self._wait_for("/healthz", timeout)

    def _wait_for(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"hmakv {self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url(path), timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"hmakv {self.name}: {path} never answered 200")

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            body: bytes = response.read()
            return body

    def metrics(self) -> MetricsPage:
        return MetricsPage.parse(self.get("/metrics").decode())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        return status_mib("VmHWM", self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def bridge_service(
    bootstrap: str,
    prefix: str,
    specs: Sequence[EngineSpec],
    index: int = 0,
    shards: int = 1,
    cpus: frozenset[int] | None = None,
) -> ServiceProcess:
    """``hmakv bridge`` following every engine, or shard ``index`` of ``shards``: engine ``i``
    is pinned to shard ``i % shards``, since with 16 names a hash splits them only roughly
    (e0..e15 hash 6/10 over two shards), and an operator who cares pins them the same way."""
    argv = ["bridge", "--kafka", bootstrap, "--topic-prefix", prefix]
    argv += ["--partitions", str(PARTITIONS), "--shard", f"{index}/{shards}"]
    for spec in specs:
        endpoints = f"tcp://127.0.0.1:{spec.port},replay=tcp://127.0.0.1:{spec.replay_port}"
        argv += ["--engine", f"{spec.name}={endpoints},shard={spec.index % shards}"]
    return ServiceProcess(argv, cpus)


def index_service(bootstrap: str, prefix: str) -> ServiceProcess:
    """``hmakv index`` replaying the topics from their beginning, no snapshots."""
    argv = ["index", "--kafka", bootstrap, "--topic-prefix", prefix, "--snapshot-to", "none"]
    argv += ["--follower-id", "hmakv-bench-fleet"]
    return ServiceProcess(argv)
