"""The stand-in engines' steps, applied to the real index in this process, leave exactly the
state ``ExpectedState`` says: the fleet benchmark's loss check compares a live index with it, so
it must be exact, and any one step missing must show."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.bridge.fanout import fan_out
from hmakv.consumers.index import KVIndex
from hmakv.fleet.engines import GROUP_IDS, RESIDENT_STEPS, ExpectedState, engine_name, step_batch


def applied(engines: int, steps: int, skipped: tuple[int, int] | None = None) -> KVIndex:
    """Every step of every engine through the bridge's fan-out into an index, but ``skipped``
    (engine, step)."""
    index = KVIndex()
    for step in range(1, steps + 1):
        for engine in range(engines):
            if (engine, step) == skipped:
                continue
            batch = step_batch(step, engine)
            for record in fan_out(engine_name(engine), 0, step, batch, GROUP_IDS):
                index.apply(record)
    return index


def state_of(index: KVIndex) -> tuple[int, int, int, dict[str, dict[int, int]]]:
    counters = index.counters
    resident = {
        info.name: {group: media.get("GPU", 0) for group, media in info.resident.items()}
        for info in index.workers()
    }
    return counters.stored, counters.removed, counters.anomalies, resident


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2 * RESIDENT_STEPS + 10))
def test_every_step_applied_leaves_the_expected_state(engines: int, steps: int) -> None:
    expected = ExpectedState.of(engines, steps)
    stored, removed, anomalies, resident = state_of(applied(engines, steps))
    assert (stored, removed, anomalies) == (expected.blocks_stored, expected.blocks_removed, 0)
    per_worker = dict.fromkeys(GROUP_IDS, expected.resident_per_group)
    assert resident == {engine_name(e): per_worker for e in range(engines)}


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_one_step_missing_shows(data: st.DataObject) -> None:
    engines = data.draw(st.integers(1, 3))
    steps = data.draw(st.integers(1, 2 * RESIDENT_STEPS + 10))
    skipped = (data.draw(st.integers(0, engines - 1)), data.draw(st.integers(1, steps)))
    expected = ExpectedState.of(engines, steps)
    stored, removed, anomalies, _ = state_of(applied(engines, steps, skipped))
    # The step's stores are missing; its removals are too, and the removal of its blocks
    # R steps later finds nothing (resident counts alone can balance out: not a check).
    assert stored < expected.blocks_stored
    if skipped[1] + RESIDENT_STEPS <= steps:
        assert anomalies > 0
    if skipped[1] > RESIDENT_STEPS:
        assert removed < expected.blocks_removed


def test_a_step_stores_in_both_groups_and_removes_what_was_stored_resident_steps_before() -> None:
    first, later = step_batch(1, 0), step_batch(RESIDENT_STEPS + 1, 0)
    assert len(first.events) == 6 and len(later.events) == 8
    stored = {
        (event.group_idx, h) for event in first.events for h in getattr(event, "block_hashes", [])
    }
    removed = {(event.group_idx, h) for event in later.events[6:] for h in event.block_hashes}
    assert removed == stored
