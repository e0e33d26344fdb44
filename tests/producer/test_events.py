"""The wire contract: vLLM's vectors, every generation's field set, and malformed input."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmakv.bridge.config import ConfigError, load_engines_file
from hmakv.producer.events import (
    KNOWN_EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    GroupSpec,
    KVEvent,
    KVEventBatch,
    WireDecodeError,
    decode,
    encode,
)

DATA = Path(__file__).parents[1] / "data"
WIRE_VECTORS = [json.loads(line) for line in (DATA / "vllm-wire.jsonl").read_text().splitlines()]
UINT64_MAX = 2**64 - 1
TOKENS = list(range(16))


def _from_vector_json(value: Any) -> Any:
    """Vectors spell bytes as {"bytes": "<hex>"}; everything else is plain JSON."""
    if isinstance(value, dict) and value.keys() == {"bytes"}:
        return bytes.fromhex(value["bytes"])
    if isinstance(value, dict):
        return {key: _from_vector_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_vector_json(item) for item in value]
    return value


def _all_fields(event: KVEvent) -> dict[str, Any]:
    fields = {name: getattr(event, name) for name in event.__struct_fields__}
    return {"type": type(event).__name__, **fields}


def _pack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def _decode_one(event: object) -> DecodedBatch:
    return decode(_pack([1.5, [event], 0]))


def _stored(**overrides: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return BlockStored(**(fields | overrides))


# --- vLLM's own vectors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "vector", WIRE_VECTORS, ids=[f"{v['vllm']}-{v['case']}" for v in WIRE_VECTORS]
)
def test_every_vllm_generation_decodes_to_its_expected_batch(vector: dict[str, Any]) -> None:
    """Each field vLLM had at that revision matches; fields it did not have yet are None."""
    expected = _from_vector_json(vector["expected"])
    decoded = decode(bytes.fromhex(vector["payload_hex"]))

    assert decoded.unknown_event_types == []
    assert decoded.batch.ts == expected["ts"]
    assert decoded.batch.data_parallel_rank == expected["data_parallel_rank"]
    assert len(decoded.batch.events) == len(expected["events"])
    for event, expected_event in zip(decoded.batch.events, expected["events"], strict=True):
        fields = _all_fields(event)
        assert {key: fields[key] for key in expected_event} == expected_event
        assert all(fields[key] is None for key in fields.keys() - expected_event.keys())


NEWEST = "0.33.0"
NEWEST_VECTORS = [v for v in WIRE_VECTORS if v["vllm"] == NEWEST]


@pytest.mark.parametrize("vector", NEWEST_VECTORS, ids=[v["case"] for v in NEWEST_VECTORS])
def test_newest_payloads_reencode_byte_for_byte(vector: dict[str, Any]) -> None:
    payload = bytes.fromhex(vector["payload_hex"])
    assert encode(decode(payload).batch) == payload


def test_newest_vectors_set_and_leave_unset_every_0_33_field() -> None:
    """The vectors exercise each 0.33.0 field both ways, or the re-encode test proves little."""
    events = [
        event
        for v in NEWEST_VECTORS
        for event in decode(bytes.fromhex(v["payload_hex"])).batch.events
    ]
    stores = [event for event in events if isinstance(event, BlockStored)]
    removals = [event for event in events if isinstance(event, BlockRemoved)]
    for name in ("ownership", "session_id", "lookahead_token_ids"):
        assert {getattr(store, name) is None for store in stores} == {True, False}, name
    assert {removal.ownership is None for removal in removals} == {True, False}
    assert any(isinstance(event, AllBlocksCleared) for event in events)


def test_a_map_encoded_batch_decodes_like_the_array_one() -> None:
    """One vLLM revision encoded the whole EventBatch as a map (vector made with its structs)."""
    [vector] = [v for v in WIRE_VECTORS if v["vllm"] == "map-batch"]
    payload = bytes.fromhex(vector["payload_hex"])
    assert msgspec.msgpack.decode(payload).keys() == {"ts", "events", "data_parallel_rank"}
    decoded = decode(payload)
    assert decode(encode(decoded.batch)) == decoded
    assert decoded.batch.data_parallel_rank == 2
    assert [type(event) for event in decoded.batch.events] == [BlockStored, BlockRemoved]


@pytest.mark.parametrize("rank", [None, 3], ids=["rank-omitted", "rank-3"])
def test_a_map_batch_of_array_events_and_an_unknown_one_decodes(rank: int | None) -> None:
    batch: dict[str, object] = {
        "ts": 6.0,
        "events": [["BlockRemoved", [5], "GPU", 1, None, "tier-x"], {"type": "BlockInactive"}],
    }
    if rank is not None:
        batch["data_parallel_rank"] = rank
    decoded = decode(_pack(batch))
    assert decoded == DecodedBatch(
        KVEventBatch(6.0, [BlockRemoved([5], "GPU", 1, ownership="tier-x")], rank),
        ["BlockInactive"],
    )


# --- Field sets and value ranges of every generation -------------------------------------------


def test_oldest_array_generation_fills_absent_fields_with_none() -> None:
    """PR #16750: BlockStored without medium/lora_name/extra_keys, BlockRemoved without medium."""
    decoded = decode(
        _pack([2.0, [["BlockStored", [7], None, TOKENS, 16, None], ["BlockRemoved", [7]]]])
    )
    assert decoded.batch == KVEventBatch(
        2.0, [_stored(block_hashes=[7], medium=None), BlockRemoved([7], None)], None
    )


def test_array_event_with_locality_and_trailing_unknown_fields() -> None:
    known = ["BlockStored", [1], None, TOKENS, 16, None, "CPU", None, None, 2, "mamba", None]
    decoded = _decode_one([*known, "LOCAL", None, None, None, "future field", 42])
    assert decoded.batch.events == [
        _stored(medium="CPU", group_idx=2, kv_cache_spec_kind="mamba", locality="LOCAL")
    ]


def test_map_event_ignores_unknown_fields_and_defaults_absent_optional_ones() -> None:
    """A future vLLM may drop the deprecated lora_id and add fields after session_id."""
    decoded = _decode_one(
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": TOKENS,
            "block_size": 16,
            "medium": "GPU",
            "session_id": "abc",
            "future_field": [1, 2],
        }
    )
    assert decoded == DecodedBatch(KVEventBatch(1.5, [_stored(session_id="abc")], 0), [])


def test_array_events_carry_the_0_33_fields_in_vllms_order() -> None:
    """Array-encoded events append each generation's fields: ownership, session, lookahead."""
    store = ["BlockStored", [1], None, TOKENS, 16, None, "GPU", None, None, 0, None, None, None]
    decoded = decode(
        _pack(
            [
                1.0,
                [
                    [*store, "tier-x", "session-1", [[16, 17]]],
                    ["BlockRemoved", [1], "CPU", 0, "LOCAL", "tier-x"],
                ],
                0,
            ]
        )
    )
    assert decoded.batch.events == [
        _stored(
            group_idx=0, ownership="tier-x", session_id="session-1", lookahead_token_ids=[[16, 17]]
        ),
        BlockRemoved([1], "CPU", 0, "LOCAL", "tier-x"),
    ]


def test_map_events_read_event_by_event_keep_the_0_33_fields() -> None:
    """A batch mixing forms takes the per-event path, whose lenient structs know the fields too."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "medium": "GPU",
        "ownership": "tier-x",
        "session_id": "s",
        "lookahead_token_ids": [[16]],
    }
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "ownership": "tier-x"}
    decoded = decode(_pack([1.0, [["AllBlocksCleared"], stored, removed], 0]))
    assert decoded.batch.events == [
        AllBlocksCleared(),
        _stored(ownership="tier-x", session_id="s", lookahead_token_ids=[[16]]),
        BlockRemoved([2], "GPU", ownership="tier-x"),
    ]


def test_the_draft_evicted_groups_form_keeps_ownership_on_every_removal() -> None:
    decoded = _decode_one(
        {"type": "BlockRemoved", "block_hashes": [1], "evicted_groups": [0, 1], "ownership": "t"}
    )
    assert decoded.batch.events == [
        BlockRemoved([1], None, 0, ownership="t"),
        BlockRemoved([1], None, 1, ownership="t"),
    ]


def test_window_group_stores_keep_their_hashes_apart_from_their_token_ids() -> None:
    """Real vLLM: a window group lists only the blocks it keeps (one hash for 160 tokens), or
    none at all with token ids and a parent; the decoder takes both as sent."""
    fewer = _stored(block_hashes=[555], parent_block_hash=333, token_ids=list(range(160)))
    none = _stored(block_hashes=[], parent_block_hash=555, token_ids=list(range(160, 192)))
    batch = KVEventBatch(1.0, [fewer, none], 0)
    assert decode(encode(batch)) == DecodedBatch(batch, [])
    assert decode(_array_encoded(batch)) == DecodedBatch(batch, [])


@pytest.mark.parametrize("as_map", [True, False], ids=["map", "array"])
def test_uint64_negative_and_bytes_hashes(as_map: bool) -> None:
    """Ints are the digest's last 8 bytes unsigned; pre-#23673 Python hashes could be negative."""
    hashes: list[int | bytes] = [UINT64_MAX, 2**63, -(2**63), b"\x01" * 32, b"\x02" * 16]
    if as_map:
        event: object = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    else:
        event = ["BlockRemoved", hashes, "GPU"]
    assert _decode_one(event).batch.events == [BlockRemoved(hashes, "GPU")]


@pytest.mark.parametrize("batch", [[1.5, []], [1.5, [], None]], ids=["rank-missing", "rank-nil"])
def test_missing_or_nil_data_parallel_rank(batch: list[object]) -> None:
    assert decode(_pack(batch)).batch == KVEventBatch(1.5, [], None)


def test_map_and_array_events_mix_in_one_batch() -> None:
    decoded = decode(
        _pack(
            [
                3.0,
                [
                    ["AllBlocksCleared"],
                    {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
                ],
                1,
            ]
        )
    )
    assert decoded.batch.events == [AllBlocksCleared(), BlockRemoved([5], "GPU")]


# --- Unknown event types -----------------------------------------------------------------------


def test_unknown_event_types_are_skipped_and_named_and_the_rest_kept() -> None:
    decoded = decode(
        _pack(
            [
                4.0,
                [
                    {"type": "BlockInactive", "block_hashes": [1]},
                    ["BlockRemoved", [9], "GPU", 1],
                    ["BlockPinned", 3],
                    {"type": "BlockInactive"},
                ],
                0,
            ]
        )
    )
    assert decoded.batch == KVEventBatch(4.0, [BlockRemoved([9], "GPU", 1)], 0)
    assert decoded.unknown_event_types == ["BlockInactive", "BlockPinned", "BlockInactive"]


def test_current_batch_with_an_unknown_event_keeps_every_known_one() -> None:
    """The fast path rejects the whole batch; the event-by-event path must lose nothing else."""
    known: list[KVEvent] = [_stored(group_idx=0), BlockRemoved([1], "GPU", 1), AllBlocksCleared()]
    events = [msgspec.to_builtins(event) for event in known]
    events.insert(1, {"type": "BlockInactive", "block_hashes": [1]})
    decoded = decode(_pack([5.0, events, 0]))
    assert decoded == DecodedBatch(KVEventBatch(5.0, known, 0), ["BlockInactive"])


# --- The draft evicted_groups form of PR #37688 ------------------------------------------------


def test_draft_evicted_groups_map_becomes_one_removal_per_group() -> None:
    decoded = _decode_one(
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "evicted_groups": [1, 3]}
    )
    assert decoded.batch.events == [BlockRemoved([1, 2], "GPU", 1), BlockRemoved([1, 2], "GPU", 3)]


def test_draft_evicted_groups_array_becomes_one_removal_per_group() -> None:
    decoded = _decode_one(["BlockRemoved", [4], "GPU", [0, 2]])
    assert decoded.batch.events == [BlockRemoved([4], "GPU", 0), BlockRemoved([4], "GPU", 2)]


def test_empty_evicted_groups_removes_from_no_group() -> None:
    assert _decode_one(["BlockRemoved", [4], "GPU", []]).batch.events == []


def test_draft_removals_share_one_hash_list_so_memory_grows_with_the_payload() -> None:
    """Found by tests/fuzz: a list copy per group took 8 MB for a 2 KB payload."""
    many = list(range(1000))
    decoded = _decode_one({"type": "BlockRemoved", "block_hashes": many, "evicted_groups": many})
    assert [event.group_idx for event in decoded.batch.events] == many
    assert len({id(event.block_hashes) for event in decoded.batch.events}) == 1


def test_evicted_groups_text_in_a_value_decodes_unchanged() -> None:
    """The key scan that guards the fast path may hit a string value; the result must not change."""
    batch = KVEventBatch(1.0, [_stored(lora_name="evicted_groups")], 0)
    assert decode(encode(batch)) == DecodedBatch(batch, [])


# --- Malformed input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        pytest.param(b"", "truncated", id="empty"),
        pytest.param(b"\xc1", "invalid", id="not-msgpack"),
        pytest.param(
            _pack({"ts": 1.0}),
            "not a KV event batch: Object missing required field `events`",
            id="map-batch-without-events",
        ),
        pytest.param(_pack("batch"), "not a KV event batch: Expected `array`", id="str-batch"),
        pytest.param(
            _pack(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [],
                            "block_size": 0,
                            "lookahead_token_ids": [1],
                        }
                    ],
                ]
            ),
            "event 0 (BlockStored): Expected `array`, got `int` - at `$.lookahead_token_ids[0]`",
            id="lookahead-not-lists",
        ),
        pytest.param(
            _pack([1.0, [["AllBlocksCleared"]]]) + b"\x00", "trailing", id="trailing-bytes"
        ),
        pytest.param(_pack(["soon", []]), "Expected `float`, got `str` - at `$[0]`", id="ts"),
        pytest.param(_pack([1.0, {}]), "Expected `array`, got `object` - at `$[1]`", id="events"),
        pytest.param(_pack([1.0, [], "0"]), "got `str` - at `$[2]`", id="rank"),
        pytest.param(_pack([1.0]), "not a KV event batch", id="short-batch"),
        pytest.param(
            _pack([1.0, [42]]), "event 0: neither a map nor a tagged array", id="int-event"
        ),
        pytest.param(
            _pack([1.0, [[]]]), "event 0: neither a map nor a tagged array", id="empty-array-event"
        ),
        pytest.param(
            _pack([1.0, [{"block_hashes": [1]}]]),
            "event 0: map without a string 'type'",
            id="untagged-map-event",
        ),
        pytest.param(
            _pack([1.0, [{"type": 7}]]), "event 0: map without a string 'type'", id="int-tag"
        ),
        pytest.param(
            _pack([1.0, [["AllBlocksCleared"], ["BlockRemoved", "x"]]]),
            "event 1 (BlockRemoved): Expected `array`, got `str` - at `$[1]`",
            id="hashes-not-a-list",
        ),
        pytest.param(
            _pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
            "event 0 (BlockStored): Object missing required field `parent_block_hash`",
            id="map-store-missing-fields",
        ),
        pytest.param(
            _pack([1.0, [["BlockRemoved", [True]]]]),
            "event 0 (BlockRemoved): Expected `int | bytes`, got `bool` - at `$[1][0]`",
            id="bool-hash",
        ),
        pytest.param(
            _pack([1.0, [["BlockRemoved", [1.5]]]]),
            "event 0 (BlockRemoved): Expected `int | bytes`, got `float`",
            id="float-hash",
        ),
        pytest.param(
            _pack([1.0, [["BlockStored", [1], None, TOKENS, "16"]]]),
            "event 0 (BlockStored): Expected `int`, got `str` - at `$[4]`",
            id="block-size-str",
        ),
        pytest.param(
            _pack([1.0, [["BlockStored", [1], None, TOKENS]]]),
            "event 0 (BlockStored): Expected `array` of at least length 5, got 4",
            id="array-store-too-short",
        ),
        pytest.param(
            encode(KVEventBatch(1.0, [_stored(block_size=-16)], 0)),
            "event 0 (BlockStored): Expected `int` >= 0 - at `$.block_size`",
            id="map-store-negative-block-size",
        ),
        pytest.param(
            _pack([1.0, [["BlockStored", [1], None, TOKENS, -16]]]),
            "event 0 (BlockStored): Expected `int` >= 0 - at `$[4]`",
            id="array-store-negative-block-size",
        ),
        # A group index no Kafka key of a consumer could carry (<worker>/<up to 9 digits>).
        pytest.param(
            _pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}]]),
            "event 0 (BlockRemoved): Expected `int` >= 0 - at `$.group_idx`",
            id="map-removal-negative-group",
        ),
        pytest.param(
            _pack([1.0, [["BlockStored", [1], None, TOKENS, 16, None, "GPU", None, None, 10**9]]]),
            "event 0 (BlockStored): Expected `int` <= 999999999 - at `$[9]`",
            id="array-store-group-past-nine-digits",
        ),
        pytest.param(
            _pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "evicted_groups": [-2]}]]),
            "event 0 (BlockRemoved): Expected `int` >= 0 - at `$.evicted_groups[0]`",
            id="draft-evicted-negative-group",
        ),
    ],
)
def test_malformed_payload_raises_wire_decode_error_naming_the_problem(
    payload: bytes, reason: str
) -> None:
    with pytest.raises(WireDecodeError, match=re.escape(reason)):
        decode(payload)


def test_known_event_with_a_wrong_type_fails_the_batch_instead_of_dropping_it() -> None:
    payload = _pack([1.0, [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": "x"}]])
    with pytest.raises(WireDecodeError, match=r"event 1 \(BlockRemoved\): .*block_hashes"):
        decode(payload)


DEEP_PLACEHOLDER = "<nested 100k deep>"
DEEP_NESTING = b"\x91" * 100_000 + b"\xc0"


@pytest.mark.parametrize(
    "batch",
    [
        [1.0, DEEP_PLACEHOLDER],
        [1.0, [["AllBlocksCleared", DEEP_PLACEHOLDER]]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "extra_keys": DEEP_PLACEHOLDER}]],
    ],
    ids=["events", "array-event", "map-extra-keys"],
)
def test_deep_nesting_is_a_wire_decode_error_not_a_recursion_error(batch: object) -> None:
    payload = _pack(batch).replace(_pack(DEEP_PLACEHOLDER), DEEP_NESTING)
    with pytest.raises(WireDecodeError, match="nested too deeply"):
        decode(payload)


def test_payload_over_the_size_limit_is_refused_before_decoding() -> None:
    payload = encode(KVEventBatch(1.0, [_stored()], 0))
    assert decode(payload, max_bytes=len(payload)).batch.events == [_stored()]
    with pytest.raises(WireDecodeError, match=f"{len(payload)} bytes exceeds the limit of 10"):
        decode(payload, max_bytes=10)


def test_a_cpu_offloading_store_of_block_size_0_is_vllms_and_decodes() -> None:
    """vLLM's CPU-offloading stores carry block size 0 (the cpu-offload-placeholder vectors): a
    batch holding one is no malformed batch, or the bridge would dead-letter its other events."""
    placeholders = [v for v in WIRE_VECTORS if v["case"] == "cpu-offload-placeholder"]
    assert placeholders
    for vector in placeholders:
        [store, _] = decode(bytes.fromhex(vector["payload_hex"])).batch.events
        assert isinstance(store, BlockStored) and store.block_size == 0


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"kind": "full_attention", "block_size": 0}, "$.block_size"),
        ({"kind": "full_attention", "block_size": -16}, "$.block_size"),
        ({"kind": "sliding_window", "block_size": 16, "sliding_window": 0}, "$.sliding_window"),
        ({"kind": "chunked_local_attention", "block_size": 16, "chunk_size": -1}, "$.chunk_size"),
    ],
    ids=["block-0", "block-negative", "window-0", "chunk-negative"],
)
def test_a_group_spec_with_a_size_that_is_not_positive_does_not_decode(
    spec: dict[str, Any], where: str
) -> None:
    """Every hit rule divides by a group's block size or counts blocks in its window or chunk."""
    readers: tuple[Callable[[], GroupSpec], ...] = (
        lambda: msgspec.msgpack.decode(_pack(spec), type=GroupSpec),
        lambda: msgspec.convert(spec, GroupSpec),
    )
    for read in readers:
        with pytest.raises(msgspec.ValidationError, match=re.escape(f">= 1 - at `{where}`")):
            read()
    good = {**spec, **{key: 16 for key in spec if key != "kind"}}
    assert msgspec.convert(good, GroupSpec) == GroupSpec(**good)


def test_configured_group_specs_are_checked_like_decoded_ones(tmp_path: Path) -> None:
    """The bridge's engines file makes GroupSpecs too; a bad size is a ConfigError naming it."""
    path = tmp_path / "engines.toml"
    path.write_text(
        '[[engines]]\nname = "a"\n'
        'groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk_size = 0 } }\n'
    )
    with pytest.raises(ConfigError, match=re.escape("groups.2: Expected `int` >= 1 - at `$.chunk")):
        load_engines_file(path)
    path.write_text(path.read_text().replace("chunk_size = 0", "chunk_size = 64"))
    [engine] = load_engines_file(path)
    assert engine.groups == {2: GroupSpec("chunked_local_attention", 16, chunk_size=64)}


def test_known_event_types_are_the_current_structs() -> None:
    assert frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"}) == KNOWN_EVENT_TYPES


# --- Properties --------------------------------------------------------------------------------

hashes = st.one_of(st.integers(-(2**63), UINT64_MAX), st.binary(min_size=16, max_size=32))
small_ints = st.integers(-(2**63), UINT64_MAX)
optional_text = st.none() | st.text(max_size=12)
extra_key = (
    st.none() | st.tuples(st.text(max_size=8), small_ints) | st.tuples(st.binary(max_size=8))
)
block_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=32),
    block_size=st.integers(0, 2**16),
    lora_id=st.none() | small_ints,
    medium=st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    lora_name=optional_text,
    extra_keys=st.none() | st.lists(extra_key, max_size=3),
    group_idx=st.none() | st.integers(0, 64),
    kv_cache_spec_kind=optional_text,
    kv_cache_spec_sliding_window=st.none() | st.integers(0, 2**20),
    locality=st.sampled_from([None, "LOCAL", "REMOTE"]),
    ownership=optional_text,
    session_id=optional_text,
    lookahead_token_ids=st.none()
    | st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=3), max_size=4),
)
block_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 64),
    locality=st.sampled_from([None, "LOCAL", "REMOTE"]),
    ownership=optional_text,
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(block_stored | block_removed | st.just(AllBlocksCleared()), max_size=6),
    data_parallel_rank=st.none() | st.integers(0, 1024),
)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | small_ints
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
event_names = st.sampled_from([*sorted(KNOWN_EVENT_TYPES), "BlockInactive"])
event_like = st.one_of(
    st.tuples(event_names).map(list) | st.lists(msgpack_values, max_size=13),
    st.builds(lambda name, rest: [name, *rest], event_names, st.lists(msgpack_values, max_size=13)),
    st.builds(
        lambda name, rest: {**rest, "type": name},
        event_names,
        st.dictionaries(
            st.sampled_from(["block_hashes", "medium", "token_ids", "block_size", "group_idx"]),
            msgpack_values,
        ),
    ),
)
batch_like = st.tuples(
    st.floats() | msgpack_values,
    st.lists(event_like, max_size=4),
    st.none() | st.integers(0, 8) | msgpack_values,
).map(list)

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


def _decodes_or_raises_wire_error(payload: bytes) -> None:
    try:
        result = decode(payload)
    except WireDecodeError:
        return
    assert isinstance(result, DecodedBatch)


@PROPERTY_SETTINGS
@given(batches)
def test_any_valid_batch_round_trips(batch: KVEventBatch) -> None:
    assert decode(encode(batch)) == DecodedBatch(batch, [])


def _array_encoded(batch: KVEventBatch) -> bytes:
    """The batch as vLLM before PR #42892 sent it: each event a tagged array of all its fields."""
    events = [
        [type(event).__name__, *(getattr(event, name) for name in event.__struct_fields__)]
        for event in batch.events
    ]
    return _pack([batch.ts, events, batch.data_parallel_rank])


@PROPERTY_SETTINGS
@given(batches)
def test_any_valid_batch_round_trips_through_the_array_encoding(batch: KVEventBatch) -> None:
    assert decode(_array_encoded(batch)) == DecodedBatch(batch, [])


@PROPERTY_SETTINGS
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_wire_decode_error(payload: bytes) -> None:
    _decodes_or_raises_wire_error(payload)


@PROPERTY_SETTINGS
@given(msgpack_values | batch_like)
def test_random_msgpack_values_decode_or_raise_wire_decode_error(value: object) -> None:
    _decodes_or_raises_wire_error(_pack(value))


@PROPERTY_SETTINGS
@given(batches, st.data())
def test_every_truncation_of_a_valid_payload_raises_wire_decode_error(
    batch: KVEventBatch, data: st.DataObject
) -> None:
    payload = encode(batch)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(WireDecodeError):
        decode(payload[:cut])


@settings(PROPERTY_SETTINGS, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.data())
def test_mutated_valid_payloads_decode_or_raise_wire_decode_error(
    batch: KVEventBatch, data: st.DataObject
) -> None:
    payload = bytearray(encode(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(payload) - 1))
        payload[position] = data.draw(st.integers(0, 255))
    _decodes_or_raises_wire_error(bytes(payload))
