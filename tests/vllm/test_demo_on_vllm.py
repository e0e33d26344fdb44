"""``hmakv demo --engine vllm`` as a user runs it: two real vLLM servers on the CPU (tiny random
models: the only stand-in), the embedded Tansu broker, the bridge, the index and the probe.

One short run; its summary must show what the README promises: zero loss, every compared answer
of the index equal to vLLM's ``cached_tokens``, and group-blind answers that are not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HMAKV = Path(sys.executable).with_name("hmakv")
RUN_S = 20
EXIT_WAIT_S = 600.0

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_the_demo_on_real_vllm_loses_nothing_and_agrees_with_cached_tokens(
    tmp_path: Path,
) -> None:
    summary_path, report = tmp_path / "summary.json", tmp_path / "report"
    command = [
        str(HMAKV), "demo", "--engine", "vllm", "--duration", str(RUN_S), "--plain",
        "--workdir", str(tmp_path / "work"), "--json", str(summary_path),
        "--report", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=EXIT_WAIT_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and not summary["problems"]
    assert summary["pipeline"]["lost"] == 0
    routing = summary["routing"]
    compared = routing["worker_answers_compared"]
    assert compared >= 10
    assert routing["hma_agreeing"] == compared
    assert routing["group_blind_agreeing"] < compared  # windows, states gone, full blocks kept
    engines = {engine["worker"]: engine for engine in summary["engines"]}
    assert sorted(engines) == ["engine-a", "engine-b"]
    for engine in engines.values():
        assert engine["batches_forwarded"] == engine["batches_published"] > 0
        assert engine["removals_received_live"] > 0  # the small pools evicted
    # engine-a is a sliding-window hybrid (Gemma 3), engine-b a mamba one (Qwen3-Next).
    assert any("sliding_window" in group for group in engines["engine-a"]["groups"])
    assert any("mamba" in group for group in engines["engine-b"]["groups"])
    assert (report / "report.html").is_file()
