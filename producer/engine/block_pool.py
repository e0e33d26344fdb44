"""The block pool all KV-cache groups share, with prefix caching and vLLM's event emission.

Mirrors ``vllm/v1/core/block_pool.py``: one pool of physical blocks for every group, a free
queue in eviction order, and a map from (group, block hash) to the cached physical blocks. The
map does not deduplicate: two requests that compute the same block before either is cached hold
two copies of one hash, each announced by its own ``BlockStored`` and, when its block is reused,
its own ``BlockRemoved``. Consumers must count copies for that reason (KV-EVENTS-FACTS 3b), so the
pool reproduces it rather than tidying it away.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from hmakv.producer.events import ExternalBlockHash
from hmakv.producer.hashing import BlockExtraKeys
from hmakv.producer.recorder import EventRecorder

HashEncoder = Callable[[bytes], ExternalBlockHash]


@dataclass(frozen=True, slots=True)
class CachedContent:
    """What a cached block holds, kept so a snapshot can re-announce it exactly as stored."""

    group: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: BlockExtraKeys


@dataclass(eq=False, slots=True)
class KVBlock:
    """One physical block; ``content`` is set while it is findable by its hash."""

    block_id: int
    ref_cnt: int = 0
    content: CachedContent | None = None
    is_null: bool = False


class FreeBlockQueue:
    """Free blocks in eviction order: allocation takes from the head.

    Blocks whose content can still be hit wait at the tail (least recently freed evicted first);
    blocks without content go to the head, since reusing them loses nothing
    (vLLM's ``FreeKVCacheBlockQueue.prepend_n`` / ``append_n``).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._blocks: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self._blocks.values())

    def popleft_n(self, count: int) -> list[KVBlock]:
        return [self._blocks.popitem(last=False)[1] for _ in range(count)]

    def remove(self, block: KVBlock) -> None:
        del self._blocks[block.block_id]

    def append_n(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            self._blocks[block.block_id] = block

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        """Put ``blocks`` at the head, keeping their order (the first is reused first)."""
        for block in reversed(blocks):
            self._blocks[block.block_id] = block
            self._blocks.move_to_end(block.block_id, last=False)


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request seen at one group's granularity: what caching its blocks needs to announce."""

    block_hashes: Sequence[bytes]
    token_ids: Sequence[int]
    extra_keys: Sequence[BlockExtraKeys]
    lora_name: str | None
    block_size: int


CacheKey = tuple[int, bytes]


class BlockPool:
    """Physical blocks shared by every group; block 0 is vLLM's null block, never allocated."""

    def __init__(self, num_blocks: int, recorder: EventRecorder, encode_hash: HashEncoder) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block and at least one more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        # Insertion-ordered: a lookup returns the oldest copy, as vLLM's BlockHashToBlockMap does.
        self._cached: dict[CacheKey, dict[int, KVBlock]] = {}
        self._recorder = recorder
        self._encode = encode_hash

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, group: int, block_hash: bytes) -> KVBlock | None:
        copies = self._cached.get((group, block_hash))
        return next(iter(copies.values())) if copies else None

    def is_cached(self, group: int, block_hash: bytes) -> bool:
        return (group, block_hash) in self._cached

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take blocks from the head of the free queue, evicting whatever they held."""
        if count > self.num_free_blocks:
            raise ValueError(f"cannot take {count} blocks from {self.num_free_blocks} free")
        blocks = self.free_queue.popleft_n(count)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero become free, the first given evicted first."""
        reuse_first: list[KVBlock] = []
        reuse_last: list[KVBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (reuse_first if block.content is None else reuse_last).append(block)
        self.free_queue.prepend_n(reuse_first)
        self.free_queue.append_n(reuse_last)

    def cache_full_blocks(
        self,
        group: int,
        blocks: Sequence[KVBlock],
        first: int,
        end: int,
        request: RequestBlocks,
        reachable: Callable[[int], bool],
    ) -> list[CacheKey]:
        """Make a request's full blocks ``first..end-1`` findable and announce them.

        Null (skipped) and unreachable blocks are left out; each contiguous run of the rest is one
        ``BlockStored`` whose parent is the hash of the block before the run, as vLLM emits them.
        """
        indices = [i for i in range(first, end) if not blocks[i].is_null and reachable(i)]
        for index in indices:
            self._insert(blocks[index], self._content(group, index, request))
        for run in _contiguous_runs(indices):
            self._announce(group, run, request)
        return [(group, request.block_hashes[i]) for i in indices]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds a block."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.content = None
        self._recorder.cleared()
        return True

    def cached_contents(self) -> Iterator[CachedContent]:
        """Every cached physical block's content: a hash appears once per copy."""
        for copies in self._cached.values():
            for block in copies.values():
                assert block.content is not None
                yield block.content

    def _content(self, group: int, index: int, request: RequestBlocks) -> CachedContent:
        size = request.block_size
        return CachedContent(
            group=group,
            block_hash=request.block_hashes[index],
            parent_hash=request.block_hashes[index - 1] if index else None,
            token_ids=tuple(request.token_ids[index * size : (index + 1) * size]),
            block_size=size,
            lora_name=request.lora_name,
            extra_keys=request.extra_keys[index],
        )

    def _insert(self, block: KVBlock, content: CachedContent) -> None:
        assert block.content is None, "a block is cached once, when it fills"
        block.content = content
        self._cached.setdefault((content.group, content.block_hash), {})[block.block_id] = block

    def _evict(self, block: KVBlock) -> None:
        content = block.content
        if content is None:
            return
        key = (content.group, content.block_hash)
        copies = self._cached[key]
        del copies[block.block_id]
        if not copies:
            del self._cached[key]
        block.content = None
        self._recorder.removed(content.group, [self._encode(content.block_hash)])

    def _announce(self, group: int, run: range, request: RequestBlocks) -> None:
        size = request.block_size
        parent = request.block_hashes[run.start - 1] if run.start else None
        self._recorder.stored(
            group,
            [self._encode(request.block_hashes[i]) for i in run],
            None if parent is None else self._encode(parent),
            request.token_ids[run.start * size : run.stop * size],
            block_size=size,
            lora_name=request.lora_name,
            extra_keys=request.extra_keys[run.start : run.stop],
        )


def _contiguous_runs(indices: Sequence[int]) -> Iterator[range]:
    start = 0
    for position in range(1, len(indices) + 1):
        if position == len(indices) or indices[position] != indices[position - 1] + 1:
            yield range(indices[start], indices[position - 1] + 1)
            start = position
