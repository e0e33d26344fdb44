"""hmakv's Kafka security against a real Apache Kafka that demands it.

One broker for the module, with no plaintext client listener: SSL, and SASL_SSL with a
SCRAM-SHA-512 user created by Kafka's own storage tool, its certificate signed by a CA made here.
The bridge, the index and ``hmakv workers`` run as the processes operators start, configured by
their ``HMAKV_KAFKA_*`` variables: an engine's batches go through the bridge into Kafka and out
to the index, and ``hmakv workers`` lists the worker. A wrong password or an untrusted broker
certificate is one line and exit 2 from each command, and no password shows anywhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tls_kit import CertificateAuthority

from hmakv.kafka import ApacheKafkaBroker, SecuredListeners, unique_topic
from hmakv.kafka.process import free_port
from hmakv.kvlog.kafka_client import KafkaSecurity, TopicSpec, ensure_topics, start_producer
from hmakv.kvlog.records import Topics, WorkerState, encode
from hmakv.producer.events import BlockStored, GroupSpec, KVEventBatch
from hmakv.producer.hashing import BlockHasher, external
from hmakv.producer.publisher import ZmqEventPublisher

pytestmark = [pytest.mark.kafka, pytest.mark.apache]

USER, PASSWORD = "alice", "alice-Scram-512-pass"
WRONG_PASSWORD = "not-alice-s-password"
WAIT_S = 60.0  # bound on every wait for a process or a condition
BLOCK = 16
PROMPT = list(range(1000, 1000 + 6 * BLOCK))  # six full blocks
HASHES = [
    external(digest) for digest in BlockHasher("sha256_cbor", "0").block_hashes(PROMPT, BLOCK)
]
ENGINE_TOPIC = "kv-events"


@dataclass(frozen=True)
class SecuredKafka:
    """The module's broker: its two listeners and the CA files a client may trust."""

    ssl_bootstrap: str
    sasl_ssl_bootstrap: str
    ca_file: Path  # signed the broker's certificate
    other_ca_file: Path  # a CA that signed nothing the broker presents

    def sasl_env(self, password: str = PASSWORD, ca_file: Path | None = None) -> dict[str, str]:
        """The variables a deployment sets for SASL_SSL with SCRAM-SHA-512."""
        return {
            "HMAKV_KAFKA_BOOTSTRAP": self.sasl_ssl_bootstrap,
            "HMAKV_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "HMAKV_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "HMAKV_KAFKA_SASL_USERNAME": USER,
            "HMAKV_KAFKA_SASL_PASSWORD": password,
            "HMAKV_KAFKA_SSL_CAFILE": str(ca_file or self.ca_file),
        }

    def ssl_env(self) -> dict[str, str]:
        return {
            "HMAKV_KAFKA_BOOTSTRAP": self.ssl_bootstrap,
            "HMAKV_KAFKA_SECURITY_PROTOCOL": "SSL",
            "HMAKV_KAFKA_SSL_CAFILE": str(self.ca_file),
        }


@pytest.fixture(scope="module")
def secured_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredKafka]:
    certs = tmp_path_factory.mktemp("certs")
    ca = CertificateAuthority.make("hmakv test CA")
    listeners = SecuredListeners(
        keystore=ca.write_server_keystore(certs / "broker.pem"),
        truststore=ca.write_cert(certs / "ca.pem"),
        scram_users={USER: PASSWORD},
    )
    other_ca = CertificateAuthority.make("some other CA").write_cert(certs / "other-ca.pem")
    with ApacheKafkaBroker(secured=listeners) as broker:
        yield SecuredKafka(
            broker.bootstrap, broker.sasl_ssl_bootstrap, listeners.truststore, other_ca
        )


# --- processes -----------------------------------------------------------------------------------


def hmakv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hmakv.cli", *args]


def run_hmakv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """One ``hmakv`` command to its exit, with ``env`` over this process's environment."""
    return subprocess.run(
        hmakv_command(*args),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


class Service:
    """A long-running ``hmakv`` command, its output in a log file; stopped with SIGTERM."""

    def __init__(self, log_path: Path, env: dict[str, str], *args: str) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                hmakv_command(*args), env={**os.environ, **env}, stdout=log, stderr=log
            )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM and the exit code; killed if it outlives the wait (the test then fails)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@pytest.fixture
def services() -> Iterator[list[Service]]:
    """Every service a test started is gone when it ends, whatever failed."""
    started: list[Service] = []
    yield started
    for service in started:
        if service.process.poll() is None:
            service.process.kill()
            service.process.wait()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


def post_json(url: str, body: object) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_until(condition: Callable[[], bool], what: str, service: Service) -> None:
    """Poll ``condition``; fail with the service's log when it dies or the wait runs out."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if service.process.poll() is not None:
            pytest.fail(
                f"{what}: the process exited ({service.process.returncode}):\n"
                f"{service.output()[-4000:]}"
            )
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out waiting until {what}:\n{service.output()[-4000:]}")
        time.sleep(0.1)


def engine_batches() -> list[KVEventBatch]:
    """One full-attention block stored per step, each the next block of ``PROMPT``."""
    batches = []
    for i, block_hash in enumerate(HASHES):
        store = BlockStored(
            [block_hash],
            HASHES[i - 1] if i else None,
            PROMPT[i * BLOCK : (i + 1) * BLOCK],
            BLOCK,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        batches.append(KVEventBatch(time.time(), [store]))
    return batches


@pytest.fixture
def engine() -> Iterator[str]:
    """A publisher holding ``engine_batches()`` in its replay ring: the bridge replays them
    from seq 0 when it connects. Yields its ``--engine`` flag."""
    pub, replay = free_port(), free_port()
    publisher = ZmqEventPublisher(
        0, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic=ENGINE_TOPIC, bind=True
    )
    try:
        for batch in engine_batches():
            publisher.publish(batch)
        yield f"engine-a=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay},topic={ENGINE_TOPIC}"
    finally:
        publisher.shutdown()


# --- the pipeline through SASL_SSL ---------------------------------------------------------------


def test_bridge_index_and_workers_work_through_sasl_ssl_with_scram(
    secured_kafka: SecuredKafka, engine: str, tmp_path: Path, services: list[Service]
) -> None:
    env = {**secured_kafka.sasl_env(), "HMAKV_TOPIC_PREFIX": unique_topic("secured")}
    bridge_url, index_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    bridge = Service(
        tmp_path / "bridge.log",
        env,
        "bridge", "--engine", engine, "--partitions", "1", "--state-interval", "0.2",
        "--listen", bridge_url.removeprefix("http://"),
    )  # fmt: skip
    services.append(bridge)
    wait_until(lambda: get(f"{bridge_url}/readyz")[0] == 200, "the bridge is ready", bridge)
    index = Service(
        tmp_path / "index.log",
        env,
        "index", "--snapshot-to", "none", "--follower-id", "secured-test",
        "--listen", index_url.removeprefix("http://"),
    )  # fmt: skip
    services.append(index)
    last_seq = len(HASHES)

    def index_follows_the_worker() -> bool:
        """Every batch applied, and the bridge's state for it read from the workers topic."""
        status, body = get(f"{index_url}/v1/workers")
        workers = json.loads(body)["workers"] if status == 200 else []
        seen = [(w["worker"], w["last_seq"], w["bridge_last_seq"]) for w in workers]
        return seen == [("engine-a", {"0": last_seq}, last_seq)]

    wait_until(index_follows_the_worker, "the index has every batch", index)
    answer = post_json(f"{index_url}/v1/score", {"token_ids": [*PROMPT, 7]})
    assert answer["best"] == "engine-a"
    assert answer["workers"][0]["hit_blocks"] == len(HASHES)

    listed = run_hmakv(env, "workers", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(row["worker"], row["health"], row["last_seq"]) for row in rows] == [
        ("engine-a", "live", last_seq)
    ]
    assert "Authenticated as alice via SCRAM-SHA-512" in listed.stderr

    metrics = [get(f"{url}/metrics")[1].decode() for url in (bridge_url, index_url)]
    assert "hmakv_bridge_" in metrics[0] and "hmakv_index_" in metrics[1]
    assert [bridge.stop(), index.stop()] == [0, 0]
    for text in (*metrics, bridge.output(), index.output(), listed.stdout, listed.stderr):
        assert PASSWORD not in text


# --- plain SSL -----------------------------------------------------------------------------------


async def workers_topic_with(
    bootstrap: str, security: KafkaSecurity, topics: Topics, state: WorkerState
) -> None:
    """The workers topic as a bridge leaves it, written through hmakv's own Kafka clients."""
    specs = [TopicSpec(topics.workers, config={"cleanup.policy": "compact"})]
    await ensure_topics(bootstrap, specs, security=security)
    started = await start_producer(bootstrap, client_id="test-ssl", security=security)
    try:
        await started.producer.send_and_wait(topics.workers, encode(state), key=state.key())
    finally:
        await started.producer.stop()


def test_plain_ssl_carries_hmakvs_clients_and_hmakv_workers(secured_kafka: SecuredKafka) -> None:
    topics = Topics(unique_topic("ssl"))
    security = KafkaSecurity(security_protocol="SSL", ssl_cafile=str(secured_kafka.ca_file))
    groups = {0: GroupSpec("full_attention", BLOCK)}
    state = WorkerState("engine-ssl", 3, 41, "live", groups, time.time())
    asyncio.run(workers_topic_with(secured_kafka.ssl_bootstrap, security, topics, state))

    env = {**secured_kafka.ssl_env(), "HMAKV_TOPIC_PREFIX": topics.prefix}
    listed = run_hmakv(env, "workers", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:4] == ["engine-ssl", "3", "41", "live"]


# --- refusals ------------------------------------------------------------------------------------

EXIT_REFUSED = 2  # a configuration that cannot run, in all three commands


def refused_run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` started as in a deployment, to the exit a refusal must bring (the bridge and
    the index would otherwise run on: the wait's bound fails the test)."""
    if command == "bridge":
        engine = f"engine-a=tcp://127.0.0.1:{free_port()}"
        return run_hmakv(env, "bridge", "--engine", engine, "--listen", f"127.0.0.1:{free_port()}")
    if command == "index":
        listen = f"127.0.0.1:{free_port()}"
        return run_hmakv(env, "index", "--snapshot-to", "none", "--listen", listen)
    return run_hmakv(env, "workers", "list")


def problem_lines(output: str) -> list[str]:
    """What an operator has to read: every line but the INFO log lines."""
    return [line for line in output.splitlines() if line.strip() and " INFO " not in line]


COMMANDS = ["bridge", "index", "workers"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_wrong_password_is_one_line_and_exit_2_and_no_password_shows(
    command: str, secured_kafka: SecuredKafka
) -> None:
    env = {**secured_kafka.sasl_env(WRONG_PASSWORD), "HMAKV_TOPIC_PREFIX": unique_topic("wrong")}
    done = refused_run(command, env)
    assert done.returncode == EXIT_REFUSED, done.stdout + done.stderr
    [line] = problem_lines(done.stdout + done.stderr)
    assert f"Kafka at {secured_kafka.sasl_ssl_bootstrap} refused the SASL SCRAM-SHA-512" in line
    assert "user 'alice'" in line and "check the user name and the password" in line
    assert WRONG_PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_an_untrusted_broker_certificate_is_one_line_and_exit_2(
    command: str, secured_kafka: SecuredKafka
) -> None:
    """The client trusts another CA: the handshake fails before any password is sent."""
    env = secured_kafka.sasl_env(ca_file=secured_kafka.other_ca_file)
    done = refused_run(command, {**env, "HMAKV_TOPIC_PREFIX": unique_topic("ca")})
    assert done.returncode == EXIT_REFUSED, done.stdout + done.stderr
    [line] = problem_lines(done.stdout + done.stderr)
    assert f"Kafka at {secured_kafka.sasl_ssl_bootstrap}: its certificate was not accepted" in line
    assert "--kafka-ssl-cafile (HMAKV_KAFKA_SSL_CAFILE) must hold the CA that signed it" in line
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("command", [["bridge"], ["index"], ["workers", "list"]])
def test_help_never_shows_the_password_from_the_environment(command: list[str]) -> None:
    done = run_hmakv({"HMAKV_KAFKA_SASL_PASSWORD": PASSWORD}, *command, "--help")
    assert done.returncode == 0, done.stderr
    assert "HMAKV_KAFKA_SASL_PASSWORD" in done.stdout
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("name, password", [("alice", "pass,word"), ("al]ice", "x"), ("bob", "")])
def test_a_scram_user_the_storage_tool_would_misread_is_refused(name: str, password: str) -> None:
    """``[name=N,password=P]`` is the storage tool's syntax: a comma or bracket inside would
    quietly make another user, or another password, than the one asked for."""
    with pytest.raises(ValueError, match="must be non-empty and free of"):
        SecuredListeners(Path("broker.pem"), Path("ca.pem"), {name: password})
