"""The local broker launcher and ``hmakv kafka``, against both distributions.

Every test that starts a broker also checks that its process is gone afterwards: a broker that
outlives its owner holds a port and memory until someone notices.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from hmakv.kafka import (
    ApacheKafkaBroker,
    BrokerDist,
    BrokerStartError,
    JarFetchError,
    TansuBroker,
    broker_answers,
    cache_dir,
    fetch_jars,
    kafka_version,
    local_broker,
    unique_topic,
)
from hmakv.kafka.process import (
    command_line,
    free_port,
    group_is_running,
    start_time,
    stop_group,
)

BOTH_DISTS = [
    pytest.param(BrokerDist.TANSU, marks=pytest.mark.kafka, id="tansu"),
    pytest.param(BrokerDist.APACHE, marks=[pytest.mark.kafka, pytest.mark.apache], id="apache"),
]


async def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=b"key")
    finally:
        await producer.stop()


async def _first_value(bootstrap: str, topic: str) -> bytes:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        record = await consumer.getone()
    finally:
        await consumer.stop()
    value: bytes = record.value
    return value


def _round_trip(bootstrap: str) -> bytes:
    topic = unique_topic("launcher")
    asyncio.run(_produce(bootstrap, topic, b"hello"))
    return asyncio.run(_first_value(bootstrap, topic))


@pytest.mark.parametrize("dist", BOTH_DISTS)
def test_launcher_serves_records_and_leaves_nothing_behind(dist: BrokerDist) -> None:
    with local_broker(dist) as broker:
        pid, data_dir = broker.pid, broker.data_dir
        assert broker.bootstrap.startswith("127.0.0.1:")
        assert _round_trip(broker.bootstrap) == b"hello"
        assert broker.log_path.stat().st_size > 0

    assert not group_is_running(pid)
    assert not data_dir.exists()


@pytest.mark.kafka
@pytest.mark.apache
def test_apache_keeps_its_topics_in_a_given_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "kafka"
    topic = unique_topic("durable")
    with local_broker(BrokerDist.APACHE, data_dir=data_dir) as first:
        asyncio.run(_produce(first.bootstrap, topic, b"kept"))
        first_pid = first.pid

    assert not group_is_running(first_pid)
    with local_broker(BrokerDist.APACHE, data_dir=data_dir) as second:
        assert asyncio.run(_first_value(second.bootstrap, topic)) == b"kept"
        second_pid = second.pid

    assert not group_is_running(second_pid)
    assert (data_dir / "broker.log").exists()


@pytest.mark.kafka
def test_a_taken_port_fails_the_start_before_spawning() -> None:
    """Spawning anyway would leave the readiness probe to whatever listens there."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        broker = TansuBroker(port=port)
        with pytest.raises(BrokerStartError, match=f"^port {port} is in use;"):
            broker.start()
    with pytest.raises(RuntimeError, match="not running"):
        _ = broker.pid


@pytest.mark.kafka
@pytest.mark.apache
def test_another_listener_answering_on_the_port_is_not_readiness(tmp_path: Path) -> None:
    """A port taken after the start's check (here by a Tansu broker, while Kafka formats its
    storage): the thief answers the probe while our broker dies on the port. That answer must
    not count as ours being ready; the start fails with our broker's log instead."""
    fetch_jars()
    data_dir = tmp_path / "kafka"
    broker = ApacheKafkaBroker(port=free_port(), data_dir=data_dir)
    thief = TansuBroker(port=int(broker.bootstrap.rpartition(":")[2]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as starter:
        starting = starter.submit(broker.start)
        try:
            _wait_for_file(data_dir / "server.properties")  # checked the port, not yet bound
            thief.start()
            with pytest.raises(BrokerStartError, match=r"(?s)exited with code.*already in use"):
                starting.result(timeout=120)
        finally:
            broker.stop()
            thief.stop()


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


OWNER_SCRIPT = """
import time
from hmakv.kafka import TansuBroker
broker = TansuBroker().start()
print(broker.pid, broker.data_dir, flush=True)
time.sleep(600)
"""


@pytest.mark.kafka
def test_a_broker_dies_with_an_owner_killed_outright() -> None:
    """The owner cannot clean up after SIGKILL; the kernel still ends its broker (Linux)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    pid_field, data_dir_field = owner.stdout.readline().split()
    broker_pid = int(pid_field)
    assert group_is_running(broker_pid)

    owner.kill()
    owner.wait()

    try:
        deadline = time.monotonic() + 30
        while group_is_running(broker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_is_running(broker_pid)
    finally:
        stop_group(broker_pid)
        shutil.rmtree(data_dir_field, ignore_errors=True)


def test_fetch_without_maven_names_the_command_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HMAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    with pytest.raises(JarFetchError, match=r"mvn -q -B -f .*dependency:copy-dependencies"):
        fetch_jars()


# ---- hmakv kafka, as the separate processes a user or CI script runs ----


def _hmakv_kafka(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hmakv.cli", "kafka", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def _hmakv_kafka_popen(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """``hmakv kafka ARGS`` left running, its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "hmakv.cli", "kafka", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def cli_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private cache dir sharing the real jars; whatever a test leaves running is stopped."""
    private_cache = tmp_path / "cache"
    private_cache.mkdir()
    (private_cache / "kafka").symlink_to(cache_dir() / "kafka", target_is_directory=True)
    env = {**os.environ, "HMAKV_CACHE_DIR": str(private_cache)}
    env.pop("HMAKV_KAFKA_DIST", None)
    yield env
    _hmakv_kafka(env, "stop")


def _recorded_state(env: dict[str, str]) -> dict[str, object]:
    state: dict[str, object] = json.loads(
        (Path(env["HMAKV_CACHE_DIR"]) / "run" / "kafka.json").read_text()
    )
    return state


@pytest.mark.parametrize("dist", BOTH_DISTS)
def test_cli_start_status_stop(cli_env: dict[str, str], dist: BrokerDist) -> None:
    if dist is BrokerDist.APACHE:
        fetch_jars()

    started = _hmakv_kafka(cli_env, "start", "--dist", dist)
    assert started.returncode == 0, started.stderr
    bootstrap = started.stdout.strip()
    state = _recorded_state(cli_env)
    pid = int(str(state["pid"]))
    data_dir = Path(str(state["data_dir"]))
    assert state["dist"] == dist
    assert state["bootstrap"] == bootstrap

    status = _hmakv_kafka(cli_env, "status")
    assert status.returncode == 0
    assert status.stdout.startswith(f"{bootstrap} running ({dist}")
    assert _round_trip(bootstrap) == b"hello"

    stopped = _hmakv_kafka(cli_env, "stop")
    assert stopped.returncode == 0
    assert not group_is_running(pid)
    assert not data_dir.exists()
    assert _hmakv_kafka(cli_env, "status").returncode == 1


@pytest.mark.kafka
def test_cli_refuses_a_second_broker_while_one_runs(cli_env: dict[str, str]) -> None:
    first = _hmakv_kafka(cli_env, "start", "--dist", "tansu")
    assert first.returncode == 0, first.stderr

    second = _hmakv_kafka(cli_env, "start", "--dist", "tansu")
    assert second.returncode == 1
    assert f"already runs at {first.stdout.strip()}" in second.stderr
    assert second.stdout == ""


@pytest.mark.kafka
def test_cli_foreground_broker_stops_cleanly_on_sigterm(cli_env: dict[str, str]) -> None:
    foreground = subprocess.Popen(
        [sys.executable, "-m", "hmakv.cli", "kafka", "start", "--dist", "tansu", "--foreground"],
        env=cli_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert foreground.stdout is not None
        bootstrap = foreground.stdout.readline().strip()
        pid = int(str(_recorded_state(cli_env)["pid"]))
        assert broker_answers(bootstrap)
        assert _hmakv_kafka(cli_env, "status").returncode == 0

        foreground.send_signal(signal.SIGTERM)
        assert foreground.wait() == 0
    finally:
        foreground.kill()
        foreground.wait()
    assert not group_is_running(pid)
    assert _hmakv_kafka(cli_env, "status").returncode == 1


@pytest.mark.kafka
def test_cli_stop_ends_a_foreground_broker_cleanly(cli_env: dict[str, str]) -> None:
    """`hmakv kafka stop` is a clean way to end `start --foreground` too: Tansu exits 0 on the
    SIGTERM it sends, which is no failure of the foreground command."""
    foreground = _hmakv_kafka_popen(cli_env, "start", "--dist", "tansu", "--foreground")
    try:
        assert foreground.stdout is not None
        bootstrap = foreground.stdout.readline().strip()
        stopped = _hmakv_kafka(cli_env, "stop")
        _, errors = foreground.communicate(timeout=60)
    finally:
        foreground.kill()
        foreground.wait()
    assert stopped.stdout == f"stopped the tansu broker at {bootstrap}\n", stopped.stderr
    assert foreground.returncode == 0, errors
    assert "ERROR" not in errors


@pytest.mark.kafka
def test_cli_concurrent_starts_run_one_broker_that_stop_ends(cli_env: dict[str, str]) -> None:
    """Starts racing on one cache dir: one broker, recorded, and the others are told it runs.
    Without the state lock two could both find no record and both start a broker, one of them
    unrecorded and so out of `stop`'s reach."""
    starts = [_hmakv_kafka_popen(cli_env, "start", "--dist", "tansu") for _ in range(3)]
    results = [(*start.communicate(timeout=120), start.returncode) for start in starts]
    addresses = [out.strip() for out, _, _ in results if out.strip()]
    recorded = _recorded_state(cli_env)["bootstrap"]
    stopped = _hmakv_kafka(cli_env, "stop")
    survivors = _tansu_pids_listening_at(addresses)
    for pid in survivors:  # leaked brokers, stopped before the asserts can fail
        stop_group(pid)

    assert sorted(code for _, _, code in results) == [0, 1, 1], results
    assert addresses == [recorded]
    refusals = [errors for _, errors, code in results if code == 1]
    assert all(f"already runs at {recorded}" in errors for errors in refusals), refusals
    assert stopped.stdout == f"stopped the tansu broker at {recorded}\n"
    assert survivors == []


def _tansu_pids_listening_at(addresses: list[str]) -> list[int]:
    """The Tansu processes told to listen at any of ``addresses``, found by command line."""
    listener_flags = [f"--listener-url tcp://{address} " for address in addresses]
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if any(flag in f"{command_line(pid)} " for flag in listener_flags)]


@pytest.mark.kafka
@pytest.mark.parametrize("action", ["start", "stop"])
def test_cli_start_and_stop_wait_while_another_holds_the_state_lock(
    cli_env: dict[str, str], action: str
) -> None:
    """Reading the state file, acting and recording is one step under the lock beside it:
    while another command holds it, they wait (and say so) instead of acting on a record that
    is about to change."""
    lock_path = Path(cli_env["HMAKV_CACHE_DIR"]) / "run" / "kafka.lock"
    lock_path.parent.mkdir()
    env = {**cli_env, "HMAKV_LOG_LEVEL": "INFO"}
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = _hmakv_kafka_popen(
            env, action, *(["--dist", "tansu"] if action == "start" else [])
        )
        assert waiting.stderr is not None
        said = waiting.stderr.readline()
        still_waiting = waiting.poll() is None
        recorded_meanwhile = lock_path.with_name("kafka.json").exists()
    out, errors = waiting.communicate(timeout=120)

    assert "waiting for another `hmakv kafka start` or `stop`" in said, (said, errors)
    assert still_waiting
    assert not recorded_meanwhile
    assert waiting.returncode == 0, errors
    assert out.strip() == (
        _recorded_state(env)["bootstrap"] if action == "start" else "no broker running"
    )


@pytest.mark.kafka
def test_cli_start_on_a_port_another_broker_holds_fails(cli_env: dict[str, str]) -> None:
    """The other broker answering on the port must not pass for ours, which dies on it: one
    line naming the port, exit 1, nothing on stdout and nothing recorded."""
    with local_broker(BrokerDist.TANSU) as other:
        port = other.bootstrap.rpartition(":")[2]
        done = _hmakv_kafka(cli_env, "start", "--dist", "tansu", "--port", port)
        assert broker_answers(other.bootstrap)

    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert f"port {port} is in use" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (Path(cli_env["HMAKV_CACHE_DIR"]) / "run" / "kafka.json").exists()


@pytest.mark.kafka
@pytest.mark.apache
@pytest.mark.parametrize("relative", ["data-dir", "cache-dir"])
def test_cli_apache_starts_with_relative_paths(
    cli_env: dict[str, str], tmp_path: Path, relative: str
) -> None:
    """The JVM runs in its data dir, so paths relative to where the user ran `hmakv kafka
    start` (its config, the jars in the cache dir) must reach it made absolute."""
    fetch_jars()
    env, args = dict(cli_env), ["start", "--dist", "apache"]
    if relative == "data-dir":
        args += ["--data-dir", "kafka-data"]
    else:
        env["HMAKV_CACHE_DIR"] = "cache"  # cli_env's cache dir, seen from tmp_path

    started = _hmakv_kafka(env, *args, cwd=tmp_path)

    assert started.returncode == 0, started.stderr
    data_dir = Path(str(_recorded_state(cli_env)["data_dir"]))
    assert data_dir.is_absolute()
    if relative == "data-dir":
        assert data_dir == tmp_path / "kafka-data"
    assert _round_trip(started.stdout.strip()) == b"hello"


def test_cli_stop_and_status_with_no_broker(cli_env: dict[str, str]) -> None:
    stopped = _hmakv_kafka(cli_env, "stop")
    assert (stopped.returncode, stopped.stdout) == (0, "no broker running\n")
    status = _hmakv_kafka(cli_env, "status")
    assert (status.returncode, status.stdout) == (1, "not running\n")


def test_cli_forgets_a_broker_that_died_and_its_temporary_dir(cli_env: dict[str, str]) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphaned_dir, state = _tansu_record(cli_env, dead.pid)
    state_path = _write_state(cli_env, json.dumps(state))

    assert _hmakv_kafka(cli_env, "status").returncode == 1
    stopped = _hmakv_kafka(cli_env, "stop")
    assert (stopped.returncode, stopped.stdout) == (0, "no broker running\n")
    assert not state_path.exists()
    assert not orphaned_dir.exists()


def _tansu_record(env: dict[str, str], pid: int) -> tuple[Path, dict[str, object]]:
    """A record of a Tansu broker at ``pid`` with a temporary data dir (made here)."""
    data_dir = Path(env["HMAKV_CACHE_DIR"]) / "orphaned-data"
    data_dir.mkdir()
    record: dict[str, object] = {
        "pid": pid,
        "dist": "tansu",
        "bootstrap": "127.0.0.1:1",
        "data_dir": str(data_dir),
        "owns_data_dir": True,
    }
    return data_dir, record


def _write_state(env: dict[str, str], text: str) -> Path:
    state_path = Path(env["HMAKV_CACHE_DIR"]) / "run" / "kafka.json"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(text)
    return state_path


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process leading its own group, like a shell's job: what a broker's pid may go to."""
    process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("recorded_start", ["earlier", "not recorded"])
def test_cli_stop_never_signals_a_process_that_took_the_brokers_pid(
    cli_env: dict[str, str], stranger: subprocess.Popen[bytes], recorded_start: str
) -> None:
    """Once the broker is gone its pid is free; a group leader holding it now is a stranger,
    whether the record has the broker's start time or (written by older code) none."""
    orphaned_dir, state = _tansu_record(cli_env, stranger.pid)
    if recorded_start == "earlier":
        state["start_time"] = (start_time(stranger.pid) or 1) - 1
    state_path = _write_state(cli_env, json.dumps(state))

    stopped = _hmakv_kafka(cli_env, "stop")

    assert (stopped.returncode, stopped.stdout) == (0, "no broker running\n")
    assert stranger.poll() is None, "stop signalled a process that is not the broker"
    assert not state_path.exists()
    assert not orphaned_dir.exists()


@pytest.mark.kafka
def test_cli_start_is_not_refused_by_a_record_of_a_reused_pid(
    cli_env: dict[str, str], stranger: subprocess.Popen[bytes]
) -> None:
    """The "already runs" check must not take a stranger holding the old pid for the broker."""
    state = {"pid": stranger.pid, "dist": "tansu", "bootstrap": "127.0.0.1:1",
             "data_dir": "/nonexistent", "owns_data_dir": False, "start_time": 1}  # fmt: skip
    _write_state(cli_env, json.dumps(state))

    started = _hmakv_kafka(cli_env, "start", "--dist", "tansu")

    assert started.returncode == 0, started.stderr
    assert int(str(_recorded_state(cli_env)["pid"])) != stranger.pid
    assert stranger.poll() is None


@pytest.mark.kafka
def test_cli_still_stops_a_broker_recorded_without_its_start_time(
    cli_env: dict[str, str],
) -> None:
    """Records written before the start time was kept stay usable: the broker's command line
    (Tansu's names its address) identifies it instead."""
    started = _hmakv_kafka(cli_env, "start", "--dist", "tansu")
    assert started.returncode == 0, started.stderr
    state = _recorded_state(cli_env)
    pid = int(str(state["pid"]))
    assert state.pop("start_time") == start_time(pid)
    _write_state(cli_env, json.dumps(state))

    assert _hmakv_kafka(cli_env, "status").returncode == 0
    stopped = _hmakv_kafka(cli_env, "stop")
    assert stopped.returncode == 0
    assert stopped.stdout.startswith("stopped the tansu broker")
    assert not group_is_running(pid)


@pytest.mark.parametrize("action", ["status", "stop", "start"])
@pytest.mark.parametrize(
    "text", ["", "{", "[]", json.dumps({"pid": 1, "dist": "tansu"})],
    ids=["empty", "cut-short", "not-an-object", "older-format"],
)  # fmt: skip
def test_cli_names_an_unreadable_state_file_and_leaves_it(
    cli_env: dict[str, str], action: str, text: str
) -> None:
    """A broker the file once described may still run, so it is not silently dropped: the
    command fails with one line naming the file and what to do, never a traceback."""
    state_path = _write_state(cli_env, text)

    done = _hmakv_kafka(cli_env, action)

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"{state_path} is not a readable broker record" in done.stderr
    assert "then delete the file" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert state_path.read_text() == text


def test_cli_start_refuses_a_file_as_its_data_dir(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A data dir that is a file is bad input: exit 2 naming it, not an OSError traceback."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")

    done = _hmakv_kafka(cli_env, "start", "--dist", "tansu", "--data-dir", str(a_file))

    assert done.returncode == 2
    assert f"--data-dir: {a_file} exists and is not a directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_data_dir_that_cannot_be_made_is_a_start_error(tmp_path: Path) -> None:
    """Callers (``hmakv kafka start``, the demo) report BrokerStartError; an OSError from
    making the data dir would reach the user as a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    broker = TansuBroker(data_dir=a_file / "kafka")
    with pytest.raises(BrokerStartError, match=f"could not be started in {a_file / 'kafka'}"):
        broker.start()
    assert a_file.read_text() == "x"


@pytest.mark.apache
def test_cli_fetch_prints_the_cached_jars_dir() -> None:
    fetched = subprocess.run(
        [sys.executable, "-m", "hmakv.cli", "kafka", "fetch"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert fetched.returncode == 0, fetched.stderr
    libs = Path(fetched.stdout.strip())
    assert (libs / f"kafka_2.13-{kafka_version()}.jar").is_file()


def test_cluster_ids_never_look_like_an_option() -> None:
    """About 1 in 64 base64 ids starts with '-', which Kafka's storage tool reads as a flag."""
    from hmakv.kafka.broker import _new_cluster_id

    ids = [_new_cluster_id() for _ in range(2000)]
    assert all(len(cluster_id) == 22 and not cluster_id.startswith("-") for cluster_id in ids)
    assert len(set(ids)) == len(ids)


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    """Outgoing connections take their local ports from the ephemeral range, so a port chosen
    there could be gone by the time a service binds it."""
    import socket

    from hmakv.kafka.process import _ephemeral_port_range, free_port

    lowest_ephemeral = _ephemeral_port_range()[0]
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < lowest_ephemeral
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_free_ports_handed_out_together_are_distinct() -> None:
    """Callers pick several ports before binding any (the demo: three per engine, and two of its
    engines once got the same one). Two thousand picks from a span of 12,000 would repeat a port
    about 160 times if each pick were independent."""
    from hmakv.kafka.process import free_port

    base = free_port(consecutive=2)  # DP rank 1 binds base + 1: handed out too
    ports = [base, base + 1, *(free_port() for _ in range(2000))]
    assert len(set(ports)) == len(ports)
