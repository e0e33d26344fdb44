"""The routing policies: llm-d's scorers, normalised as llm-d normalises them, and the baselines."""

from __future__ import annotations

from hmakv.producer.events import KVEventBatch
from hmakv.routing.estimates import Prompt
from hmakv.routing.policies import (
    EngineLoad,
    LeastLoaded,
    RoundRobin,
    ScoredRouter,
    Weights,
)

PROMPT = Prompt(num_tokens=100, block_hashes=(1, 2, 3, 4, 5, 6))
IDLE = EngineLoad(waiting=0, running=0, kv_usage=0.0)


class FixedHits:
    """An estimate that predicts given hits and remembers where prompts were routed."""

    def __init__(self, hits: list[int]) -> None:
        self._hits = hits
        self.routed_to: list[int] = []

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        """Nothing to learn."""

    def routed(self, worker: int, prompt: Prompt, now: float) -> None:
        self.routed_to.append(worker)

    def hits(self, prompt: Prompt, now: float) -> list[int]:
        return list(self._hits)


def test_the_longest_predicted_hit_wins_among_equally_loaded_engines() -> None:
    estimate = FixedHits([16, 64, 32, 0])
    router = ScoredRouter("r", estimate, seed=0)
    choice = router.choose(PROMPT, [IDLE] * 4, 0.0)
    assert (choice.worker, choice.predicted_hit) == (1, 64)
    assert estimate.routed_to == [1]


def test_load_outweighs_a_small_prefix_edge_at_llm_d_weights() -> None:
    """Prefix scores are min-max scaled: 64 vs 48 tokens is 1.0 vs 0.0, worth 3; a full queue
    against an empty one is worth 2 and a full pool against an empty one 2 more."""
    loads = [EngineLoad(8, 4, 1.0), EngineLoad(0, 0, 0.0)]
    assert ScoredRouter("r", FixedHits([64, 48]), seed=0).choose(PROMPT, loads, 0.0).worker == 1
    half = [EngineLoad(8, 4, 0.5), EngineLoad(0, 0, 0.5)]
    assert ScoredRouter("r", FixedHits([64, 48]), seed=0).choose(PROMPT, half, 0.0).worker == 0


def test_a_prefix_weight_of_zero_leaves_only_load() -> None:
    loads = [EngineLoad(3, 0, 0.2), EngineLoad(1, 0, 0.2), EngineLoad(2, 0, 0.2)]
    router = ScoredRouter("r", FixedHits([96, 0, 0]), Weights(prefix=0.0), seed=0)
    assert router.choose(PROMPT, loads, 0.0).worker == 1


def test_ties_are_broken_at_random_but_reproducibly() -> None:
    def picks(seed: int) -> list[int]:
        router = ScoredRouter("r", FixedHits([0, 0, 0, 0]), seed=seed)
        return [router.choose(PROMPT, [IDLE] * 4, 0.0).worker for _ in range(40)]

    assert picks(1) == picks(1)
    assert set(picks(1)) == {0, 1, 2, 3}


def test_least_loaded_counts_waiting_and_running_and_predicts_nothing() -> None:
    loads = [EngineLoad(1, 3, 0.0), EngineLoad(2, 1, 0.9), EngineLoad(0, 5, 0.0)]
    choice = LeastLoaded(seed=0).choose(PROMPT, loads, 0.0)
    assert (choice.worker, choice.predicted_hit) == (1, None)


def test_round_robin_cycles() -> None:
    router = RoundRobin()
    assert [router.choose(PROMPT, [IDLE] * 3, 0.0).worker for _ in range(7)] == [
        0,
        1,
        2,
        0,
        1,
        2,
        0,
    ]


def test_affinity_breaks_a_tie_towards_where_the_prefix_went_before() -> None:
    history = FixedHits([0, 48, 16])
    router = ScoredRouter("r", FixedHits([0, 0, 0]), seed=0, affinity=history)
    choices = {router.choose(PROMPT, [IDLE] * 3, 0.0).worker for _ in range(20)}
    assert choices == {1}
    assert history.routed_to == [1] * 20


def test_affinity_never_overrules_a_better_score() -> None:
    router = ScoredRouter("r", FixedHits([0, 32, 0]), seed=0, affinity=FixedHits([96, 0, 0]))
    assert router.choose(PROMPT, [IDLE] * 3, 0.0).worker == 1
