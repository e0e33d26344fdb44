"""Speculation against the reference engine: a prompt routed to a worker, scored again before
the worker's events arrive, gets the hit the engine really gives once it computed the prompt and
the index applied its events (what the feature is for), and those events confirm every block
the index speculated, so none is left to expire."""

from __future__ import annotations

import random

import pytest

from hmakv.bridge.fanout import fan_out
from hmakv.consumers.index import KVIndex
from hmakv.producer.engine import HybridCacheManager, get_profile
from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.hashing import BlockHasher, external
from hmakv.producer.recorder import EventRecorder

WORKER = "w0"


class Worker:
    """One engine and the index fed its batches as the bridge would cut them into records."""

    def __init__(self, profile_name: str) -> None:
        self.profile = get_profile(profile_name)
        groups = self.profile.groups
        self.manager = HybridCacheManager(self.profile, EventRecorder(groups))
        self.index = KVIndex(hash_block_size=hash_block_size(groups))
        self.index.set_catalog(WORKER, dict(enumerate(groups)))
        self.hasher = BlockHasher(self.profile.hash_fn, self.profile.hash_seed)
        self.seq = 0

    def hashes(self, tokens: list[int]) -> list[int]:
        size = self.index.hash_block_size
        return [external(digest) for digest in self.hasher.block_hashes(tokens, size)]

    def prefill(self, request_id: str, tokens: list[int], budget: int | None = None) -> None:
        """Run the prompt to its end, one scheduler step (of ``budget`` tokens at most) at a
        time, and finish it; each step's events are applied."""
        assert self.manager.admit(request_id, tokens, token_budget=budget) is not None
        self.apply_step()
        while self.manager.progress(request_id).num_computed_tokens < len(tokens):
            assert self.manager.schedule(request_id, token_budget=budget)
            self.apply_step()
        self.manager.finish(request_id)
        self.apply_step()

    def apply_step(self) -> None:
        batch = self.manager.end_step()
        if batch is None:
            return
        groups = range(len(self.profile.groups))
        for record in fan_out(WORKER, 0, self.seq, batch, groups):
            self.index.apply(record)
        self.seq += 1

    def score(self, tokens: list[int]) -> tuple[int, int]:
        """(confirmed hit, speculative hit) for the prompt."""
        (hit,) = self.index.score(self.hashes(tokens), len(tokens))
        assert hit.speculative_hit_tokens is not None
        return hit.hit_tokens, hit.speculative_hit_tokens


@pytest.mark.parametrize("profile", ["gpt-oss-like", "gemma3-like", "mamba-hybrid-like"])
@pytest.mark.parametrize("seed", range(4))
def test_the_speculative_hit_is_the_hit_the_engine_gives_once_its_events_are_applied(
    profile: str, seed: int
) -> None:
    rng = random.Random(seed)
    worker = Worker(profile)
    reach = 1024 if profile == "gemma3-like" else 200  # past every window
    shared = [rng.randrange(1000) for _ in range(rng.randint(reach // 2, reach))]
    worker.prefill("earlier", shared + [rng.randrange(1000) for _ in range(rng.randint(1, 40))])
    routed = shared + [rng.randrange(1000) for _ in range(rng.randint(reach // 2, 2 * reach))]
    follow_up = routed + [rng.randrange(1000) for _ in range(rng.randint(1, 80))]
    before, _ = worker.score(follow_up)

    worker.index.speculate(WORKER, worker.hashes(routed), len(routed), expires_at=2.0)
    confirmed, speculative = worker.score(follow_up)
    assert confirmed == before and speculative > confirmed

    worker.prefill("routed", routed)
    engine_hit = worker.manager.lookup(follow_up)
    assert speculative == engine_hit == worker.score(follow_up)[0]
    assert worker.index.workers()[0].speculative_blocks == 0  # every one confirmed
    counters = worker.index.counters
    assert counters.speculation_confirmed == counters.speculated > 0


@pytest.mark.parametrize("seed", range(6))
def test_given_the_chunk_size_mamba_states_where_chunks_stop_are_held_too(seed: int) -> None:
    """A mamba engine caches a state where each prefill chunk stops, not only at the prompt's
    end: a prompt branching off the routed one mid-way hits the last of those before it. Told
    the engine's budget, the index speculates them all, from the worker's hit for the prompt;
    without it, only the last, so the branch's speculative hit falls short."""
    rng = random.Random(seed)
    budget = rng.choice([128, 256, 320])
    worker = Worker("mamba-hybrid-like")
    shared = [rng.randrange(1000) for _ in range(rng.randint(500, 1200))]
    routed = shared + [rng.randrange(1000) for _ in range(rng.randint(100, 400))]
    branch = shared + [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
    if seed % 2:  # the routed prompt's prefill then starts from a hit
        worker.prefill("earlier", shared[: rng.randint(64, 400)])
    hashes = worker.hashes(routed)

    worker.index.speculate(WORKER, hashes, len(routed), expires_at=2.0)
    _, last_state_only = worker.score(branch)
    worker.index.expire_speculation(3.0)
    worker.index.speculate(WORKER, hashes, len(routed), expires_at=4.0, prefill_chunk_tokens=budget)
    _, speculative = worker.score(branch)

    worker.prefill("routed", routed, budget)
    engine_hit = worker.manager.lookup(branch)
    assert speculative == engine_hit == worker.score(branch)[0]
    assert last_state_only < engine_hit
    assert worker.index.workers()[0].speculative_blocks == 0  # every one confirmed
