"""Routing policies: where each request goes, given prefix estimates and the engines' load.

``ScoredRouter`` combines a prefix estimate with load the way llm-d's inference scheduler does
(its precise prefix-cache profile: ``precise-prefix-cache-scorer`` weight 3,
``kv-cache-utilization-scorer`` 2, ``queue-scorer`` 2, then ``max-score-picker``); each scorer
normalised as llm-d normalises it:

- prefix: workers with a predicted hit are scaled min-max to 0..1 (1.0 when they are equal);
  workers without one score 0;
- queue: ``(max - waiting) / (max - min)`` over the workers' waiting requests (1.0 when equal);
- KV cache: ``1 - usage``, the fraction of the worker's block pool in use.

``Weights`` sets the three weights (``BENCHMARKS.md`` shows the result under other choices);
ties go to a seeded random pick, as llm-d's picker shuffles. ``LeastLoaded`` and ``RoundRobin``
ignore prefixes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hmakv.producer.events import KVEventBatch
from hmakv.routing.estimates import PrefixEstimate, Prompt


@dataclass(frozen=True)
class EngineLoad:
    """What a router reads of one engine at decision time (vLLM's metrics)."""

    waiting: int
    running: int
    kv_usage: float


@dataclass(frozen=True)
class Choice:
    worker: int
    predicted_hit: int | None
    """The hit the router expects there, in tokens; None for a router that does not predict."""


class Router(Protocol):
    name: str

    def choose(self, prompt: Prompt, loads: Sequence[EngineLoad], now: float) -> Choice: ...

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None: ...


@dataclass(frozen=True)
class Weights:
    prefix: float = 3.0
    queue: float = 2.0
    kv_cache: float = 2.0


LLM_D_WEIGHTS = Weights()


class ScoredRouter:
    """A prefix estimate weighed against load, llm-d's way.

    ``affinity``, when given, breaks ties between the best-scored workers before the random
    pick: the worker it predicts the longest hit on wins (a routing history: where the prompt's
    prefix was sent before). A prompt that no worker holds then follows its prefix instead of
    landing anywhere, which keeps related prompts, and their future hits, together.
    """

    def __init__(
        self,
        name: str,
        estimate: PrefixEstimate,
        weights: Weights = LLM_D_WEIGHTS,
        *,
        seed: int,
        affinity: PrefixEstimate | None = None,
    ) -> None:
        self.name = name
        self.estimate = estimate
        self._weights = weights
        self._rng = random.Random(seed)
        self._affinity = affinity

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        self.estimate.observe(worker, batch, now)

    def choose(self, prompt: Prompt, loads: Sequence[EngineLoad], now: float) -> Choice:
        hits = self.estimate.hits(prompt, now)
        prefix = _prefix_scores(hits)
        queue = _queue_scores([load.waiting for load in loads])
        weights = self._weights
        totals = [
            weights.prefix * p + weights.queue * q + weights.kv_cache * (1.0 - load.kv_usage)
            for p, q, load in zip(prefix, queue, loads, strict=True)
        ]
        tied = _best(totals)
        if len(tied) > 1 and self._affinity is not None:
            held = self._affinity.hits(prompt, now)
            longest = max(held[worker] for worker in tied)
            tied = [worker for worker in tied if held[worker] == longest]
        worker = self._rng.choice(tied)
        self.estimate.routed(worker, prompt, now)
        if self._affinity is not None:
            self._affinity.routed(worker, prompt, now)
        return Choice(worker, hits[worker])


class LeastLoaded:
    """The engine with the fewest requests waiting or running."""

    name = "least-loaded"

    def __init__(self, *, seed: int) -> None:
        self._rng = random.Random(seed)

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        """Load only."""

    def choose(self, prompt: Prompt, loads: Sequence[EngineLoad], now: float) -> Choice:
        return Choice(self._rng.choice(_best([-(x.waiting + x.running) for x in loads])), None)


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        """Nothing to learn."""

    def choose(self, prompt: Prompt, loads: Sequence[EngineLoad], now: float) -> Choice:
        worker = self._next % len(loads)
        self._next += 1
        return Choice(worker, None)


def _prefix_scores(hits: Sequence[int]) -> list[float]:
    held = [hit for hit in hits if hit > 0]
    if not held:
        return [0.0] * len(hits)
    low, high = min(held), max(held)
    if low == high:
        return [1.0 if hit > 0 else 0.0 for hit in hits]
    return [(hit - low) / (high - low) if hit > 0 else 0.0 for hit in hits]


def _queue_scores(waiting: Sequence[int]) -> list[float]:
    low, high = min(waiting), max(waiting)
    if low == high:
        return [1.0] * len(waiting)
    return [(high - count) / (high - low) for count in waiting]


def _best(values: Sequence[float]) -> list[int]:
    """The indices of the largest value, every one where it ties."""
    top = max(values)
    return [index for index, value in enumerate(values) if value == top]
