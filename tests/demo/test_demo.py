"""``hmakv demo`` as users run it: the installed command as a subprocess, on an embedded Tansu
broker, engines without their torch model (the same cache and events, synthetic tokens).

One 20-second run is shared by the checks of its results; Ctrl-C gets a run of its own. Waits are
bounded polls, never fixed sleeps, and no check is about how fast anything was.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from hmakv.demo.report import PLOTS
from hmakv.demo.services import Services, read_services
from hmakv.kafka import TansuBroker
from hmakv.routing.study import ROUTERS

HMAKV = Path(sys.executable).with_name("hmakv")
RUN_S = 20
EXIT_WAIT_S = 180.0
STARTUP_WAIT_S = 120.0
MIN_COMPARED = 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class FinishedRun:
    returncode: int
    output: str
    summary: dict[str, Any]
    services: Services
    report_dir: Path


def demo_command(workdir: Path, *options: str) -> list[str]:
    return [
        str(HMAKV),
        "demo",
        "--kafka",
        "tansu",
        "--no-model",
        "--plain",
        "--workdir",
        str(workdir),
        *options,
    ]


def start_demo(workdir: Path, output: Path, *options: str) -> subprocess.Popen[bytes]:
    with output.open("wb") as sink:
        return subprocess.Popen(
            demo_command(workdir, *options), stdout=sink, stderr=subprocess.STDOUT
        )


def finish(process: subprocess.Popen[bytes], output: Path) -> int:
    """Wait for the demo to exit; kill it (and fail) if it does not within the bound."""
    try:
        return process.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"the demo did not exit within {EXIT_WAIT_S:.0f} s:\n{output.read_text()}")


def wait_for_services(workdir: Path, process: subprocess.Popen[bytes], output: Path) -> Services:
    deadline = time.monotonic() + STARTUP_WAIT_S
    while (services := read_services(workdir)) is None:
        assert process.poll() is None, f"the demo exited early:\n{output.read_text()}"
        assert time.monotonic() < deadline, f"no services.json after {STARTUP_WAIT_S:.0f} s"
        time.sleep(0.1)
    return services


def wait_for_output(output: Path, pattern: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_WAIT_S
    while re.search(pattern, output.read_text()) is None:
        assert process.poll() is None, f"the demo exited early:\n{output.read_text()}"
        assert time.monotonic() < deadline, f"{pattern!r} never matched:\n{output.read_text()}"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Running, or a zombie nobody reaped: either way the demo left it behind."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def leftovers(services: Services) -> list[str]:
    """Every started process, or process group, that still exists."""
    found = []
    for name, pid in [*services.pids.items(), ("broker", services.broker_pid)]:
        if pid is None:
            continue
        if alive(pid):
            found.append(f"{name} (pid {pid})")
        elif group_exists(pid):
            found.append(f"{name}'s process group {pid}")
    return found


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FinishedRun]:
    root = tmp_path_factory.mktemp("demo")
    workdir, output = root / "work", root / "output.txt"
    summary_path, report_dir = root / "summary.json", root / "report"
    process = start_demo(
        workdir,
        output,
        "--duration",
        str(RUN_S),
        "--json",
        str(summary_path),
        "--report",
        str(report_dir),
    )
    returncode = finish(process, output)
    services = read_services(workdir)
    assert services is not None, f"the demo never got its services up:\n{output.read_text()}"
    assert summary_path.exists(), f"no summary JSON:\n{output.read_text()}"
    yield FinishedRun(
        returncode=returncode,
        output=output.read_text(),
        summary=json.loads(summary_path.read_text()),
        services=services,
        report_dir=report_dir,
    )


def test_the_run_passes_with_zero_loss_and_every_hma_answer_right(
    finished_run: FinishedRun,
) -> None:
    summary, output = finished_run.summary, finished_run.output
    assert finished_run.returncode == 0, output
    assert summary["ok"] is True, summary["problems"]
    pipeline = summary["pipeline"]
    assert pipeline["lost"] == 0, pipeline
    assert pipeline["gaps_unrecoverable"] == 0, pipeline
    assert pipeline["batches_published"] > 0, pipeline
    assert pipeline["batches_forwarded"] == pipeline["batches_published"], pipeline
    assert (
        pipeline["records_applied"] + pipeline["records_ignored_as_replayed"]
        >= (pipeline["records_forwarded"])
    ), pipeline
    routing = summary["routing"]
    assert routing["worker_answers_compared"] >= MIN_COMPARED, routing
    assert routing["hma_agreeing"] == routing["worker_answers_compared"], routing
    assert routing["hma_agreement"] == 1.0, routing
    assert routing["disagreements"] == [], routing
    assert routing["requests_routed"] > 0, routing
    assert "result     OK" in output, output


def test_every_engine_published_and_the_index_reached_its_last_seq(
    finished_run: FinishedRun,
) -> None:
    engines = {engine["worker"]: engine for engine in finished_run.summary["engines"]}
    assert set(engines) == set(finished_run.services.engines)
    profiles = {engine["profile"] for engine in engines.values()}
    assert profiles == {"gpt-oss-like", "gemma3-like"}
    for engine in engines.values():
        assert engine["events_published"] > 0, engine
        assert engine["index_last_seq"] == engine["batches_published"] - 1, engine


def test_the_summary_reports_event_age_and_group_blind_agreement(
    finished_run: FinishedRun,
) -> None:
    summary = finished_run.summary
    age = summary["event_age"]
    assert age["p50_s"] is not None and age["p99_s"] is not None, age
    assert 0 <= age["p50_s"] <= age["p99_s"], age
    hops = summary["hops"]
    assert set(hops) == {"engine_to_bridge", "bridge_to_kafka_ack", "kafka_to_index_fetch"}
    for hop in hops.values():
        assert hop["p50_s"] is not None and 0 <= hop["p50_s"] <= hop["p99_s"], hop
        assert hop["p50_s"] <= age["p99_s"], (hop, age)  # a hop is part of the whole
    routing = summary["routing"]
    blind = routing["group_blind_agreement"]
    assert blind is not None and 0.0 <= blind <= 1.0, routing
    assert (
        routing["group_blind_agreeing"] + routing["group_blind_over"] + routing["group_blind_under"]
        == routing["worker_answers_compared"]
    ), routing


def test_routed_prompts_are_held_speculatively_and_reported_apart(
    finished_run: FinishedRun,
) -> None:
    """The probe announces each choice (/v1/routed) as a router does; what the speculative
    prediction got right is reported beside the confirmed one, outside the agreement figures."""
    routing = finished_run.summary["routing"]
    assert routing["routed_speculated_blocks"] > 0, routing
    routed = routing["requests_routed"]
    assert 0 < routing["routed_predicted_granted"] <= routed, routing
    assert 0 < routing["routed_speculative_granted"] <= routed, routing
    assert routing["hma_agreement"] == 1.0, routing


def test_the_summary_compares_every_router_on_the_runs_own_traffic(
    finished_run: FinishedRun,
) -> None:
    summary = finished_run.summary
    comparison, routing = summary["routing_comparison"], summary["routing"]
    sent = comparison["prompts"]  # every prompt the probe routed, all admitted in a clean run
    assert sent == routing["requests_routed"] > 0
    fleets = {fleet["profile"]: fleet for fleet in comparison["fleets"]}
    assert set(fleets) == {"gpt-oss-like", "gemma3-like"}
    for fleet in fleets.values():
        runs = {run["router"]: run for run in fleet["runs"]}
        assert list(runs) == list(ROUTERS)
        for run in runs.values():
            assert run["requests"] == run["served"] == sent, run
            assert 0 <= run["cached_tokens"] <= run["prompt_tokens"], run
        assert runs["hmakv"]["predicted"] == sent
        assert runs["round-robin"]["predicted"] == 0
    assert "routers    this run's" in finished_run.output


def test_the_report_has_its_page_and_plots(finished_run: FinishedRun) -> None:
    page = finished_run.report_dir / "report.html"
    assert page.exists()
    html = page.read_text()
    for plot in PLOTS:
        path = finished_run.report_dir / plot
        assert path.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC, plot
        assert f'src="{plot}"' in html
    assert "hmakv demo: passed" in html


def test_nothing_the_demo_started_outlives_it(finished_run: FinishedRun) -> None:
    assert len(finished_run.services.pids) == 4  # two engines, the bridge, the index
    assert finished_run.services.broker_pid is not None
    assert leftovers(finished_run.services) == []
    logs = {path.name for path in Path(finished_run.summary["workdir"]).glob("*.log")}
    assert {"engine-a.log", "engine-b.log", "bridge.log", "index.log", "kafka.log"} <= logs


def test_ctrl_c_mid_run_stops_everything_and_still_summarises(tmp_path: Path) -> None:
    workdir, output, summary_path = tmp_path / "work", tmp_path / "output.txt", tmp_path / "s.json"
    process = start_demo(
        workdir, output, "--duration", "600", "--interval", "1", "--json", str(summary_path)
    )
    try:
        services = wait_for_services(workdir, process, output)
        wait_for_output(output, r"[1-9][0-9]* compared", process)  # answers were compared
        process.send_signal(signal.SIGINT)
        returncode = finish(process, output)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = output.read_text()
    assert returncode == 0, text
    assert "interrupted after" in text, text
    summary = json.loads(summary_path.read_text())
    assert summary["interrupted"] is True
    assert summary["pipeline"]["lost"] == 0, summary["pipeline"]
    assert leftovers(services) == []


async def _demo_topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {topic for topic in await admin.list_topics() if topic.startswith("hmakv-demo-")}
    finally:
        await admin.close()


@pytest.mark.kafka
def test_a_failed_run_on_an_existing_cluster_removes_its_topics(tmp_path: Path) -> None:
    """Nobody else knows the run's random topic prefix, so topics a failed run leaves on the
    user's cluster stay there for good. The index refuses its hash function (exit 2) once the
    bridge has made the topics."""
    workdir, output = tmp_path / "work", tmp_path / "output.txt"
    with TansuBroker() as broker:
        with output.open("wb") as sink:
            process = subprocess.Popen(
                demo_command(workdir, "--kafka", broker.bootstrap, "--duration", "5"),
                env={**os.environ, "HMAKV_INDEX_HASH_FN": "bogus"},
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        returncode = finish(process, output)
        left = asyncio.run(_demo_topics(broker.bootstrap))
    text = output.read_text()
    assert returncode == 1, text
    assert "index exited with code 2" in text, text
    assert left == set(), text
