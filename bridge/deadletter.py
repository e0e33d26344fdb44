"""Every message the bridge cannot use: counted, logged (rate-limited) and kept, raw.

The SUB sockets reject live frames and the channels reject replies and unknown events; both hand
them here, so that each reason is counted, logged and dead-lettered the same way. A misbehaving
engine can send thousands of bad frames a second: the log line is rate-limited, the count and the
dead letter are not (frames truncated to what fits one Kafka record).
"""

from __future__ import annotations

import logging
import time

from hmakv.bridge.frames import Rejected
from hmakv.bridge.metrics import BridgeMetrics
from hmakv.bridge.sink import KafkaSink
from hmakv.kvlog.logs import RateLimitedLog
from hmakv.kvlog.records import DeadLetter

log = logging.getLogger(__name__)
incidents = RateLimitedLog(log)


class DeadLetterOffice:
    """Counts, logs (rate-limited) and dead-letters every message the bridge cannot use."""

    def __init__(self, sink: KafkaSink, metrics: BridgeMetrics, max_bytes: int) -> None:
        self._sink = sink
        self._metrics = metrics
        self._max_bytes = max_bytes

    def reject(self, source: str, rejected: Rejected) -> None:
        reason = rejected.reason.value
        self._metrics.frames_rejected.labels(reason).inc()
        incidents.warning(
            f"rejected:{reason}",
            "%s: message rejected (%s): %s",
            source,
            reason,
            rejected.detail,
            source=source,
            reason=reason,
            seq=rejected.seq,
        )
        frames, detail = self._bounded(rejected.frames, rejected.detail)
        self._sink.put_dead_letter(DeadLetter(source, reason, detail, frames, time.time()))

    def _bounded(self, frames: list[bytes], detail: str) -> tuple[list[bytes], str]:
        """Frames that fit a Kafka record: an oversize payload keeps its first bytes only."""
        if sum(map(len, frames)) <= self._max_bytes:
            return frames, detail
        budget = self._max_bytes
        kept = []
        for frame in frames:
            kept.append(frame[: max(0, budget)])
            budget -= len(kept[-1])
        sizes = ", ".join(str(len(frame)) for frame in frames)
        return kept, f"{detail} [frames truncated to {self._max_bytes} bytes; sizes {sizes}]"
