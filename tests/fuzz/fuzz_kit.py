"""What the fuzzers share: bounded, reproducible settings, vLLM's wire vectors as seeds, and the
values and mutations they are fuzzed with.

Counts: each fuzzer names its CI count (``fuzz_settings(n)``), and runs exactly that many examples,
derandomized (the same examples on every run and machine) and without Hypothesis' example
database, so a CI failure reproduces anywhere. ``HMAKV_FUZZ_EXAMPLES=N`` runs N examples per
fuzzer instead, randomly seeded (pytest's ``--hypothesis-seed`` fixes the seed), for a longer hunt;
a failure prints the ``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from hmakv.producer.events import (
    GROUP_KINDS,
    KNOWN_EVENT_TYPES,
    MAX_GROUP_IDX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    WireDecodeError,
    decode,
    encode,
)

EXAMPLES_ENV = "HMAKV_FUZZ_EXAMPLES"
DATA = Path(__file__).parents[1] / "data"
UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)


def examples_override() -> int | None:
    """``HMAKV_FUZZ_EXAMPLES`` as a count, or None when unset (CI)."""
    value = os.environ.get(EXAMPLES_ENV, "").strip()
    if not value:
        return None
    count = int(value)
    if count <= 0:
        raise ValueError(f"{EXAMPLES_ENV} must be a positive count, got {value!r}")
    return count


def fuzz_settings(examples: int) -> settings:
    """``examples`` derandomized examples (CI), or ``HMAKV_FUZZ_EXAMPLES`` random ones."""
    override = examples_override()
    return settings(
        max_examples=examples if override is None else override,
        deadline=None,
        derandomize=override is None,
        database=None,
        print_blob=True,
        # Explaining a failure reruns it thousands of times (minutes for the index's); the
        # shrunk example and its reproduction blob are what a fix needs.
        phases=[phase for phase in Phase if phase is not Phase.explain],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# A decode's peak memory may be at most this multiple of its payload, plus a constant for what
# any decode allocates (its structs, an error's message and traceback). The worst found, with
# the limit below met: an evicted_groups list of 1-byte groups, each a BlockRemoved (~81x);
# empty maps as extra keys (~80x); empty lists (~72x). Every byte of msgpack can be one
# Python object, so the multiple cannot be small; what it rules out is growth with anything but
# the payload's size: a quadratic (2 KB took 8 MB before the draft's removals shared their
# hashes) or an allocation for a length the payload only claims.
MEMORY_MULTIPLE = 128
MEMORY_CONSTANT = 64 * 1024


def decode_peak(payload: bytes) -> int:
    """The most memory ``decode`` held at once (its result included), in bytes."""
    tracemalloc.start()
    try:
        try:
            decoded = decode(payload)
        except WireDecodeError:
            decoded = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del decoded
    return peak


# --- vLLM's vectors, every generation ---------------------------------------------------------

WIRE_VECTORS: list[dict[str, Any]] = [
    json.loads(line) for line in (DATA / "vllm-wire.jsonl").read_text().splitlines()
]
GENERATIONS = sorted({vector["vllm"] for vector in WIRE_VECTORS})
VECTOR_PAYLOADS: dict[str, bytes] = {
    f"{vector['vllm']}/{vector['case']}": bytes.fromhex(vector["payload_hex"])
    for vector in WIRE_VECTORS
}


def _pack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


# Generations the vectors do not hold, built as producer/README.md describes them: the early
# draft of PR #37688 (evicted_groups, map and array) and an event type this code does not know.
SYNTHETIC_PAYLOADS: dict[str, bytes] = {
    "draft/evicted-groups-map": _pack(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1, 2], "evicted_groups": [0, 1]}], 0]
    ),
    "draft/evicted-groups-array": _pack([1.0, [["BlockRemoved", [4], "GPU", [0, 2]]], 0]),
    "newer/unknown-event": _pack(
        [2.0, [{"type": "BlockInactive", "block_hashes": [7]}, {"type": "AllBlocksCleared"}], 1]
    ),
}
SEED_PAYLOADS: dict[str, bytes] = {**VECTOR_PAYLOADS, **SYNTHETIC_PAYLOADS}
seed_payloads = st.sampled_from(sorted(SEED_PAYLOADS)).map(SEED_PAYLOADS.__getitem__)


def valid_payloads() -> st.SearchStrategy[bytes]:
    """vLLM's payloads, and any well-typed batch encoded as vLLM 0.33.0 does (``batches``)."""
    return st.one_of(seed_payloads, batches.map(encode))


# --- msgpack values -----------------------------------------------------------------------------

# Names decoders look for, so that random maps and arrays meet the typed paths.
FIELD_NAMES = (
    "type",
    "ts",
    "events",
    "data_parallel_rank",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "evicted_groups",
    "worker",
    "epoch",
    "seq",
    "first_event",
    "health",
    "groups",
    "kind",
    "sliding_window",
    "chunk_size",
    "endpoint",
    "last_seq",
    "source",
    "reason",
    "detail",
    "frames",
)
EVENT_NAMES = (*sorted(KNOWN_EVENT_TYPES), "BlockInactive")
BOUNDARY_INTS = (
    0,
    1,
    -1,
    127,
    128,
    255,
    256,
    2**16,
    2**32 - 1,
    2**32,
    MAX_GROUP_IDX,
    MAX_GROUP_IDX + 1,
    2**63 - 1,
    UINT64_MAX,
    INT64_MIN,
)

ints = st.one_of(st.integers(INT64_MIN, UINT64_MAX), st.sampled_from(BOUNDARY_INTS))
texts = st.one_of(st.text(max_size=8), st.sampled_from(FIELD_NAMES + EVENT_NAMES))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(),
    texts,
    st.binary(max_size=12),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=4)),
)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(texts, children, max_size=6),
    ),
    max_leaves=16,
)


# --- mutations ----------------------------------------------------------------------------------

# Headers that claim far more than follows: a decoder must not allocate for the claim.
LYING_HEADERS = (
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G elements
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GB
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\xdc\xff\xff",  # array16
    b"\xc1",  # never used
    b"\x91" * 64,  # nesting
)


@st.composite
def byte_mutations(draw: st.DrawFn, payload: bytes) -> bytes:
    """``payload`` after one to four byte-level edits: overwrite, insert, delete, duplicate a
    span, truncate, splice in a seed or a lying header."""
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 6))
        at = draw(st.integers(0, len(data)))
        if kind == 0 and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif kind == 1:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == 2:
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == 3:
            span = data[at : at + draw(st.integers(1, 32))]
            data[at:at] = span * draw(st.integers(1, 8))
        elif kind == 4:
            del data[at:]
        elif kind == 5:
            data[at:at] = draw(st.sampled_from(LYING_HEADERS))
        else:
            other = draw(seed_payloads)
            cut = draw(st.integers(0, len(other)))
            data[at:] = other[cut:]
    return bytes(data)


@st.composite
def tree_mutations(draw: st.DrawFn, payload: bytes) -> bytes:
    """``payload`` decoded as plain msgpack, one node deep inside it changed, encoded again: the
    shape stays near the real one, so the typed decoders get past their first checks."""
    return _pack(draw(mutated_value(msgspec.msgpack.decode(payload))))


@st.composite
def mutated_value(draw: st.DrawFn, value: Any, depth: int = 0) -> Any:
    """``value`` with one node replaced, repeated, dropped, wrapped or retyped."""
    descend = draw(st.integers(0, 9)) < 7 and depth < 12
    if isinstance(value, list) and value and descend:
        at = draw(st.integers(0, len(value) - 1))
        copy = list(value)
        copy[at] = draw(mutated_value(value[at], depth + 1))
        return copy
    if isinstance(value, dict) and value and descend:
        key = draw(st.sampled_from(sorted(value, key=repr)))
        return {**value, key: draw(mutated_value(value[key], depth + 1))}
    return draw(_replacements(value))


def _replacements(value: Any) -> st.SearchStrategy[Any]:
    options: list[st.SearchStrategy[Any]] = [
        msgpack_values,
        st.just([value]),
        st.sampled_from(BOUNDARY_INTS),
        st.sampled_from(FIELD_NAMES + EVENT_NAMES),
        st.none(),
    ]
    if isinstance(value, list):
        options += [
            st.integers(1, 256).map(lambda times: value * times),
            st.integers(0, max(0, len(value) - 1)).map(lambda at: value[:at] + value[at + 1 :]),
            msgpack_values.map(lambda extra: [*value, extra]),
        ]
    if isinstance(value, dict):
        options += [
            st.sampled_from(sorted(value, key=repr)).map(
                lambda key: {k: v for k, v in value.items() if k != key}
            )
            if value
            else st.just(value),
            st.tuples(st.sampled_from(FIELD_NAMES), msgpack_values).map(
                lambda item: {**value, item[0]: item[1]}
            ),
        ]
    return st.one_of(options)


def mutations_of(payloads: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Byte-level or tree-level mutations of what ``payloads`` draws, or the payload itself."""
    return payloads.flatmap(
        lambda payload: st.one_of(
            st.just(payload),
            byte_mutations(payload),
            tree_mutations(payload) if _is_msgpack(payload) else byte_mutations(payload),
        )
    )


def _is_msgpack(payload: bytes) -> bool:
    try:
        msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


# --- well-typed events: any value their types admit ---------------------------------------------

any_hash = st.one_of(ints, st.binary(max_size=32))


def stores(
    hashes: st.SearchStrategy[list[ExternalBlockHash]],
    media: st.SearchStrategy[str | None],
    group_idx: st.SearchStrategy[int | None],
) -> st.SearchStrategy[BlockStored]:
    """``BlockStored`` with every field anything its type (and so ``decode``) admits; its
    ``block_hashes`` from ``hashes``, its parent one of them or any."""
    small_lists = st.lists(ints, max_size=4)
    return st.builds(
        BlockStored,
        block_hashes=hashes,
        parent_block_hash=st.none() | any_hash,
        token_ids=st.lists(ints, max_size=40),
        block_size=st.sampled_from([0, 1, 4, 16, 32]) | st.integers(0, UINT64_MAX),
        lora_id=st.none() | ints,
        medium=media,
        lora_name=st.none() | texts,
        extra_keys=st.none() | st.lists(st.none() | st.lists(scalars, max_size=4).map(tuple)),
        group_idx=group_idx,
        kv_cache_spec_kind=st.none() | st.sampled_from(GROUP_KINDS) | texts,
        kv_cache_spec_sliding_window=st.none() | st.sampled_from([1, 16, 32, 64]) | ints,
        locality=st.none() | texts,
        ownership=st.none() | texts,
        session_id=st.none() | texts,
        lookahead_token_ids=st.none() | st.lists(small_lists, max_size=8),
    )


def removals(
    hashes: st.SearchStrategy[list[ExternalBlockHash]],
    media: st.SearchStrategy[str | None],
    group_idx: st.SearchStrategy[int | None],
) -> st.SearchStrategy[BlockRemoved]:
    return st.builds(
        BlockRemoved,
        block_hashes=hashes,
        medium=media,
        group_idx=group_idx,
        locality=st.none() | texts,
        ownership=st.none() | texts,
    )


any_hash_lists = st.lists(any_hash, max_size=8)  # ints and digests mixed, which decode takes
any_media = st.none() | st.sampled_from(["GPU", "CPU"]) | texts
any_group_idx = st.none() | st.integers(0, MAX_GROUP_IDX)


def events(
    hashes: st.SearchStrategy[list[ExternalBlockHash]] = any_hash_lists,
    media: st.SearchStrategy[str | None] = any_media,
    group_idx: st.SearchStrategy[int | None] = any_group_idx,
) -> st.SearchStrategy[KVEvent]:
    return st.one_of(
        stores(hashes, media, group_idx),
        removals(hashes, media, group_idx),
        st.just(AllBlocksCleared()),
    )


batches = st.builds(
    KVEventBatch,
    ts=st.floats(),
    events=st.lists(events(), max_size=6),
    data_parallel_rank=st.none() | ints,
)
