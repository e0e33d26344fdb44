"""The run's story without Grafana: PNG plots and one HTML page that shows them with the summary.

- ``residency.png``: resident blocks per worker and cache group over time: the sliding-window
  groups hold fewer blocks than full attention once the cache is under pressure;
- ``evictions.png``: block removals per second, all of them and those of sliding-window copies
  whose full-attention copy stays (what a group-blind index gets wrong);
- ``hits.png``: predicted against real prefix hits, HMA-aware and group-blind;
- ``pipeline.png``: events per second per engine, records forwarded and applied, and the event
  age (engine batch to index apply) over the run;
- ``routers.png``: the summary's routing comparison: the share of prompt tokens each router's
  choices found cached, per simulated fleet, with its TTFT p99.

matplotlib draws off-screen (Agg), so no display is needed.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from hmakv.demo.comparison import RoutingComparison
from hmakv.demo.monitor import INDEX, Tick, rate
from hmakv.demo.probe import ProbeStats
from hmakv.demo.promtext import bucket_difference, bucket_quantile
from hmakv.demo.summary import Summary, encode_json, render_text

PLOTS = ("residency.png", "evictions.png", "hits.png", "pipeline.png", "routers.png")
AGE_HISTOGRAM = f"{INDEX}_event_age_seconds"
_DPI = 110


def write_report(
    directory: Path, summary: Summary, ticks: Sequence[Tick], stats: ProbeStats
) -> Path:
    """Write the plots and ``report.html`` into ``directory``; returns the HTML page's path."""
    directory.mkdir(parents=True, exist_ok=True)
    workers = [engine.worker for engine in summary.engines]
    _save(_residency(ticks, workers), directory / "residency.png")
    _save(_evictions(ticks), directory / "evictions.png")
    _save(_hits(stats), directory / "hits.png")
    _save(_pipeline(ticks, workers), directory / "pipeline.png")
    _save(_routers(summary.routing_comparison), directory / "routers.png")
    page = directory / "report.html"
    page.write_text(_html(summary))
    return page


def _save(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI)
    plt.close(figure)


def _times(ticks: Sequence[Tick]) -> list[float]:
    return [tick.at_s for tick in ticks]


def _residency(ticks: Sequence[Tick], workers: list[str]) -> Figure:
    figure, axes = plt.subplots(len(workers), 1, figsize=(9, 3.2 * len(workers)), squeeze=False)
    for axis, worker in zip(axes[:, 0], workers, strict=True):
        groups = sorted({g for tick in ticks for g in tick.resident(worker)}, key=_group_number)
        for group in groups:
            values = [tick.resident(worker).get(group, 0.0) for tick in ticks]
            axis.plot(_times(ticks), values, label=group, linestyle=_line_style(group))
        _label(axis, f"{worker}: resident blocks per cache group", "blocks")
    return figure


def _group_number(label: str) -> int:
    number = label.split(" ", 1)[0].lstrip("g")
    return int(number) if number.isdigit() else 1 << 30


def _line_style(group_label: str) -> str:
    return "-" if "full" in group_label else "--"


def _per_interval(ticks: Sequence[Tick], value: Callable[[Tick], float]) -> list[float]:
    """Per-second rates between consecutive ticks, placed at the later tick."""
    return [rate(later, earlier, value) for earlier, later in itertools.pairwise(ticks)]


def _evictions(ticks: Sequence[Tick]) -> Figure:
    figure, axis = plt.subplots(figsize=(9, 3.6))
    times = _times(ticks)[1:]
    by_kind = ticks[-1].removed_by_kind() if ticks else None
    if by_kind:
        for kind in sorted(by_kind):
            axis.plot(times, _per_interval(ticks, _kind_removed(kind)), label=f"{kind} removals")
    else:
        axis.plot(times, _per_interval(ticks, Tick.removed), label="all block removals")
    axis.plot(
        times,
        _per_interval(ticks, Tick.partial_evictions),
        label="sliding-window copy removed, full-attention copy kept",
        linestyle="--",
    )
    _label(axis, "Evictions: sliding window vs full attention", "blocks/s")
    return figure


def _kind_removed(kind: str) -> Callable[[Tick], float]:
    def removed(tick: Tick) -> float:
        return (tick.removed_by_kind() or {}).get(kind, 0.0)

    return removed


def _hits(stats: ProbeStats) -> Figure:
    figure, axis = plt.subplots(figsize=(6.4, 6.0))
    actual = [c.actual for c in stats.comparisons]
    axis.scatter(
        actual,
        [c.group_blind for c in stats.comparisons],
        marker="x",
        color="tab:orange",
        label=f"group-blind ({_share(stats.blind_agreeing, len(actual))} exact)",
    )
    axis.scatter(
        actual,
        [c.hma for c in stats.comparisons],
        marker="o",
        facecolors="none",
        edgecolors="tab:blue",
        label=f"HMA-aware ({_share(stats.hma_agreeing, len(actual))} exact)",
    )
    top = max([1, *actual, *(c.group_blind for c in stats.comparisons)])
    axis.plot([0, top], [0, top], color="grey", linewidth=0.8, label="predicted = real")
    axis.set_xlabel("real hit (engine lookup), tokens")
    _label(axis, "Predicted vs real prefix hits, same seq", "predicted hit, tokens")
    return figure


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _pipeline(ticks: Sequence[Tick], workers: list[str]) -> Figure:
    figure, (events, age) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    times = _times(ticks)[1:]
    for worker in workers:
        events.plot(times, _per_interval(ticks, _events_of(worker)), label=f"{worker} events/s")
    events.plot(times, _per_interval(ticks, Tick.records_forwarded), label="bridge records/s")
    events.plot(
        times, _per_interval(ticks, Tick.records_applied), label="index records/s", linestyle=":"
    )
    _label(events, "Throughput", "per second")
    events.set_xlabel("")
    for quantile in (0.5, 0.99):
        age.plot(times, _age_per_interval(ticks, quantile), label=f"p{quantile * 100:g}")
    _label(age, "Event age, engine batch to index apply", "seconds")
    return figure


def _age_per_interval(ticks: Sequence[Tick], quantile: float) -> list[float]:
    """The quantile of the ages observed between consecutive ticks (NaN: none observed)."""
    ages = []
    for earlier, later in itertools.pairwise(ticks):
        window = bucket_difference(
            later.index.buckets(AGE_HISTOGRAM), earlier.index.buckets(AGE_HISTOGRAM)
        )
        value = bucket_quantile(window, quantile)
        ages.append(math.nan if value is None else value)
    return ages


def _events_of(worker: str) -> Callable[[Tick], float]:
    def received(tick: Tick) -> float:
        return tick.events_received(worker)

    return received


def _routers(comparison: RoutingComparison | None) -> Figure:
    fleets = comparison.fleets if comparison else []
    figure, axes = plt.subplots(
        max(1, len(fleets)), 1, figsize=(9, 3.4 * max(1, len(fleets))), squeeze=False
    )
    if not fleets:
        axes[0, 0].text(0.5, 0.5, "no routing comparison in this run", ha="center")
        axes[0, 0].set_axis_off()
        return figure
    for axis, fleet in zip(axes[:, 0], fleets, strict=True):
        runs = fleet.runs[::-1]  # the first router on top
        shares = [100 * run.cached_share for run in runs]
        colours = ["tab:blue" if run.router.startswith("hmakv") else "tab:grey" for run in runs]
        axis.barh([run.router for run in runs], shares, color=colours)
        for row, run in enumerate(runs):
            p99 = "-" if run.ttft_p99_s is None else f"{run.ttft_p99_s * 1000:.1f} ms"
            axis.text(shares[row], row, f" {shares[row]:.1f}%, TTFT p99 {p99}", va="center")
        axis.set_xlim(0, 135)
        axis.set_xlabel("prompt tokens found cached, %")
        axis.set_title(
            f"This run's routed prompts behind each router: {fleet.engines} x {fleet.profile} "
            f"({fleet.num_blocks} blocks), simulated"
        )
        axis.grid(alpha=0.3, axis="x")
    return figure


def _label(axis: Axes, title: str, unit: str) -> None:
    axis.set_title(title)
    axis.set_ylabel(unit)
    if not axis.get_xlabel():
        axis.set_xlabel("seconds into the run")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small", loc="best")


def _html(summary: Summary) -> str:
    images = "\n".join(f'<p><img src="{name}" alt="{name}"></p>' for name in PLOTS)
    verdict = "passed" if summary.ok else "FAILED"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hmakv demo report</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}
pre{{background:#f4f4f4;padding:1em;overflow-x:auto}}img{{max-width:100%}}</style></head>
<body>
<h1>hmakv demo: {verdict}</h1>
<pre>{html.escape(render_text(summary))}</pre>
{images}
<h2>Summary JSON</h2>
<pre>{html.escape(encode_json(summary).decode())}</pre>
</body></html>
"""
