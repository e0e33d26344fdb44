"""A tiny hybrid transformer that really computes K/V and keeps them in the paged cache.

The reference engine's cache manager decides which blocks hold which tokens; this model is what
makes those decisions observable. It writes every new token's K/V (or recurrent state) into the
blocks of the tables it is given and attends only over what it reads back from them, so a wrong
block table, a prefix hit on blocks that do not hold that prefix, or a sliding-window block freed
too early changes the logits (or raises), exactly as it would corrupt a real vLLM engine.

Shape: ``num_heads * head_dim`` wide, ``layers_per_group[g]`` decoder layers for group ``g``,
seeded random float32 weights, RoPE positions, pre-norm residual layers with a small MLP.

Cache layout, one tensor per group, indexed by the pool's block ids:

- attention groups: ``[layers_in_group, 2 (K, V), num_blocks, block_size, num_heads, head_dim]``,
  keys stored after RoPE, as vLLM stores them;
- mamba groups: ``[layers_in_group, num_blocks, hidden]``, one recurrent state per block, from a
  gated linear recurrence ``h = a * h + (1 - a) * u``.

Token ids index the embedding modulo ``MAX_EMBED_ROWS`` rows and the output head scores the same
rows, so a large vocabulary costs nothing; every token id below ``vocab_size`` still gets a logit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hmakv.producer.engine.hit_rule import check_group
from hmakv.producer.engine.paged_attention import (
    AttentionIndex,
    BlockTable,
    GroupIndex,
    StateIndex,
    group_index,
    paged_attention,
    write_kv,
)
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.events import FULL_ATTENTION_KINDS, MAMBA_KIND, GroupSpec

MAX_EMBED_ROWS = 4096
ROPE_BASE = 10_000.0
MLP_EXPANSION = 2
# Keeps the recurrence's decay near 1 at initialisation, so a state carries a long history and a
# state restored from the wrong block visibly changes the output.
DECAY_BIAS = 2.0


def default_device() -> torch.device:
    """The accelerator when there is one: the engine should run where vLLM would."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class SequenceStep:
    """One request's share of a step: new tokens from ``start_pos``, and where their cache lives.

    ``block_tables[g]`` lists the physical block ids the cache manager gave the request in group
    ``g``; position ``p`` lives in ``block_tables[g][p // block_size]``. Entries the step does not
    touch (freed sliding-window blocks, earlier mamba states) may be the null block, 0.
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_tables: Sequence[Sequence[int]]


@dataclass(frozen=True)
class StepOutput:
    """The next-token distribution after a request's last new token, and its greedy choice."""

    request_id: str
    logits: torch.Tensor
    next_token: int


def layer_groups(profile: ModelProfile) -> tuple[int, ...]:
    """The group of each layer, in depth order.

    Layer types interleave as in the real models: one layer of each group per round, full
    attention last, so gpt-oss-like alternates sliding and full layers and gemma3-like has five
    sliding layers before each full one.
    """
    groups = sorted(
        range(len(profile.groups)),
        key=lambda g: profile.groups[g].kind in FULL_ATTENTION_KINDS,
    )
    rounds = max(profile.dims.layers_per_group)
    return tuple(
        g for depth in range(rounds) for g in groups if depth < profile.dims.layers_per_group[g]
    )


class PagedKVCache:
    """The physical cache: one tensor per group, indexed by the pool's block ids.

    Every group is sized for the whole pool, since a block id may be handed to any group; block 0,
    the null block, is allocated but never holds anything a step reads.
    """

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        layers_per_group: Sequence[int],
        num_blocks: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.tensors = tuple(
            torch.zeros(_group_shape(spec, layers, num_blocks, num_heads, head_dim), device=device)
            for spec, layers in zip(groups, layers_per_group, strict=True)
        )

    def layer(self, group: int, slot: int) -> torch.Tensor:
        """One layer's view of its group's tensor (its ``slot``-th layer)."""
        return self.tensors[group][slot]


def _group_shape(
    spec: GroupSpec, layers: int, num_blocks: int, num_heads: int, head_dim: int
) -> tuple[int, ...]:
    if spec.kind == MAMBA_KIND:
        return (layers, num_blocks, num_heads * head_dim)
    return (layers, 2, num_blocks, spec.block_size, num_heads, head_dim)


def _weight(rng: torch.Generator, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A ``[rows, cols]`` matrix scaled so activations keep unit size; drawn on the CPU so a seed
    gives the same model on every device."""
    return (torch.randn(rows, cols, generator=rng) / math.sqrt(rows)).to(device)


def _rms_norm(hidden: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden, (hidden.shape[-1],))


def apply_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``[tokens, heads, head_dim]`` by position, so attention depends on where a token
    is: a key cached at the wrong position cannot match the recomputed one."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = (positions.to(torch.float32)[:, None] * inv_freq)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


Segments = Sequence[tuple[slice, GroupIndex]]


class AttentionMixer:
    """Multi-head attention whose keys and values only ever come from the paged cache."""

    def __init__(
        self, rng: torch.Generator, num_heads: int, head_dim: int, device: torch.device
    ) -> None:
        width = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.w_q = _weight(rng, width, width, device)
        self.w_k = _weight(rng, width, width, device)
        self.w_v = _weight(rng, width, width, device)
        self.w_o = _weight(rng, width, width, device)

    def _heads(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1, self.num_heads, self.head_dim)

    def project_kv(
        self, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key (rotated) and value of each token, as they are stored in the cache."""
        key = apply_rope(self._heads(normed @ self.w_k), positions)
        return key, self._heads(normed @ self.w_v)

    def __call__(
        self,
        normed: torch.Tensor,
        positions: torch.Tensor,
        layer_cache: torch.Tensor,
        segments: Segments,
    ) -> torch.Tensor:
        query = apply_rope(self._heads(normed @ self.w_q), positions)
        key, value = self.project_kv(normed, positions)
        # Every write lands before any read, as vLLM caches a whole batch before attending.
        for rows, index in segments:
            assert isinstance(index, AttentionIndex)
            write_kv(layer_cache, index, key[rows], value[rows])
        out = torch.empty_like(query)
        for rows, index in segments:
            assert isinstance(index, AttentionIndex)
            out[rows] = paged_attention(query[rows], layer_cache, index)
        return out.flatten(1) @ self.w_o


class MambaMixer:
    """A gated linear recurrence: the smallest mixer whose whole history is one cached state."""

    def __init__(self, rng: torch.Generator, width: int, device: torch.device) -> None:
        self.w_decay = _weight(rng, width, width, device)
        self.w_in = _weight(rng, width, width, device)
        self.w_gate = _weight(rng, width, width, device)
        self.w_out = _weight(rng, width, width, device)

    def states(self, normed: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        """The state after each token of one sequence, continuing from ``initial``."""
        decay = torch.sigmoid(normed @ self.w_decay + DECAY_BIAS)
        inputs = (1 - decay) * (normed @ self.w_in)
        state = initial
        states = []
        for token in range(normed.shape[0]):
            state = decay[token] * state + inputs[token]
            states.append(state)
        return torch.stack(states)

    def __call__(
        self,
        normed: torch.Tensor,
        positions: torch.Tensor,
        layer_cache: torch.Tensor,
        segments: Segments,
    ) -> torch.Tensor:
        mixed = torch.empty_like(normed)
        for rows, index in segments:
            assert isinstance(index, StateIndex)
            initial = (
                torch.zeros_like(normed[0])
                if index.source_block is None
                else layer_cache[index.source_block]
            )
            states = self.states(normed[rows], initial)
            layer_cache[index.write_blocks] = states[list(index.write_offsets)]
            mixed[rows] = states
        return (mixed * F.silu(normed @ self.w_gate)) @ self.w_out


class DecoderLayer:
    """Pre-norm residual layer: a mixer (attention or recurrence), then a small MLP."""

    def __init__(
        self,
        rng: torch.Generator,
        spec: GroupSpec,
        group: int,
        slot: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> None:
        width = num_heads * head_dim
        self.group, self.slot = group, slot
        self.mixer: AttentionMixer | MambaMixer = (
            MambaMixer(rng, width, device)
            if spec.kind == MAMBA_KIND
            else AttentionMixer(rng, num_heads, head_dim, device)
        )
        self.w_up = _weight(rng, width, MLP_EXPANSION * width, device)
        self.w_down = _weight(rng, MLP_EXPANSION * width, width, device)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the mixer sees of the layer's input: the cached K/V and states derive from it."""
        return _rms_norm(hidden)

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        layer_cache: torch.Tensor,
        segments: Segments,
    ) -> torch.Tensor:
        hidden = hidden + self.mixer(self.normed(hidden), positions, layer_cache, segments)
        return hidden + F.silu(_rms_norm(hidden) @ self.w_up) @ self.w_down


@dataclass(frozen=True)
class _StepPlan:
    """A batch flattened into one token axis, with each group's addressing per sequence."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    last_rows: torch.Tensor
    segments: tuple[Segments, ...]


class HybridModel:
    """The reference engine's model: steps over a batch, reading and writing the paged cache.

    ``num_blocks`` overrides the profile's pool size (tests use small pools); block ids in the
    tables must be below it.
    """

    def __init__(
        self,
        profile: ModelProfile,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        num_blocks: int | None = None,
    ) -> None:
        for spec in profile.groups:
            check_group(spec)
        dims = profile.dims
        self.profile = profile
        self.device = default_device() if device is None else torch.device(device)
        self.vocab_size = dims.vocab_size
        rng = torch.Generator().manual_seed(seed)
        rows = min(dims.vocab_size, MAX_EMBED_ROWS)
        width = dims.num_heads * dims.head_dim
        self.embedding = torch.randn(rows, width, generator=rng).to(self.device)
        self.head = _weight(rng, width, rows, self.device)
        self._vocab_rows = torch.arange(dims.vocab_size, device=self.device) % rows
        slots = [itertools.count() for _ in profile.groups]
        self.layers = tuple(
            DecoderLayer(
                rng,
                profile.groups[g],
                g,
                next(slots[g]),
                dims.num_heads,
                dims.head_dim,
                self.device,
            )
            for g in layer_groups(profile)
        )
        self.cache = PagedKVCache(
            profile.groups,
            dims.layers_per_group,
            profile.num_blocks if num_blocks is None else num_blocks,
            dims.num_heads,
            dims.head_dim,
            self.device,
        )

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The first layer's input for these tokens (hashed into the embedding table)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        return self.embedding[ids % self.embedding.shape[0]]

    def step(self, batch: Sequence[SequenceStep]) -> list[StepOutput]:
        """Run one engine step: prefill chunks and decode tokens of many requests together."""
        plan = self._plan(batch)
        hidden = self.embed(plan.token_ids)
        for layer in self.layers:
            layer_cache = self.cache.layer(layer.group, layer.slot)
            hidden = layer(hidden, plan.positions, layer_cache, plan.segments[layer.group])
        logits = self._logits(hidden[plan.last_rows])
        next_tokens = logits.argmax(dim=-1).tolist()
        return [
            StepOutput(seq.request_id, row_logits, token)
            for seq, row_logits, token in zip(batch, logits, next_tokens, strict=True)
        ]

    def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        start_pos: int,
        block_tables: Sequence[Sequence[int]],
    ) -> StepOutput:
        """Compute one request's tokens from ``start_pos``; a prefix hit of ``k`` blocks starts at
        ``k * block_size`` and reads the earlier positions from the blocks the hit found."""
        return self.step([SequenceStep(request_id, token_ids, start_pos, block_tables)])[0]

    def decode(self, batch: Sequence[SequenceStep]) -> list[StepOutput]:
        """One token for each request: a step that refuses anything but single new tokens."""
        for seq in batch:
            if len(seq.token_ids) != 1:
                raise ValueError(
                    f"decode takes one token per request, {seq.request_id!r} has "
                    f"{len(seq.token_ids)}"
                )
        return self.step(batch)

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Every token id gets the score of its hashed row, like the embedding's hashing."""
        row_scores = _rms_norm(last_hidden) @ self.head
        return row_scores[:, self._vocab_rows]

    def _plan(self, batch: Sequence[SequenceStep]) -> _StepPlan:
        self._check_batch(batch)
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        segments: list[list[tuple[slice, GroupIndex]]] = [[] for _ in self.profile.groups]
        for seq in batch:
            rows = slice(len(token_ids), len(token_ids) + len(seq.token_ids))
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
            last_rows.append(rows.stop - 1)
            for g, (spec, table) in enumerate(
                zip(self.profile.groups, seq.block_tables, strict=True)
            ):
                index = group_index(
                    BlockTable(spec, table, self.cache.num_blocks, self.device),
                    seq.start_pos,
                    len(seq.token_ids),
                )
                segments[g].append((rows, index))
        return _StepPlan(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(last_rows, dtype=torch.long, device=self.device),
            tuple(segments),
        )

    def _check_batch(self, batch: Sequence[SequenceStep]) -> None:
        if not batch:
            raise ValueError("a step needs at least one request")
        if len({seq.request_id for seq in batch}) != len(batch):
            raise ValueError("a request appears twice in one step")
        for seq in batch:
            if not seq.token_ids or seq.start_pos < 0:
                raise ValueError(f"{seq.request_id!r}: no new tokens or a negative start")
            if len(seq.block_tables) != len(self.profile.groups):
                raise ValueError(
                    f"{seq.request_id!r}: {len(seq.block_tables)} block tables for "
                    f"{len(self.profile.groups)} groups"
                )
            if not all(0 <= t < self.vocab_size for t in seq.token_ids):
                raise ValueError(f"{seq.request_id!r}: token id outside the vocabulary")
