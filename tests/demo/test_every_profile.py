"""The index against the reference engines as ground truth, on every cache layout and workload.

One ``hmakv demo`` run (a subprocess, embedded Tansu, engines without their torch model) with six
engines chosen by ``--engine``: every profile once, every workload with traffic at least once,
pools small enough that every engine evicts (BlockRemoved events seen) within the run.
The probe compares, at many moments, each engine's own ``find_longest_cache_hit`` for its probe
prompts with the index's HMA-aware answer for the same seq; every one must agree, for every
engine, with enough comparisons per engine to mean something. The group-blind answer's agreement
is printed beside it (it is allowed to be wrong: that is what the HMA-aware index fixes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_demo import finish, start_demo

from hmakv.demo.config import ENGINE_WORKLOADS
from hmakv.producer.engine.profiles import PROFILES

RUN_S = 15
MIN_COMPARED_PER_ENGINE = 10
LINEUP = (
    # profile, workload, pool blocks: pools small enough that every engine evicts within the run
    ("gpt-oss-like", "chat", 512),
    ("gemma3-like", "documents", 512),
    ("mamba-hybrid-like", "random-prefix", 512),
    ("swa-small", "agentic", 250),
    ("chunked-local-like", "burst", 512),
    ("mixed-block-like", "random-prefix", 256),
)


def run_demo(root: Path) -> tuple[int, str, dict[str, Any]]:
    workdir, output, summary_path = root / "work", root / "output.txt", root / "summary.json"
    engines = [
        option
        for profile, workload, blocks in LINEUP
        for option in ("--engine", f"{profile}:{workload}:{blocks}")
    ]
    process = start_demo(
        workdir, output, "--duration", str(RUN_S), "--json", str(summary_path), *engines
    )
    returncode = finish(process, output)
    text = output.read_text()
    assert summary_path.exists(), f"no summary JSON:\n{text}"
    return returncode, text, json.loads(summary_path.read_text())


def test_the_lineup_covers_every_profile_and_workload() -> None:
    assert {profile for profile, _, _ in LINEUP} == set(PROFILES)
    assert {workload for _, workload, _ in LINEUP} == set(ENGINE_WORKLOADS)


def test_the_index_agrees_with_every_engine_on_every_profile(tmp_path: Path) -> None:
    returncode, output, summary = run_demo(tmp_path)
    engines = summary["engines"]
    print()
    for engine in engines:
        compared = engine["answers_compared"]
        print(
            f"{engine['worker']} {engine['profile']:>18} {engine['workload']:>13}: "
            f"HMA-aware {engine['hma_agreeing']}/{compared}, "
            f"group-blind {engine['group_blind_agreeing']}/{compared}, "
            f"{engine['removals_received_live']} removal events"
        )
    routing = summary["routing"]
    print(
        f"all: HMA-aware {routing['hma_agreement']}, group-blind {routing['group_blind_agreement']}"
        f" over {routing['worker_answers_compared']} answers ({routing['raced']} raced)"
    )

    assert returncode == 0, output
    assert summary["ok"] is True, summary["problems"]
    assert [(e["profile"], e["workload"]) for e in engines] == [(p, w) for p, w, _ in LINEUP]
    pipeline = summary["pipeline"]
    assert pipeline["lost"] == 0, pipeline
    assert pipeline["gaps_unrecoverable"] == 0, pipeline
    assert pipeline["batches_forwarded"] == pipeline["batches_published"], pipeline
    assert routing["disagreements"] == [], routing
    assert routing["hma_agreeing"] == routing["worker_answers_compared"], routing
    for engine in engines:
        assert engine["events_published"] > 0, engine
        assert engine["index_last_seq"] == engine["batches_published"] - 1, engine
        assert engine["answers_compared"] >= MIN_COMPARED_PER_ENGINE, engine
        assert engine["hma_agreeing"] == engine["answers_compared"], engine
        assert engine["removals_received_live"] > 0, engine  # its cache was under pressure
    assert (
        sum(engine["answers_compared"] for engine in engines)
        == (routing["worker_answers_compared"])
    ), routing
