"""The bridge's Prometheus metrics, in their own registry (so tests and embedders never clash).

Names are ``hmakv_bridge_*`` in base units; the only labels are the worker (bounded by the
configuration, or by ``--max-workers`` for workers named by their topic), the group-free reason
or kind enums below, the event type (``EVENT_TYPES``) and the health state.
"""

from __future__ import annotations

import contextlib
import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hmakv.kvlog.records import HEALTH_STATES, Health
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored

# The event types the bridge counts: the known ones by name, any other as "unknown" (bounded).
KNOWN_EVENT_CLASSES = (BlockStored, BlockRemoved, AllBlocksCleared)
UNKNOWN_EVENT_TYPE = "unknown"
EVENT_TYPES = (*(cls.__name__ for cls in KNOWN_EVENT_CLASSES), UNKNOWN_EVENT_TYPE)

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
    5, 10, 30,
)  # fmt: skip
_REPLAY_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)
_WAKEUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        worker = ("worker",)
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        histogram = functools.partial(Histogram, registry=r)
        self.batches_received = counter(
            "hmakv_bridge_batches_received", "Live batches received, per worker", worker
        )
        self.events_received = counter(
            "hmakv_bridge_events_received",
            "Events in live batches received, by type (unknown: skipped, and dead-lettered); "
            "the known types sum to the events forwarded from live batches",
            ("worker", "type"),
        )
        self.unknown_events = counter(
            "hmakv_bridge_unknown_events",
            "Events of types this bridge does not know, skipped (their batch is dead-lettered too)",
            worker,
        )
        self.records_produced = counter(
            "hmakv_bridge_records_produced",
            "Records acknowledged by Kafka, per topic kind (events, workers, deadletter)",
            ("topic",),
        )
        self.gaps_detected = counter(
            "hmakv_bridge_gaps_detected", "Gaps in a worker's sequence", worker
        )
        self.gaps_replayed = counter(
            "hmakv_bridge_gaps_replayed", "Gaps filled, by replay or snapshot", ("worker", "by")
        )
        self.gaps_unrecoverable = counter(
            "hmakv_bridge_gaps_unrecoverable",
            "Gaps lost for good (the worker is cleared and degraded)",
            worker,
        )
        self.batches_lost = counter(
            "hmakv_bridge_batches_lost", "Seqs in unrecoverable gaps", worker
        )
        self.replays = counter(
            "hmakv_bridge_replays",
            "Replay and snapshot requests, by kind and outcome (ended, failed, cancelled)",
            ("kind", "outcome"),
        )
        self.replay_duration = histogram(
            "hmakv_bridge_replay_duration_seconds",
            "From request to end marker, per kind",
            ("kind",),
            buckets=_REPLAY_BUCKETS,
        )
        self.epochs_started = counter(
            "hmakv_bridge_epochs_started",
            "New epochs: engine restarts, or records Kafka refused",
            worker,
        )
        self.duplicates = counter(
            "hmakv_bridge_duplicate_batches",
            "Batches already forwarded (replay overlap), dropped",
            worker,
        )
        self.batches_not_kept = counter(
            "hmakv_bridge_batches_not_kept",
            "Live batches the bridge could not hold during a replay (fetched again later)",
            ("worker", "reason"),
        )
        self.frames_rejected = counter(
            "hmakv_bridge_frames_rejected",
            "Messages that could not be used, by reason (each is dead-lettered)",
            ("reason",),
        )
        self.handshakes_refused = counter(
            "hmakv_bridge_curve_handshakes_refused",
            "CURVE handshakes on --bind-sub from client keys neither an engine's nor a join key",
        )
        self.handshakes_failed = counter(
            "hmakv_bridge_engine_handshakes_failed",
            "Handshakes with engines the bridge connects to that failed (CURVE: the peer proved "
            "no key configured for the engine, or refused the bridge's)",
        )
        self.dead_letters_dropped = counter(
            "hmakv_bridge_dead_letters_dropped", "Dead letters the full queue could not keep"
        )
        self.delivery_failures = counter(
            "hmakv_bridge_delivery_failures",
            "Batches Kafka refused for good (non-retriable errors)",
            worker,
        )
        self.workers_retired = counter(
            "hmakv_bridge_workers_retired",
            "Workers retired: removed from the fleet's engines, or llm-d pods replaced at "
            "--max-workers (their state is written once more, retired, for consumers to drop)",
        )
        self.producer_replacements = counter(
            "hmakv_bridge_kafka_producer_replacements",
            "Kafka producers replaced after a refusal (an idempotent one numbers batches per "
            "partition; a new one starts afresh)",
        )
        self.send_retries = counter(
            "hmakv_bridge_kafka_send_retries",
            "Record batches sent again after a retriable Kafka error",
        )
        self.queue_full = counter(
            "hmakv_bridge_queue_full_seconds",
            "Time the Kafka queue was full, intake paused (engines and their rings held the rest)",
        )
        self.queue_depth = gauge(
            "hmakv_bridge_queue_depth", "Batches queued for Kafka, not yet sent"
        )
        self.send_latency = histogram(
            "hmakv_bridge_kafka_send_latency_seconds",
            "From handing a chunk of records to the producer to Kafka's acknowledgement",
            buckets=_LATENCY_BUCKETS,
        )
        self.intake_age = histogram(
            "hmakv_bridge_intake_age_seconds",
            "From the engine's batch timestamp to the bridge reading the batch live (the engine's "
            "publish and ZMQ)",
            buckets=_LATENCY_BUCKETS,
        )
        self.end_to_end_age = histogram(
            "hmakv_bridge_end_to_end_age_seconds",
            "From the engine's batch timestamp to Kafka's acknowledgement",
            buckets=_LATENCY_BUCKETS,
        )
        self.worker_epoch = gauge("hmakv_bridge_worker_epoch", "The worker's current epoch", worker)
        self.worker_last_seq = gauge(
            "hmakv_bridge_worker_last_seq", "The worker's last seq acknowledged by Kafka", worker
        )
        self.worker_health = gauge(
            "hmakv_bridge_worker_health",
            "1 for the worker's current health state, 0 for the others",
            ("worker", "health"),
        )
        self.sources = gauge("hmakv_bridge_sources", "ZMQ sources configured")
        self.sources_connected = gauge(
            "hmakv_bridge_sources_connected", "ZMQ sources connected (or bound)"
        )
        self.kafka_reachable = gauge("hmakv_bridge_kafka_reachable", "1 while Kafka answers")
        self.messages_per_wakeup = histogram(
            "hmakv_bridge_messages_per_wakeup",
            "Messages taken from a socket per round of the intake (one round per tick at most)",
            buckets=_WAKEUP_BUCKETS,
        )

    def set_health(self, worker: str, health: Health) -> None:
        for state in HEALTH_STATES:
            self.worker_health.labels(worker, state).set(1 if state == health else 0)

    def start_worker(self, worker: str) -> None:
        """Export a worker's incident counters at 0 from its start, so that queries over them
        have a series before the first incident (no ``or vector(0)``)."""
        for metric in (
            self.gaps_detected,
            self.gaps_unrecoverable,
            self.batches_lost,
            self.epochs_started,
            self.delivery_failures,
        ):
            metric.labels(worker)
        for by in ("replay", "snapshot"):
            self.gaps_replayed.labels(worker, by)

    def forget_worker(self, worker: str) -> None:
        """Drop a removed worker's series, so the label set stays that of the configuration."""
        for metric in (
            self.batches_received,
            self.unknown_events,
            self.gaps_detected,
            self.gaps_unrecoverable,
            self.batches_lost,
            self.epochs_started,
            self.duplicates,
            self.delivery_failures,
            self.worker_epoch,
            self.worker_last_seq,
        ):
            _remove(metric, worker)
        for event_type in EVENT_TYPES:
            _remove(self.events_received, worker, event_type)
        for by in ("replay", "snapshot"):
            _remove(self.gaps_replayed, worker, by)
        _remove(self.batches_not_kept, worker, "buffer_full")
        for state in HEALTH_STATES:
            _remove(self.worker_health, worker, state)


def _remove(metric: Counter | Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never observed: nothing to remove
        metric.remove(*labels)
