"""vLLM-compatible prefix-cache block hashes, recomputed outside the engine.

A router can only ask "which worker holds this prompt's prefix?" if it computes the very hashes the
engine put on the wire. vLLM chains them: block i hashes ``(parent digest, block tokens, extra
keys)``, the first block's parent being ``NONE_HASH``, a digest of the seed (``PYTHONHASHSEED``).
Only the CBOR-based functions serialize the same way in every process; the pickle-based ``sha256``
and ``xxhash`` are refused, as their bytes depend on the engine's Python and are not a contract.
Reference: ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``.

The Python loop here is the specification. Blocks without extra keys, a router's usual prompt, go
through ``hmakv_native`` (``native/``, Rust) when it is installed: 7x faster on 8k tokens. A
prompt may come packed (``PackedTokenIds``), which that path reads without a Python int per token.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, TypeAlias, TypeVar

import cbor2
import xxhash

# One block's extra keys as vLLM builds them: a tuple, or None when the block has none.
BlockExtraKeys = tuple[object, ...] | None

EXTERNAL_HASH_BYTES = 8

# A block hash in any form: digest bytes, external int, or a test's stand-in.
H = TypeVar("H")


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": _sha256_digest,
    "xxhash_cbor": xxhash.xxh3_128_digest,
}

# vLLM's pickle-based functions: their bytes depend on the engine's Python and pickle protocol.
_ENGINE_ONLY = frozenset({"sha256", "xxhash"})

HASH_FUNCTIONS = tuple(_DIGESTS)


PACKED_TOKEN_BYTES = 4  # a packed token id: a little-endian uint32


class PackedTokenIds:
    """A prompt's token ids as one buffer of little-endian uint32s (every vocabulary fits).

    The form a router sends when it wants the index to skip making a Python int per token:
    native hashing reads the buffer as it is, the Python specification unpacks it.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % PACKED_TOKEN_BYTES:
            raise ValueError(
                f"packed token ids are {PACKED_TOKEN_BYTES} bytes each: "
                f"{len(data)} bytes is not a whole number of them"
            )
        self.data = data

    @classmethod
    def pack(cls, token_ids: Sequence[int]) -> PackedTokenIds:
        """Raises ``struct.error`` for a token id outside uint32."""
        return cls(struct.pack(f"<{len(token_ids)}I", *token_ids))

    def __len__(self) -> int:
        return len(self.data) // PACKED_TOKEN_BYTES

    def unpack(self) -> tuple[int, ...]:
        return struct.unpack(f"<{len(self)}I", self.data)


TokenIds = Sequence[int] | PackedTokenIds
# A prompt's hashes in vLLM's external form, as uint64s in one buffer.
ExternalHashes: TypeAlias = "array[int]"  # (subscripted only for the type checker on 3.11)
EXTERNAL_HASHES_TYPECODE = "Q"
# What hmakv_native reads: ints, or a PackedTokenIds' bytes.
Tokens = list[int] | tuple[int, ...] | bytes


class _NativeHasher(Protocol):
    """``hmakv_native``: blocks without extra keys; tokens must be a list or tuple of ints, or
    packed bytes."""

    def block_hashes(
        self, hash_fn: str, parent: bytes, token_ids: Tokens, block_size: int, lookahead: int = 0
    ) -> list[bytes]: ...

    def external_hashes(
        self, hash_fn: str, parent: bytes, token_ids: Tokens, block_size: int, lookahead: int = 0
    ) -> bytes: ...


def _native_hashing() -> _NativeHasher | None:
    try:
        import hmakv_native
    except ImportError:  # not built (scripts/setup builds it): every prompt is hashed in Python
        return None
    return hmakv_native


_NATIVE = _native_hashing()
NATIVE_HASHING = _NATIVE is not None


class UnsupportedHashFunction(ValueError):
    """The named hash function cannot be reproduced here (pickle-based or unknown)."""


def _digest_for(hash_fn: str) -> Callable[[bytes], bytes]:
    digest = _DIGESTS.get(hash_fn)
    if digest is not None:
        return digest
    supported = ", ".join(HASH_FUNCTIONS)
    if hash_fn in _ENGINE_ONLY:
        raise UnsupportedHashFunction(
            f"hash function {hash_fn!r} hashes a Python pickle and cannot be reproduced outside "
            f"the engine process; start vLLM with --prefix-caching-hash-algo set to one of "
            f"{supported} and a fixed PYTHONHASHSEED"
        )
    raise UnsupportedHashFunction(f"unknown hash function {hash_fn!r}; supported: {supported}")


def _cbor_hash(digest: Callable[[bytes], bytes], value: object) -> bytes:
    return digest(cbor2.dumps(value, canonical=True))


def external(block_hash: bytes) -> int:
    """The int vLLM puts on the wire for a digest: its last 8 bytes, unsigned big-endian.

    It can exceed 2**63 - 1, so it travels as a msgpack uint64.
    """
    return int.from_bytes(block_hash[-EXTERNAL_HASH_BYTES:], "big")


class BlockHasher:
    """Chained block hashing for one (hash function, seed) pair.

    Built once and reused: ``NONE_HASH`` and the digest are resolved here so that the per-block
    path is one CBOR encode and one digest.
    """

    __slots__ = ("_digest", "hash_fn", "none_hash", "seed")

    def __init__(self, hash_fn: str = "sha256_cbor", seed: str = "0") -> None:
        self._digest = _digest_for(hash_fn)
        self.hash_fn = hash_fn
        self.seed = seed
        self.none_hash: bytes = _cbor_hash(self._digest, seed)

    def __repr__(self) -> str:
        return f"BlockHasher(hash_fn={self.hash_fn!r}, seed={self.seed!r})"

    def block_hashes(
        self,
        token_ids: TokenIds,
        block_size: int,
        *,
        extra_keys: Sequence[BlockExtraKeys] | None = None,
        parent: bytes | None = None,
        lookahead: int = 0,
    ) -> list[bytes]:
        """Digests of the full blocks of ``token_ids``; a trailing partial block is not hashed.

        ``parent`` continues a chain (the digest of the block before ``token_ids[0]``).
        ``extra_keys[i]`` belongs to block i and must cover every hashed block; entries beyond
        them are ignored, since an engine knows a block's keys before the block fills.

        ``lookahead`` is vLLM's ``num_hash_lookahead_tokens`` (EAGLE-style drafters, vLLM 0.33.0
        and later): each hash then also covers the ``lookahead`` tokens after its block, as the
        block's extra keys ``(keys or None, *those tokens)``, so a block is hashed only once they
        exist, as in vLLM's ``get_request_block_hasher``. A worker's stores say which setting it
        runs with (``BlockStored.lookahead_token_ids``). With it, ``extra_keys[i]`` are the keys
        vLLM gives block i together with its lookahead tokens (a multimodal item starting among
        them counts).
        """
        num_blocks = _full_blocks(len(token_ids), block_size, lookahead)
        if extra_keys is not None and len(extra_keys) < num_blocks:
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries for {num_blocks} full blocks"
            )
        previous = parent or self.none_hash
        if _NATIVE is not None and extra_keys is None:
            try:
                return _NATIVE.block_hashes(
                    self.hash_fn, previous, _native_form(token_ids), block_size, lookahead
                )
            except (OverflowError, TypeError):
                pass  # a token that is not a uint64 int: CBOR encodes it otherwise
        return self._python_block_hashes(
            _python_form(token_ids), block_size, num_blocks, extra_keys, previous, lookahead
        )

    def external_hashes(
        self,
        token_ids: TokenIds,
        block_size: int,
        *,
        extra_keys: Sequence[BlockExtraKeys] | None = None,
        lookahead: int = 0,
    ) -> ExternalHashes:
        """``block_hashes`` in vLLM's external form, as a router looks them up."""
        if _NATIVE is not None and extra_keys is None:
            _full_blocks(len(token_ids), block_size, lookahead)
            try:
                packed = _NATIVE.external_hashes(
                    self.hash_fn, self.none_hash, _native_form(token_ids), block_size, lookahead
                )
            except (OverflowError, TypeError):
                pass  # as in block_hashes
            else:
                return array(EXTERNAL_HASHES_TYPECODE, packed)
        digests = self.block_hashes(
            token_ids, block_size, extra_keys=extra_keys, lookahead=lookahead
        )
        return array(EXTERNAL_HASHES_TYPECODE, map(external, digests))

    def _python_block_hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        num_blocks: int,
        extra_keys: Sequence[BlockExtraKeys] | None,
        previous: bytes,
        lookahead: int,
    ) -> list[bytes]:
        digest = self._digest
        dumps = cbor2.dumps
        hashes: list[bytes] = []
        for index in range(num_blocks):
            start = index * block_size
            end = start + block_size
            keys = (extra_keys[index] if extra_keys is not None else None) or None
            if lookahead:
                keys = (keys, *tokens[end : end + lookahead])
            block = (previous, tokens[start:end], keys)
            previous = digest(dumps(block, canonical=True))
            hashes.append(previous)
        return hashes


def _native_form(token_ids: TokenIds) -> Tokens:
    if isinstance(token_ids, PackedTokenIds):
        return token_ids.data
    return _python_form(token_ids)  # bytes as ints, as Python reads them, never as packed


def _python_form(token_ids: TokenIds) -> list[int] | tuple[int, ...]:
    # CBOR encodes lists and tuples alike, so list slices hash as vLLM's tuples do.
    if isinstance(token_ids, PackedTokenIds):
        return token_ids.unpack()
    return token_ids if isinstance(token_ids, list | tuple) else list(token_ids)


def _full_blocks(num_tokens: int, block_size: int, lookahead: int) -> int:
    """How many blocks a prompt of ``num_tokens`` hashes; refuses impossible settings."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if lookahead < 0:
        raise ValueError(f"lookahead must not be negative, got {lookahead}")
    return max(0, num_tokens - lookahead) // block_size


def group_block_hashes(
    hashes: Sequence[H], hash_block_size: int, group_block_size: int
) -> Sequence[H]:
    """Hashes of a group whose blocks span several hash blocks, as vLLM derives them.

    vLLM hashes at the finest block size; hashes are chained, so the hash of a group block's last
    sub-block identifies that block and its whole prefix, and vLLM (``BlockHashListWithBlockSize``)
    uses it as the group block's hash. Sub-blocks that do not fill a group block are dropped.
    (Older vLLM concatenated the sub-blocks' digests: its whole digests differ, but the int form,
    the wire's default, is the same last 8 bytes, and the index keeps every hash as that int.)
    """
    if hash_block_size <= 0 or group_block_size % hash_block_size:
        raise ValueError(
            f"group block size {group_block_size} is not a multiple of "
            f"hash block size {hash_block_size}"
        )
    scale = group_block_size // hash_block_size
    return hashes if scale == 1 else hashes[scale - 1 :: scale]


class MultiModalSpan(NamedTuple):
    """Where one multimodal item sits in the prompt: vLLM's identifier and placeholder range."""

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    num_blocks: int,
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
    cache_salt: str | None = None,
) -> list[BlockExtraKeys]:
    """Per-block extra keys, in vLLM's order: LoRA name, multimodal items, cache salt.

    A multimodal item contributes ``(identifier, offset relative to the block start)`` to every
    block its placeholder range overlaps; spans must not overlap one another (vLLM's assumption).
    The salt goes into the first block only: the chain carries it to every later block.
    Prompt-embedding digests, vLLM's fourth kind, need the tensors and are not produced here.
    """
    spans = sorted(mm_spans, key=lambda span: span.offset)
    first_live_span = 0
    keys: list[BlockExtraKeys] = []
    for index in range(num_blocks):
        start = index * block_size
        end = start + block_size
        while first_live_span < len(spans) and _span_end(spans[first_live_span]) <= start:
            first_live_span += 1
        block_keys: list[object] = [lora_name] if lora_name else []
        block_keys.extend(_overlapping_items(spans, first_live_span, start, end))
        if index == 0 and cache_salt:
            block_keys.append(cache_salt)
        keys.append(tuple(block_keys) or None)
    return keys


def _span_end(span: MultiModalSpan) -> int:
    return span.offset + span.length


def _overlapping_items(
    spans: Sequence[MultiModalSpan], first: int, start: int, end: int
) -> list[tuple[str, int]]:
    items: list[tuple[str, int]] = []
    for span in spans[first:]:
        if span.offset >= end:
            break
        if _span_end(span) > start:
            items.append((span.identifier, span.offset - start))
    return items
