"""Paged KV-cache addressing: which physical slots a step writes and which ones it may read.

The cache manager hands out a block table per request and KV-cache group; position ``p`` lives
in physical block ``table[p // block_size]`` at slot ``p % block_size``. Everything here turns a
block table into index tensors once per step and group, so that every layer of the group reuses
them, and checks the table on the host first: a missing block is a cache-manager bug and must be
an error that names it, not a silently wrong (or NaN) answer.

What a query may see, per group kind (``p`` the query position, ``k`` a key position):

- full attention (and MLA, whose latent cache a stand-in need not imitate): ``k <= p``;
- sliding window ``W`` (vLLM / Hugging Face convention, ``window_size=(W-1, 0)`` in flash
  attention): the last ``W`` tokens including the query itself, ``p - W < k <= p``;
- chunked local attention ``C``: ``k <= p`` in the same chunk, ``k // C == p // C``.

Only positions some new query can see are gathered, so blocks the manager has already freed
(out of the window or an earlier chunk, their entries replaced by the null block) are never read.

Mamba groups hold one recurrent state per block: block ``i`` holds the state after the last
position processed in it, so once full it holds the state at its end, ``(i + 1) * block_size``
tokens in, which is exactly what a prefix hit of ``i + 1`` blocks continues from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hmakv.producer.events import CHUNKED_LOCAL_KIND, MAMBA_KIND, SLIDING_WINDOW_KINDS, GroupSpec

# vLLM's null block: the pool reserves block 0 and puts it wherever a table has no real block.
NULL_BLOCK = 0


class BlockTableError(ValueError):
    """A block table that lacks a block the step must write or read."""


@dataclass(frozen=True)
class AttentionIndex:
    """One sequence's addressing in one attention group for one step.

    ``write_*`` place the new tokens; ``read_*`` gather the keys they may see, in position order;
    ``visible`` is the ``[new tokens, gathered keys]`` mask of what each query attends to.
    """

    write_blocks: torch.Tensor
    write_slots: torch.Tensor
    read_blocks: torch.Tensor
    read_slots: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class StateIndex:
    """One sequence's addressing in one mamba group for one step.

    ``source_block`` holds the state to continue from (``None``: start from zeros);
    ``write_offsets[i]`` is the new token after which the state is stored in ``write_blocks[i]``.
    """

    source_block: int | None
    write_offsets: tuple[int, ...]
    write_blocks: torch.Tensor


GroupIndex = AttentionIndex | StateIndex


def first_visible_position(spec: GroupSpec, start_pos: int) -> int:
    """The earliest key any query at ``start_pos`` or later can see: where gathering begins."""
    if spec.kind in SLIDING_WINDOW_KINDS:
        assert spec.sliding_window is not None
        return max(0, start_pos - spec.sliding_window + 1)
    if spec.kind == CHUNKED_LOCAL_KIND:
        assert spec.chunk_size is not None
        return start_pos // spec.chunk_size * spec.chunk_size
    return 0


def visible_mask(spec: GroupSpec, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """``[queries, keys]`` booleans: True where the query attends to the key (module docstring)."""
    query = query_pos[:, None]
    key = key_pos[None, :]
    visible = key <= query
    if spec.kind in SLIDING_WINDOW_KINDS:
        assert spec.sliding_window is not None
        visible &= query - key < spec.sliding_window
    elif spec.kind == CHUNKED_LOCAL_KIND:
        assert spec.chunk_size is not None
        visible &= key // spec.chunk_size == query // spec.chunk_size
    return visible


@dataclass(frozen=True)
class BlockTable:
    """One sequence's block table in one group, the pool size its ids must be below, and the
    device its index tensors go to."""

    spec: GroupSpec
    blocks: Sequence[int]
    num_blocks: int
    device: torch.device

    def block_at(self, position: int, what: str) -> int:
        """The physical block holding ``position``; an error when there is no real block there."""
        index = position // self.spec.block_size
        block = self.blocks[index] if index < len(self.blocks) else NULL_BLOCK
        if not NULL_BLOCK < block < self.num_blocks:
            raise BlockTableError(
                f"{self.spec.kind} group: no block to {what} position {position} "
                f"(table entry {index} is {block if index < len(self.blocks) else 'missing'})"
            )
        return block

    def slot_index(self, positions: range, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The block and the slot in it of each position, as tensors."""
        blocks = [self.block_at(p, what) for p in positions]
        slots = [p % self.spec.block_size for p in positions]
        return (
            torch.tensor(blocks, dtype=torch.long, device=self.device),
            torch.tensor(slots, dtype=torch.long, device=self.device),
        )


def attention_index(table: BlockTable, start_pos: int, num_new: int) -> AttentionIndex:
    """Addressing for ``num_new`` tokens from ``start_pos``: write them, then read their keys."""
    end = start_pos + num_new
    read = range(first_visible_position(table.spec, start_pos), end)
    write_blocks, write_slots = table.slot_index(range(start_pos, end), "write")
    read_blocks, read_slots = table.slot_index(read, "read")
    query_pos = torch.arange(start_pos, end, device=table.device)
    key_pos = torch.arange(read.start, read.stop, device=table.device)
    return AttentionIndex(
        write_blocks,
        write_slots,
        read_blocks,
        read_slots,
        visible_mask(table.spec, query_pos, key_pos),
    )


def state_index(table: BlockTable, start_pos: int, num_new: int) -> StateIndex:
    """Addressing for a mamba group: the state to resume and where each block's state goes.

    The state after the last new token must be stored (the next step resumes from it); states at
    block ends crossed on the way are stored only where the table has a real block, because vLLM
    caches a mamba state only where a future hit may need it.
    """
    end = start_pos + num_new
    source = table.block_at(start_pos - 1, "resume the state at") if start_pos else None
    offsets: list[int] = []
    blocks: list[int] = []
    size = table.spec.block_size
    for position in range(start_pos // size * size + size - 1, end - 1, size):
        index = position // size
        if index < len(table.blocks) and table.blocks[index] != NULL_BLOCK:
            offsets.append(position - start_pos)
            blocks.append(table.block_at(position, "store the state at"))
    offsets.append(num_new - 1)
    blocks.append(table.block_at(end - 1, "store the state at"))
    return StateIndex(
        source, tuple(offsets), torch.tensor(blocks, dtype=torch.long, device=table.device)
    )


def group_index(table: BlockTable, start_pos: int, num_new: int) -> GroupIndex:
    """The addressing a group's layers need for one sequence in one step."""
    build = state_index if table.spec.kind == MAMBA_KIND else attention_index
    return build(table, start_pos, num_new)


def write_kv(
    layer_cache: torch.Tensor, index: AttentionIndex, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store new K/V (``[tokens, heads, head_dim]``) in ``layer_cache`` (``[2, blocks, ...]``)."""
    layer_cache[0, index.write_blocks, index.write_slots] = key
    layer_cache[1, index.write_blocks, index.write_slots] = value


def paged_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, index: AttentionIndex
) -> torch.Tensor:
    """Attention of new queries (``[tokens, heads, head_dim]``) over K/V gathered from blocks.

    Keys come back from the cache even for the tokens of this very step, so what is attended is
    what is stored: a wrong slot or block shows up in the output, as it would in vLLM.
    """
    key = layer_cache[0, index.read_blocks, index.read_slots]
    value = layer_cache[1, index.read_blocks, index.read_slots]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        attn_mask=index.visible,
    )
    return out.transpose(0, 1)
