"""Periodic samples of every service, and the rates and levels the live view and report show.

A sample is what the services publish themselves: the bridge's and the index's /metrics pages,
the index's /v1/workers and each engine's /v1/status. Rates are differences between two
samples, as Prometheus' ``rate()`` would compute them from its own scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hmakv.demo.client import EngineStatus, Http, IndexClient
from hmakv.demo.promtext import MetricsPage
from hmakv.kvlog.answers import WorkersResponse

log = logging.getLogger(__name__)

BRIDGE = "hmakv_bridge"
INDEX = "hmakv_index"


@dataclass(frozen=True)
class Tick:
    """Everything sampled at one moment (``at_s`` seconds into the run)."""

    at_s: float
    bridge: MetricsPage
    index: MetricsPage
    workers: WorkersResponse
    engines: dict[str, EngineStatus]

    def events_received(self, worker: str) -> float:
        """Known events received live (those forwarded): unknown types are skipped."""
        name = f"{BRIDGE}_events_received_total"
        return self.bridge.total(name, worker=worker) - self.bridge.total(
            name, worker=worker, type="unknown"
        )

    def records_forwarded(self) -> float:
        return self.bridge.total(f"{BRIDGE}_records_produced_total", topic="events")

    def records_applied(self) -> float:
        return self.index.total(f"{INDEX}_records_applied_total")

    def removed(self) -> float:
        return self.index.total(f"{INDEX}_blocks_removed_total")

    def partial_evictions(self) -> float:
        return self.index.total(f"{INDEX}_partial_evictions_total")

    def lag_records(self) -> float:
        return self.index.total(f"{INDEX}_consumer_lag_records")

    def resident(self, worker: str) -> dict[str, float]:
        """Resident blocks per group (``"g<idx> <kind>"``) for one worker, every medium summed."""
        by_group: dict[str, float] = {}
        for sample in self.index.matching(f"{INDEX}_resident_blocks", worker=worker):
            label = f"g{sample.labels.get('group', '?')} {sample.labels.get('kind', '?')}"
            by_group[label] = by_group.get(label, 0.0) + sample.value
        return dict(sorted(by_group.items(), key=lambda item: _group_order(item[0])))

    def removed_by_kind(self) -> dict[str, float] | None:
        """Block removals per group kind, if the index exports them by kind."""
        samples = self.index.matching(f"{INDEX}_blocks_removed_total")
        if not samples or not any("kind" in sample.labels for sample in samples):
            return None
        by_kind: dict[str, float] = {}
        for sample in samples:
            kind = sample.labels.get("kind", "unknown")
            by_kind[kind] = by_kind.get(kind, 0.0) + sample.value
        return by_kind


def _group_order(label: str) -> int:
    number = label.split(" ", 1)[0].lstrip("g")
    return int(number) if number.isdigit() else 1 << 30


def rate(later: Tick, earlier: Tick, value: Callable[[Tick], float]) -> float:
    """Per-second increase of a counter between two ticks (0 when they coincide)."""
    elapsed = later.at_s - earlier.at_s
    if elapsed <= 0:
        return 0.0
    return max(0.0, value(later) - value(earlier)) / elapsed


class StatusSource(Protocol):
    """An engine as the monitor reads it: a reference engine's API, or a vLLM witness."""

    @property
    def name(self) -> str: ...

    async def status(self) -> EngineStatus: ...


@dataclass
class Monitor:
    """Samples every ``interval_s`` into ``ticks`` until stopped; a failed sample is skipped."""

    http: Http
    bridge_url: str
    index: IndexClient
    engines: Sequence[StatusSource]
    clock: Callable[[], float]
    interval_s: float
    ticks: list[Tick] = field(default_factory=list)
    failures: int = 0

    async def sample(self, *, engines_running: bool = True) -> Tick:
        """One tick; once the engines are stopped their last answered status is kept."""
        engines = self.engines if engines_running else []
        bridge_text, index_text, workers = await asyncio.gather(
            self.http.text(f"{self.bridge_url}/metrics"),
            self.http.text(f"{self.index.base_url}/metrics"),
            self.index.workers(),
        )
        statuses = await asyncio.gather(*(engine.status() for engine in engines))
        known = dict(self.latest.engines) if self.latest else {}
        known.update(
            (engine.name, status) for engine, status in zip(engines, statuses, strict=True)
        )
        tick = Tick(
            at_s=self.clock(),
            bridge=MetricsPage.parse(bridge_text),
            index=MetricsPage.parse(index_text),
            workers=workers,
            engines=known,
        )
        self.ticks.append(tick)
        return tick

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sample()
            except Exception as error:  # a slow or restarting service must not end the demo
                self.failures += 1
                log.debug("sample failed: %s", error)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()

    @property
    def latest(self) -> Tick | None:
        return self.ticks[-1] if self.ticks else None

    def window(self, seconds: float) -> tuple[Tick, Tick] | None:
        """The latest tick and the oldest one at most ``seconds`` older (for rates)."""
        if len(self.ticks) < 2:
            return None
        latest = self.ticks[-1]
        earlier = next(
            (tick for tick in self.ticks if latest.at_s - tick.at_s <= seconds), self.ticks[-2]
        )
        if earlier is latest:
            earlier = self.ticks[-2]
        return latest, earlier
