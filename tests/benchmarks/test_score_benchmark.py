"""benchmarks/score.py: a --quick run's report with each load generator, never its timing. The
script itself fails when any answer the load generator got differs from the index's own score of
the prompt (wrk, which scripts/setup installs: from the answer checked against it, byte for
byte)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCORE = Path(__file__).resolve().parents[2] / "benchmarks" / "score.py"


@pytest.mark.parametrize("client", ["wrk", "aiohttp"])
def test_every_prompt_size_native_path_and_form_is_measured_beside_its_floor_and_steps(
    tmp_path: Path, client: str
) -> None:
    report_path = tmp_path / "score.json"
    run = subprocess.run(
        [sys.executable, str(SCORE), "--quick", "--client", client, "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(report_path.read_text())
    assert report["setup"]["client"] == client
    rows = {(row["tokens"], row["native"], row["form"]): row for row in report["rows"]}
    paths = [("none", "json"), ("all", "json"), ("all", "json-packed"), ("all", "msgpack-packed")]
    paths += [("hashing", "msgpack-packed-lean"), ("all", "msgpack-packed-lean")]
    paths += [("all", "msgpack-packed-lean-top4")]  # the router port only
    assert sorted(rows) == sorted((tokens, *path) for tokens in (1024, 8192) for path in paths)
    for (tokens, _, _), row in rows.items():
        assert row["blocks"] == tokens // 16
        for measured in ("latency", "throughput", "floor_latency", "floor_throughput"):
            assert row[measured]["requests"] > 0, (tokens, measured)
            assert 0 < row[measured]["p50_us"] <= row[measured]["p99_us"]
        assert all(value > 0 for value in row["steps"].values()), row["steps"]
    assert "8k tokens, fastest path (native: " in run.stdout
    assert "8k tokens, the best 4 workers over every worker (router port" in run.stdout
