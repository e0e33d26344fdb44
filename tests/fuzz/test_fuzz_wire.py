"""Fuzzing the wire decoder: ``producer.events.decode`` on arbitrary bytes, arbitrary msgpack and
mutations of every vLLM generation's payloads. It returns a ``DecodedBatch`` the bridge can carry
on, or raises ``WireDecodeError``, and nothing else; and a decode never holds far more memory
than its payload (``tracemalloc``, on a bounded sample).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from fuzz_kit import (
    BOUNDARY_INTS,
    GENERATIONS,
    LYING_HEADERS,
    MEMORY_CONSTANT,
    MEMORY_MULTIPLE,
    SEED_PAYLOADS,
    batches,
    decode_peak,
    fuzz_settings,
    msgpack_values,
    mutations_of,
    seed_payloads,
)
from hypothesis import given
from hypothesis import strategies as st

from hmakv.bridge.fanout import fan_out
from hmakv.kvlog import records
from hmakv.producer.events import (
    KNOWN_EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    WireDecodeError,
    decode,
    encode,
)


def decodes_or_raises_wire_error(payload: bytes) -> DecodedBatch | None:
    """The decoder's contract for one payload; the decoded batch, or None for a WireDecodeError."""
    try:
        decoded = decode(payload)
    except WireDecodeError as error:
        assert str(error), "a WireDecodeError says what was wrong: it is the dead letter's detail"
        return None
    assert isinstance(decoded, DecodedBatch)
    assert all(
        type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in decoded.batch.events
    )
    assert all(
        isinstance(name, str) and name not in KNOWN_EVENT_TYPES
        for name in decoded.unknown_event_types
    )
    carried_on(decoded)
    return decoded


def carried_on(decoded: DecodedBatch) -> None:
    """What the bridge does next with a decoded batch must work whatever was decoded: encode it
    again, fan it out into records per group, and have a consumer decode those."""
    batch = decoded.batch
    again = decode(encode(batch)).batch
    assert encode(again) == encode(batch)  # bytes, so that a NaN ts compares
    groups = sorted(
        {0} | {e.group_idx or 0 for e in batch.events if not isinstance(e, AllBlocksCleared)}
    )
    for record in fan_out("w", 0, 0, batch, groups):
        value = records.encode(record)
        assert records.encode(records.decode_event_record(value)) == value


@fuzz_settings(400)
@given(st.one_of(st.binary(max_size=512), st.lists(st.sampled_from(LYING_HEADERS)).map(b"".join)))
def test_arbitrary_bytes(payload: bytes) -> None:
    decodes_or_raises_wire_error(payload)


batch_like = st.tuples(
    st.floats() | msgpack_values,
    st.lists(
        st.one_of(
            msgpack_values,
            st.builds(
                lambda name, rest: [name, *rest],
                st.sampled_from([*KNOWN_EVENT_TYPES, "BlockInactive"]),
                st.lists(msgpack_values, max_size=16),
            ),
            st.builds(
                lambda name, rest: {**rest, "type": name},
                st.sampled_from([*KNOWN_EVENT_TYPES, "BlockInactive"]),
                st.dictionaries(
                    st.sampled_from(
                        [
                            "block_hashes",
                            "medium",
                            "token_ids",
                            "block_size",
                            "group_idx",
                            "evicted_groups",
                            "extra_keys",
                            "lookahead_token_ids",
                            "parent_block_hash",
                        ]
                    ),
                    msgpack_values,
                ),
            ),
        ),
        max_size=5,
    ),
    st.none() | st.sampled_from(BOUNDARY_INTS) | msgpack_values,
).map(list)


@fuzz_settings(400)
@given(
    msgpack_values
    | batch_like
    | batch_like.map(lambda b: dict(zip(["ts", "events", "data_parallel_rank"], b, strict=True)))
)
def test_arbitrary_msgpack_values(value: object) -> None:
    decodes_or_raises_wire_error(msgspec.msgpack.encode(value))


def test_every_seed_decodes() -> None:
    """The mutations start from valid payloads of every generation (or they test less)."""
    assert set(GENERATIONS) >= {"0.33.0", "hma", "map-batch", "new", "old", "pre"}
    for name, payload in SEED_PAYLOADS.items():
        assert decodes_or_raises_wire_error(payload) is not None, name


def _seeds_of(prefix: str) -> st.SearchStrategy[bytes]:
    names = sorted(name for name in SEED_PAYLOADS if name.startswith(f"{prefix}/"))
    assert names, prefix
    return st.sampled_from(names).map(SEED_PAYLOADS.__getitem__)


@pytest.mark.parametrize("generation", [*GENERATIONS, "draft", "newer"])
@fuzz_settings(250)
@given(data=st.data())
def test_mutated_payloads_of_every_generation(generation: str, data: st.DataObject) -> None:
    decodes_or_raises_wire_error(data.draw(mutations_of(_seeds_of(generation)), "payload"))


@fuzz_settings(300)
@given(mutations_of(batches.map(encode)))
def test_mutated_well_typed_batches(payload: bytes) -> None:
    decodes_or_raises_wire_error(payload)


# --- memory ------------------------------------------------------------------------------------


def _store(**fields: object) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **fields,
    }


# Payloads that are cheap on the wire and many objects once decoded, each made of ``n`` repeats
# of a 1 to 3 byte item: what an attacker sends to make a bridge allocate.
AMPLIFIERS: dict[str, Callable[[int], object]] = {
    "evicted-groups": lambda n: [
        1.0,
        [{"type": "BlockRemoved", "block_hashes": [1] * n, "evicted_groups": [0] * n}],
        0,
    ],
    "evicted-groups-array": lambda n: [1.0, [["BlockRemoved", [300] * n, "GPU", [1] * n]], 0],
    "clears": lambda n: [1.0, [["AllBlocksCleared"]] * n, 0],
    "unknown-events": lambda n: [1.0, [["X"]] * n, 0],
    "empty-removals": lambda n: [1.0, [["BlockRemoved", []]] * n, 0],
    "empty-events": lambda n: [1.0, [[]] * n, 0],
    "hashes": lambda n: [1.0, [_store(block_hashes=[300] * n)], 0],
    "token-ids": lambda n: [1.0, [_store(token_ids=[1] * n)], 0],
    "extra-keys-lists": lambda n: [1.0, [_store(extra_keys=[[[]] * n])], 0],
    "extra-keys-maps": lambda n: [1.0, [_store(extra_keys=[[{}] * n])], 0],
    "extra-keys-nested": lambda n: [1.0, [_store(extra_keys=[[[[[]]]] * n])], 0],
    "lookahead-lists": lambda n: [1.0, [_store(lookahead_token_ids=[[]] * n)], 0],
    "map-batch": lambda n: {"ts": 1.0, "events": [{"type": "AllBlocksCleared"}] * n},
}
amplifiers = st.builds(
    lambda make, n: msgspec.msgpack.encode(AMPLIFIERS[make](n)),
    st.sampled_from(sorted(AMPLIFIERS)),
    st.integers(0, 3000),
)
# Mutations of an amplifier keep most of its bulk: what fails late must not have cost more.
memory_payloads = st.one_of(
    amplifiers, mutations_of(amplifiers), mutations_of(seed_payloads), st.binary(max_size=256)
)


for _payload in SEED_PAYLOADS.values():  # first calls fill caches that no decode should be charged
    decode_peak(_payload)


@fuzz_settings(200)
@given(memory_payloads)
def test_a_decode_holds_at_most_a_multiple_of_its_payload(payload: bytes) -> None:
    peak = decode_peak(payload)
    assert peak <= MEMORY_MULTIPLE * len(payload) + MEMORY_CONSTANT, (
        f"decoding {len(payload)} bytes peaked at {peak} bytes ({peak / max(1, len(payload)):.0f}x)"
    )
