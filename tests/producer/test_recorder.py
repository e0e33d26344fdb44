"""The engine-facing recorder: stamping, per-step batching, order, and the encoded wire shape."""

from __future__ import annotations

import msgspec
import pytest

from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEventBatch,
    encode,
)
from hmakv.producer.hashing import BlockHasher, external
from hmakv.producer.recorder import EventRecorder

# gpt-oss-like catalog: full attention and a 128-token sliding window, both with 16-token blocks.
GPT_OSS = (
    GroupSpec(kind="full_attention", block_size=16),
    GroupSpec(kind="sliding_window", block_size=16, sliding_window=128),
)
FULL, SWA = 0, 1
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks and a partial one
HASHES: list[ExternalBlockHash] = [
    external(h) for h in BlockHasher(seed="0").block_hashes(PROMPT, 16)
]


class ListSink:
    """In-memory sink standing in for the ZMQ publisher, which has its own tests."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


def fixed_clock() -> float:
    return 1_700_000_000.5


def recorder(
    sink: ListSink | None = None, *, medium: str = "GPU", data_parallel_rank: int | None = None
) -> EventRecorder:
    return EventRecorder(
        GPT_OSS, sink, medium=medium, data_parallel_rank=data_parallel_rank, clock=fixed_clock
    )


def test_prompt_stored_in_both_groups_is_stamped_per_group() -> None:
    rec = recorder()
    for group in (FULL, SWA):
        rec.stored(group, HASHES, None, PROMPT[:32])
    batch = rec.flush()
    assert batch is not None
    assert batch.events == [
        BlockStored(
            block_hashes=HASHES,
            parent_block_hash=None,
            token_ids=PROMPT[:32],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=FULL,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=HASHES,
            parent_block_hash=None,
            token_ids=PROMPT[:32],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=SWA,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
    ]


def test_store_passes_parent_lora_and_extra_keys_through() -> None:
    rec = recorder()
    rec.stored(
        FULL,
        HASHES[1:],
        HASHES[0],
        PROMPT[16:32],
        lora_name="adapter-x",
        extra_keys=[("adapter-x",)],
    )
    batch = rec.flush()
    assert batch is not None
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == HASHES[0]
    assert event.lora_name == "adapter-x"
    assert event.extra_keys == [("adapter-x",)]


def test_block_size_defaults_to_the_group_and_can_be_overridden() -> None:
    catalog = (GroupSpec("full_attention", 16), GroupSpec("sliding_window", 32, sliding_window=64))
    rec = EventRecorder(catalog, clock=fixed_clock)
    rec.stored(1, [7], None, list(range(32)))
    rec.stored(0, [8], None, list(range(16)), block_size=48)
    batch = rec.flush()
    assert batch is not None
    assert [e.block_size for e in batch.events if isinstance(e, BlockStored)] == [32, 48]


def test_medium_comes_from_the_recorder_unless_the_event_names_one() -> None:
    rec = recorder(medium="CPU")
    rec.stored(FULL, HASHES, None, PROMPT[:32])
    rec.removed(FULL, HASHES[:1])
    rec.removed(SWA, HASHES[:1], medium="STORAGE")
    batch = rec.flush()
    assert batch is not None
    assert [e.medium for e in batch.events if not isinstance(e, AllBlocksCleared)] == [
        "CPU",
        "CPU",
        "STORAGE",
    ]


def test_removal_names_its_group_only() -> None:
    """The SWA copy leaves the window while the full-attention copy stays: one event, group 1."""
    rec = recorder()
    rec.removed(SWA, HASHES[:1])
    batch = rec.flush()
    assert batch is not None
    assert batch.events == [BlockRemoved(block_hashes=HASHES[:1], medium="GPU", group_idx=SWA)]


def test_events_keep_their_recorded_order_within_a_step() -> None:
    rec = recorder()
    rec.stored(FULL, HASHES[:1], None, PROMPT[:16])
    rec.removed(SWA, [5])
    rec.cleared()
    rec.stored(SWA, HASHES[:1], None, PROMPT[:16])
    batch = rec.flush()
    assert batch is not None
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "BlockStored",
    ]


def test_flush_sends_one_batch_per_step_and_starts_a_new_one() -> None:
    sink = ListSink()
    rec = recorder(sink, data_parallel_rank=3)
    rec.stored(FULL, HASHES, None, PROMPT[:32])
    first = rec.flush()
    rec.removed(FULL, HASHES[1:])
    second = rec.flush()
    assert sink.batches == [first, second]
    assert first is not None and second is not None
    assert (first.ts, first.data_parallel_rank, len(first.events)) == (fixed_clock(), 3, 1)
    assert second.events == [BlockRemoved(block_hashes=HASHES[1:], medium="GPU", group_idx=FULL)]


def test_empty_step_sends_nothing() -> None:
    sink = ListSink()
    rec = recorder(sink)
    assert rec.flush() is None
    rec.stored(FULL, HASHES, None, PROMPT[:32])
    rec.flush()
    assert rec.flush() is None
    assert len(sink.batches) == 1


def test_events_naming_no_block_are_not_recorded() -> None:
    rec = recorder()
    rec.stored(FULL, [], None, [])
    rec.removed(SWA, [])
    assert rec.flush() is None


def test_clear_is_recorded_as_one_event() -> None:
    rec = recorder()
    rec.cleared()
    batch = rec.flush()
    assert batch is not None
    assert batch.events == [AllBlocksCleared()]


@pytest.mark.parametrize("group", [-1, 2])
def test_group_outside_the_catalog_is_refused(group: int) -> None:
    rec = recorder()
    with pytest.raises(ValueError, match=rf"group index {group} is outside .* 2 groups \(0\.\.1\)"):
        rec.stored(group, HASHES, None, PROMPT[:32])
    with pytest.raises(ValueError, match="outside"):
        rec.removed(group, HASHES)
    assert rec.flush() is None


def test_empty_catalog_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EventRecorder([])


def test_groups_property_exposes_the_catalog() -> None:
    assert recorder().groups == GPT_OSS


def test_inputs_are_copied_so_the_engine_may_reuse_its_lists() -> None:
    rec = recorder()
    hashes, tokens = list(HASHES), PROMPT[:32]
    rec.stored(FULL, hashes, None, tokens)
    hashes.clear()
    tokens.clear()
    batch = rec.flush()
    assert batch is not None
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, len(event.token_ids)) == (HASHES, 32)


def test_flushed_batch_round_trips_through_the_wire_encoding() -> None:
    rec = recorder(data_parallel_rank=0)
    rec.stored(SWA, [2**64 - 1, *HASHES], None, PROMPT[:16] * 3)
    rec.removed(FULL, [HASHES[0]])
    rec.cleared()
    batch = rec.flush()
    assert batch is not None
    payload = encode(batch)
    assert msgspec.msgpack.decode(payload, type=KVEventBatch) == batch


def test_encoded_removal_has_vllms_map_shape() -> None:
    rec = recorder()
    rec.removed(SWA, [HASHES[0]])
    batch = rec.flush()
    assert batch is not None
    assert msgspec.msgpack.decode(encode(batch)) == [
        fixed_clock(),
        [{"type": "BlockRemoved", "block_hashes": [HASHES[0]], "medium": "GPU", "group_idx": 1}],
        None,
    ]
