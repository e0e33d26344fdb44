"""Fuzzing the Kafka record decoders of ``kvlog.records``: whatever a record's value or key
holds (anyone who can write the log decides), ``decode_event_record``, ``decode_worker_state``,
``decode_dead_letter`` and ``parse_event_key`` return their value or raise ``RecordDecodeError``,
their one documented error, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import msgspec
import pytest
from fuzz_kit import (
    events,
    fuzz_settings,
    ints,
    msgpack_values,
    mutations_of,
    texts,
)
from hypothesis import given
from hypothesis import strategies as st

from hmakv.kvlog import records
from hmakv.kvlog.records import (
    HEALTH_STATES,
    MAX_FIRST_EVENT,
    RETIRED,
    DeadLetter,
    EventRecord,
    RecordDecodeError,
    WorkerState,
    event_key,
    parse_event_key,
)
from hmakv.producer.events import GROUP_KINDS, MAX_GROUP_IDX, BlockStored, GroupSpec

# what the contract takes (kvlog.records.Epoch, Seq), boundaries included
epochs = st.one_of(st.integers(0, 2**63 - 2), st.sampled_from([0, 1, 2**63 - 2]))
seqs = st.one_of(st.integers(-1, 2**63 - 1), st.sampled_from([-1, 0, 2**63 - 1]))

event_records = st.builds(
    EventRecord,
    worker=texts,
    epoch=epochs,
    seq=seqs,
    ts=st.floats(),
    group_idx=ints,
    events=st.lists(events(), max_size=4),
    data_parallel_rank=st.none() | ints,
    first_event=st.integers(0, MAX_FIRST_EVENT),
)
group_specs = st.builds(
    GroupSpec,
    kind=st.sampled_from(GROUP_KINDS) | texts,
    block_size=st.integers(1, 2**64 - 1),
    sliding_window=st.none() | st.integers(1, 2**64 - 1),
    chunk_size=st.none() | st.integers(1, 2**64 - 1),
)
worker_states = st.builds(
    WorkerState,
    worker=texts,
    epoch=epochs,
    last_seq=seqs,
    health=st.sampled_from([*HEALTH_STATES, RETIRED]),
    groups=st.dictionaries(ints, group_specs, max_size=4),
    ts=st.floats(),
    data_parallel_rank=st.none() | ints,
    endpoint=st.none() | texts,
)
dead_letters = st.builds(
    DeadLetter,
    source=texts,
    reason=texts,
    detail=texts,
    frames=st.lists(st.binary(max_size=16), max_size=5),
    ts=st.floats(),
)
# A store whose extra keys hold a nil: extra keys are any msgpack value, the one place a record
# takes a value nested as deep as its bytes say.
with_any_value = st.builds(
    lambda record, store: msgspec.structs.replace(record, events=[store, *record.events]),
    event_records,
    st.builds(
        BlockStored,
        block_hashes=st.just([1]),
        parent_block_hash=st.none(),
        token_ids=st.just([]),
        block_size=st.just(16),
        lora_id=st.none(),
        medium=st.none(),
        lora_name=st.none(),
        extra_keys=st.just([(None,)]),
    ),
)
DECODERS: dict[str, tuple[Callable[[bytes], object], type, st.SearchStrategy[bytes]]] = {
    "event-record": (
        records.decode_event_record,
        EventRecord,
        st.one_of(event_records, with_any_value).map(records.encode),
    ),
    "event-record-without-token-ids": (
        partial(records.decode_event_record, token_ids=False),
        EventRecord,
        st.one_of(event_records, with_any_value).map(records.encode),
    ),
    "worker-state": (records.decode_worker_state, WorkerState, worker_states.map(records.encode)),
    "dead-letter": (records.decode_dead_letter, DeadLetter, dead_letters.map(records.encode)),
}


@st.composite
def deeply_nested(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid value with one of its nils (an absent optional, an extra key) nested thousands of
    arrays deep: past any recursion limit, where a field takes any value."""
    value = draw(valid)
    nils = [at for at, byte in enumerate(value) if byte == 0xC0]
    if not nils:
        return value
    keys = [at for at in nils if value[at - 1] == 0x91]  # a 1-tuple of nil: an extra key
    prefer_keys = bool(keys) and draw(st.booleans())
    at = draw(st.sampled_from(keys if prefer_keys else nils))
    return value[:at] + b"\x91" * draw(st.sampled_from([64, 5_000, 100_000])) + value[at:]


def values_for(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=256),
        msgpack_values.map(msgspec.msgpack.encode),
        valid,
        mutations_of(valid),
        deeply_nested(valid),
    )


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz_settings(250)
@given(data=st.data())
def test_a_record_decodes_or_raises_record_decode_error(name: str, data: st.DataObject) -> None:
    decoder, kind, valid = DECODERS[name]
    value = data.draw(values_for(valid), "value")
    try:
        decoded = decoder(value)
    except RecordDecodeError as error:
        assert str(error)
        return
    assert isinstance(decoded, kind)
    assert records.encode(decoded) == records.encode(decoder(records.encode(decoded)))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz_settings(60)
@given(data=st.data())
def test_a_record_nested_past_the_recursion_limit_raises_record_decode_error(
    name: str, data: st.DataObject
) -> None:
    decoder, kind, valid = DECODERS[name]
    value = data.draw(deeply_nested(valid), "value")
    try:
        assert isinstance(decoder(value), kind)
    except RecordDecodeError as error:
        assert str(error)


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz_settings(60)
@given(data=st.data())
def test_a_valid_record_round_trips(name: str, data: st.DataObject) -> None:
    decoder, _, valid = DECODERS[name]
    value = data.draw(valid, "value")
    assert records.encode(decoder(value)) == value  # type: ignore[arg-type]


keys = st.one_of(
    st.binary(max_size=40),
    st.builds(
        lambda worker, group: f"{worker}/{group}".encode(),
        texts,
        st.one_of(ints, st.sampled_from(["", "²", "\u0661", "+1", " 1", "0x1", "9" * 5000]), texts),
    ),
)


@fuzz_settings(400)
@given(keys)
def test_an_event_key_parses_or_raises_record_decode_error(key: bytes) -> None:
    try:
        worker, group = parse_event_key(key)
    except RecordDecodeError as error:
        assert str(error)
        return
    assert worker and isinstance(group, int) and 0 <= group <= MAX_GROUP_IDX
    assert key.decode("utf-8", "replace") == f"{worker}/{key.rsplit(b'/', 1)[1].decode()}"


@fuzz_settings(200)
@given(texts.filter(bool), st.integers(0, MAX_GROUP_IDX))
def test_every_key_the_bridge_writes_parses_back(worker: str, group: int) -> None:
    assert parse_event_key(event_key(worker, group)) == (worker, group)
