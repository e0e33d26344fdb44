"""One fleet run: stand-in engines -> ``hmakv bridge`` -> Apache Kafka -> ``hmakv index``.

Each run has fresh topics and fresh services. The clock starts when the engines start publishing
and stops when the index has applied every engine's last step in both groups (polled every
``POLL_S``). Event age is the index's own ``hmakv_index_event_age_seconds`` (engine batch
timestamp to applied), interpolated in its buckets; "warm" leaves out what was applied in the
first ``WARMUP_S`` seconds (the broker's JIT, the topics' first segments). Loss is checked
against the state an index must hold once every event is applied (``ExpectedState``): each
worker's last seq and resident blocks per group, and the index's store and removal counters.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from hmakv.demo.promtext import MetricsPage, bucket_difference, bucket_quantile
from hmakv.fleet.ceilings import Ceiling, fetch_ceiling
from hmakv.fleet.engines import GROUPS, EngineSpec, ExpectedState, engines
from hmakv.fleet.services import ServiceProcess, bridge_service, index_service
from hmakv.kafka import unique_topic
from hmakv.kvlog.answers import WorkersResponse
from hmakv.kvlog.records import Topics

WARMUP_S = 2.0
POLL_S = 0.25
RUN_TIMEOUT_S = 600.0
EVENT_AGE = "hmakv_index_event_age_seconds"
GAPS = "hmakv_bridge_gaps_detected_total"
# The event age's hops, each a histogram of the service that sees it.
BRIDGE_HOPS = {
    "engine -> bridge": "hmakv_bridge_intake_age_seconds",
    "bridge -> Kafka ack": "hmakv_bridge_kafka_send_latency_seconds",
}
INDEX_HOPS = {"Kafka -> index fetch": "hmakv_index_fetch_age_seconds"}
Buckets = list[tuple[float, float]]


@dataclass(frozen=True)
class EventAge:
    """Seconds; ``max_le_s``: the bound of the highest bucket holding an observation."""

    p50_s: float | None
    p99_s: float | None
    max_le_s: float | None
    warm_p50_s: float | None
    warm_p99_s: float | None

    @classmethod
    def of(cls, run: Buckets, warm: Buckets | None) -> EventAge:
        """From the run's buckets and those after its warm-up (None: it was shorter)."""
        total = run[-1][1] if run else 0.0
        max_le = next((bound for bound, count in run if total and count >= total), None)
        return cls(
            p50_s=bucket_quantile(run, 0.5),
            p99_s=bucket_quantile(run, 0.99),
            max_le_s=max_le,
            warm_p50_s=None if warm is None else bucket_quantile(warm, 0.5),
            warm_p99_s=None if warm is None else bucket_quantile(warm, 0.99),
        )


@dataclass(frozen=True)
class Hop:
    p50_s: float | None
    p99_s: float | None


def _histograms(page: MetricsPage, names: dict[str, str]) -> dict[str, Buckets]:
    return {hop: page.buckets(name) for hop, name in names.items()}


def _hops(after: dict[str, Buckets], before: dict[str, Buckets]) -> dict[str, Hop]:
    hops = {}
    for hop, buckets in after.items():
        run = bucket_difference(buckets, before[hop])
        hops[hop] = Hop(bucket_quantile(run, 0.5), bucket_quantile(run, 0.99))
    return hops


@dataclass(frozen=True)
class ServiceCost:
    cpu_percent: float
    cpu_us_per_batch: float
    peak_rss_mib: float


@dataclass(frozen=True)
class PipelineRun:
    engines: int
    steps: int
    rate: float  # batches/s, all engines together; 0: as fast as they publish
    seconds: float
    batches_per_s: float
    block_events_per_s: float
    event_age: EventAge
    hops: dict[str, Hop]
    bridge: ServiceCost
    index: ServiceCost
    gaps_detected: float
    lost_seqs: int
    mismatches: list[str] = field(default_factory=list)
    topic_prefix: str = ""


def state_mismatches(
    workers: WorkersResponse, index: MetricsPage, specs: list[EngineSpec], steps: int
) -> tuple[int, list[str]]:
    """Seqs the index never applied, and every way its state differs from ``ExpectedState``."""
    expected = ExpectedState.of(len(specs), steps)
    views = {view.worker: view for view in workers.workers}
    lost = 0
    mismatches: list[str] = []
    for spec in specs:
        view = views.get(spec.name)
        if view is None:
            lost += steps * len(GROUPS)
            mismatches.append(f"{spec.name}: unknown to the index")
            continue
        for group, _, _ in GROUPS:
            lost += max(0, steps - view.last_seq.get(group, 0))
            resident = view.resident_blocks.get(group, {}).get("GPU", 0)
            if resident != expected.resident_per_group:
                mismatches.append(
                    f"{spec.name} group {group}: {resident} blocks resident, "
                    f"expected {expected.resident_per_group}"
                )
    for counter, want in (
        ("hmakv_index_blocks_stored_total", expected.blocks_stored),
        ("hmakv_index_blocks_removed_total", expected.blocks_removed),
        ("hmakv_index_removal_anomalies_total", 0),
    ):
        got = index.total(counter)
        if got != want:
            mismatches.append(f"{counter} {got:.0f}, expected {want}")
    return lost, mismatches


def _workers(index: ServiceProcess) -> WorkersResponse:
    return msgspec.json.decode(index.get("/v1/workers"), type=WorkersResponse)


def _applied_all(workers: WorkersResponse, count: int, steps: int) -> bool:
    done = [
        all(view.last_seq.get(group, -1) >= steps for group, _, _ in GROUPS)
        for view in workers.workers
    ]
    return len(done) == count and all(done)


def _wait_for_workers(index: ServiceProcess, count: int) -> None:
    """Until the index knows every engine (its start-up clear applied)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(_workers(index).workers) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the index never saw all {count} engines start")
        time.sleep(POLL_S)


def _cost(cpu_seconds: float, seconds: float, batches: int, rss: float) -> ServiceCost:
    return ServiceCost(100 * cpu_seconds / seconds, 1e6 * cpu_seconds / batches, rss)


def pipeline_run(bootstrap: str, engine_count: int, steps: int, rate: float) -> PipelineRun:
    """``steps`` steps of each of ``engine_count`` engines at ``rate`` batches/s in all (0: as
    fast as they publish), through one bridge and one index."""
    prefix = unique_topic("fleet")
    batches = engine_count * steps
    with engines(engine_count, steps, rate / engine_count) as (specs, go):
        bridge = bridge_service(bootstrap, prefix, specs)
        index: ServiceProcess | None = None
        try:
            bridge.wait_ready()
            index = index_service(bootstrap, prefix)
            index.wait_ready()
            _wait_for_workers(index, engine_count)
            # The start-up clears were published before the services started: not the load.
            index_before, bridge_before = index.metrics(), bridge.metrics()
            hops_before = _histograms(bridge_before, BRIDGE_HOPS)
            hops_before |= _histograms(index_before, INDEX_HOPS)
            cpu_before = bridge.cpu_seconds(), index.cpu_seconds()
            started = time.monotonic()
            go.set()
            warm_from = _wait_applied(index, engine_count, steps, started)
            seconds = time.monotonic() - started
            bridge_cpu = bridge.cpu_seconds() - cpu_before[0]
            index_cpu = index.cpu_seconds() - cpu_before[1]
            index_page, bridge_page = index.metrics(), bridge.metrics()
            ages = index_page.buckets(EVENT_AGE)
            hops_after = _histograms(bridge_page, BRIDGE_HOPS)
            hops_after |= _histograms(index_page, INDEX_HOPS)
            lost, mismatches = state_mismatches(_workers(index), index_page, specs, steps)
            bridge_rss, index_rss = bridge.peak_rss_mib(), index.peak_rss_mib()
        finally:
            if index is not None:
                index.stop()
            bridge.stop()
    expected = ExpectedState.of(engine_count, steps)
    return PipelineRun(
        engines=engine_count,
        steps=steps,
        rate=rate,
        seconds=seconds,
        batches_per_s=batches / seconds,
        block_events_per_s=(expected.blocks_stored + expected.blocks_removed) / seconds,
        event_age=EventAge.of(
            bucket_difference(ages, index_before.buckets(EVENT_AGE)),
            None if warm_from is None else bucket_difference(ages, warm_from),
        ),
        hops=_hops(hops_after, hops_before),
        bridge=_cost(bridge_cpu, seconds, batches, bridge_rss),
        index=_cost(index_cpu, seconds, batches, index_rss),
        gaps_detected=bridge_page.total(GAPS) - bridge_before.total(GAPS),
        lost_seqs=lost,
        mismatches=mismatches,
        topic_prefix=prefix,
    )


def _wait_applied(
    index: ServiceProcess, engine_count: int, steps: int, started: float
) -> Buckets | None:
    """Until the index applied every step; the event-age buckets at the end of the warm-up
    (None if it applied everything sooner)."""
    warm_from: Buckets | None = None
    while not _applied_all(_workers(index), engine_count, steps):
        elapsed = time.monotonic() - started
        if warm_from is None and elapsed >= WARMUP_S:
            warm_from = index.metrics().buckets(EVENT_AGE)
        if elapsed > RUN_TIMEOUT_S:
            raise RuntimeError(f"the index had not applied every step after {elapsed:.0f} s")
        time.sleep(POLL_S)
    return warm_from


def index_alone(bootstrap: str, run: PipelineRun) -> Ceiling:
    """A fresh index reading a finished run's topics from their beginning, nothing else
    running: the index hop's own ceiling, everything it does included."""
    index = index_service(bootstrap, run.topic_prefix)
    try:
        index.wait_up()  # its API serves before its follower starts
        started, cpu_before = time.monotonic(), index.cpu_seconds()
        while not _applied_all(_workers(index), run.engines, run.steps):
            if time.monotonic() - started > RUN_TIMEOUT_S:
                raise RuntimeError("the index did not catch up")
            time.sleep(POLL_S / 5)
        seconds = time.monotonic() - started
        cpu = index.cpu_seconds() - cpu_before
    finally:
        index.stop()
    batches = run.engines * run.steps
    return {
        "batches_per_s": batches / seconds,
        "seconds": seconds,
        "cpu_us_per_batch": 1e6 * cpu / batches,
    }


def fetch_alone(bootstrap: str, run: PipelineRun) -> Ceiling:
    """The bare consumer over a finished run's events topic (every record but the clears)."""
    records = run.engines * run.steps * len(GROUPS)
    return asyncio.run(fetch_ceiling(bootstrap, Topics(run.topic_prefix).events, records))
