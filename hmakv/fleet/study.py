"""``hmakv bench fleet``: for each fleet size, a fixed-rate run, a max-rate run and each hop alone.

The hops' ceilings (``ceilings.py``, and the index catching up alone) are measured in the same
run, on the same machine, with the same steps, so that every figure is a ratio: a hop's
efficiency is the max-rate run's throughput over that hop's ceiling, and the cost of a larger
fleet is its CPU per batch over the smallest fleet's at the same total rate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from hmakv.fleet.ceilings import Ceiling, append_ceiling, receive_ceiling
from hmakv.fleet.engines import RESIDENT_STEPS
from hmakv.fleet.run import PipelineRun, fetch_alone, index_alone, pipeline_run
from hmakv.fleet.services import PARTITIONS

TARGET_ENGINES = 16
TARGET_RATE = 5000.0
TARGET_P99_S = 0.1
TARGET_EFFICIENCY = 0.5
HOPS = ("receive", "append", "fetch", "index alone")


@dataclass(frozen=True)
class FleetPlan:
    engine_counts: tuple[int, ...] = (4, 16, 64)
    rate: float = TARGET_RATE  # batches/s, all engines together, in the fixed-rate runs
    duration_s: float = 10.0  # of publishing at that rate; the max-rate run publishes as much
    max_rate: bool = True  # and measure each hop alone
    partitions: int = PARTITIONS

    def steps(self, engine_count: int) -> int:
        """Per engine; enough for removals to start (every worker's state then is bounded)."""
        return max(RESIDENT_STEPS + 1, round(self.rate * self.duration_s / engine_count))


@dataclass
class FleetSize:
    """Everything measured with one number of engines."""

    engines: int
    fixed: PipelineRun
    max_rate: PipelineRun | None = None
    ceilings: dict[str, Ceiling] = field(default_factory=dict)

    def efficiency(self) -> dict[str, float]:
        """The max-rate run's throughput over each hop's ceiling."""
        if self.max_rate is None:
            return {}
        reached = self.max_rate.batches_per_s
        return {hop: reached / ceiling["batches_per_s"] for hop, ceiling in self.ceilings.items()}


def run_fleet(plan: FleetPlan, bootstrap: str) -> Iterator[FleetSize]:
    for engine_count in plan.engine_counts:
        steps = plan.steps(engine_count)
        size = FleetSize(engine_count, pipeline_run(bootstrap, engine_count, steps, plan.rate))
        if plan.max_rate:
            size.max_rate = run = pipeline_run(bootstrap, engine_count, steps, 0)
            size.ceilings = {
                "receive": receive_ceiling(engine_count, steps),
                "append": asyncio.run(
                    append_ceiling(bootstrap, engine_count, steps, plan.partitions)
                ),
                "fetch": fetch_alone(bootstrap, run),
                "index alone": index_alone(bootstrap, run),
            }
        yield size


def runs(sizes: list[FleetSize]) -> list[PipelineRun]:
    return [run for s in sizes for run in (s.fixed, s.max_rate) if run is not None]


def lossless(sizes: list[FleetSize]) -> bool:
    """Every run's index applied every step and holds exactly what the engines published."""
    return all(run.lost_seqs == 0 and not run.mismatches for run in runs(sizes))


def targets(sizes: list[FleetSize]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    for size in sizes:
        fixed = size.fixed
        if fixed.engines == TARGET_ENGINES and fixed.rate == TARGET_RATE:
            p99 = fixed.event_age.p99_s
            met[f"p99 event age {_ms(p99)} ms at {TARGET_RATE:,.0f}/s, 16 engines < 100 ms"] = (
                p99 is not None and p99 < TARGET_P99_S
            )
    met["zero loss, index state as expected"] = lossless(sizes)
    for size in sizes:
        for hop, ratio in size.efficiency().items():
            met[f"{size.engines} engines: {hop} {ratio:.2f} x its ceiling >= 0.5"] = (
                ratio >= TARGET_EFFICIENCY
            )
    return met


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def fleet_table(sizes: list[FleetSize]) -> str:
    header = (
        f"{'run':<22}{'batches/s':>11}{'blocks/s':>11}{'age p50':>9}{'p99':>8}{'max<=':>8}"
        f"{'warm p99':>9}{'bridge %':>9}{'us/b':>6}{'MiB':>5}{'index %':>8}{'us/b':>6}"
        f"{'MiB':>5}{'lost':>5}"
    )
    lines = [header, "-" * len(header)]
    for run in runs(sizes):
        how = f"{run.rate:,.0f}/s" if run.rate else "max"
        age = run.event_age
        lines.append(
            f"{f'{run.engines} engines, {how}':<22}{run.batches_per_s:>11,.0f}"
            f"{run.block_events_per_s:>11,.0f}{_ms(age.p50_s):>9}{_ms(age.p99_s):>8}"
            f"{_ms(age.max_le_s):>8}{_ms(age.warm_p99_s):>9}"
            f"{run.bridge.cpu_percent:>9.0f}{run.bridge.cpu_us_per_batch:>6.0f}"
            f"{run.bridge.peak_rss_mib:>5.0f}{run.index.cpu_percent:>8.0f}"
            f"{run.index.cpu_us_per_batch:>6.0f}{run.index.peak_rss_mib:>5.0f}"
            f"{run.lost_seqs + len(run.mismatches):>5}"
        )
    for run in runs(sizes):
        how = f"{run.rate:,.0f}/s" if run.rate else "max"
        cells = ", ".join(f"{hop} {_ms(q.p50_s)} / {_ms(q.p99_s)}" for hop, q in run.hops.items())
        lines.append(f"{run.engines} engines, {how}, hops p50 / p99 ms: {cells}")
    for size in sizes:
        if size.ceilings:
            cells = ", ".join(
                f"{hop} {c['batches_per_s']:,.0f}/s ({size.efficiency()[hop]:.2f}x)"
                for hop, c in size.ceilings.items()
            )
            lines.append(f"{size.engines} engines, each hop alone (max run / it): {cells}")
    base = sizes[0].fixed if sizes else None
    for size in sizes[1:]:
        assert base is not None
        fixed = size.fixed
        lines.append(
            f"{size.engines} engines / {base.engines} at the same rate: CPU per batch, bridge "
            f"{fixed.bridge.cpu_us_per_batch / base.bridge.cpu_us_per_batch:.2f}x, index "
            f"{fixed.index.cpu_us_per_batch / base.index.cpu_us_per_batch:.2f}x"
        )
    for run in runs(sizes):
        for mismatch in run.mismatches:
            lines.append(f"MISMATCH {run.engines} engines: {mismatch}")
    return "\n".join(lines)
