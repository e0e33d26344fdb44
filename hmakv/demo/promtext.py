"""Reading a /metrics page: samples by name and labels, sums, and histogram quantiles.

The demo reads the services' own Prometheus endpoints rather than anything private, so what it
shows is what a dashboard would show. Parsing is prometheus_client's; this module only answers
the questions the demo asks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


class MetricsPage:
    """One scrape: every sample, looked up by its exposed name (counters end in ``_total``)."""

    def __init__(self, samples: Iterable[Sample] = ()) -> None:
        self._by_name: dict[str, list[Sample]] = {}
        for sample in samples:
            self._by_name.setdefault(sample.name, []).append(sample)

    @classmethod
    def parse(cls, text: str) -> MetricsPage:
        return cls(
            Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )

    def samples(self) -> Iterator[Sample]:
        for samples in self._by_name.values():
            yield from samples

    def has(self, name: str) -> bool:
        return name in self._by_name

    def matching(self, name: str, **labels: str) -> list[Sample]:
        return [
            sample
            for sample in self._by_name.get(name, [])
            if all(sample.labels.get(key) == value for key, value in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        """The sum over every sample of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(sample.value for sample in self.matching(name, **labels))

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Sums of ``name`` grouped by one label's value."""
        sums: dict[str, float] = {}
        for sample in self.matching(name, **labels):
            key = sample.labels.get(label, "")
            sums[key] = sums.get(key, 0.0) + sample.value
        return sums

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """Cumulative ``(le, count)`` pairs of a histogram, summed over its other labels."""
        sums: dict[float, float] = {}
        for sample in self.matching(f"{histogram}_bucket"):
            bound = float(sample.labels["le"])
            sums[bound] = sums.get(bound, 0.0) + sample.value
        return sorted(sums.items())


def bucket_quantile(buckets: list[tuple[float, float]], quantile: float) -> float | None:
    """PromQL's ``histogram_quantile``: linear interpolation inside the bucket holding the rank.

    None when nothing was observed. A rank in the +Inf bucket answers the largest finite bound,
    as Prometheus does.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = quantile * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_difference(
    later: list[tuple[float, float]], earlier: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The observations between two scrapes of one histogram (a rate window's buckets)."""
    before = dict(earlier)
    return [(bound, count - before.get(bound, 0.0)) for bound, count in later]
