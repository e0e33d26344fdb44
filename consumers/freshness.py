"""How current the index is: its contact with Kafka, each worker's lag behind the bridge, and
what ``/readyz`` makes of them.

Why the index needs a view of its own: while Kafka is away the bridge cannot write worker
states, so every state the index holds goes on saying its worker is live and caught up while the
engines move on (issue 16: 91-136 seqs behind, ``/readyz`` 200, every worker ``live``). Two
things only the index can tell answer that:

- broker contact: when Kafka last answered it. An idle topic brings no records, so record
  arrival cannot be the signal: the follower asks Kafka for the log ends about once a second
  (``BrokerContact`` keeps when it last answered).
- a worker's lag: the seqs the bridge says it forwarded in the worker's current life that the
  index has not applied (``lag_seqs``).

A worker is stale when its lag passes ``max_worker_lag``, or when Kafka has been silent for
longer than ``max_broker_silence_s``: then the index cannot know how far any worker went, and
every one is stale. ``/readyz`` answers 503 while the index catches up or Kafka is silent
(``not_ready``). Workers that lag alone do not make it 503: each is marked stale where a router
reads it, and an index behind on every worker is one behind the log, which ``catching_up``
already says from the log ends.

Pure: plain values and an injected clock, no Kafka, so each rule is tested alone; the follower
asks Kafka and keeps the contact, the API and the exporter read the verdicts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from hmakv.kvlog.records import WorkerState

Clock = Callable[[], float]
# Why /readyz answers 503 (its ``reasons``): not caught up with the log yet (starting,
# restoring, rebalancing, or behind it), or Kafka silent past the limit.
NotReady = Literal["catching_up", "broker_silent"]

DEFAULT_MAX_BROKER_SILENCE_S = 10.0
# At vLLM's one batch per engine step, one to a few seconds of a busy engine's steps.
DEFAULT_MAX_WORKER_LAG = 100


@dataclass(frozen=True)
class FreshnessLimits:
    """When the index stops vouching for its answers: ``max_broker_silence_s`` without an answer
    from Kafka (every worker), ``max_worker_lag`` seqs behind the bridge (that worker)."""

    max_broker_silence_s: float = DEFAULT_MAX_BROKER_SILENCE_S
    max_worker_lag: int = DEFAULT_MAX_WORKER_LAG

    def __post_init__(self) -> None:
        silence = self.max_broker_silence_s
        if not (silence > 0 and math.isfinite(silence)):
            raise ValueError(f"max_broker_silence_s must be positive: {silence}")
        if self.max_worker_lag < 0:
            raise ValueError(f"max_worker_lag must not be negative: {self.max_worker_lag}")

    def silent(self, broker_silence_s: float) -> bool:
        """Whether Kafka has been silent too long for the index to vouch for any worker."""
        return broker_silence_s > self.max_broker_silence_s


class BrokerContact:
    """When Kafka last answered, on ``clock`` (seconds; monotonic unless a test gives its own).

    Before the first answer the silence counts from when the contact was made: an index that
    never reached Kafka has been without it since it started.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()

    def heard(self) -> None:
        self._last = self._clock()

    def silence_s(self) -> float:
        return max(0.0, self._clock() - self._last)


def lag_seqs(state: WorkerState | None, epoch: int, applied_seq: int) -> int | None:
    """Seqs the bridge forwarded (``state.last_seq``) that the index has not applied, in the
    index's life of the worker (``epoch``, its newest ``applied_seq``); None without a bridge
    state of that life, when there is nothing to compare with."""
    if state is None or state.epoch != epoch:
        return None
    return max(0, state.last_seq - applied_seq)


def behind(lag: int | None, max_worker_lag: int) -> bool:
    """Whether a worker's lag (``lag_seqs``) makes it stale; an unknown lag is no sign of it."""
    return lag is not None and lag > max_worker_lag


def record_age(ts: float | None, now: float) -> float | None:
    """Seconds from an engine's batch timestamp to ``now`` (never below 0: the engine's clock
    may run ahead); None without a record."""
    return None if ts is None else max(0.0, now - ts)


@dataclass(frozen=True)
class Freshness:
    """One reading, for one request or scrape: Kafka's silence and every known worker's lag
    (``lag_seqs``)."""

    broker_silence_s: float
    lags: Mapping[str, int | None]
    limits: FreshnessLimits

    @property
    def broker_silent(self) -> bool:
        return self.limits.silent(self.broker_silence_s)

    def stale(self, worker: str) -> bool:
        """Whether the index's answer for the worker may be behind what its engine holds; an
        unknown lag is no sign of being behind, a silent broker is one for every worker."""
        return self.broker_silent or behind(self.lags.get(worker), self.limits.max_worker_lag)

    def stale_workers(self) -> set[str]:
        if self.broker_silent:
            return set(self.lags)
        limit = self.limits.max_worker_lag
        return {worker for worker, lag in self.lags.items() if behind(lag, limit)}


def not_ready(*, caught_up: bool, freshness: Freshness) -> list[NotReady]:
    """Why ``/readyz`` answers 503, every reason that holds; none: 200."""
    reasons: list[NotReady] = []
    if not caught_up:
        reasons.append("catching_up")
    if freshness.broker_silent:
        reasons.append("broker_silent")
    return reasons
