"""How long a routed prompt's blocks stay speculatively held: long enough for the engine's events
to arrive, no longer.

A speculative entry that outlives the events it stands for only delays a removal the index has
already applied (the removal drops it), but one that lives on after a routed request failed
before caching anything promises blocks nobody holds. So its TTL follows the event lag this
index measures (engine record timestamp to applied): ``multiplier`` times the recent p99,
within ``[floor_s, ceiling_s]``; until a lag is measured, llm-d's 2 s default. A fixed TTL
(``--speculative-ttl SECONDS``) replaces the measurement. Pure: lags are handed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_TTL_S = 2.0  # llm-d's speculative indexing default, before any lag is measured
DEFAULT_FLOOR_S = 1.0  # the lag leaves out the prefill itself, which a routed prompt waits for
DEFAULT_CEILING_S = 30.0
DEFAULT_MULTIPLIER = 2.0
LAG_SAMPLES = 1024  # the recent lags the p99 is taken over


@dataclass(frozen=True)
class TtlLimits:
    """The measured TTL's bounds and multiplier; a request's own TTL is capped at the ceiling."""

    floor_s: float = DEFAULT_FLOOR_S
    ceiling_s: float = DEFAULT_CEILING_S
    multiplier: float = DEFAULT_MULTIPLIER

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s < math.inf:
            raise ValueError(f"need 0 < floor_s <= ceiling_s: {self.floor_s}, {self.ceiling_s}")
        if not self.multiplier > 0:
            raise ValueError(f"multiplier must be positive: {self.multiplier}")


class SpeculationTtl:
    """The TTL of a speculative entry now: ``fixed_s``, or one that follows the recent lag."""

    def __init__(self, fixed_s: float | None = None, limits: TtlLimits = TtlLimits()) -> None:
        if fixed_s is not None and not 0 < fixed_s < math.inf:
            raise ValueError(f"a fixed TTL must be positive: {fixed_s}")
        self.fixed_s = fixed_s
        self.limits = limits
        self._lags: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._measured: float | None = None  # the TTL from the lags, until another is observed

    def observe(self, lag_s: float) -> None:
        """One applied record's lag, engine timestamp to applied."""
        self._lags.append(max(0.0, lag_s))
        self._measured = None

    def ttl_s(self) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if not self._lags:
            return DEFAULT_TTL_S
        if self._measured is None:
            limits = self.limits
            wanted = limits.multiplier * _p99(self._lags)
            self._measured = min(max(wanted, limits.floor_s), limits.ceiling_s)
        return self._measured

    def for_request(self, asked_s: float | None) -> float:
        """The TTL of a request that may name its own: at most the ceiling (or the fixed TTL,
        when that is longer), so that no caller keeps blocks held indefinitely."""
        if asked_s is None:
            return self.ttl_s()
        return min(asked_s, max(self.limits.ceiling_s, self.fixed_s or 0.0))


def _p99(lags: deque[float]) -> float:
    ordered = sorted(lags)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
