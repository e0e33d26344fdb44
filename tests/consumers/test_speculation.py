"""Speculative entries in the index: a prompt routed to a worker counts as held there until its
events confirm or remove each block, or the entry expires; never in the confirmed figures."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_index import FULL, PROMPT, SWA_128, B, only, record, removed, stored

from hmakv.consumers.index import KVIndex, UnknownWorker
from hmakv.consumers.scoring import SPECULATIVE_MEDIUM
from hmakv.consumers.speculation import DEFAULT_TTL_S, LAG_SAMPLES, SpeculationTtl, TtlLimits
from hmakv.kvlog.answers import WorkerHit, hma_best
from hmakv.producer.events import AllBlocksCleared, GroupSpec

MAMBA_64 = GroupSpec("mamba", 64)
TOKENS = len(PROMPT) * B  # 25 full blocks: a hit is at most 24 of them


def fleet(*catalog: GroupSpec, workers: tuple[str, ...] = ("w0", "w1")) -> KVIndex:
    index = KVIndex(hash_block_size=B)
    for worker in workers:
        index.set_catalog(worker, dict(enumerate(catalog)))
    return index


def test_a_routed_prompt_is_a_speculative_hit_and_best_but_not_the_confirmed_one() -> None:
    index = fleet(FULL)
    assert index.speculate("w1", PROMPT, TOKENS, expires_at=2.0) == 25
    scores = index.score(PROMPT, TOKENS)
    routed = only(scores, "w1")
    assert (routed.hit_tokens, routed.speculative_hit_tokens) == (0, 24 * B)
    assert routed.group_hit_tokens == {0: 0} and routed.tier_hit_tokens["GPU"] == 0
    assert routed.group_blind_hit_tokens == 0
    assert routed.speculative_weighted_tokens == 24 * B * 1.0
    assert scores[0].worker == "w1" and hma_best(scores) == routed
    other = only(scores, "w0")
    assert other.speculative_hit_tokens == other.hit_tokens == 0


def test_speculation_is_a_set_renewed_not_counted_twice() -> None:
    index = fleet(FULL)
    assert index.speculate("w0", PROMPT, TOKENS, expires_at=2.0) == 25
    assert index.speculate("w0", PROMPT[:10], 10 * B + 1, expires_at=5.0) == 0
    assert index.workers()[0].speculative_blocks == 25
    assert index.expire_speculation(3.0) == 15  # the 10 renewed blocks live on
    assert only(index.score(PROMPT, TOKENS)).speculative_hit_tokens == 10 * B
    assert index.expire_speculation(5.0) == 10
    assert index.counters.speculation_expired == 25 and index.next_expiry() is None


def test_a_real_store_confirms_and_a_real_removal_removes() -> None:
    index = fleet(FULL)
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    index.apply(record(0, 0, stored(PROMPT[:20], 0)))
    assert index.workers()[0].speculative_blocks == 5
    index.apply(record(1, 0, removed(PROMPT[:3], 0)))
    score = only(index.score(PROMPT, TOKENS))
    assert (score.hit_tokens, score.speculative_hit_tokens) == (0, 0)
    index.apply(record(2, 0, removed(PROMPT[22:], 0)))  # speculative only: gone too
    counters = index.counters
    assert (counters.speculation_confirmed, counters.speculation_removed) == (20, 3)
    assert index.workers()[0].speculative_blocks == 2
    assert index.expire_speculation(2.0) == 2


def test_blocks_really_held_are_not_speculated() -> None:
    index = fleet(FULL)
    index.apply(record(0, 0, stored(PROMPT[:20], 0)))
    assert index.speculate("w0", PROMPT, TOKENS, expires_at=2.0) == 5
    score = only(index.score(PROMPT, TOKENS))
    assert (score.hit_tokens, score.speculative_hit_tokens) == (20 * B, 24 * B)


def test_sliding_window_speculation_follows_the_hma_rule() -> None:
    """The window group's blocks 12..19 are evicted for real after routing: the hit needs them,
    so speculation must not hide it."""
    index = fleet(FULL, SWA_128)
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    assert only(index.score(PROMPT, TOKENS)).speculative_hit_tokens == 24 * B
    index.apply(record(0, 0, stored(PROMPT, 0)))
    index.apply(record(0, 1, stored(PROMPT[:20], 1, SWA_128), removed(PROMPT[12:20], 1)))
    score = only(index.score(PROMPT, TOKENS))
    # Window blocks 12..19 are gone, 20..24 still speculative: the window hit needs 16..23.
    assert score.hit_tokens == 12 * B and score.speculative_hit_tokens == 12 * B
    assert score.group_hit_tokens[0] == 24 * B


def test_mamba_speculates_the_state_block_at_the_aligned_length() -> None:
    index = fleet(FULL, MAMBA_64)
    # 25 blocks of 16 = 400 tokens: the state is cached at 384 (mamba block 5).
    assert index.speculate("w0", PROMPT, TOKENS, expires_at=2.0) == 25 + 1
    keys = {key for key in index._workers["w0"].speculative if key[0] == 1}
    assert keys == {(1, PROMPT[23])}
    follow_up = [*PROMPT, 999]
    assert only(index.score(follow_up, TOKENS + B)).speculative_hit_tokens == 384
    assert only(index.score(PROMPT, TOKENS)).speculative_hit_tokens == 384


def test_clears_epochs_dropped_groups_and_departures_drop_speculation() -> None:
    index = fleet(FULL, SWA_128)
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    index.apply(record(0, 1, AllBlocksCleared()))
    assert {g for g, _ in index._workers["w0"].speculative} == {0}
    index.drop_group("w0", 0)
    assert index.workers()[0].speculative_blocks == 0
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    index.start_epoch("w0", 1)
    assert index.workers()[0].speculative_blocks == 0
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    index.forget_worker("w0")
    assert only(index.score(PROMPT, TOKENS), "w1").speculative_hit_tokens == 0
    assert not index._media[SPECULATIVE_MEDIUM].owners
    assert index.counters.speculation_removed == 3 * 2 * 25  # both groups, three times
    assert index.expire_speculation(9.0) == 0  # their entries find nothing left


def test_unknown_workers_are_refused() -> None:
    index = fleet(FULL)
    with pytest.raises(UnknownWorker):
        index.speculate("nobody", PROMPT, TOKENS, expires_at=2.0)
    assert [info.name for info in index.workers()] == ["w0", "w1"]


def test_snapshots_leave_speculation_out() -> None:
    index = fleet(FULL)
    index.apply(record(0, 0, stored(PROMPT[:5], 0)))
    before = index.snapshot()
    index.speculate("w0", PROMPT, TOKENS, expires_at=2.0)
    assert index.snapshot() == before
    restored = KVIndex.restore(index.snapshot(), hash_block_size=B)
    assert only(restored.score(PROMPT, TOKENS)).speculative_hit_tokens == 5 * B


def test_speculation_counts_against_the_worker_cap_and_never_refuses_real_stores() -> None:
    index = KVIndex(hash_block_size=B, max_blocks_per_worker=10)
    index.set_catalog("w0", {0: FULL})
    index.apply(record(0, 0, stored(PROMPT[:4], 0)))
    assert index.speculate("w0", PROMPT, TOKENS, expires_at=2.0) == 6
    assert index.counters.speculation_refused == 15
    index.apply(record(1, 0, stored(PROMPT[10:16], 0)))
    assert index.counters.blocks_refused == 0


def test_engines_cannot_store_or_remove_on_the_speculative_medium() -> None:
    index = fleet(FULL)
    index.apply(record(0, 0, stored(PROMPT, 0, medium=SPECULATIVE_MEDIUM)))
    index.apply(record(1, 0, removed(PROMPT[:2], 0, medium=SPECULATIVE_MEDIUM)))
    assert index.counters.reserved_medium_blocks == 27
    assert only(index.score(PROMPT, TOKENS)).speculative_hit_tokens == 0
    with pytest.raises(ValueError, match="own medium"):
        KVIndex(tier_weights={"GPU": 1.0, SPECULATIVE_MEDIUM: 0.9})


def test_without_speculation_answers_are_what_they_were() -> None:
    """Speculated, then expired: every answer encodes to the bytes of one that never speculated,
    and the speculative figures are the confirmed ones."""
    plain, routed = fleet(FULL, SWA_128), fleet(FULL, SWA_128)
    for index in (plain, routed):
        index.apply(record(0, 0, stored(PROMPT, 0)))
        index.apply(record(0, 1, stored(PROMPT[12:20], 1, SWA_128)))
    routed.speculate("w1", PROMPT, TOKENS, expires_at=2.0)
    routed.expire_speculation(2.0)
    for details in (True, False):
        answers = plain.score(PROMPT, TOKENS, details=details)
        assert msgspec.json.encode(answers) == msgspec.json.encode(
            routed.score(PROMPT, TOKENS, details=details)
        )
        for hit in answers:
            assert hit.speculative_hit_tokens == hit.hit_tokens
            assert hit.speculative_weighted_tokens == hit.weighted_tokens
    assert plain.snapshot() == routed.snapshot()


def test_an_older_index_answer_still_decodes_and_ranks() -> None:
    old = b'{"worker":"w0","hit_tokens":32,"hit_blocks":2,"groups":{},"tiers":{},"score":32.0,'
    old += b'"health":"live","degraded":false,"catalog_ok":true,"group_blind_hit_tokens":32,'
    old += b'"stale_groups":[]}'
    hit = msgspec.json.decode(old, type=WorkerHit)
    assert hit.speculative_hit_tokens is None and hma_best([hit]) == hit


def test_the_ttl_follows_the_recent_p99_lag_within_its_bounds() -> None:
    ttl = SpeculationTtl()
    assert ttl.ttl_s() == DEFAULT_TTL_S  # nothing measured yet: llm-d's default
    for _ in range(98):
        ttl.observe(0.2)
    ttl.observe(5.0)
    ttl.observe(5.0)  # two slow records in a hundred: the p99 (nearest rank)
    assert ttl.ttl_s() == 2 * 5.0
    for _ in range(LAG_SAMPLES):
        ttl.observe(0.01)  # the slow one has left the window; the floor holds
    assert ttl.ttl_s() == TtlLimits().floor_s
    ttl.observe(1e6)
    ttl.observe(1e6)
    assert ttl.ttl_s() == TtlLimits().floor_s  # two in 1024: below the p99
    for _ in range(20):
        ttl.observe(1e6)
    assert ttl.ttl_s() == TtlLimits().ceiling_s
    assert ttl.for_request(0.5) == 0.5 and ttl.for_request(1e9) == TtlLimits().ceiling_s


def test_a_fixed_ttl_ignores_the_lag_and_caps_requests_at_the_longer_bound() -> None:
    ttl = SpeculationTtl(60.0)
    ttl.observe(0.1)
    assert ttl.ttl_s() == 60.0 and ttl.for_request(None) == 60.0
    assert ttl.for_request(1e9) == 60.0
    with pytest.raises(ValueError):
        SpeculationTtl(0.0)
    with pytest.raises(ValueError):
        TtlLimits(floor_s=5.0, ceiling_s=1.0)


Step = tuple[str, int, int]  # (operation, first block, blocks), a time step apart


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["speculate", "store", "remove", "clear", "wait"]),
            st.integers(0, 7),
            st.integers(1, 8),
        ),
        max_size=30,
    )
)
@settings(max_examples=200, deadline=None)
def test_speculation_against_a_model_of_sets(steps: list[Step]) -> None:
    """Full attention alone: the speculative hit is the prefix of blocks really held or
    speculated and not yet expired, settled or cleared; the confirmed hit ignores speculation."""
    index = fleet(FULL, workers=("w0",))
    prompt = PROMPT[:16]
    real: set[int] = set()
    speculative: dict[int, float] = {}  # hash -> expiry
    for now, (operation, first, count) in enumerate(steps):
        blocks = prompt[first : first + count]
        index.expire_speculation(now)
        speculative = {h: at for h, at in speculative.items() if at > now}
        if operation == "speculate":
            index.speculate("w0", prompt[: first + count], (first + count) * B, expires_at=now + 3)
            for h in prompt[: first + count]:
                if h not in real:
                    speculative[h] = now + 3
        elif operation == "store":
            index.apply(record(now, 0, stored([h for h in blocks if h not in real], 0)))
            real |= set(blocks)
            speculative = {h: at for h, at in speculative.items() if h not in blocks}
        elif operation == "remove":
            index.apply(record(now, 0, removed(blocks, 0)))  # some held, some not
            real -= set(blocks)
            speculative = {h: at for h, at in speculative.items() if h not in blocks}
        elif operation == "clear":
            index.apply(record(now, 0, AllBlocksCleared()))
            real, speculative = set(), {}
        hit = only(index.score(prompt, len(prompt) * B))
        assert hit.hit_tokens == _prefix(prompt, real) * B
        assert hit.speculative_hit_tokens == _prefix(prompt, real | set(speculative)) * B
        assert index.workers()[0].speculative_blocks == len(speculative)


def _prefix(prompt: list[int], held: set[int]) -> int:
    """Blocks of the longest held prefix, at most all but the last (its token is computed)."""
    return next((i for i, h in enumerate(prompt[:-1]) if h not in held), len(prompt) - 1)
