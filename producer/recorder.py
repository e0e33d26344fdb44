"""What an engine's block pool calls: per-group stores and removals, one batch per scheduler step.

The recorder runs on the engine's scheduler thread, so it only builds msgspec structs and never
encodes or sends bytes itself; the sink (the publisher) does that elsewhere. Stores are stamped
with their group's catalog entry (``group_idx``, kind, sliding window, block size) the way vLLM's
block pool stamps them, so consumers can apply the hybrid hit rule without out-of-band config.
Not thread-safe by design: one scheduler thread records and flushes, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hmakv.producer.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEvent,
    KVEventBatch,
)


class BatchSink(Protocol):
    """Receives each non-empty step batch; must not block the engine thread."""

    def publish(self, batch: KVEventBatch) -> None: ...


class EventRecorder:
    """Collects one scheduler step's KV-cache events for a fixed group catalog."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        sink: BatchSink | None = None,
        *,
        medium: str = MEDIUM_GPU,
        data_parallel_rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not groups:
            raise ValueError("an event recorder needs at least one KV-cache group")
        self._groups = tuple(groups)
        self._sink = sink
        self._medium = medium
        self._data_parallel_rank = data_parallel_rank
        self._clock = clock
        self._events: list[KVEvent] = []

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        return self._groups

    def stored(
        self,
        group: int,
        block_hashes: Sequence[ExternalBlockHash],
        parent_block_hash: ExternalBlockHash | None,
        token_ids: Sequence[int],
        *,
        block_size: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[tuple[object, ...] | None] | None = None,
        medium: str | None = None,
    ) -> None:
        """Record newly cached full blocks of one group, in chain order.

        ``block_size`` defaults to the group's; an empty ``block_hashes`` records nothing, since an
        event naming no block changes nothing downstream. Inputs are copied: the engine may reuse
        its lists before the batch is encoded on another thread.
        """
        spec = self._spec(group)
        if not block_hashes:
            return
        self._events.append(
            BlockStored(
                block_hashes=list(block_hashes),
                parent_block_hash=parent_block_hash,
                token_ids=list(token_ids),
                block_size=spec.block_size if block_size is None else block_size,
                lora_id=None,
                medium=medium or self._medium,
                lora_name=lora_name,
                extra_keys=None if extra_keys is None else list(extra_keys),
                group_idx=group,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
            )
        )

    def removed(
        self,
        group: int,
        block_hashes: Sequence[ExternalBlockHash],
        *,
        medium: str | None = None,
    ) -> None:
        """Record evicted blocks of one group; other groups' copies of the same hashes stay."""
        self._spec(group)
        if not block_hashes:
            return
        self._events.append(
            BlockRemoved(
                block_hashes=list(block_hashes),
                medium=medium or self._medium,
                group_idx=group,
            )
        )

    def cleared(self) -> None:
        """Record that every block of every group was dropped (vLLM's prefix-cache reset)."""
        self._events.append(AllBlocksCleared())

    def flush(self) -> KVEventBatch | None:
        """End the step: hand its events, in recorded order, to the sink as one batch.

        Returns None and sends nothing when the step recorded no event, as vLLM's scheduler does.
        """
        if not self._events:
            return None
        batch = KVEventBatch(
            ts=self._clock(),
            events=self._events,
            data_parallel_rank=self._data_parallel_rank,
        )
        self._events = []
        if self._sink is not None:
            self._sink.publish(batch)
        return batch

    def _spec(self, group: int) -> GroupSpec:
        if not 0 <= group < len(self._groups):
            raise ValueError(
                f"group index {group} is outside this recorder's catalog of "
                f"{len(self._groups)} groups (0..{len(self._groups) - 1})"
            )
        return self._groups[group]
