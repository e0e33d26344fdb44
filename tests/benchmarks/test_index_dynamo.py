"""benchmarks/index.py beside NVIDIA Dynamo's indexer: a --quick run's answers, never its timing.

Dynamo's RadixTree gets the full-attention group of the same hybrid stream, so its overlap must
be the index's full-attention hit for every worker and query (the events' conversion is right),
never under the index's HMA hit, and over it where a window's blocks were evicted. The script
itself checks that both answer the timed prompts alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "dynamo._core", reason="the bench extra is not installed: pip install -e '.[bench]'"
)

INDEX = Path(__file__).resolve().parents[2] / "benchmarks" / "index.py"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One --quick run for every test here: its report and what it printed."""
    report_path = tmp_path_factory.mktemp("index") / "index.json"
    run = subprocess.run(
        [sys.executable, str(INDEX), "--quick", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(report_path.read_text()), run.stdout


def test_dynamo_over_predicts_only_where_windows_were_evicted(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    report, printed = quick_run
    answers, sizes = report["answers"], report["sizes"]
    assert answers["queries"] == sizes["answer_queries"]
    assert answers["pairs"] == answers["queries"] * sizes["workers"]
    assert answers["differs_from_full_attention"] == 0
    assert answers["dynamo_under"] == 0
    assert answers["dynamo_over"] > 0
    assert answers["equal"] + answers["dynamo_over"] == answers["pairs"]
    assert answers["dynamo_refused_events"] == report["apply"]["dynamo_refused_events"] == 0
    # the stream as vLLM's steps: finer events, each stored piece under one Dynamo holds
    apply = report["apply"]
    assert apply["dynamo_steps_refused_events"] == 0
    assert apply["step_events"] > apply["step_records"] > apply["records"]
    assert "Dynamo keeps only full-attention groups" in printed


def test_every_side_by_side_figure_is_reported(quick_run: tuple[dict[str, Any], str]) -> None:
    report, _printed = quick_run
    assert report["apply"]["dynamo_updates_per_s"] > 0
    assert report["apply"]["dynamo_steps_updates_per_s"] > 0
    timed = {f"dynamo_{p}_{q}_us" for p in ("whole", "fork") for q in ("p50", "p99")}
    assert timed <= set(report["score"])
    rss = {key: value for key, value in report["memory_rss"].items() if key.endswith("rss_bytes")}
    assert len(rss) == 6 and all(value > 0 for value in rss.values())
    assert all(ratio > 0 for ratio in report["vs_dynamo"].values())
