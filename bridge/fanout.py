"""One engine batch into Kafka records: one ``EventRecord`` per (batch, group), no I/O.

A record per group keeps each (worker, group) key's records in one partition and in order, so a
consumer of one group never waits for another. An ``AllBlocksCleared`` empties every group, so it
is copied into every group the worker is known to have, at its place among the other events.
A group's events too many for one Kafka record are split over parts (``split_to_fit``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from hmakv.kvlog import records
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import AllBlocksCleared, KVEvent, KVEventBatch

# What a part's record costs beyond its events is measured on an empty one with a first_event no
# split reaches, plus what a list's msgpack header can grow by (1 byte when empty, at most 5):
# every part fits, with at most 8 bytes to spare.
_ARRAY_HEADER_GROWTH = 4
_LARGEST_FIRST_EVENT = records.MAX_FIRST_EVENT
_event_encoder = msgspec.msgpack.Encoder()


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


def split_to_fit(record: EventRecord, max_bytes: int) -> list[EventRecord] | None:
    """The record's events, in order, over records (parts) whose encodings are at most
    ``max_bytes`` each, each with its ``first_event``; None when one event alone cannot fit.

    msgpack writes a list as a header followed by its items, so a part's size is what the record
    costs without events, plus its list header, plus each event's own encoding.
    """
    empty = msgspec.structs.replace(record, events=[], first_event=_LARGEST_FIRST_EVENT)
    room = max_bytes - len(records.encode(empty)) - _ARRAY_HEADER_GROWTH
    events = record.events
    starts: list[int] = [0]
    used = 0
    for index, event in enumerate(events):
        size = len(_event_encoder.encode(event))
        if size > room:
            return None
        if used + size > room:
            starts.append(index)
            used = 0
        used += size
    ends = [*starts[1:], len(events)]
    return [
        msgspec.structs.replace(record, events=events[start:end], first_event=start)
        for start, end in zip(starts, ends, strict=True)
    ]
