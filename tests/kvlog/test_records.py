"""The Kafka record contract: keys, headers and values round-trip; bad input is one error type."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from hmakv.bridge.catalog import GroupCatalog
from hmakv.kvlog import records
from hmakv.kvlog.records import DeadLetter, EventRecord, RecordDecodeError, Topics, WorkerState
from hmakv.producer import events
from hmakv.producer.events import AllBlocksCleared, BlockRemoved, BlockStored, GroupSpec

WIRE_VECTORS = Path(__file__).parents[1] / "data" / "vllm-wire.jsonl"


def test_topics_derive_from_prefix() -> None:
    topics = Topics("fleet1")
    assert (topics.events, topics.workers, topics.deadletter, topics.snapshots) == (
        "fleet1.events",
        "fleet1.workers",
        "fleet1.deadletter",
        "fleet1.snapshots",
    )


def test_worker_id_per_dp_rank() -> None:
    assert records.worker_id("engine-a", None) == "engine-a"
    assert records.worker_id("engine-a", 3) == "engine-a-dp3"
    with pytest.raises(ValueError, match="no '/'"):
        records.worker_id("a/b", None)
    with pytest.raises(ValueError):
        records.worker_id("", 0)


def test_event_key_round_trip_and_errors() -> None:
    key = records.event_key("engine-a-dp1", 2)
    assert key == b"engine-a-dp1/2"
    assert records.parse_event_key(key) == ("engine-a-dp1", 2)
    for bad in (b"nogroup", b"/1", b"w/x", b"w/"):
        with pytest.raises(RecordDecodeError, match="malformed event key"):
            records.parse_event_key(bad)


@pytest.mark.parametrize(
    "key",
    [
        "w/\N{SUPERSCRIPT TWO}".encode(),  # str.isdigit says yes, int() says no
        "w/\N{ARABIC-INDIC DIGIT THREE}".encode(),  # int() would take it: not our key either
        b"w/" + b"9" * 5000,  # past int()'s 4300-digit limit
        b"w/" + b"1" * 10,
    ],
    ids=["superscript", "arabic-indic", "5000-digits", "10-digits"],
)
def test_a_key_whose_group_is_not_a_short_ascii_number_is_a_record_decode_error(
    key: bytes,
) -> None:
    with pytest.raises(RecordDecodeError, match="malformed event key"):
        records.parse_event_key(key)
    assert records.parse_event_key(b"w/" + b"9" * 9) == ("w", 999_999_999)


def test_event_record_round_trip_with_every_event_type() -> None:
    record = EventRecord(
        worker="w",
        epoch=2,
        seq=17,
        ts=1.5,
        group_idx=1,
        events=[
            BlockStored(
                [2**64 - 1, b"\x01" * 32],
                None,
                list(range(16)),
                16,
                None,
                "GPU",
                None,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
            ),
            BlockRemoved([2**64 - 1], "GPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert records.decode_event_record(records.encode(record)) == record
    assert dict(record.headers()) == {
        "worker": b"w",
        "group": b"1",
        "epoch": b"2",
        "seq": b"17",
    }


def test_records_carry_vllm_0_33_events_whole() -> None:
    """Consumers learn a worker's lookahead hashing from its stores' ``lookahead_token_ids``,
    and window stores list fewer hashes than token blocks (or none): a record changes nothing of
    either, and a store as older vLLM sent it still reads with the new fields None."""
    newest = [json.loads(line) for line in WIRE_VECTORS.read_text().splitlines()]
    batches = [
        events.decode(bytes.fromhex(v["payload_hex"])).batch
        for v in newest
        if v["vllm"] == "0.33.0"
    ]
    carried = [event for batch in batches for event in batch.events]
    stores = [event for event in carried if isinstance(event, BlockStored)]
    assert any(store.lookahead_token_ids for store in stores)
    assert any(
        len(store.token_ids) > len(store.block_hashes) * store.block_size for store in stores
    )
    assert any(not store.block_hashes and store.token_ids for store in stores)
    record = EventRecord("w", 0, 3, 1.0, 1, carried)
    assert records.decode_event_record(records.encode(record)).events == carried

    older = EventRecord("w", 0, 3, 1.0, 0, [BlockStored([1], None, [], 16, None, "GPU", None)])
    value = records.encode(older)
    assert b"lookahead_token_ids" not in value and b"ownership" not in value
    [store] = records.decode_event_record(value).events
    assert isinstance(store, BlockStored)
    assert (store.ownership, store.session_id, store.lookahead_token_ids) == (None, None, None)


def test_a_reader_that_never_looks_at_token_ids_gets_them_undecoded() -> None:
    """``token_ids=False`` (the index's): every store is still a ``BlockStored`` with every other
    field as decoded whole, its token ids the msgpack they came as; garbage is still refused."""
    newest = [json.loads(line) for line in WIRE_VECTORS.read_text().splitlines()]
    carried = [
        event
        for vector in newest
        if vector["vllm"] == "0.33.0"
        for event in events.decode(bytes.fromhex(vector["payload_hex"])).batch.events
    ]
    carried += [BlockRemoved([7], "CPU", 1), AllBlocksCleared()]
    value = records.encode(EventRecord("w", 2, 3, 1.0, 1, carried, first_event=4))
    whole = records.decode_event_record(value)
    lean = records.decode_event_record(value, token_ids=False)
    assert isinstance(lean, EventRecord)
    header = {**msgspec.structs.asdict(whole), "events": None}
    assert {**msgspec.structs.asdict(lean), "events": None} == header
    assert len(lean.events) == len(whole.events) == len(carried)
    for got, want in zip(lean.events, whole.events, strict=True):
        if isinstance(want, BlockStored):
            assert isinstance(got, BlockStored) and isinstance(got.token_ids, msgspec.Raw)
            assert msgspec.msgpack.decode(got.token_ids) == want.token_ids
            fields = [f for f in BlockStored.__struct_fields__ if f != "token_ids"]
            assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
        else:
            assert got == want
    for bad in (value[:-1], value.replace(b"BlockStored", b"BlockStoreX", 1)):
        with pytest.raises(RecordDecodeError):
            records.decode_event_record(bad, token_ids=False)


def test_event_headers_reused_across_a_workers_records_match_each_record() -> None:
    """One ``EventHeaders`` serves every record of a worker: a changed group, epoch or seq,
    including a bridge-made clear's seq -1, shows in the next record's headers."""
    headers = records.EventHeaders("w-dp1")
    positions = [(0, 1, 0), (0, 1, 1), (0, 2, 0), (1, -1, 0), (1, -1, 1), (1, 0, 1), (3, 0, 12)]
    for epoch, seq, group in positions:
        record = EventRecord("w-dp1", epoch, seq, 1.0, group, [])
        assert headers.of(record) == [
            ("worker", b"w-dp1"),
            ("group", str(group).encode()),
            ("epoch", str(epoch).encode()),
            ("seq", str(seq).encode()),
        ]


def test_a_split_records_first_event_round_trips_and_shows_in_its_headers() -> None:
    headers = records.EventHeaders("w")
    first = EventRecord("w", 0, 5, 1.0, 0, [AllBlocksCleared()])
    second = msgspec.structs.replace(first, first_event=1)
    assert records.decode_event_record(records.encode(second)) == second
    assert headers.of(first) == [("worker", b"w"), ("group", b"0"), ("epoch", b"0"), ("seq", b"5")]
    assert headers.of(second) == [*headers.of(first), ("first_event", b"1")]


def test_a_record_written_before_records_were_split_starts_at_event_0() -> None:
    old = {"worker": "w", "epoch": 0, "seq": 3, "ts": 1.0, "group_idx": 1, "events": []}
    record = records.decode_event_record(msgspec.msgpack.encode(old))
    assert (record.seq, record.first_event) == (3, 0)


def test_worker_state_and_dead_letter_round_trip() -> None:
    state = WorkerState(
        worker="w",
        epoch=1,
        last_seq=-1,
        health="degraded",
        groups={0: GroupSpec("full_attention", 16), 1: GroupSpec("sliding_window", 16, 128)},
        ts=2.0,
    )
    assert records.decode_worker_state(records.encode(state)) == state
    letter = DeadLetter(
        "tcp://127.0.0.1:5557", "bad_seq", "seq frame has 3 bytes", [b"t", b"abc", b"\xc1"], 3.0
    )
    assert records.decode_dead_letter(records.encode(letter)) == letter
    assert dict(letter.headers())["reason"] == b"bad_seq"


def test_the_worker_states_the_bridge_learns_from_vllm_batches_decode() -> None:
    """The bridge writes the group specs it learns from stores in each WorkerState; one learned
    from vLLM's CPU-offloading stores (block size 0) made the state unreadable to the followers
    and to the bridge's own resume."""
    catalog = GroupCatalog()
    for line in WIRE_VECTORS.read_text().splitlines():
        catalog.learn(events.decode(bytes.fromhex(json.loads(line)["payload_hex"])).batch.events)
        assert all(spec.block_size > 0 for spec in catalog.specs.values()), catalog.specs
        state = WorkerState("w", 0, 0, "live", catalog.specs, 0.0)
        assert records.decode_worker_state(records.encode(state)) == state
    assert catalog.groups == (0, 1)


@pytest.mark.parametrize(
    "value",
    [b"", b"\xc1", msgspec.msgpack.encode({"worker": 1}), msgspec.msgpack.encode([1, 2, 3])],
)
def test_bad_values_raise_record_decode_error(value: bytes) -> None:
    for decode in (
        records.decode_event_record,
        records.decode_worker_state,
        records.decode_dead_letter,
    ):
        with pytest.raises(RecordDecodeError):
            decode(value)


def test_unknown_health_is_rejected() -> None:
    value = msgspec.msgpack.encode(
        {"worker": "w", "epoch": 0, "last_seq": 0, "health": "sleepy", "groups": {}, "ts": 0.0}
    )
    with pytest.raises(RecordDecodeError, match="health"):
        records.decode_worker_state(value)


def test_an_extra_key_nested_past_the_recursion_limit_is_a_record_decode_error() -> None:
    """Found by tests/fuzz: msgspec's RecursionError escaped (a follower's poison record)."""
    store = BlockStored([1], None, [], 16, None, "GPU", None, extra_keys=[(None,)])
    value = records.encode(EventRecord("w", 0, 0, 0.0, 0, [store]))
    at = value.index(b"\x91\xc0")  # the extra key's 1-tuple of nil
    deep = value[:at] + b"\x91" * 100_000 + value[at:]
    with pytest.raises(RecordDecodeError, match="recursion"):
        records.decode_event_record(deep)


@pytest.mark.parametrize("first_event", [-1, records.MAX_FIRST_EVENT + 1, 2**64 - 1])
def test_a_first_event_no_batch_has_is_a_record_decode_error(first_event: int) -> None:
    """Found by tests/fuzz: 2**64 - 1 made an index's every snapshot fail (its next event past
    msgpack's ints); positions are a batch's, far below MAX_FIRST_EVENT."""
    record = EventRecord("w", 0, 0, 0.0, 0, [AllBlocksCleared()], first_event=first_event)
    with pytest.raises(RecordDecodeError, match="first_event"):
        records.decode_event_record(records.encode(record))
    largest = msgspec.structs.replace(record, first_event=records.MAX_FIRST_EVENT)
    assert records.decode_event_record(records.encode(largest)) == largest


@pytest.mark.parametrize(("epoch", "seq"), [(-1, 0), (2**63 - 1, 0), (2**64 - 1, 0), (0, -2)])
def test_an_epoch_or_seq_no_bridge_writes_is_a_record_decode_error(epoch: int, seq: int) -> None:
    """Found by tests/fuzz: a retired worker's epoch 2**64 - 1 made the index keep 2**64 (where
    it may come back) and every snapshot fail; epochs count lives from 0, seqs are signed 64-bit
    frames with -1 for an epoch's opening clear."""
    record = EventRecord("w", epoch, seq, 0.0, 0, [AllBlocksCleared()])
    state = WorkerState("w", epoch, seq, "retired", {}, 0.0)
    with pytest.raises(RecordDecodeError):
        records.decode_event_record(records.encode(record))
    with pytest.raises(RecordDecodeError):
        records.decode_worker_state(records.encode(state))
    largest = EventRecord("w", 2**63 - 2, 2**63 - 1, 0.0, 0, [AllBlocksCleared()])
    assert records.decode_event_record(records.encode(largest)) == largest
