"""A record's events as the runs the index hands its block tables: each run the consecutive
stores (or removals) on one medium, their hashes in one list in vLLM's int form.

vLLM sends a few blocks an event and many events a step, so reading the events cost the index
more than applying their blocks. ``record_runs`` is ``hmakv_native.RecordRuns`` where it is
built (the events read without the interpreter), else ``py_record_runs``: the specification,
which tests/consumers/test_record_runs.py checks the native one against.

Either answers None for a record that needs the index event by event: a clear, or a store that
teaches the worker something (its group's spec, its lookahead, or that a store carries no usable
sizes), or a hash that is neither an int nor a digest. ``known`` is the (kind, block size,
window) of a store that teaches nothing about the record's group (the index's ``_known_spec``),
``lookahead`` the worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hmakv.producer.events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)
from hmakv.producer.hashing import external

Run = tuple[bool, str, list[ExternalBlockHash]]  # stores (else removals), medium, hashes
KnownSpec = tuple[str, int, int | None]


class RecordRuns(Protocol):
    def __call__(
        self, events: Sequence[KVEvent], known: KnownSpec | None, lookahead: int, /
    ) -> list[Run] | None: ...


def py_record_runs(
    events: Sequence[KVEvent], known: KnownSpec | None, lookahead: int, /
) -> list[Run] | None:
    runs: list[Run] = []
    for event in events:
        if isinstance(event, BlockStored):
            stores = True
        elif isinstance(event, BlockRemoved):
            stores = False
        else:
            return None  # a clear
        medium = event.medium or MEDIUM_GPU
        hashes = event.block_hashes
        if isinstance(event, BlockStored) and _teaches(event, medium, known, lookahead):
            return None
        keys = as_keys(hashes)
        if keys is None:
            return None
        if not runs or runs[-1][0] is not stores or runs[-1][1] != medium:
            runs.append((stores, medium, []))
        runs[-1][2].extend(keys)
    return runs


def _teaches(store: BlockStored, medium: str, known: KnownSpec | None, lookahead: int) -> bool:
    """Whether the index's ``_learn_group`` or ``_learn_lookahead`` would do anything with it."""
    kind, size, window = (
        store.kv_cache_spec_kind,
        store.block_size,
        store.kv_cache_spec_sliding_window,
    )
    # A store without a kind keeps the known spec, when its sizes are a group's.
    keeps = kind is None and size > 0 and (window is None or window > 0)
    if known is None or ((kind, size, window) != known and not keeps):
        return True
    if store.block_hashes and medium == MEDIUM_GPU:
        ids = store.lookahead_token_ids
        return (len(ids[0]) if ids else 0) != lookahead
    return False


def as_keys(hashes: Sequence[ExternalBlockHash]) -> Sequence[ExternalBlockHash] | None:
    """The hashes in vLLM's int form, the index's keys; None for one that is neither an int nor
    a digest. vLLM sends a digest whole only with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, for
    every event of its life: a list that starts with an int is all ints, and costs one look."""
    if not hashes or type(hashes[0]) is int:
        return hashes
    keys: list[ExternalBlockHash] = []
    for block_hash in hashes:
        if isinstance(block_hash, int):
            keys.append(block_hash)
        elif isinstance(block_hash, bytes):
            keys.append(external(block_hash))
        else:
            return None
    return keys


def _native_record_runs() -> RecordRuns | None:
    try:
        import hmakv_native
    except ImportError:  # not built (scripts/setup builds it): records are read in Python
        return None
    reader: RecordRuns = hmakv_native.RecordRuns(BlockStored, BlockRemoved, MEDIUM_GPU)
    return reader


_NATIVE = _native_record_runs()
NATIVE_RECORD_RUNS = _NATIVE is not None


def record_runs(
    events: Sequence[KVEvent], known: KnownSpec | None, lookahead: int, /
) -> list[Run] | None:
    if _NATIVE is not None:
        return _NATIVE(events, known, lookahead)
    return py_record_runs(events, known, lookahead)
