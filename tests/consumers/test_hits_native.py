"""The native hit scan (``hmakv_native.longest_hits``) against its specification
(``consumers.hit_rule.scan``): on random columns, rules and worker sets, wider than a machine word
too, both give the same (tokens, workers) pairs. Skipped without ``hmakv_native``, the one thing
scripts/setup may leave out (a machine without cargo); CI builds it. The index-level check (an
index on every native path answers as one on the Python specification) is in
test_block_table.py."""

from __future__ import annotations

import math

import hmakv_native
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmakv.consumers import hit_rule
from hmakv.consumers.hit_rule import Acceptance, Column, GroupRule, longest_hits, scan

pytestmark = pytest.mark.skipif(
    not hit_rule.NATIVE_HITS, reason="hmakv_native is not installed: run scripts/setup"
)

HASH_BLOCK = 16
RULES = st.one_of(
    st.builds(lambda k: GroupRule(0, "prefix", HASH_BLOCK * k), st.integers(1, 3)),
    st.builds(
        lambda k, w: GroupRule(0, "window", HASH_BLOCK * k, window_blocks=w),
        st.integers(1, 2),
        st.integers(1, 9),
    ),
    st.builds(lambda k: GroupRule(0, "state", HASH_BLOCK * k), st.integers(1, 2)),
    st.builds(
        lambda k, c: GroupRule(0, "chunk", HASH_BLOCK * k, chunk_size=c),
        st.integers(1, 2),
        st.sampled_from([16, 64, 100, 128]),
    ),
)


@st.composite
def classes(draw: st.DrawFn) -> tuple[list[Acceptance], int, int, int]:
    """A catalog class: its groups' lanes packed into shared values, as the index keeps them."""
    rules = draw(st.lists(RULES, min_size=1, max_size=3))
    slots = draw(st.sampled_from([3, 8, 64, 70, 140]))  # one word, exactly one, several
    max_tokens = draw(st.integers(0, 60 * HASH_BLOCK))
    lane = st.integers(0, 2**slots - 1)
    # Few distinct holders, so that neighbouring blocks form runs as a shared prefix does.
    pool = draw(st.lists(st.tuples(*(lane for _ in rules)), min_size=1, max_size=6))
    acceptances = []
    for position, rule in enumerate(rules):
        length = max_tokens // rule.block_size + draw(st.integers(0, 2))
        picks = draw(st.lists(st.sampled_from(pool), min_size=length, max_size=length))
        values = [sum(held << (slots * lane) for lane, held in enumerate(pick)) for pick in picks]
        acceptances.append(Acceptance(rule, Column(values), slots * position))
    everyone = draw(st.integers(0, 2**slots - 1))
    align = math.lcm(*(rule.block_size for rule in rules))
    return acceptances, everyone, align, max_tokens


@settings(max_examples=600, deadline=None)
@given(classes())
def test_the_native_scan_answers_as_the_specification(
    drawn: tuple[list[Acceptance], int, int, int],
) -> None:
    acceptances, everyone, align, max_tokens = drawn
    assert longest_hits(acceptances, everyone, align, max_tokens) == scan(
        acceptances, everyone, align, max_tokens
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(33, 80), st.integers(0, 2**9 - 1))
def test_many_runs_agree_too(runs: int, everyone: int) -> None:
    """Past RUN_SEARCH_LIMIT runs the column finds them in one pass: the same answers."""
    values = [(block * 37) % 2**9 | (1 if block % 5 else 0) for block in range(runs)]
    rules = [GroupRule(0, "prefix", 16), GroupRule(1, "window", 16, window_blocks=3)]
    acceptances = [Acceptance(rule, Column(values), 0) for rule in rules]
    hits = longest_hits(acceptances, everyone, 16, runs * 16)
    assert hits == scan(acceptances, everyone, 16, runs * 16)


def test_a_worked_hybrid_example() -> None:
    """gpt-oss-like: worker 0 holds 20 full-attention blocks and the last 8 of the window;
    worker 1 the same full blocks but window blocks 0-3 only: 20 blocks against 4."""
    full = Column([0b11] * 20 + [0])
    window = Column([0b10] * 4 + [0] * 8 + [0b01] * 8 + [0])
    acceptances = [
        Acceptance(GroupRule(0, "prefix", 16), full, 0),
        Acceptance(GroupRule(1, "window", 16, window_blocks=8), window, 0),
    ]
    assert longest_hits(acceptances, 0b11, 16, 320) == [(320, 0b01), (64, 0b10)]


def test_bad_lanes_are_refused_not_guessed() -> None:
    edges, held = [0, 4], [1]
    with pytest.raises(ValueError, match="unknown hit rule"):
        hmakv_native.longest_hits([("diagonal", 16, 0, 0, edges, held)], 1, 16, 64)
    with pytest.raises(ValueError, match="one edge more than runs"):
        hmakv_native.longest_hits([("prefix", 16, 0, 0, [0], held)], 1, 16, 64)
    with pytest.raises(ValueError, match="align must be positive"):
        hmakv_native.longest_hits([("prefix", 16, 0, 0, edges, held)], 1, 0, 64)
    with pytest.raises(OverflowError):
        hmakv_native.longest_hits([("prefix", 16, 0, 0, edges, [-1])], 1, 16, 64)


def test_a_block_size_past_64_bits_is_scanned_in_python_alike() -> None:
    """A store may claim any block size (the index fuzzer found one whose catalog's alignment
    passed 2**64): the native scan cannot take it, the specification can, and answers."""
    huge = GroupRule(0, "prefix", 2**64 + HASH_BLOCK)
    acceptances = [
        Acceptance(GroupRule(0, "prefix", HASH_BLOCK), Column([0b11] * 4), 0),
        Acceptance(huge, Column([]), 2),
    ]
    align = math.lcm(HASH_BLOCK, huge.block_size)
    with pytest.raises(OverflowError):
        hmakv_native.longest_hits([a.lane(0b11) for a in acceptances], 0b11, align, 4 * HASH_BLOCK)
    assert longest_hits(acceptances, 0b11, align, 4 * HASH_BLOCK) == [(0, 0b11)]
    assert scan(acceptances, 0b11, align, 4 * HASH_BLOCK) == [(0, 0b11)]
