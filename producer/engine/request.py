"""A request as the cache manager sees it: its tokens, its chained block hashes, its progress.

Hashes are computed once, at the hash block size, as tokens arrive (vLLM's request block hasher):
every group derives its own block hashes from them, and the hit rule, the cached blocks and the
events all name blocks by these digests.
"""

from __future__ import annotations

from collections.abc import Sequence

from hmakv.producer.hashing import BlockExtraKeys, BlockHasher, block_extra_keys


class EngineRequest:
    """Token ids, block hashes and computed-token count of one request."""

    __slots__ = (
        "_hasher",
        "block_hashes",
        "cache_salt",
        "hash_block_size",
        "lora_name",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher,
        hash_block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.hash_block_size = hash_block_size
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self.append(prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Add tokens and hash every hash block they complete."""
        self.token_ids.extend(token_ids)
        size = self.hash_block_size
        first = len(self.block_hashes)
        end = len(self.token_ids) // size
        if end == first:
            return
        self.block_hashes.extend(
            self._hasher.block_hashes(
                self.token_ids[first * size : end * size],
                size,
                extra_keys=self.extra_keys(size, end)[first:],
                parent=self.block_hashes[-1] if self.block_hashes else None,
            )
        )

    def extra_keys(self, block_size: int, num_blocks: int) -> list[BlockExtraKeys]:
        """Per-block extra keys at ``block_size``: the LoRA name, and the salt in block 0."""
        return block_extra_keys(
            num_blocks, block_size, lora_name=self.lora_name, cache_salt=self.cache_salt
        )
