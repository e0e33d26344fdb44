"""How a score call's answers split the fleet (``scoring._Answers``), against a model that keeps
every worker's answers apart: on random worker sets up to 140 slots wide and random scans, both of
``record``'s ways (each part trying the pairs in turn, and each part going by a table of slots)
split the fleet into the same parts, each worker's part holding exactly the model's answers; and
``Roster`` names a worker set's members in name order, as a pass over the whole roster would."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.consumers import scoring
from hmakv.consumers.scoring import AnswerKey, Roster
from hmakv.kvlog.records import Health

KEYS: list[AnswerKey] = [("hit", 0), ("group", 0), ("group", 1), ("tier", "CPU"), ("blind", 0)]


@st.composite
def scans(draw: st.DrawFn, everyone: int) -> tuple[AnswerKey, list[tuple[int, int]]]:
    """One key and a scan's pairs: disjoint worker sets over some of ``everyone``, in any order,
    some tokens repeated and some sets empty (as ``_score_class`` may append)."""
    slots = [slot for slot in range(everyone.bit_length()) if everyone >> slot & 1]
    pairs = draw(st.integers(1, 6))
    labels = draw(st.lists(st.integers(-1, pairs - 1), min_size=len(slots), max_size=len(slots)))
    tokens = draw(st.lists(st.sampled_from([0, 16, 32, 48, 512]), min_size=pairs, max_size=pairs))
    labelled = list(zip(slots, labels, strict=True))
    hits = [
        (tokens[pair], sum(1 << slot for slot, label in labelled if label == pair))
        for pair in range(pairs)
    ]
    return draw(st.sampled_from(KEYS)), hits


@st.composite
def calls(draw: st.DrawFn) -> tuple[int, list[tuple[AnswerKey, list[tuple[int, int]]]]]:
    width = draw(st.integers(1, 140))
    everyone = draw(st.integers(1, (1 << width) - 1))
    return everyone, draw(st.lists(scans(everyone), max_size=6))


def recorded(
    everyone: int, records: list[tuple[AnswerKey, list[tuple[int, int]]]], pairs_tried: int
) -> dict[int, dict[AnswerKey, int]]:
    with mock.patch.object(scoring, "_PAIRS_TRIED", pairs_tried):
        answers = scoring._Answers(everyone)
        for key, hits in records:
            answers.record(key, hits)
    return answers.parts


@settings(max_examples=400, deadline=None)
@given(calls())
def test_both_ways_split_the_fleet_as_the_model_answers(
    call: tuple[int, list[tuple[AnswerKey, list[tuple[int, int]]]]],
) -> None:
    everyone, records = call
    model: dict[int, dict[AnswerKey, int]] = {
        slot: {} for slot in range(everyone.bit_length()) if everyone >> slot & 1
    }
    for key, hits in records:
        for tokens, workers in hits:
            for slot in model:
                if workers >> slot & 1:
                    model[slot][key] = tokens

    by_pairs = recorded(everyone, records, pairs_tried=1 << 30)
    by_slot = recorded(everyone, records, pairs_tried=0)
    assert by_slot == by_pairs
    covered = 0
    for workers, answers in by_slot.items():
        assert workers and not workers & covered  # non-empty, disjoint
        covered |= workers
        assert all(model[slot] == answers for slot in model if workers >> slot & 1)
    assert covered == everyone


def test_a_whole_part_keeps_its_own_dict_and_a_split_copies_it() -> None:
    for pairs_tried in (0, 1 << 30):
        with mock.patch.object(scoring, "_PAIRS_TRIED", pairs_tried):
            answers = scoring._Answers(0b111)
            answers.record(("hit", 0), [(32, 0b111)])
            whole = answers.parts[0b111]
            answers.record(("group", 0), [(32, 0b011), (16, 0b100)])
            assert answers.parts == {
                0b011: {("hit", 0): 32, ("group", 0): 32},
                0b100: {("hit", 0): 32, ("group", 0): 16},
            }
            assert all(part is not whole for part in answers.parts.values())


class _Member:
    def __init__(self, name: str, slot: int, health: Health) -> None:
        self.name, self.bit, self.health = name, 1 << slot, health


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text("abcw0123", min_size=1, max_size=4), unique=True, min_size=1, max_size=140),
    st.data(),
)
def test_a_roster_names_each_set_in_name_order(names: list[str], data: st.DataObject) -> None:
    order = data.draw(st.permutations(range(len(names))))  # slots are not in name order
    health: list[Health] = ["live", "degraded"]
    members = [
        _Member(name, slot, health[slot % 2]) for name, slot in zip(names, order, strict=True)
    ]
    roster = Roster(members)
    for _ in range(3):
        workers = data.draw(st.integers(0, (1 << len(names)) - 1))
        chosen = sorted((m for m in members if m.bit & workers), key=lambda m: m.name)
        expected = (
            [m.name for m in chosen],
            [m.health for m in chosen],
            [m.health != "live" for m in chosen],
        )
        assert roster.named(workers) == expected
        assert roster.named(workers) == expected  # listed once, then reused
