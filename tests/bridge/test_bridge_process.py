"""``hmakv bridge`` as operators run it: a process killed and restarted, reloaded, stopped.

The bridge runs as a subprocess of the real command line; engines and Kafka are real too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bridge_harness import (
    TOPIC,
    WAIT_S,
    EngineThread,
    KafkaLog,
    by_group,
    engines_running,
    expected_records,
    free_port,
)

from hmakv.bridge.config import EngineConfig, Shard
from hmakv.bridge.service import BridgeService, BridgeSettings
from hmakv.cli import build_parser, main
from hmakv.commands import bridge as bridge_command
from hmakv.commands.bridge import reload_engines
from hmakv.kafka import unique_topic
from hmakv.kvlog.records import Topics


class BridgeProcess:
    def __init__(self, args: list[str], log_path: Path) -> None:
        self._log = log_path.open("ab")
        command = [sys.executable, "-m", "hmakv.cli", "bridge", *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait(self) -> int:
        try:
            return self.process.wait(WAIT_S)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


@pytest.fixture
def processes() -> Iterator[list[BridgeProcess]]:
    started: list[BridgeProcess] = []
    yield started
    for process in started:
        process.kill()


def engine_flag(engine: EngineThread) -> str:
    return (
        f"{engine.name}=tcp://127.0.0.1:{engine.pub_port},"
        f"replay=tcp://127.0.0.1:{engine.replay_port},topic={TOPIC}"
    )


async def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


@pytest.mark.kafka
async def test_a_bridge_killed_and_restarted_loses_nothing_the_ring_covers(
    kafka_bootstrap: str, tmp_path: Path, processes: list[BridgeProcess]
) -> None:
    engine = EngineThread("engine-a")
    prefix = unique_topic("bridge")
    args = ["--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "3"]
    args += ["--engine", engine_flag(engine), "--state-interval", "0.2"]
    log = KafkaLog(kafka_bootstrap, Topics(prefix))
    with engines_running(engine):
        processes.append(BridgeProcess(args, tmp_path / "bridge.log"))
        await log.wait_for(lambda log: log.state("engine-a") is not None, "the bridge up")
        engine.publish(150, interval=0.01)

        def resumable(log: KafkaLog) -> bool:
            state = log.state("engine-a")
            return state is not None and state.last_seq >= 30

        await log.wait_for(resumable, "a resume point past seq 30")
        processes[0].process.kill()  # SIGKILL: no flush, no goodbye
        processes[0].wait()
        await log.wait_for(resumable, "the last resume point the first bridge wrote")
        resume_point = log.state("engine-a").last_seq  # type: ignore[union-attr]
        await wait_until(lambda: engine.last_seq >= 90, "the engine went on without a bridge")
        processes.append(BridgeProcess(args, tmp_path / "bridge.log"))
        await asyncio.to_thread(engine.wait_idle)
        await log.wait_for(lambda log: log.has_seq("engine-a", 150), "every step")
        processes[1].signal(signal.SIGTERM)
        assert processes[1].wait() == 0
    assert "bridge started: 1 engines, 1 workers resumed" in (tmp_path / "bridge.log").read_text()
    # Resumed from its last resume point, not from scratch: what came before it went out once.
    written = [r.seq for r in log.records_of("engine-a") if r.group_idx == 0]
    assert all(written.count(seq) == 1 for seq in range(1, resume_point + 1))
    for group, records in log.applied("engine-a").items():
        assert {r.epoch for r in records} == {0}, "a bridge restart is not an engine restart"
        rest = [r for r in records if r.seq > 0]
        assert rest == by_group(expected_records("engine-a", 0, engine))[group]


@pytest.mark.kafka
async def test_sighup_reloads_the_engines_and_sigterm_flushes_state(
    kafka_bootstrap: str, tmp_path: Path, processes: list[BridgeProcess]
) -> None:
    a, b = EngineThread("engine-a"), EngineThread("engine-b")
    engines_file = tmp_path / "engines.toml"
    engines_file.write_text(toml_engine(a))
    prefix = unique_topic("bridge")
    args = ["--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--engines", str(engines_file)]
    # Resume points are written when a worker's health changes, else once a minute: the last
    # one can only come from the flush at shutdown.
    args += ["--state-interval", "60", "--log-format", "json"]
    log = KafkaLog(kafka_bootstrap, Topics(prefix))
    with engines_running(a, b):
        processes.append(BridgeProcess(args, tmp_path / "bridge.log"))
        await a.published_all(10)
        await log.wait_for(lambda log: log.has_seq("engine-a", 10), "engine-a's steps")
        engines_file.write_text(toml_engine(a) + toml_engine(b))
        processes[0].signal(signal.SIGHUP)
        await b.published_all(10)
        await log.wait_for(lambda log: log.has_seq("engine-b", 10), "engine-b, added by SIGHUP")
        await a.published_all(5)
        await log.wait_for(lambda log: log.has_seq("engine-a", 15), "engine-a's last steps")
        processes[0].signal(signal.SIGTERM)
        assert processes[0].wait() == 0
    await log.wait_for(lambda log: log.state("engine-a") is not None, "the final states")
    final_a, final_b = log.state("engine-a"), log.state("engine-b")
    assert final_a is not None and (final_a.last_seq, final_a.health) == (15, "live")
    assert final_b is not None and final_b.last_seq == 10
    output = (tmp_path / "bridge.log").read_text()
    assert '"message": "engines reloaded: engine-a, engine-b"' in output


@pytest.mark.kafka
async def test_sighup_retires_an_engine_gone_from_the_file_not_one_moved_to_another_shard(
    kafka_bootstrap: str, tmp_path: Path, processes: list[BridgeProcess]
) -> None:
    moved, gone = EngineThread("engine-a"), EngineThread("engine-b")
    engines_file = tmp_path / "engines.toml"
    engines_file.write_text(toml_engine(moved, shard=0) + toml_engine(gone, shard=0))
    prefix = unique_topic("bridge")
    args = ["--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--engines", str(engines_file)]
    args += ["--shard", "0/2", "--state-interval", "0.2", "--log-format", "json"]
    log = KafkaLog(kafka_bootstrap, Topics(prefix))
    with engines_running(moved, gone):
        processes.append(BridgeProcess(args, tmp_path / "bridge.log"))
        await moved.published_all(3)
        await gone.published_all(3)
        await log.wait_for(
            lambda log: all(last_seq(log, e.name) == 3 for e in (moved, gone)), "both followed"
        )
        engines_file.write_text(toml_engine(moved, shard=1))  # the other bridge's now
        processes[0].signal(signal.SIGHUP)

        def retired(log: KafkaLog) -> bool:
            state = log.state("engine-b")
            return state is not None and state.health == "retired"

        await log.wait_for(retired, "engine-b retired")
        processes[0].signal(signal.SIGTERM)
        assert processes[0].wait() == 0
    await log.wait_for(lambda log: last_seq(log, "engine-a") == 3, "the final states")
    assert [s.health for s in log.states if s.worker == "engine-a"][-1] == "live"
    output = (tmp_path / "bridge.log").read_text()
    assert "worker 'engine-b' retired at epoch 0: consumers drop it" in output
    assert "engine-a' retired" not in output


def last_seq(log: KafkaLog, worker: str) -> int | None:
    state = log.state(worker)
    return None if state is None else state.last_seq


@pytest.mark.kafka
async def test_two_sharded_bridges_split_a_fleet_and_write_every_step_once(
    kafka_bootstrap: str, tmp_path: Path, processes: list[BridgeProcess]
) -> None:
    engines = [EngineThread(f"engine-{letter}") for letter in "abcdef"]
    owners = {e.name: Shard(0, 2).owns(EngineConfig(e.name, "tcp://h:1")) for e in engines}
    assert len(set(owners.values())) == 2, "both shards have engines (names chosen for it)"
    prefix = unique_topic("bridge")
    args = ["--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "3"]
    for engine in engines:
        args += ["--engine", engine_flag(engine)]
    log = KafkaLog(kafka_bootstrap, Topics(prefix))
    with engines_running(*engines):
        for index in (0, 1):
            shard = ["--shard", f"{index}/2"]
            processes.append(BridgeProcess([*args, *shard], tmp_path / f"bridge-{index}.log"))
        for engine in engines:
            await engine.published_all(20)
        await log.wait_for(
            lambda log: all(log.has_seq(e.name, 20) for e in engines), "every engine's steps"
        )
        for process in processes:
            process.signal(signal.SIGTERM)
            assert process.wait() == 0
    for engine in engines:
        expected = by_group(expected_records(engine.name, 0, engine))
        written = by_group([r for r in log.records_of(engine.name) if r.seq > 0])
        assert written == expected, f"{engine.name}: every step once, from one bridge"
    followed = sum(owners.values())
    output = (tmp_path / "bridge-0.log").read_text()
    assert f"shard 0/2: following {followed} of 6 engines" in output


def toml_engine(engine: EngineThread, shard: int | None = None) -> str:
    return (
        f'[[engines]]\nname = "{engine.name}"\n'
        f'endpoint = "tcp://127.0.0.1:{engine.pub_port}"\n'
        f'replay = "tcp://127.0.0.1:{engine.replay_port}"\n'
        f'topic = "{TOPIC}"\n' + ("" if shard is None else f"shard = {shard}\n")
    )


def test_a_configuration_that_cannot_run_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_toml = tmp_path / "engines.toml"
    bad_toml.write_text('[[engines]]\nname = "a/b"\nendpoint = "tcp://h:1"\n')
    cases = {
        ("--engine", "no-endpoint"): "expected NAME=ENDPOINT",
        ("--engine", "a=tcp://h:1,flavour=x"): "unknown option",
        ("--engine", "a=tcp://h:1", "--engine", "a=tcp://h:2"): "unique",
        ("--engines", str(bad_toml)): "contain no '/'",
        (): "no engines",
        ("--bind-sub", "tcp://127.0.0.1:1", "--shard", "0/2"): "--shard splits",
        ("--engine", "a=ipc:///tmp/a,dp=2"): "cannot offset",
    }
    for args, message in cases.items():
        assert main(["bridge", *args]) == 2
        assert message in capsys.readouterr().err


def test_help_names_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hmakv.cli", "bridge", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in ("--engines", "--engine", "--bind-sub", "--kafka", "--topic-prefix",
                 "--partitions", "--replication", "--compression", "--listen", "--max-replays",
                 "--replay-timeout", "--queue-size", "HMAKV_BRIDGE_QUEUE_SIZE",
                 "HMAKV_KAFKA_BOOTSTRAP"):  # fmt: skip
        assert flag in result.stdout


ENGINE_A = '[[engines]]\nname = "a"\nendpoint = "tcp://h:5557"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[engines]]\nname = "a"\nendpoint = "ipc:///tmp/hmakv-a"\ndp_ranks = [0, 1]\n',
            "cannot offset",
        ),
        (ENGINE_A.encode() + b'topic = "\xff"\n', "'utf-8' codec can't decode"),
        (ENGINE_A + 'groups = { "\u00b2" = { kind = "mamba", block_size = 1 } }', "index"),
        (
            ENGINE_A + 'groups = { 2 = { kind = "mamba", block_size = 1, chunk = 64 } }',
            "unknown keys ['chunk']",
        ),
        (ENGINE_A + "dp_ranks = [0, 65535]", "past port 65535"),
        (
            ENGINE_A + 'dp_ranks = [0, 1]\n[[engines]]\nname = "a-dp1"\nendpoint = "tcp://g:1"',
            "worker ids",
        ),
        ('[[engines]]\nname = "a"\nendpoint = "tcp://*:5557"\n', "wildcard"),
    ],
)
async def test_a_sighup_with_an_engines_file_that_cannot_run_keeps_the_engines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str | bytes, message: str
) -> None:
    engines = tmp_path / "engines.toml"
    engines.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = argparse.Namespace(engines=engines, engine=[], bind_sub=None, shard=Shard(0, 1))
    service = BridgeService(BridgeSettings(kafka="127.0.0.1:1"), [])
    with caplog.at_level(logging.ERROR):
        await reload_engines(service, args)  # what SIGHUP runs
    assert "engines not reloaded" in caplog.text and message in caplog.text


def test_sighup_without_an_engines_file_does_not_end_the_bridge(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process unflushed: the bridge takes it whatever its
    configuration (here --engine flags only, nothing to re-read, and no Kafka yet)."""
    log_path = tmp_path / "bridge.log"
    bridge = BridgeProcess(
        ["--kafka", f"127.0.0.1:{free_port()}", "--engine", "a=tcp://127.0.0.1:1"], log_path
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while b"not usable yet" not in log_path.read_bytes():  # start() runs: signals are set
            assert bridge.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        bridge.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert bridge.process.poll() is None, "SIGHUP ended the bridge"
        bridge.signal(signal.SIGTERM)
        assert bridge.wait() == 0
    finally:
        bridge.kill()


BRIDGE = [sys.executable, "-m", "hmakv.cli", "bridge"]


def test_a_listen_port_taken_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """A start that fails (here --listen's port is another process's) says why in the log and
    exits 1, for the supervisor to restart it, instead of a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        kafka, listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}"
        done = subprocess.run(
            [*BRIDGE, "--kafka", kafka, "--listen", listen, "--engine", "a=tcp://127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1, done.stderr
    assert "the bridge did not start" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_topic_prefix_the_index_reads_is_the_bridges_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HMAKV_TOPIC_PREFIX is what the index and `hmakv workers` read: a bridge that read only
    a variable of its own wrote topics that no index set up the same way ever read."""
    monkeypatch.setenv("HMAKV_TOPIC_PREFIX", "fleet-a")
    bridge = build_parser().parse_args(["bridge", "--engine", "a=tcp://h:1"])
    index = build_parser().parse_args(["index", "--kafka", "k:9092"])
    assert bridge.topic_prefix == index.topic_prefix == "fleet-a"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("HMAKV_LOG_FORMAT", "yaml", "--log-format: invalid choice: 'yaml'"),
        # The Kafka producer would refuse it only once started: an exit 1 on every restart.
        ("HMAKV_BRIDGE_COMPRESSION", "zstandard", "--compression: invalid choice: 'zstandard'"),
    ],
)
def test_a_choice_from_the_environment_is_checked_like_the_flag(
    variable: str,
    value: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    served = []

    async def serve(*args: object) -> int:
        served.append(args)
        return 0

    monkeypatch.setattr(bridge_command, "_serve", serve)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        main(["bridge", "--engine", "a=tcp://h:1"])
    assert exit_.value.code == 2
    assert not served
    assert message in capsys.readouterr().err


async def test_a_reload_of_a_bridge_that_never_started_does_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM during start (Kafka not answering) cancels it; a SIGHUP queued behind it must
    not run on a bridge without Kafka (it failed an assertion in a task nobody awaited)."""
    service = BridgeService(BridgeSettings(kafka="127.0.0.1:1"), [])
    with caplog.at_level(logging.WARNING, logger="hmakv.bridge.service"):
        await service.reload([EngineConfig("a", "tcp://127.0.0.1:1")])
    assert "has not started" in caplog.text
    assert service.readiness().sources == {}
