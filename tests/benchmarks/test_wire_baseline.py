"""benchmarks/wire.py measures against copies of vLLM's structs: they must still be vLLM's.

The script refuses to time anything when vLLM's structs and ours encode a batch to different
bytes (it did, for a while, after vLLM 0.33.0 added three fields to ``BlockStored``), so running
it briefly checks the baseline the BENCHMARKS.md wire table rests on. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WIRE = Path(__file__).resolve().parents[2] / "benchmarks" / "wire.py"


def test_the_wire_benchmark_baseline_encodes_every_case_to_our_bytes(tmp_path: Path) -> None:
    report_path = tmp_path / "wire.json"
    run = subprocess.run(
        [sys.executable, str(WIRE), "--repeats", "1", "--min-time", "0.001", "--json", report_path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(report_path.read_text())
    cases = {(row["case"], row["operation"]) for row in report["results"]}
    assert cases == {
        ("typical", "encode"),
        ("typical", "decode"),
        ("large", "encode"),
        ("large", "decode"),
        ("typical, array events (vLLM < #42892)", "decode"),
    }
    assert all(row["payload_bytes"] > 0 and row["ratio"] > 0 for row in report["results"])
