"""``hmakv index`` as a process: SIGTERM leaves a final snapshot, SIGKILL leaves the last one, and
either way the next start restores it and reads only what came after; the router port, where
configured, answers as the main port does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from follower_kit import LogWriter, fresh_topics, record, stored, wait_until
from prometheus_client.parser import text_string_to_metric_families

from hmakv.kafka.process import free_port
from hmakv.kvlog.records import Topics

EXIT_TIMEOUT_S = 60


@contextmanager
def index_process(
    bootstrap: str, topics: Topics, snapshot: Path, port: int, router_port: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    command = [
        sys.executable, "-m", "hmakv.cli", "index",
        "--topic-prefix", topics.prefix,
        "--snapshot-to", f"file:{snapshot}",
        "--snapshot-interval", "0",
        "--follower-id", "cli-test",
        "--ready-max-lag", "0",
    ]  # fmt: skip
    env = {
        **os.environ,
        "HMAKV_KAFKA_BOOTSTRAP": bootstrap,
        "HMAKV_INDEX_LISTEN": f"127.0.0.1:{port}",
    }
    if router_port is not None:
        env["HMAKV_INDEX_ROUTER_LISTEN"] = f"127.0.0.1:{router_port}"
    process = subprocess.Popen(command, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(EXIT_TIMEOUT_S)


class Index:
    def __init__(self, http: aiohttp.ClientSession, port: int) -> None:
        self.http = http
        self.url = f"http://127.0.0.1:{port}"

    async def ready(self) -> bool:
        try:
            async with self.http.get(f"{self.url}/readyz") as response:
                return response.status == 200
        except aiohttp.ClientConnectionError:
            return False

    async def workers(self) -> Any:
        async with self.http.get(f"{self.url}/v1/workers") as response:
            return (await response.json())["workers"]

    async def score(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        async with self.http.post(f"{url}/v1/score", json=body) as response:
            return response.status, await response.read()

    async def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        async with self.http.get(f"{self.url}/metrics") as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return 0.0

    async def consumed_events(self, topics: Topics) -> float:
        return await self.metric("hmakv_index_records_consumed_total", {"topic": topics.events})

    async def heap_frozen(self) -> bool:
        return await self.metric("hmakv_index_gc_frozen_objects") > 0


@pytest.mark.kafka
async def test_sigterm_snapshots_and_a_restart_after_sigkill_reads_only_what_is_new(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topics = await fresh_topics(kafka_bootstrap)
    snapshot = tmp_path / "index.snapshot"
    port = free_port()
    async with LogWriter(kafka_bootstrap, topics) as log, aiohttp.ClientSession() as http:
        index = Index(http, port)
        await log.events(*(record("w", seq, [stored([seq])]) for seq in range(6)))
        router_port = free_port()
        with index_process(kafka_bootstrap, topics, snapshot, port, router_port) as process:
            await wait_until(index.ready, "the first process ready")
            assert (await index.workers())[0]["last_seq"] == {"0": 5}
            prompt = {"block_hashes": [0, 1, 2], "details": False}
            status, answer = await index.score(f"http://127.0.0.1:{router_port}", prompt)
            assert status == 200 and b'"best":"w"' in answer
            assert await index.score(index.url, prompt) == (status, answer)
            await wait_until(index.heap_frozen, "the heap frozen once caught up")
            process.send_signal(signal.SIGTERM)
            assert process.wait(EXIT_TIMEOUT_S) == 0
        assert snapshot.is_file()

        await log.events(*(record("w", seq, [stored([seq])]) for seq in range(6, 10)))
        with index_process(kafka_bootstrap, topics, snapshot, port) as process:
            await wait_until(index.ready, "the second process ready")
            assert await index.consumed_events(topics) == 4
            expected = without_ages(await index.workers())
            assert expected[0]["last_seq"] == {"0": 9}
            process.kill()
            process.wait(EXIT_TIMEOUT_S)

        with index_process(kafka_bootstrap, topics, snapshot, port):
            await wait_until(index.ready, "the third process ready")
            assert await index.consumed_events(topics) == 4, "only what followed the snapshot"
            assert without_ages(await index.workers()) == expected


def without_ages(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers' views but for the age of their last record, which the clock moves on."""
    return [{k: v for k, v in worker.items() if k != "applied_age_s"} for worker in workers]


def run_index(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hmakv index`` as a process, to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "hmakv.cli", "index", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        check=False,
    )


def test_missing_kafka_address_is_a_usage_error(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "HMAKV_KAFKA_BOOTSTRAP"}
    result = run_index("--snapshot-to", "none", env=env)
    assert result.returncode == 2
    assert "--kafka" in result.stderr
    # A port that is no number, from the environment too: checked before Kafka's client sees it.
    result = run_index("--snapshot-to", "none", env={**env, "HMAKV_KAFKA_BOOTSTRAP": "kafka:90x"})
    assert result.returncode == 2
    assert "invalid HOST[:PORT][,...] value: 'kafka:90x'" in result.stderr


@pytest.mark.parametrize(
    "argument",
    [
        ["--snapshot-to", "s3://bucket"],
        ["--mode", "solo"],
        ["--listen", "8181"],
        ["--router-listen", "8182"],
        ["--tier-weight", "GPU"],
        ["--follower-id", "a/b"],  # its snapshot's chunks are keyed <id>/<snapshot>/<n>
        ["--kafka", "host:abc"],
    ],
)
def test_bad_options_are_usage_errors(argument: list[str]) -> None:
    result = run_index("--kafka", "127.0.0.1:1", *argument)
    assert result.returncode == 2, result.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HMAKV_INDEX_MODE", "solo"),
        ("HMAKV_INDEX_HASH_FN", "sha256"),  # vLLM's name, not ours
        ("HMAKV_INDEX_TIER_WEIGHT", "GPU=1,bad"),
        ("HMAKV_INDEX_ROUTER_LISTEN", "nowhere"),
    ],
)
def test_bad_options_from_the_environment_are_usage_errors(variable: str, value: str) -> None:
    """argparse checks an option's choices, not a default that came from the environment."""
    result = run_index("--kafka", "127.0.0.1:1", env={**os.environ, variable: value})
    assert result.returncode == 2, result.stderr
    assert value in result.stderr


def test_kafka_out_of_reach_at_start_is_one_line_and_exit_1() -> None:
    """An outage, not a bug: the supervisor restarts the index; no traceback to read through."""
    result = run_index("--kafka", "127.0.0.1:1")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "the index stopped" in result.stderr and "127.0.0.1:1" in result.stderr


def test_a_snapshot_path_that_cannot_be_used_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """An operator's mistake in the environment (a file where the snapshot's directory should
    be; a port taken, an SSL file missing are the same OSError): one line, not a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = run_index("--kafka", "127.0.0.1:1", "--snapshot-to", f"file:{a_file}/index.snapshot")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "the index stopped" in result.stderr and "Not a directory" in result.stderr
