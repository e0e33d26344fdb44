"""The plain counters the follower and the score API bump, and the exporter reads at scrape time.

They sit below everything that writes or reads them: the follower and the API import them to
count, ``metrics`` imports them (and those two) to turn them into Prometheus families, and
nothing here imports any of them. Bumping a counter is a bare int addition, no lock, because
everything that counts and scrapes runs on the one event loop thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from hmakv.kvlog.answers import GroupBlindAnswer

# Engine batch timestamp to applied: milliseconds when healthy, minutes when the bridge replays.
# Fine below 25 ms, where a healthy pipeline's figures fall (issue 18's targets: 5 and 25 ms).
EVENT_AGE_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
SCORE_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Buckets:
    """A histogram as bare counts: observing is a bisect and two additions.

    ``counts[i]`` counts the values at or below ``bounds[i]`` and above the bound before; the
    last one those above every bound.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass
class ScoreStats:
    """Score requests by outcome, their durations and what they answered, for the exporter.

    The HMA-aware and the group-blind answers' predicted hit tokens (each answer's best worker,
    0 without one), summed over answered requests, and how many requests the two answers named
    different best workers; routed-prompt notices by outcome; the router port's refusals.
    """

    requests: dict[str, int] = field(default_factory=lambda: {"ok": 0, "rejected": 0})
    duration: Buckets = field(default_factory=lambda: Buckets(SCORE_DURATION_BUCKETS))
    hma_hit_tokens: int = 0
    group_blind_hit_tokens: int = 0
    best_differs: int = 0
    routed: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "rejected": 0, "unknown_worker": 0}
    )
    # The router port's requests refused before a reply (by status), and its open connections.
    router_port_refused: dict[int, int] = field(default_factory=dict)
    router_port_connections: int = 0

    def record(self, outcome: str, seconds: float) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
        self.duration.observe(seconds)

    def record_answer(self, hma_hit_tokens: int, blind: GroupBlindAnswer, best: str | None) -> None:
        self.hma_hit_tokens += hma_hit_tokens
        self.group_blind_hit_tokens += blind.hit_tokens
        if blind.best != best:
            self.best_differs += 1

    def record_routed(self, outcome: str) -> None:
        """A ``POST /v1/routed``: ok, rejected (a bad request) or unknown_worker (404)."""
        self.routed[outcome] = self.routed.get(outcome, 0) + 1
