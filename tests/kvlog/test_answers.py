"""The best-worker rule of ``kvlog.answers``, which the score API and the demo's probe share."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from hmakv.kvlog.answers import WorkerHit, best_worker, group_blind_answer, hma_best
from hmakv.kvlog.records import Health


def hit(worker: str, tokens: int, *, blind: int = 0, degraded: bool = False) -> WorkerHit:
    health: Health = "degraded" if degraded else "live"
    return WorkerHit(worker, tokens, 0, {}, {}, tokens, health, degraded, True, blind, ())


def test_the_highest_rank_wins_and_the_first_name_breaks_ties_whatever_the_order() -> None:
    hits = [hit("c", 32), hit("b", 64), hit("a", 64)]
    assert best_worker(hits, lambda h: (h.hit_tokens,)) is hits[2]
    assert best_worker(reversed(hits), lambda h: (h.hit_tokens,)) is hits[2]


@given(
    st.lists(
        st.tuples(st.sampled_from("abcdef"), st.integers(0, 3), st.integers(0, 3)),
        unique_by=lambda answer: answer[0],
    )
)
def test_the_best_is_the_top_rank_and_its_first_name_in_any_order(
    answers: list[tuple[str, int, int]],
) -> None:
    hits = [hit(name, tokens, blind=blind) for name, tokens, blind in answers]
    ranks = {h.worker: (float(h.hit_tokens), float(h.group_blind_hit_tokens)) for h in hits}
    top = max(ranks.values(), default=(0.0, 0.0))
    expected = min((w for w, r in ranks.items() if r == top), default=None) if top[0] else None
    best = best_worker(hits, lambda h: ranks[h.worker])
    assert (best.worker if best is not None else None) == expected


def test_no_hit_names_no_worker() -> None:
    assert best_worker([hit("a", 0), hit("b", 0)], lambda h: (h.hit_tokens,)) is None
    assert best_worker([], lambda h: (h.hit_tokens,)) is None


def test_the_answers_leave_out_workers_the_index_does_not_follow_wholly() -> None:
    hits = [hit("degraded", 128, blind=128, degraded=True), hit("live", 16, blind=64)]
    assert hma_best(hits) is hits[1]
    blind = group_blind_answer(hits)
    assert (blind.best, blind.hit_tokens) == ("live", 64)


def test_a_stale_worker_is_never_the_best_of_either_answer() -> None:
    """The index may be behind it (issue 16): a router falls back rather than trust its hit."""
    stale = msgspec.structs.replace(hit("behind", 128, blind=128), stale=True)
    hits = [stale, hit("current", 16, blind=64)]
    assert hma_best(hits) is hits[1]
    assert group_blind_answer(hits).best == "current"
    assert hma_best([stale]) is None and group_blind_answer([stale]).best is None
