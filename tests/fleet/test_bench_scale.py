"""``hmakv bench scale``: the index built at a fleet's size in a process of its own. The smoke
run CI makes is judged on what the index answers and on the report's shape, never on timing."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from hmakv.cli import main
from hmakv.fleet.engines import GROUPS
from hmakv.fleet.scale import (
    SHARED_BLOCKS,
    ScalePlan,
    build,
    ladder_block,
    ladder_held,
    own_block,
    own_blocks,
    prompt,
    worker_batches,
)


def test_every_worker_holds_its_blocks_in_both_groups_and_its_prompts_best() -> None:
    plan = ScalePlan(workers=5, blocks=3000, prompts=20)
    index = build(plan)
    for info in index.workers():
        assert info.resident == {group: {"GPU": plan.blocks} for group, _, _ in GROUPS}
    hits = index.score(prompt(3, 7, 100, plan), plan.prompt_blocks * 16)
    assert hits[0].worker == "w3"
    assert hits[0].hit_blocks == plan.prompt_blocks - 1  # vLLM computes the last token
    assert {h.hit_blocks for h in hits[1:]} == {SHARED_BLOCKS}  # the system prompt only


def test_the_ladder_prompt_answers_each_worker_its_own_share() -> None:
    plan = ScalePlan(workers=5, blocks=3000)
    index = build(plan)
    ladder = [ladder_block(b) for b in range(plan.prompt_blocks)]
    hits = index.score(ladder, plan.prompt_blocks * 16)
    # 102, 204, 307, 409 and all 512 blocks held; the last is never a hit.
    assert [(h.worker, h.hit_blocks) for h in hits] == [
        ("w4", 511),
        ("w3", 409),
        ("w2", 307),
        ("w1", 204),
        ("w0", 102),
    ]


def test_a_worker_stores_the_shared_system_prompts_then_its_own_blocks_once_each() -> None:
    plan = ScalePlan(workers=2, blocks=2500)
    stored = [h for batch in worker_batches(1, plan) for h in batch.events[0].block_hashes]
    others = {h for batch in worker_batches(0, plan) for h in batch.events[0].block_hashes}
    assert len(stored) == len(set(stored)) == plan.blocks
    ladder = {ladder_block(b) for b in range(ladder_held(0, plan), ladder_held(1, plan))}
    own = {own_block(1, b) for b in range(own_blocks(plan, 1))}
    assert set(stored) - others == own | ladder


def test_the_smoke_run_reports_every_size_with_every_best_worker_right(tmp_path: Path) -> None:
    path = tmp_path / "scale.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "scale", "--smoke", "--prompts", "50", "--json", str(path)]) == 0
    reports = json.loads(path.read_text())["reports"]
    assert [r["workers"] for r in reports] == [16, 64]
    for r in reports:
        assert r["resident_entries"] == r["workers"] * r["blocks_per_worker"] * len(GROUPS)
        assert r["best_hits_right"] == r["prompts"] == 50
        for ladder in (r["ladder"], r["ladder_default_gc"]):
            assert ladder["right"] and ladder["hits"] == min(r["workers"], 512)
            assert 0 < ladder["hit_only_p50_us"] <= ladder["hit_only_p99_us"]
        assert r["rss_mib"] > r["rss_before_mib"] > 0 and r["bytes_per_entry"] > 0
        assert 0 < r["score_p50_us"] <= r["score_p99_us"]
        answer = r["router_answer"]
        assert answer["top_right"] and 0 < answer["top_bytes"] < answer["bytes"]
        assert 0 < answer["top_p50_us"] <= answer["top_p99_us"]
    assert "64 workers / 16" in out.getvalue()


def test_too_few_blocks_for_a_prompt_is_bad_usage() -> None:
    assert main(["bench", "scale", "--workers", "2", "--blocks", "1000"]) == 2
