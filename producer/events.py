"""The ZMQ wire contract: vLLM's KV-cache event structs, an exact encoder and a tolerant decoder.

Field names, order, defaults and encoding mirror ``vllm/distributed/kv_events.py`` as of vLLM
0.33.0 (map-encoded events, vLLM PR #42892 and later; ``locality`` from PR #48281; ``ownership``,
``session_id`` and ``lookahead_token_ids``), so that ``encode`` produces the bytes vLLM 0.33.0
would for the same batch. ``decode`` reads every generation vLLM has shipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

# vLLM's ExternalBlockHash: the digest's last 8 bytes as an unsigned int, or the raw digest.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"

# A store's block size: vLLM's CPU-offloading stores carry 0 (see the "cpu-offload-placeholder"
# vectors), so 0 is on the wire; no engine sends a negative one.
StoreBlockSize = Annotated[int, msgspec.Meta(ge=0)]
# A group's block size, window or chunk, in tokens: every hit rule divides by it or counts in it.
GroupSize = Annotated[int, msgspec.Meta(gt=0)]
# A group index is a KV-cache group's position in the engine's list: a handful in practice. The
# bound keeps each group's Kafka key (``<worker>/<group>``) one that consumers can parse.
MAX_GROUP_IDX = 10**9 - 1
GroupIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_GROUP_IDX)]


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of every event; the ``type`` tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    """Blocks cached in one group (or reported again when a request reuses them).

    A sliding-window group lists only the blocks it keeps: ``token_ids`` can cover more blocks
    than ``block_hashes``, or some with no hash at all, so nothing may derive one from the other.
    ``ownership`` names the secondary offloading tier that made the event, ``session_id`` the
    request context that triggered it. ``lookahead_token_ids`` (None when vLLM's EAGLE lookahead
    hashing is off) has one list per hash: the tokens after the block that its hash also covers.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: StoreBlockSize
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: GroupIndex | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: GroupIndex | None = None
    locality: str | None = None
    ownership: str | None = None


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
# The kind families, by the rule vLLM's prefix cache applies to each (its
# ``single_type_kv_cache_manager.py``). ``unknown`` and any newer kind are in none of them.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""A hit needs every block from the first (vLLM's SinkFullAttentionManager is a
FullAttentionManager); a block removed from a sliding window may still be held here."""
SLIDING_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
"""A hit needs the blocks the window covers before its end."""
CHUNKED_LOCAL_KIND = "chunked_local_attention"
"""A hit needs the blocks of its last chunk."""
MAMBA_KIND = "mamba"
"""A hit needs the one state block at its end."""
UNCACHED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})
"""vLLM keeps these out of prefix caching: they never decide a hit."""
PREFIX_CACHED_KINDS = FULL_ATTENTION_KINDS | SLIDING_WINDOW_KINDS | {CHUNKED_LOCAL_KIND, MAMBA_KIND}
"""Every kind whose rule is known."""


class GroupSpec(msgspec.Struct, frozen=True, gc=False):
    """One KV-cache group: what a consumer needs to apply vLLM's hit rule to it.

    ``kind`` and ``sliding_window`` travel on stores (``kv_cache_spec_kind``,
    ``kv_cache_spec_sliding_window``) and ``block_size`` is the store's ``block_size``;
    ``chunk_size`` (chunked local attention) does not travel on the wire and comes from config.
    Sizes are positive: decoding or ``msgspec.convert`` refuses any other (constructing one
    directly does not check), so a spec read from the log or configuration can never make a hit
    rule divide by zero or accept blocks a worker cannot have.
    """

    kind: str
    block_size: GroupSize
    sliding_window: GroupSize | None = None
    chunk_size: GroupSize | None = None


def has_group_sizes(store: BlockStored) -> bool:
    """Whether a store's block size and window can be a group's (``GroupSize``): vLLM's
    CPU-offloading stores carry block size 0, and teach nothing about their group."""
    window = store.kv_cache_spec_sliding_window
    return store.block_size > 0 and (window is None or window > 0)


# --- Decoding --------------------------------------------------------------------------------
#
# The bridge decodes every frame of every engine, so the common case must cost what vLLM's own
# typed decode costs: one msgspec pass over the whole batch into the current structs. A batch that
# pass rejects is most likely from a vLLM before PR #42892 (events as tagged arrays), so a second
# typed pass reads it with lenient array structs. Only a batch both reject (an event type this code
# does not know, a mix of forms, a missing field, a map with the draft ``evicted_groups``, a batch
# encoded as a map, or garbage) is read event by event. Lenient structs are converted to the
# current ones.

# 64 MiB: a 1M-token prompt stored in 7 groups is ~35 MB of token ids; anything bigger is garbage
# or an attack, and refusing it beats allocating for it.
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


class WireDecodeError(ValueError):
    """A payload that no vLLM generation would send; the only exception ``decode`` raises.

    One type, so a caller can dead-letter the frame with ``str(error)`` as the reason and never
    crash on a bad frame; the message names the event and the field that were wrong.
    """


class DecodedBatch(msgspec.Struct, frozen=True, gc=False):
    """A decoded batch and what the decoder skipped to read it.

    ``unknown_event_types`` holds the type name of every event skipped because this code does not
    know it (one entry per skipped event, in batch order), so a caller can count and log what a
    newer engine sent instead of losing the whole batch, as vLLM's own decoder would.
    """

    batch: KVEventBatch
    unknown_event_types: list[str] = []


class _LenientBlockStored(msgspec.Struct, gc=False):
    """BlockStored as any generation sends it: only the fields of PR #16750 are required.

    The fields are ``BlockStored``'s, in the same order, so a decoded value converts positionally;
    array-encoded events list them in this order, each generation appending its new ones.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: StoreBlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: GroupIndex | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockStored(_LenientBlockStored, tag="BlockStored"):
    pass


class _ArrayBlockStored(_LenientBlockStored, tag="BlockStored", array_like=True):
    pass


class _MapBlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    """BlockRemoved as a map; ``evicted_groups`` is the early draft of PR #37688."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: GroupIndex | None = None
    locality: str | None = None
    ownership: str | None = None
    evicted_groups: list[GroupIndex] | None = None


class _ArrayBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    """BlockRemoved as a tagged array.

    The third element is ``group_idx`` as merged in PR #37688, or, from its early draft, the list
    of evicted groups that took the same place.
    """

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx_or_evicted_groups: GroupIndex | list[GroupIndex] | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_MapEvent = _MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared
_ArrayEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _ArrayEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _MapEnvelope(msgspec.Struct, gc=False):
    """The batch with its events left undecoded, so that each event can fail on its own.

    As a map: one vLLM revision encoded ``EventBatch`` without ``array_like``.
    """

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Envelope(_MapEnvelope, array_like=True):
    """``_MapEnvelope`` as every released vLLM sends it: a 3-element array."""


class _MapTag(msgspec.Struct, gc=False):
    type: str


class _ArrayTag(msgspec.Struct, array_like=True, gc=False):
    type: str


KNOWN_EVENT_TYPES = frozenset(cls.__name__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared))

# Only the draft form needs a lenient look at a map-encoded batch the fast path would accept (it
# would silently drop the key). Scanning for the key costs far less than a second decode.
_EVICTED_GROUPS_KEY = msgspec.msgpack.encode("evicted_groups")

_DECODE_FAILURES = (msgspec.DecodeError, RecursionError)

_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_events_batch_decoder = msgspec.msgpack.Decoder(_ArrayEventsBatch)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_map_envelope_decoder = msgspec.msgpack.Decoder(_MapEnvelope)
_map_event_decoder = msgspec.msgpack.Decoder(_MapEvent)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayEvent)
_map_tag_decoder = msgspec.msgpack.Decoder(_MapTag)
_array_tag_decoder = msgspec.msgpack.Decoder(_ArrayTag)


def decode(payload: bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> DecodedBatch:
    """Decode one batch as any vLLM generation encodes it; raise ``WireDecodeError`` if none does.

    Unknown event types are skipped and named in the result, unknown fields are ignored, and
    absent fields take the current structs' defaults (None), so one engine on a newer or older
    vLLM never costs the fleet its events.
    """
    if len(payload) > max_bytes:
        raise WireDecodeError(f"payload of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if _EVICTED_GROUPS_KEY not in payload:
        try:
            return DecodedBatch(_batch_decoder.decode(payload))
        except _DECODE_FAILURES:
            pass
    try:
        legacy = _array_events_batch_decoder.decode(payload)
    except _DECODE_FAILURES:
        return _decode_event_by_event(payload)
    events = [current for event in legacy.events for current in _to_current(event)]
    return DecodedBatch(KVEventBatch(legacy.ts, events, legacy.data_parallel_rank))


def _decode_event_by_event(payload: bytes) -> DecodedBatch:
    envelope_decoder = _map_envelope_decoder if _is_msgpack_map(payload) else _envelope_decoder
    try:
        envelope = envelope_decoder.decode(payload)
    except _DECODE_FAILURES as error:
        raise WireDecodeError(f"not a KV event batch: {_reason(error)}") from error
    events: list[KVEvent] = []
    unknown_event_types: list[str] = []
    for index, raw in enumerate(envelope.events):
        is_map = _is_msgpack_map(raw)
        try:
            lenient = (_map_event_decoder if is_map else _array_event_decoder).decode(raw)
        except _DECODE_FAILURES as error:
            unknown_event_types.append(_unknown_type_or_raise(index, raw, is_map, error))
            continue
        events.extend(_to_current(lenient))
    batch = KVEventBatch(envelope.ts, events, envelope.data_parallel_rank)
    return DecodedBatch(batch, unknown_event_types)


def _is_msgpack_map(data: bytes | msgspec.Raw) -> bool:
    """Fixmap (0x80-0x8f), map16 (0xde) or map32 (0xdf): events are maps or tagged arrays, and
    batches arrays or, from one vLLM revision, maps."""
    head = memoryview(data)[:1]
    return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def _unknown_type_or_raise(index: int, raw: msgspec.Raw, is_map: bool, error: Exception) -> str:
    """The type name of an event the lenient structs rejected, if that type is unknown.

    A known type that does not decode is a malformed event: dropping it would corrupt every
    consumer's view of the cache, so the batch fails (the bridge dead-letters it) instead.
    """
    try:
        tag = (_map_tag_decoder if is_map else _array_tag_decoder).decode(raw).type
    except _DECODE_FAILURES:
        shape = "map without a string 'type'" if is_map else "neither a map nor a tagged array"
        raise WireDecodeError(f"event {index}: {shape}: {_reason(error)}") from error
    if tag in KNOWN_EVENT_TYPES:
        raise WireDecodeError(f"event {index} ({tag}): {_reason(error)}") from error
    return tag


def _to_current(event: _MapEvent | _ArrayEvent) -> list[KVEvent]:
    if isinstance(event, _LenientBlockStored):
        # Same fields in the same order: positional copying is ~5x faster than by name.
        return [BlockStored(*msgspec.structs.astuple(event))]
    if isinstance(event, _MapBlockRemoved):
        groups = [event.group_idx] if event.evicted_groups is None else event.evicted_groups
        return _removals(event, groups)
    if isinstance(event, _ArrayBlockRemoved):
        group = event.group_idx_or_evicted_groups
        groups = group if isinstance(group, list) else [group]
        return _removals(event, groups)
    return [AllBlocksCleared()]


def _removals(
    event: _MapBlockRemoved | _ArrayBlockRemoved, groups: Sequence[int | None]
) -> list[KVEvent]:
    """One BlockRemoved per group, the form PR #37688 merged, also for its draft's group list.

    An empty draft list evicted the blocks from no group, so it yields no event. The removals
    share one hash list: a copy per group made memory grow with hashes times groups, both
    unbounded on the wire (2 KB of payload, 1,000 of each, took 8 MB; 2 MB would take 8 TB).
    """
    hashes = event.block_hashes
    return [
        BlockRemoved(hashes, event.medium, group, event.locality, event.ownership)
        for group in groups
    ]


def _reason(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error)
