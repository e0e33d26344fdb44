"""The index's Prometheus exporter: one custom collector that reads everything at scrape time.

The apply loop only bumps plain ints (the index's own counters, the follower's stats, a bucket
array for the event age: ``stats``), and the collector turns them into metric families when
Prometheus scrapes. Updating prometheus_client gauges per event would take a lock per record and
make every worker/group/medium gauge a live object to keep in sync with the index. So this module
is a reader on top: it imports the follower and the counters, and nothing below imports it.

Labels are bounded by the fleet and its configuration: worker, group, kind, medium, health,
topic, reason, outcome. Never a block hash or a request detail.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Mapping

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hmakv.consumers.applier import IgnoredState
from hmakv.consumers.follower import Follower
from hmakv.consumers.freshness import not_ready
from hmakv.consumers.index import IndexCounters
from hmakv.consumers.stats import Buckets, ScoreStats
from hmakv.kvlog.records import HEALTH_STATES

PREFIX = "hmakv_index"
# Why the follower ignored a worker state: each exported, zero or not.
IGNORED_STATE_REASONS: tuple[IgnoredState, ...] = ("stale_epoch", "retired")


def _histogram(buckets: Buckets, name: str, documentation: str) -> HistogramMetricFamily:
    """Bare counts as Prometheus wants them: cumulative, one bucket per bound and +Inf."""
    cumulative: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*buckets.bounds, float("inf")), buckets.counts, strict=True):
        running += count
        cumulative.append((_le(bound), running))
    return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=buckets.total)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class IndexCollector(Collector):
    """Every ``hmakv_index_*`` metric, read from the follower, its index and the score API."""

    def __init__(self, follower: Follower, score_stats: ScoreStats) -> None:
        self._follower = follower
        self._score_stats = score_stats

    def collect(self) -> Iterator[Metric]:
        yield from self._index_families()
        yield from self._follower_families()
        yield from self._freshness_families()
        yield from self._snapshot_families()
        yield from self._score_families()
        yield GaugeMetricFamily(
            f"{PREFIX}_gc_frozen_objects",
            "Objects frozen out of the garbage collector (hmakv index freezes its heap once "
            "caught up: kvlog.heap)",
            value=gc.get_freeze_count(),
        )

    def _index_families(self) -> Iterator[Metric]:
        follower = self._follower
        counters = follower.index.counters
        resident = GaugeMetricFamily(
            f"{PREFIX}_resident_blocks",
            "Distinct block hashes a worker holds, per cache group and medium",
            labels=["worker", "group", "kind", "medium"],
        )
        speculative = GaugeMetricFamily(
            f"{PREFIX}_speculative_blocks",
            "Blocks of prompts routed to a worker held speculatively, its events not applied yet "
            "(all groups); never in resident_blocks",
            labels=["worker"],
        )
        by_health = dict.fromkeys(HEALTH_STATES, 0)
        stale_groups = follower.stale_groups_by_worker()
        for info in follower.index.workers():
            by_health[info.health] += 1
            if info.speculative_blocks:
                speculative.add_metric([info.name], info.speculative_blocks)
            stale = stale_groups.get(info.name, ())
            for group, media in info.resident.items():
                if group in stale:
                    continue  # another group member exports it; do not count it twice
                spec = info.groups.get(group)
                kind = spec.kind if spec is not None else "unknown"
                for medium, blocks in media.items():
                    resident.add_metric([info.name, str(group), kind, medium], blocks)
        yield resident
        yield speculative
        workers = GaugeMetricFamily(
            f"{PREFIX}_workers", "Workers the index knows, by health", labels=["health"]
        )
        for health, count in by_health.items():
            workers.add_metric([health], count)
        yield workers
        for name, value, documentation in (
            ("blocks_stored", counters.stored, "Block copies stored"),
            ("blocks_removed", counters.removed, "Block copies removed"),
            ("clears", counters.cleared, "AllBlocksCleared applied, per worker group"),
            ("worker_restarts", counters.restarts, "New epochs seen: a worker's engine restarted"),
            (
                "partial_evictions",
                counters.partial_evictions,
                "Sliding-window blocks removed while the full-attention copy stays resident",
            ),
            (
                "removal_anomalies",
                counters.anomalies,
                "Removals of a block the worker did not hold",
            ),
            ("duplicate_copies", counters.duplicate_copies, "Stores of a block already held"),
            (
                "blocks_refused",
                counters.blocks_refused,
                "Stored blocks not kept: past --max-blocks-per-worker, or on a medium past the 16 "
                "the index keeps (it knows less than the engine holds, never more)",
            ),
            (
                "workers_retired",
                counters.workers_retired,
                "Workers dropped because the bridge retired them (they left the fleet)",
            ),
            (
                "sizeless_stores",
                counters.sizeless_stores,
                "Stores whose block size or window no group can have (vLLM's CPU-offloading "
                "stores carry block size 0): blocks kept, no group spec learned",
            ),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=value)
        ignored = CounterMetricFamily(
            f"{PREFIX}_records_ignored",
            "Event records that changed nothing: replays, older epochs, retired workers' lives",
            labels=["reason"],
        )
        ignored.add_metric(["duplicate"], counters.duplicates_ignored)
        ignored.add_metric(["stale_epoch"], counters.stale_epoch_ignored)
        ignored.add_metric(["retired"], counters.retired_ignored)
        yield ignored
        yield from self._speculation_families(counters)

    def _speculation_families(self, counters: IndexCounters) -> Iterator[Metric]:
        outcomes = CounterMetricFamily(
            f"{PREFIX}_speculative_blocks_outcomes",
            "Speculative blocks by what became of them: speculated (added), confirmed (a real "
            "store), removed (a real removal, clear, restart or departure), expired (the TTL), "
            "refused (past --max-blocks-per-worker)",
            labels=["outcome"],
        )
        for outcome, count in (
            ("speculated", counters.speculated),
            ("confirmed", counters.speculation_confirmed),
            ("removed", counters.speculation_removed),
            ("expired", counters.speculation_expired),
            ("refused", counters.speculation_refused),
        ):
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield CounterMetricFamily(
            f"{PREFIX}_reserved_medium_blocks",
            "Blocks of stores and removals an engine sent on the index's speculative medium's "
            "name: refused",
            value=counters.reserved_medium_blocks,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_speculative_ttl_seconds",
            "How long a routed prompt's blocks are held speculatively now (--speculative-ttl, "
            "or following the measured event lag)",
            value=self._follower.speculation_ttl.ttl_s(),
        )

    def _follower_families(self) -> Iterator[Metric]:
        stats = self._follower.stats
        yield _per_label(
            "records_consumed",
            "Kafka records read by this process, bad ones included",
            stats.consumed,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_records_applied",
            "Event records applied to the index by this process",
            value=stats.events_applied,
        )
        yield from self._worker_state_families()
        bad = CounterMetricFamily(
            f"{PREFIX}_bad_records", "Records skipped as unusable", labels=["topic", "reason"]
        )
        for (topic, reason), count in sorted(stats.bad_records.items()):
            bad.add_metric([topic, reason], count)
        yield bad
        yield CounterMetricFamily(
            f"{PREFIX}_records_lost",
            "Records deleted by retention before this follower applied them",
            value=stats.records_lost,
        )
        yield from self._partition_families()
        yield CounterMetricFamily(
            f"{PREFIX}_commits_failed",
            "Group mode: offset commits that failed (as during a rebalance), retried at the next "
            "interval",
            value=stats.commits_failed,
        )
        lag = GaugeMetricFamily(
            f"{PREFIX}_consumer_lag_records",
            "Records between the applied position and the log end, over assigned partitions",
            labels=["topic"],
        )
        for topic, records in sorted(self._follower.lag_by_topic().items()):
            lag.add_metric([topic], records)
        yield lag
        yield _histogram(
            stats.event_age,
            f"{PREFIX}_event_age_seconds",
            "From the engine batch timestamp to the record being applied",
        )
        yield _histogram(
            stats.fetch_age,
            f"{PREFIX}_fetch_age_seconds",
            "From an event record's Kafka timestamp (the bridge handing it to its producer) to "
            "this process fetching it",
        )

    def _freshness_families(self) -> Iterator[Metric]:
        """Readiness, Kafka's silence and each worker's lag and staleness, from one reading; a
        worker's series go with the worker (retired or forgotten)."""
        follower = self._follower
        freshness = follower.freshness()
        yield GaugeMetricFamily(
            f"{PREFIX}_ready",
            "1 while /readyz answers 200: caught up with the log, and Kafka answering",
            value=0 if not_ready(caught_up=follower.ready, freshness=freshness) else 1,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_broker_silence_seconds",
            "Seconds since Kafka last answered this index (since it started, before the first "
            "answer); past --max-broker-silence /readyz answers 503 and every worker is stale",
            value=freshness.broker_silence_s,
        )
        stale = GaugeMetricFamily(
            f"{PREFIX}_worker_stale",
            "1 while the index may be behind the worker (more seqs behind the bridge than "
            "--max-worker-lag, or Kafka silent): never named best",
            labels=["worker"],
        )
        lag = GaugeMetricFamily(
            f"{PREFIX}_worker_lag_seqs",
            "Seqs the bridge forwarded in the worker's life that the index has not applied "
            "(workers with a bridge state of that life)",
            labels=["worker"],
        )
        for worker, seqs in sorted(freshness.lags.items()):
            stale.add_metric([worker], 1 if freshness.stale(worker) else 0)
            if seqs is not None:
                lag.add_metric([worker], seqs)
        yield stale
        yield lag

    def _worker_state_families(self) -> Iterator[Metric]:
        stats = self._follower.stats
        yield CounterMetricFamily(
            f"{PREFIX}_worker_states_applied",
            "Worker states (catalog, health) applied by this process",
            value=stats.worker_states_applied,
        )
        ignored = CounterMetricFamily(
            f"{PREFIX}_worker_states_ignored",
            "Worker states that changed nothing: an older life than the index's (stale_epoch), "
            "or a retired one (retired)",
            labels=["reason"],
        )
        for why in IGNORED_STATE_REASONS:
            ignored.add_metric([why], stats.worker_states_ignored.get(why, 0))
        yield ignored

    def _partition_families(self) -> Iterator[Metric]:
        stats = self._follower.stats
        yield _per_label(
            "log_restarts",
            "Partitions whose log was found below this follower's position (the topic recreated, "
            "or truncated by an unclean leader election): read again from their beginning, the "
            "workers with keys there forgotten",
            stats.log_restarts,
        )
        yield _per_label(
            "partitions_added",
            "Partitions added to a topic this follower reads by assignment, read since from their "
            "beginning",
            stats.partitions_added,
        )

    def _snapshot_families(self) -> Iterator[Metric]:
        stats = self._follower.stats
        snapshots = CounterMetricFamily(
            f"{PREFIX}_snapshots", "Snapshot writes by this process", labels=["outcome"]
        )
        snapshots.add_metric(["written"], stats.snapshots_written)
        snapshots.add_metric(["failed"], stats.snapshots_failed)
        yield snapshots
        if stats.last_snapshot_at is None:
            return
        yield GaugeMetricFamily(
            f"{PREFIX}_snapshot_age_seconds",
            "Time since the newest snapshot (written or restored) was taken",
            value=time.time() - stats.last_snapshot_at,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_snapshot_duration_seconds",
            "How long the last snapshot write took, capture to stored",
            value=stats.last_snapshot_duration_s,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_snapshot_size_bytes",
            "Compressed size of the last snapshot written or restored",
            value=stats.last_snapshot_bytes,
        )

    def _score_families(self) -> Iterator[Metric]:
        stats = self._score_stats
        requests = CounterMetricFamily(
            f"{PREFIX}_score_requests", "POST /v1/score requests", labels=["outcome"]
        )
        for outcome, count in sorted(stats.requests.items()):
            requests.add_metric([outcome], count)
        yield requests
        yield _histogram(
            stats.duration,
            f"{PREFIX}_score_duration_seconds",
            "Time to answer a score request, reading included",
        )
        hits = CounterMetricFamily(
            f"{PREFIX}_score_hit_tokens",
            "Predicted hit tokens of each answer's best worker, summed over answered requests "
            "with details: HMA-aware (hma) or ignoring cache groups (group_blind)",
            labels=["answer"],
        )
        hits.add_metric(["hma"], stats.hma_hit_tokens)
        hits.add_metric(["group_blind"], stats.group_blind_hit_tokens)
        yield hits
        yield CounterMetricFamily(
            f"{PREFIX}_score_best_differs",
            "Answered score requests with details whose group-blind best worker is not the "
            "HMA-aware one",
            value=stats.best_differs,
        )
        yield _per_label(
            "routed_requests",
            "POST /v1/routed requests: ok, rejected (bad request) or unknown_worker",
            stats.routed,
            label="outcome",
        )
        refused = CounterMetricFamily(
            f"{PREFIX}_router_port_refused",
            "Router-port requests refused by the port itself (bounds, token, path), by status",
            labels=["status"],
        )
        for status, count in sorted(stats.router_port_refused.items()):
            refused.add_metric([str(status)], count)
        yield refused
        yield GaugeMetricFamily(
            f"{PREFIX}_router_port_connections",
            "Connections open on the router port",
            value=stats.router_port_connections,
        )


def index_registry(follower: Follower, score_stats: ScoreStats) -> CollectorRegistry:
    """A registry of its own: no process or platform collectors from the global one."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IndexCollector(follower, score_stats))
    return registry


def _per_label(
    name: str, documentation: str, counts: Mapping[str, int], *, label: str = "topic"
) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count)
    return family
