"""The coverage-guided fuzzer (``atheris_wire.py``), run for a bounded number of inputs from vLLM's
payloads: it must end without a crash, and must have explored past its seeds.

atheris ships wheels for Linux on x86_64 only (elsewhere it needs clang's libFuzzer to build), so
the dev extras install it there alone, and this test is skipped where it is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris: the dev extras install it on Linux x86_64 only")

HARNESS = Path(__file__).with_name("atheris_wire.py")
RUNS_ENV = "HMAKV_ATHERIS_RUNS"
CI_RUNS = 50_000


def test_coverage_guided_fuzzing_finds_no_crash(tmp_path: Path) -> None:
    runs = int(os.environ.get(RUNS_ENV, CI_RUNS))
    corpus = tmp_path / "corpus"
    done = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            str(corpus),
            f"-runs={runs}",
            "-seed=1",  # the same inputs on every run
            "-max_len=4096",
            "-rss_limit_mb=2048",
            "-timeout=20",  # seconds one input may take
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = done.stderr + done.stdout
    crashes = sorted(path.name for path in tmp_path.iterdir() if path.name != "corpus")
    assert done.returncode == 0 and not crashes, f"{crashes}\n{log[-4000:]}"
    assert f"Done {runs} runs" in log, log[-4000:]
    seeds = sum(1 for _ in corpus.iterdir())
    assert seeds > 0
    # libFuzzer reports the coverage it reached; without instrumentation it would stay at 0.
    coverage = [int(n) for n in re.findall(r"cov: (\d+)", log)]
    assert coverage and max(coverage) > 50, log[-4000:]
