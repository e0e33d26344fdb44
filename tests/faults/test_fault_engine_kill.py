"""Scenario 4: an engine SIGKILLed and restarted on the same endpoints, as its supervisor does.

Nothing on vLLM's wire names an engine life: the bridge tells the new one by its seqs going
backwards (or by its seq 0, an ``AllBlocksCleared``, should it arrive after later seqs), and
starts a new epoch. The index must then drop everything the old life held, and follow the new
one exactly.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fault_kit import BRIDGE, INDEX, Pipeline, kill, pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


async def new_life_followed(fleet: Pipeline) -> bool:
    view = (await fleet.workers()).get("engine-a")
    return view is not None and view.epoch == 1


async def replays_run(fleet: Pipeline) -> float:
    """Replays the bridge ran so far, whatever their outcome: one follows every reconnect."""
    return (await fleet.bridge_metrics()).total(f"{BRIDGE}_replays_total", kind="replay")


async def replays_run_since(fleet: Pipeline, before: float) -> bool:
    return await replays_run(fleet) > before


async def test_an_engine_killed_and_restarted_is_a_new_epoch_without_the_old_blocks(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    async with pipeline(tmp_path, kafka_bootstrap) as fleet:
        await fleet.serve(60)
        await fleet.settle()
        old_life = await fleet.assert_agreement()
        old_prompts = list(fleet.served)
        held = [p for p in old_prompts if old_life.by_prompt[p]["engine-a"].actual > 0]

        replays = await replays_run(fleet)
        kill(fleet.processes["engine-a"])
        await fleet.start_engine("engine-a")
        # Batches published before the bridge is back on the new life's PUB socket are missed
        # live; its catch-up finds the new life (see the test below), and so would the first
        # live batch, by its seq going backwards.
        await fleet.until(
            lambda: replays_run_since(fleet, replays), "the bridge back on engine-a (its catch-up)"
        )
        await fleet.serve(10, to=["engine-a"])
        await fleet.until(lambda: new_life_followed(fleet), "the index follows the new life")
        await fleet.settle()
        # What the old life held and the new one does not must not score there now. The new
        # life's prompts may bring back every system prompt, so that no old prompt scores 0
        # (seen once in CI): what shrank is what it lost.
        agreement = await fleet.assert_agreement(old_prompts)
        lives = [
            (old_life.by_prompt[p]["engine-a"], agreement.by_prompt[p]["engine-a"]) for p in held
        ]
        gone = [now for before, now in lives if now.actual < before.actual]
        bridge = await fleet.bridge_metrics()
        index = await fleet.index_metrics()
        views = await fleet.workers()
    assert gone, "the new life holds all the old one did: the check proves nothing"
    assert all(c.hma == c.actual for c in gone)  # the index lost what the engine lost
    assert bridge.total(f"{BRIDGE}_epochs_started_total", worker="engine-a") == 1
    assert bridge.total(f"{BRIDGE}_epochs_started_total", worker="engine-b") == 0
    assert bridge.total(f"{BRIDGE}_worker_epoch", worker="engine-a") == 1
    assert bridge.total(f"{BRIDGE}_batches_lost_total") == 0
    assert index.total(f"{INDEX}_worker_restarts_total") == 1
    assert (views["engine-a"].epoch, views["engine-b"].epoch) == (1, 0)
    assert views["engine-a"].health == "live"


async def test_an_engine_restarted_and_left_idle_loses_its_old_blocks_in_the_index(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Found by this suite: the new life's seq 0 goes out before a subscriber can have joined,
    and the catch-up from the resume point came back empty, which proved nothing; the index
    kept the old life's blocks until the engine's next batch. An empty answer to a verifying
    replay is now probed from seq 0, and a ring with batches but not the verified one is
    another life's."""
    async with pipeline(tmp_path, kafka_bootstrap) as fleet:
        await fleet.serve(40)
        await fleet.settle()
        old_prompts = list(fleet.served)
        replays = await replays_run(fleet)
        # The bridge frozen across the restart certainly misses the new life's seq 0 live, as
        # it practically always does anyway.
        bridge = fleet.processes["bridge"]
        os.killpg(bridge.pid, signal.SIGSTOP)
        try:
            kill(fleet.processes["engine-a"])
            await fleet.start_engine("engine-a")
        finally:
            os.killpg(bridge.pid, signal.SIGCONT)

        await fleet.until(
            lambda: replays_run_since(fleet, replays), "the bridge back on engine-a (its catch-up)"
        )
        await fleet.until(
            lambda: new_life_followed(fleet), "the index drops the old life", timeout_s=10
        )
        agreement = await fleet.compare(old_prompts)
    assert not agreement.claimed_too_much, agreement.summary()
