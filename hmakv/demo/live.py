"""Live progress: a compact view redrawn in place on a terminal, plain lines anywhere else.

Both show the same numbers (events/s per engine, records/s through the bridge, index lag,
resident blocks per worker and group, routing agreement so far); the plain form is one line per
interval so logs and CI output stay readable.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from hmakv.demo.monitor import Monitor, Tick, rate
from hmakv.demo.probe import ProbeStats

RATE_WINDOW_S = 5.0
REFRESH_S = 1.0
_CLEAR_BELOW = "\x1b[J"


def percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def _short(count: float) -> str:
    return f"{count / 1000:.1f}k" if count >= 10_000 else f"{count:.0f}"


def _events_rate(latest: Tick, earlier: Tick, worker: str) -> float:
    def received(tick: Tick) -> float:
        return tick.events_received(worker)

    return rate(latest, earlier, received)


class LiveView:
    """Renders the monitor's latest ticks and the probe's stats, every ``interval_s``."""

    def __init__(
        self,
        monitor: Monitor,
        stats: ProbeStats,
        workers: Sequence[str],
        *,
        clock: Callable[[], float],
        duration_s: float,
        refresh: bool,
        interval_s: float,
        out: TextIO = sys.stdout,
    ) -> None:
        self._monitor = monitor
        self._stats = stats
        self._workers = list(workers)
        self._clock = clock
        self._duration_s = duration_s
        self._refresh = refresh
        self._interval_s = REFRESH_S if refresh else interval_s
        self._out = out
        self._drawn_lines = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with asyncio.timeout(self._interval_s):
                    await stop.wait()
            except TimeoutError:
                self.show()

    def show(self) -> None:
        if self._refresh:
            self._redraw(self.panel())
        else:
            print(self.line(), file=self._out, flush=True)

    def finish(self) -> None:
        """Leave the last panel on screen and move below it."""
        self._drawn_lines = 0

    def _redraw(self, lines: list[str]) -> None:
        """Replace the previous panel; lines are cut to the terminal so none wraps (a wrapped
        line would throw off how far the cursor moves up next time)."""
        width = max(20, shutil.get_terminal_size().columns - 1)
        up = f"\x1b[{self._drawn_lines}F" if self._drawn_lines else ""
        self._out.write(up + _CLEAR_BELOW + "\n".join(line[:width] for line in lines) + "\n")
        self._out.flush()
        self._drawn_lines = len(lines)

    def line(self) -> str:
        """One plain progress line."""
        parts = [f"[{self._clock():5.1f}s]"]
        window = self._monitor.window(RATE_WINDOW_S)
        if window is not None:
            latest, earlier = window
            for worker in self._workers:
                events = _events_rate(latest, earlier, worker)
                blocks = _blocks_by_kind(latest.resident(worker)) or "no blocks yet"
                parts.append(f"{worker} {events:.0f} ev/s, blocks {blocks}")
            parts.append(f"bridge {rate(latest, earlier, Tick.records_forwarded):.0f} rec/s")
            parts.append(
                f"index lag {latest.lag_records():.0f}, evicted {latest.removed():.0f}"
                f" (SWA-only {latest.partial_evictions():.0f})"
            )
        parts.append(self._routing_counts() + ": " + self._agreement())
        return " | ".join(parts)

    def panel(self) -> list[str]:
        """The refreshing view: a header, two lines per engine, then pipeline and routing."""
        lines = [
            f"hmakv demo  {self._clock():5.1f} s of {self._duration_s:.0f} s  (Ctrl-C ends it)"
        ]
        window = self._monitor.window(RATE_WINDOW_S)
        if window is not None:
            latest, earlier = window
            for worker in self._workers:
                lines.extend(self._engine_lines(worker, latest, earlier))
            lines += [
                f"  bridge    {rate(latest, earlier, Tick.records_forwarded):.0f} records/s to "
                f"Kafka, gaps {latest.bridge.total('hmakv_bridge_gaps_detected_total'):.0f} "
                f"({latest.bridge.total('hmakv_bridge_gaps_unrecoverable_total'):.0f} "
                "unrecoverable)",
                f"  index     {rate(latest, earlier, Tick.records_applied):.0f} records/s "
                f"applied, lag {latest.lag_records():.0f}, evictions "
                f"{rate(latest, earlier, Tick.removed):.0f}/s "
                f"(SWA-only {rate(latest, earlier, Tick.partial_evictions):.0f}/s)",
            ]
        else:
            lines.append("  waiting for the first samples...")
        return [*lines, f"  routing   {self._routing_counts()}", f"            {self._agreement()}"]

    def _engine_lines(self, worker: str, latest: Tick, earlier: Tick) -> list[str]:
        status = latest.engines.get(worker)
        profile = status.profile if status else "?"
        seq = status.seq if status else -1
        events = _events_rate(latest, earlier, worker)
        return [
            f"  {worker:<9} {profile:<14} {events:5.0f} events/s  seq {seq}",
            f"            blocks {_blocks_by_kind(latest.resident(worker)) or 'none yet'}",
        ]

    def _routing_counts(self) -> str:
        stats = self._stats
        return f"{stats.probes} probes, {len(stats.comparisons)} compared, {stats.raced} raced"

    def _agreement(self) -> str:
        stats = self._stats
        compared = len(stats.comparisons)
        return (
            f"HMA-aware {percent(stats.hma_agreeing, compared)}, "
            f"group-blind {percent(stats.blind_agreeing, compared)}"
        )


_SHORT_KINDS = {"full_attention": "full", "sliding_window": "swa", "mamba": "mamba"}


def _blocks_by_kind(resident: dict[str, float]) -> str:
    """``full 214 | swa 214 214 214``: one number per group, groups of one kind together."""
    by_kind: dict[str, list[str]] = {}
    for label, blocks in resident.items():
        kind = label.split(" ", 1)[-1]
        by_kind.setdefault(_SHORT_KINDS.get(kind, kind), []).append(_short(blocks))
    return " | ".join(f"{kind} {' '.join(counts)}" for kind, counts in by_kind.items())
