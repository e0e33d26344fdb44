"""The hybrid KV-cache manager: vLLM's ``KVCacheManager`` + ``HybridKVCacheCoordinator``.

A scheduler drives it one step at a time: ``admit`` new requests (prefix lookup, then slots for
the first chunk), ``schedule`` running ones (the next prefill chunk or one decode token),
``append_tokens`` as tokens are sampled, ``finish`` them, then ``end_step`` to flush the step's
events as one batch. Each call performs vLLM's ``allocate_slots`` sequence in vLLM's order (free
out-of-window blocks, check capacity, take the hit, allocate, cache newly full blocks), group by
group, so the events come out in the order vLLM emits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hmakv.producer.engine.block_pool import BlockPool, CachedContent, HashEncoder, KVBlock
from hmakv.producer.engine.group_managers import GroupBlockManager, make_group_manager
from hmakv.producer.engine.hit_rule import (
    alignment_tokens,
    find_longest_cache_hit,
    hash_block_size,
    required_blocks,
)
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.engine.request import EngineRequest
from hmakv.producer.events import MAMBA_KIND, MEDIUM_GPU, BlockStored, KVEventBatch
from hmakv.producer.hashing import BlockHasher, external, group_block_hashes
from hmakv.producer.recorder import EventRecorder


@dataclass(frozen=True)
class Admission:
    """A new request's prefix hit and the tokens scheduled for it in this step."""

    num_cached_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True)
class RequestProgress:
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int


def _raw_digest(block_hash: bytes) -> bytes:
    return block_hash


class HybridCacheManager:
    """Block tables, prefix caching and KV events of every group of one model profile.

    ``int_hashes`` mirrors ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: events carry the digest's last
    8 bytes as an int (vLLM's default) or the raw digest.
    """

    def __init__(
        self, profile: ModelProfile, recorder: EventRecorder, *, int_hashes: bool = True
    ) -> None:
        if tuple(recorder.groups) != profile.groups:
            raise ValueError(
                f"the recorder's groups {recorder.groups} are not profile "
                f"{profile.name!r}'s {profile.groups}"
            )
        self.profile = profile
        self.hash_block_size = hash_block_size(profile.groups)
        self.alignment = alignment_tokens(profile.groups)
        self._encode: HashEncoder = external if int_hashes else _raw_digest
        self._hasher = BlockHasher(profile.hash_fn, profile.hash_seed)
        self._recorder = recorder
        self.pool = BlockPool(profile.num_blocks, recorder, self._encode)
        self._groups: list[GroupBlockManager] = [
            make_group_manager(index, spec, self.pool, self.alignment)
            for index, spec in enumerate(profile.groups)
        ]
        self._requests: dict[str, EngineRequest] = {}
        self._refused: EngineRequest | None = None  # the last request refused admission
        # vLLM's "align" mode schedules prefill in whole state blocks so the states get cached.
        has_mamba = any(spec.kind == MAMBA_KIND for spec in profile.groups)
        self._state_block_size = self.alignment if has_mamba else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """The prefix hit, in tokens, a request with this prompt would get now; changes nothing."""
        return self._longest_hit(self._new_request("lookup", token_ids, lora_name, cache_salt))

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        token_budget: int | None = None,
    ) -> Admission | None:
        """Start a request: take its prefix hit and slots for its first chunk.

        Returns None, holding nothing, when the pool cannot fit the chunk, the budget cannot fit
        a whole state block (mamba), or the hit is a mamba state cached in this very step (vLLM
        defers such a request by a step); the caller may try again in a later step.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        request = self._new_request(request_id, prompt_token_ids, lora_name, cache_salt)
        hit = self._longest_hit(request)
        request.num_computed_tokens = hit
        chunk = self._chunk_size(request, token_budget)
        if chunk <= 0 or not self._allocate_slots(
            request, chunk, self._hit_blocks(request, hit) if hit else None
        ):
            self._refused = request
            return None
        self._refused = None
        request.num_computed_tokens += chunk
        self._requests[request_id] = request
        return Admission(num_cached_tokens=hit, num_scheduled_tokens=chunk)

    def schedule(self, request_id: str, *, token_budget: int | None = None) -> int | None:
        """Give a running request slots for its next tokens: a prefill chunk or a decode token.

        Returns the number of tokens scheduled (0 when none is pending or the budget fits none),
        or None when the pool cannot fit them; blocks the window has left are freed either way.
        """
        request = self._request(request_id)
        chunk = self._chunk_size(request, token_budget)
        if chunk <= 0:
            return 0
        if not self._allocate_slots(request, chunk, None):
            return None
        request.num_computed_tokens += chunk
        return chunk

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Add sampled tokens; their blocks get cached when they are scheduled."""
        self._request(request_id).append(token_ids)

    def finish(self, request_id: str) -> None:
        """Release a request's blocks; cached ones stay hittable until reused."""
        self._request(request_id)
        for manager in self._groups:
            manager.free(request_id)
        del self._requests[request_id]

    def progress(self, request_id: str) -> RequestProgress:
        request = self._request(request_id)
        return RequestProgress(
            num_prompt_tokens=request.num_prompt_tokens,
            num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens,
        )

    def block_table(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Block ids per group, one per block of tokens; 0 (the null block) where skipped."""
        self._request(request_id)
        return tuple(manager.block_ids(request_id) for manager in self._groups)

    def end_step(self) -> KVEventBatch | None:
        """Close the scheduler step: flush its events as one batch (None when it had none)."""
        for manager in self._groups:
            manager.end_step()
        return self._recorder.flush()

    def reset(self) -> bool:
        """Drop every cached block (``AllBlocksCleared``); refused while a request holds blocks."""
        return self.pool.reset_prefix_cache()

    def resident_blocks(self) -> tuple[list[BlockStored], ...]:
        """One ``BlockStored`` per cached physical block, per group: a replayable snapshot.

        Duplicate copies of a hash appear once each, so replaying the snapshot into a counting
        index gives the same counts as replaying every event since the last clear.
        """
        per_group: tuple[list[BlockStored], ...] = tuple([] for _ in self._groups)
        for content in self.pool.cached_contents():
            per_group[content.group].append(self._snapshot_event(content))
        return per_group

    def _new_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
    ) -> EngineRequest:
        """A new request, or the one last refused admission if this is it again: a scheduler
        retries the head of its queue every step, and its block hashes, like vLLM's, are
        computed once."""
        refused = self._refused
        if (
            refused is not None
            and refused.request_id == request_id
            and refused.lora_name == lora_name
            and refused.cache_salt == cache_salt
            and refused.token_ids == list(token_ids)
        ):
            refused.num_computed_tokens = 0
            return refused
        return EngineRequest(
            request_id,
            token_ids,
            self._hasher,
            self.hash_block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
        )

    def _request(self, request_id: str) -> EngineRequest:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"no running request {request_id!r}") from None

    def _longest_hit(self, request: EngineRequest) -> int:
        # The last token is always recomputed: its logits are what the step is for.
        return find_longest_cache_hit(
            self.profile.groups, request.block_hashes, request.num_tokens - 1, self.pool.is_cached
        )

    def _hit_blocks(self, request: EngineRequest, num_tokens: int) -> list[list[KVBlock]]:
        """Per group, the blocks of a hit of ``num_tokens``: cached where read, null elsewhere."""
        hits: list[list[KVBlock]] = []
        for manager in self._groups:
            size = manager.block_size
            hashes = group_block_hashes(request.block_hashes, self.hash_block_size, size)
            row = [self.pool.null_block] * (num_tokens // size)
            for index in required_blocks(manager.spec, num_tokens):
                block = self.pool.get_cached_block(manager.group_idx, hashes[index])
                assert block is not None, "the hit rule only grants cached blocks"
                row[index] = block
            hits.append(row)
        return hits

    def _chunk_size(self, request: EngineRequest, token_budget: int | None) -> int:
        """Tokens to schedule now; with mamba, prefill stops on state-block boundaries.

        vLLM's ``Scheduler._mamba_block_aligned_split``: before the prompt's last full state
        block, chunks are whole state blocks; the chunk crossing it stops there, so that state
        is cached; the remainder follows in the next step.
        """
        computed = request.num_computed_tokens
        pending = request.num_tokens - computed
        chunk = pending if token_budget is None else min(pending, token_budget)
        size = self._state_block_size
        if size is None or computed >= max(request.num_prompt_tokens, request.num_tokens - 1):
            return chunk
        last_state_end = request.num_tokens // size * size
        if computed + chunk < last_state_end:
            return chunk // size * size
        if computed < last_state_end:
            return last_state_end - computed
        return chunk

    def _allocate_slots(
        self, request: EngineRequest, num_new_tokens: int, hit: list[list[KVBlock]] | None
    ) -> bool:
        """vLLM's ``allocate_slots`` for ``num_new_tokens`` beyond ``num_computed_tokens``."""
        request_id = request.request_id
        computed = request.num_computed_tokens
        num_tokens = computed + num_new_tokens
        for manager in self._groups:
            manager.remove_skipped_blocks(request_id, computed)
        hits = hit if hit is not None else [[] for _ in self._groups]
        needed = sum(
            manager.num_blocks_to_allocate(request_id, num_tokens, group_hit, computed)
            for manager, group_hit in zip(self._groups, hits, strict=True)
        )
        if needed > self.pool.num_free_blocks:
            return False
        if hit is not None:
            for manager, group_hit in zip(self._groups, hit, strict=True):
                manager.add_hit_blocks(request_id, group_hit, computed)
        for manager in self._groups:
            manager.allocate_new_blocks(request_id, num_tokens)
        for manager in self._groups:
            manager.cache_blocks(request, min(num_tokens, request.num_tokens))
        return True

    def _snapshot_event(self, content: CachedContent) -> BlockStored:
        spec = self.profile.groups[content.group]
        parent = content.parent_hash
        return BlockStored(
            block_hashes=[self._encode(content.block_hash)],
            parent_block_hash=None if parent is None else self._encode(parent),
            token_ids=list(content.token_ids),
            block_size=content.block_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=content.lora_name,
            extra_keys=[content.extra_keys],
            group_idx=content.group,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
        )
