"""``hmakv bench fleet --smoke``: the command CI runs, on the session's Apache Kafka, judged on
correctness only (every step reaches the index, whose state matches the engines'; every figure
is measured), never on its timing."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.apache]


@pytest.fixture(scope="module")
def smoke(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[str, Any]]:
    path = tmp_path_factory.mktemp("bench") / "fleet.json"
    command = [sys.executable, "-m", "hmakv.cli", "bench", "fleet", "--smoke"]
    command += ["--kafka", kafka_bootstrap, "--json", str(path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout, json.loads(path.read_text())


def test_every_run_delivers_every_step_and_the_index_holds_what_the_engines_published(
    smoke: tuple[str, dict[str, Any]],
) -> None:
    _, report = smoke
    (size,) = report["sizes"]
    assert size["engines"] == 4
    for run in (size["fixed"], size["max_rate"]):
        assert run["lost_seqs"] == 0 and run["mismatches"] == [], run
        assert run["steps"] == report["plan"]["rate"] * report["plan"]["duration_s"] / 4
        assert run["batches_per_s"] > 0 and run["block_events_per_s"] > run["batches_per_s"]
        age = run["event_age"]
        assert 0 < age["p50_s"] <= age["p99_s"] <= age["max_le_s"]
        assert set(run["hops"]) == {
            "engine -> bridge",
            "bridge -> Kafka ack",
            "Kafka -> index fetch",
        }
        assert all(hop["p50_s"] is not None for hop in run["hops"].values()), run["hops"]
        for service in ("bridge", "index"):
            assert run[service]["cpu_us_per_batch"] > 0 and run[service]["peak_rss_mib"] > 0
    assert size["fixed"]["rate"] == report["plan"]["rate"] and size["max_rate"]["rate"] == 0
    assert report["targets"]["zero loss, index state as expected"] is True


def test_each_hop_alone_is_measured_and_printed_beside_the_runs(
    smoke: tuple[str, dict[str, Any]],
) -> None:
    out, report = smoke
    ceilings = report["sizes"][0]["ceilings"]
    assert set(ceilings) == {"receive", "append", "fetch", "index alone"}
    assert all(ceiling["batches_per_s"] > 0 for ceiling in ceilings.values())
    assert "4 engines, 500/s" in out and "4 engines, max" in out
    assert "each hop alone" in out and "targets:" in out
