"""Per-group block tables: which blocks a request holds in one KV-cache group, and when they go.

One manager per group, as in ``vllm/v1/core/single_type_kv_cache_manager.py``. The kinds differ
in which blocks a running request can give back early (sliding window and chunked local attention
free the blocks their window has left; mamba keeps only its latest state) and in which blocks are
worth caching. Freed blocks keep their hash, so they stay hittable until the pool reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

from hmakv.producer.engine.block_pool import BlockPool, CacheKey, KVBlock, RequestBlocks
from hmakv.producer.engine.hit_rule import is_reachable_block
from hmakv.producer.engine.request import EngineRequest
from hmakv.producer.events import CHUNKED_LOCAL_KIND, MAMBA_KIND, SLIDING_WINDOW_KINDS, GroupSpec
from hmakv.producer.hashing import group_block_hashes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class GroupBlockManager:
    """Block tables of one group; full attention as is, other kinds override the skip rules."""

    def __init__(self, group_idx: int, spec: GroupSpec, pool: BlockPool, alignment: int) -> None:
        self.group_idx = group_idx
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.alignment = alignment
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Present only once a request holds cached blocks: marks it running (vLLM's
        # ``num_cached_block``), which changes how its allocations are counted.
        self.num_cached_blocks: dict[str, int] = {}

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token no longer attends to; their blocks can be freed."""
        return 0

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(block.block_id for block in self.req_blocks.get(request_id, ()))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks left behind by the window, the rightmost first to be evicted."""
        blocks = self.req_blocks.get(request_id)
        skipped = self.num_skipped_tokens(num_computed_tokens)
        if blocks is None or skipped <= 0:
            return
        freed: list[KVBlock] = []
        for index in range(min(skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[index].is_null:
                break  # earlier blocks were freed by an earlier step
            freed.append(blocks[index])
            blocks[index] = self.pool.null_block
        self.pool.free_blocks(freed)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit: Sequence[KVBlock], num_computed_tokens: int
    ) -> int:
        """Free blocks this allocation consumes, hit blocks taken out of the free queue included."""
        required = _ceil_div(num_tokens, self.block_size)
        held = len(self.req_blocks.get(request_id, ()))
        if request_id in self.num_cached_blocks:
            return max(required - held, 0)
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        new = max(required - max(skipped, len(hit) + held), 0)
        kept_hit = hit[max(0, skipped - held) :]
        return new + sum(block.ref_cnt == 0 and not block.is_null for block in kept_hit)

    def add_hit_blocks(
        self, request_id: str, hit: Sequence[KVBlock], num_computed_tokens: int
    ) -> None:
        """Put a new request's prefix hit in its table; blocks already out of window stay null."""
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = hit[skipped:]
        self.pool.touch(kept)
        blocks = self.req_blocks.setdefault(request_id, [])
        blocks.extend([self.pool.null_block] * skipped)
        blocks.extend(kept)
        self.num_cached_blocks[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        missing = _ceil_div(num_tokens, self.block_size) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.get_new_blocks(missing))

    def cache_blocks(self, request: EngineRequest, num_tokens: int) -> list[CacheKey]:
        """Cache the request's blocks that ``num_tokens`` completes; returns what was cached."""
        first = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if first >= end:
            return []
        cached = self.pool.cache_full_blocks(
            self.group_idx,
            self.req_blocks[request.request_id],
            first,
            end,
            self._request_blocks(request),
            self._is_reachable,
        )
        self.num_cached_blocks[request.request_id] = end
        return cached

    def free(self, request_id: str) -> None:
        """Release a finished request's blocks, tail first, so its tail is evicted first."""
        blocks = self.req_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def end_step(self) -> None:
        """A scheduler step ended; only mamba keeps per-step state."""

    def _is_reachable(self, block_index: int) -> bool:
        return is_reachable_block(self.spec, block_index, self.alignment)

    def _request_blocks(self, request: EngineRequest) -> RequestBlocks:
        hashes = group_block_hashes(request.block_hashes, request.hash_block_size, self.block_size)
        return RequestBlocks(
            block_hashes=hashes,
            token_ids=request.token_ids,
            extra_keys=request.extra_keys(self.block_size, len(hashes)),
            lora_name=request.lora_name,
            block_size=self.block_size,
        )


class SlidingWindowBlockManager(GroupBlockManager):
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        assert self.spec.sliding_window is not None
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)


class ChunkedLocalBlockManager(GroupBlockManager):
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        assert self.spec.chunk_size is not None
        return num_computed_tokens // self.spec.chunk_size * self.spec.chunk_size


class MambaBlockManager(GroupBlockManager):
    """Mamba in vLLM's "align" mode: one live state block per request, cached on block ends.

    Each time a request crosses into a new block, a fresh state block is allocated at that index
    (the ones before stay null); the previous state block is freed a step later, once the new one
    has been written from it. A state cached during a step cannot be hit in that same step.
    """

    def __init__(self, group_idx: int, spec: GroupSpec, pool: BlockPool, alignment: int) -> None:
        super().__init__(group_idx, spec, pool, alignment)
        self._previous_state_index: dict[str, int] = {}
        self._cached_this_step: set[CacheKey] = set()

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        previous = self._previous_state_index.get(request_id)
        if previous is None or previous >= _ceil_div(num_computed_tokens, self.block_size) - 1:
            return
        blocks = self.req_blocks[request_id]
        if not blocks[previous].is_null:
            self.pool.free_blocks([blocks[previous]])
            blocks[previous] = self.pool.null_block

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit: Sequence[KVBlock], num_computed_tokens: int
    ) -> int:
        if hit and self._cached_key(hit[-1]) in self._cached_this_step:
            # vLLM defers the request a step: more blocks than exist, so it cannot be admitted.
            return self.pool.num_blocks + 1
        required = _ceil_div(num_tokens, self.block_size)
        new = required - len(hit) - len(self.req_blocks.get(request_id, ()))
        evictable = sum(block.ref_cnt == 0 and not block.is_null for block in hit)
        return min(new, 1) + evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        required = _ceil_div(num_tokens, self.block_size)
        if required == len(blocks):
            return
        if blocks:
            # The state so far (last step's, or the prefix hit's) seeds the new state block.
            self._previous_state_index[request_id] = len(blocks) - 1
        blocks.extend([self.pool.null_block] * (required - 1 - len(blocks)))
        blocks.extend(self.pool.get_new_blocks(1))

    def cache_blocks(self, request: EngineRequest, num_tokens: int) -> list[CacheKey]:
        cached = super().cache_blocks(request, num_tokens)
        self._cached_this_step.update(cached)
        return cached

    def free(self, request_id: str) -> None:
        self._previous_state_index.pop(request_id, None)
        super().free(request_id)

    def end_step(self) -> None:
        self._cached_this_step.clear()

    def _cached_key(self, block: KVBlock) -> CacheKey:
        assert block.content is not None
        return (block.content.group, block.content.block_hash)


def make_group_manager(
    group_idx: int, spec: GroupSpec, pool: BlockPool, alignment: int
) -> GroupBlockManager:
    """The manager for a group's kind (full and MLA attention share the base behaviour)."""
    if spec.kind in SLIDING_WINDOW_KINDS:
        return SlidingWindowBlockManager(group_idx, spec, pool, alignment)
    if spec.kind == CHUNKED_LOCAL_KIND:
        return ChunkedLocalBlockManager(group_idx, spec, pool, alignment)
    if spec.kind == MAMBA_KIND:
        return MambaBlockManager(group_idx, spec, pool, alignment)
    return GroupBlockManager(group_idx, spec, pool, alignment)
