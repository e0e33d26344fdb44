"""Model profiles: the KV-cache layout of a hybrid model, as data.

The reference engine stands in for vLLM, so a profile carries exactly what vLLM's KV-cache
manager derives from a model: its cache groups (one per layer type, with their block sizes and
windows), the size of the one block pool they share, and the hash function and seed that make
block hashes reproducible outside the engine. The small model dimensions are there for a toy
model layered on top later; the cache core never reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hmakv.producer.events import GroupSpec


@dataclass(frozen=True)
class ModelDims:
    """Toy-model shape: one entry of ``layers_per_group`` per cache group."""

    layers_per_group: tuple[int, ...]
    num_heads: int
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class ModelProfile:
    """A hybrid model's cache layout.

    ``num_blocks`` counts the single pool every group allocates from, block 0 (vLLM's null block)
    included, because vLLM sizes one pool for all groups rather than one per group.
    """

    name: str
    groups: tuple[GroupSpec, ...]
    num_blocks: int
    dims: ModelDims
    hash_fn: str = "sha256_cbor"
    hash_seed: str = "0"

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"profile {self.name!r} has no KV-cache group")
        if len(self.dims.layers_per_group) != len(self.groups):
            raise ValueError(
                f"profile {self.name!r}: {len(self.dims.layers_per_group)} layer counts for "
                f"{len(self.groups)} groups"
            )
        if self.num_blocks < 2:
            raise ValueError(f"profile {self.name!r}: a pool needs the null block and one more")


def _full(block_size: int = 16) -> GroupSpec:
    return GroupSpec(kind="full_attention", block_size=block_size)


def _sliding(window: int, block_size: int = 16) -> GroupSpec:
    return GroupSpec(kind="sliding_window", block_size=block_size, sliding_window=window)


_TOY = {"num_heads": 4, "head_dim": 16, "vocab_size": 512}

_PROFILES = (
    # gpt-oss alternates full and 128-token sliding-window layers: two groups, equal blocks.
    ModelProfile(
        name="gpt-oss-like",
        groups=(_full(), _sliding(128)),
        num_blocks=1024,
        dims=ModelDims(layers_per_group=(2, 2), **_TOY),
    ),
    # Gemma 3 has five 1024-token sliding-window layers per full layer; vLLM puts as many layers
    # in every group, so the sliding layers form five groups with one identical spec.
    ModelProfile(
        name="gemma3-like",
        groups=(_full(), *(_sliding(1024) for _ in range(5))),
        num_blocks=4096,
        dims=ModelDims(layers_per_group=(1, 1, 1, 1, 1, 1), **_TOY),
    ),
    # Mamba hybrids in vLLM's "align" cache mode: the state is cached once per mamba block, a
    # multiple of the attention block, so every hit is a whole number of mamba blocks.
    ModelProfile(
        name="mamba-hybrid-like",
        groups=(_full(), GroupSpec(kind="mamba", block_size=64)),
        num_blocks=1024,
        dims=ModelDims(layers_per_group=(1, 3), **_TOY),
    ),
    # The layout of tests/data/vllm-trace-swa-small-seed1.jsonl.gz (recorded from vLLM itself).
    ModelProfile(
        name="swa-small",
        groups=(_full(), _sliding(32), _sliding(64)),
        num_blocks=250,
        dims=ModelDims(layers_per_group=(1, 1, 1), **_TOY),
    ),
    # Llama 4 style chunked local attention (chunk 8192 there; small here so tests reach it).
    ModelProfile(
        name="chunked-local-like",
        groups=(_full(), GroupSpec(kind="chunked_local_attention", block_size=16, chunk_size=64)),
        num_blocks=1024,
        dims=ModelDims(layers_per_group=(1, 3), **_TOY),
    ),
    # Groups with different block sizes: a hit is a multiple of 64 tokens, so vLLM caches only the
    # sliding-window blocks ending a 64-token segment (the only ones a hit can read).
    ModelProfile(
        name="mixed-block-like",
        groups=(_full(64), _sliding(32)),
        num_blocks=1024,
        dims=ModelDims(layers_per_group=(1, 1), **_TOY),
    ),
)

PROFILES: Mapping[str, ModelProfile] = MappingProxyType({p.name: p for p in _PROFILES})


class UnknownProfile(KeyError):
    """No profile has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


def get_profile(name: str) -> ModelProfile:
    """The profile called ``name``; the error lists the names there are."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise UnknownProfile(f"unknown model profile {name!r}; known profiles: {known}") from None
