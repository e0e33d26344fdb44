"""What sources hand to the Kafka sink: encoded records, grouped by the position they stand for.

An ``Outgoing`` is everything one tracker step produces (one batch's records, or one clear's), so
that the sink can tell, when Kafka acknowledges it, how far each worker's log is durable. Both
are named tuples: the bridge makes two or three per engine batch, and a tuple is the cheapest
immutable value Python builds.
"""

from __future__ import annotations

from typing import NamedTuple


class KafkaRecord(NamedTuple):
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


class Outgoing(NamedTuple):
    """The records of one forwarded batch or clear of one worker (possibly none: an empty batch),
    or of one dead letter (``worker`` None).

    ``engine_batch`` is True for the engine's records (a batch or a snapshot), False for a clear
    the bridge made or a dead letter. ``resumable``: the engine published this batch at this
    seq, so it may be the worker's resume point, whose ``ts`` a restarted bridge compares with
    the batch replayed at that seq (a snapshot's ts is not that batch's).
    """

    worker: str | None
    epoch: int
    seq: int
    ts: float
    records: list[KafkaRecord]
    engine_batch: bool
    resumable: bool = True
