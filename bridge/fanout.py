"""One engine batch into Kafka records: one ``EventRecord`` per (batch, group), no I/O.

A record per group keeps each (worker, group) key's records in one partition and in order, so a
consumer of one group never waits for another. An ``AllBlocksCleared`` empties every group, so it
is copied into every group the worker is known to have, at its place among the other events.
"""

from __future__ import annotations

from collections.abc import Sequence

from bridge.records import EventRecord
from producer.events import AllBlocksCleared, KVEvent, KVEventBatch


def fan_out(
    worker: str, epoch: int, seq: int, batch: KVEventBatch, groups: Sequence[int]
) -> list[EventRecord]:
    """The batch's records in group order; events keep the engine's order within a group."""
    by_group: dict[int, list[KVEvent]] = {}
    for event in batch.events:
        if type(event) is AllBlocksCleared:
            for group in groups:
                by_group.setdefault(group, []).append(event)
        else:
            group = event.group_idx or 0  # type: ignore[union-attr]
            events = by_group.get(group)
            if events is None:
                by_group[group] = [event]
            else:
                events.append(event)
    rank = batch.data_parallel_rank
    return [
        EventRecord(worker, epoch, seq, batch.ts, group, by_group[group], rank)
        for group in sorted(by_group)
    ]


def clear_records(
    worker: str,
    epoch: int,
    seq: int,
    ts: float,
    groups: Sequence[int],
    data_parallel_rank: int | None,
) -> list[EventRecord]:
    """A clear of the worker made by the bridge (restart, loss): one record per known group."""
    return [
        EventRecord(worker, epoch, seq, ts, group, [AllBlocksCleared()], data_parallel_rank)
        for group in groups
    ]
