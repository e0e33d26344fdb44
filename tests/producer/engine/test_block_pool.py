"""The shared block pool: eviction order, reference counts and one event per cached copy."""

from __future__ import annotations

from hmakv.producer.engine.block_pool import BlockPool, KVBlock, RequestBlocks
from hmakv.producer.events import BlockRemoved, BlockStored, GroupSpec
from hmakv.producer.hashing import external
from hmakv.producer.recorder import EventRecorder

GROUPS = (
    GroupSpec(kind="full_attention", block_size=2),
    GroupSpec(kind="full_attention", block_size=2),
)


def make_pool(num_blocks: int = 9) -> tuple[BlockPool, EventRecorder]:
    recorder = EventRecorder(GROUPS)
    return BlockPool(num_blocks, recorder, external), recorder


def digest(n: int) -> bytes:
    return n.to_bytes(32, "big")


def cache(pool: BlockPool, group: int, blocks: list[KVBlock], first_hash: int) -> None:
    """Cache ``blocks`` as one request's consecutive full blocks."""
    pool.cache_full_blocks(
        group,
        blocks,
        0,
        len(blocks),
        RequestBlocks(
            block_hashes=[digest(first_hash + i) for i in range(len(blocks))],
            token_ids=list(range(2 * len(blocks))),
            extra_keys=[None] * len(blocks),
            lora_name=None,
            block_size=2,
        ),
        lambda index: True,
    )


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_null_block_is_never_handed_out() -> None:
    pool, _ = make_pool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.num_free_blocks == 0


def test_freed_blocks_without_content_are_reused_first_and_cached_ones_last() -> None:
    pool, _ = make_pool(9)
    blocks = pool.get_new_blocks(4)  # ids 1..4; 5..8 stay free
    cache(pool, 0, [blocks[1], blocks[3]], first_hash=10)
    pool.free_blocks(blocks)
    # Nothing can hit blocks 1 and 3: reusing them first loses nothing. 2 and 4 keep LRU order.
    assert queue_ids(pool) == [1, 3, 5, 6, 7, 8, 2, 4]


def test_touch_takes_a_free_cached_block_out_of_eviction_and_counts_references() -> None:
    pool, _ = make_pool(5)
    blocks = pool.get_new_blocks(2)
    cache(pool, 0, blocks, first_hash=0)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 2, 1]
    pool.touch([blocks[0]])
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2 and queue_ids(pool) == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert queue_ids(pool) == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert queue_ids(pool) == [3, 4, 2, 1]


def test_each_copy_of_a_hash_is_stored_and_removed_on_its_own() -> None:
    pool, recorder = make_pool(4)
    first, second, third = pool.get_new_blocks(3)
    cache(pool, 0, [first], first_hash=7)
    cache(pool, 0, [second], first_hash=7)
    cache(pool, 1, [third], first_hash=7)
    assert pool.get_cached_block(0, digest(7)) is first  # the oldest copy serves hits
    pool.free_blocks([first, second, third])
    assert pool.get_new_blocks(1) == [first]
    assert pool.is_cached(0, digest(7)) and pool.get_cached_block(0, digest(7)) is second
    pool.get_new_blocks(2)
    assert not pool.is_cached(0, digest(7)) and not pool.is_cached(1, digest(7))
    batch = recorder.flush()
    assert batch is not None
    assert [(type(e), getattr(e, "group_idx", None)) for e in batch.events] == [
        (BlockStored, 0),
        (BlockStored, 0),
        (BlockStored, 1),
        (BlockRemoved, 0),
        (BlockRemoved, 0),
        (BlockRemoved, 1),
    ]
    assert {
        tuple(e.block_hashes) for e in batch.events if isinstance(e, BlockStored | BlockRemoved)
    } == {(external(digest(7)),)}


def test_reset_is_refused_while_a_block_is_held() -> None:
    pool, recorder = make_pool(4)
    blocks = pool.get_new_blocks(1)
    cache(pool, 0, blocks, first_hash=1)
    recorder.flush()
    assert pool.reset_prefix_cache() is False and recorder.flush() is None
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert not pool.is_cached(0, digest(1)) and list(pool.cached_contents()) == []
    pool.get_new_blocks(3)  # reusing the once-cached block removes nothing: it was cleared
    batch = recorder.flush()
    assert batch is not None and [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"]
