"""benchmarks/score.py: a --quick run's report, never its timing. The script itself fails when
any answer the load generator got differs from the index's own score of the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCORE = Path(__file__).resolve().parents[2] / "benchmarks" / "score.py"


def test_every_prompt_size_hashing_and_form_is_measured_over_http_beside_its_floor_and_steps(
    tmp_path: Path,
) -> None:
    report_path = tmp_path / "score.json"
    run = subprocess.run(
        [sys.executable, str(SCORE), "--quick", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(report_path.read_text())
    rows = {(row["tokens"], row["hashing"], row["form"]): row for row in report["rows"]}
    paths = [("python", "json"), ("native", "json"), ("native", "json-packed")]
    paths += [("native", "msgpack-packed"), ("native", "msgpack-packed-lean")]
    assert sorted(rows) == sorted((tokens, *path) for tokens in (1024, 8192) for path in paths)
    for (tokens, _, _), row in rows.items():
        assert row["blocks"] == tokens // 16
        for measured in ("latency", "throughput", "floor_latency", "floor_throughput"):
            assert row[measured]["requests"] > 0, (tokens, measured)
            assert 0 < row[measured]["p50_us"] <= row[measured]["p99_us"]
        assert all(value > 0 for value in row["steps"].values()), row["steps"]
    assert "8k tokens, fastest path (native hashing" in run.stdout
