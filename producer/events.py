"""The ZMQ wire contract: vLLM's KV-cache event structs, an exact encoder and a tolerant decoder.

Field names, order, defaults and encoding mirror ``vllm/distributed/kv_events.py`` (map-encoded
events, vLLM PR #42892 and later; ``locality`` from PR #48281), so that ``encode`` produces the
bytes vLLM would for the same batch. ``decode`` reads every generation vLLM has shipped.
"""

from __future__ import annotations

import msgspec

# vLLM's ExternalBlockHash: the digest's last 8 bytes as an unsigned int, or the raw digest.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of every event; the ``type`` tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All events of one scheduler step: always a 3-element msgpack array on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(batch: KVEventBatch) -> bytes:
    """Encode a batch exactly as vLLM's publisher does."""
    return _encoder.encode(batch)


# Group kinds as vLLM names them in ``kv_cache_spec_kind``.
GROUP_KINDS = (
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
    "unknown",
)


class GroupSpec(msgspec.Struct, frozen=True, gc=False):
    """One KV-cache group: what a consumer needs to apply vLLM's hit rule to it.

    ``kind`` and ``sliding_window`` travel on stores (``kv_cache_spec_kind``,
    ``kv_cache_spec_sliding_window``) and ``block_size`` is the store's ``block_size``;
    ``chunk_size`` (chunked local attention) does not travel on the wire and comes from config.
    """

    kind: str
    block_size: int
    sliding_window: int | None = None
    chunk_size: int | None = None
