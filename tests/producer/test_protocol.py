"""vLLM's ZMQ transport contract (``producer.protocol``): frames, the codec, endpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmakv.producer.protocol import (
    END_MARKER,
    END_SEQ_FRAME,
    SEQ_BYTES,
    SNAPSHOT_REQUEST,
    Malformed,
    ReplyEnd,
    SeqFrames,
    decode_seq,
    encode_seq,
    live_frames,
    offset_endpoint_port,
    parse_live,
    parse_replay_request,
    parse_reply,
    replay_request,
    reply_frames,
    should_bind,
)

PAYLOAD = b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x90\x00"  # any bytes: the codec never reads it
SEQS = st.integers(min_value=0, max_value=2**64 - 1)


# --- seq frames ----------------------------------------------------------------------------------


def test_seq_frames_are_eight_bytes_big_endian_unsigned() -> None:
    assert encode_seq(0) == bytes(8)
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert encode_seq(SNAPSHOT_REQUEST) == b"\xff" * 8
    assert decode_seq(b"\x00\x00\x00\x00\x00\x00\x01\x02") == 258
    with pytest.raises(OverflowError):
        encode_seq(2**64)
    with pytest.raises(OverflowError):
        encode_seq(-1)


def test_the_end_marker_is_seq_minus_one_signed() -> None:
    assert END_SEQ_FRAME == b"\xff" * 8 == encode_seq(SNAPSHOT_REQUEST)
    assert END_MARKER == (b"", END_SEQ_FRAME, b"")
    assert SNAPSHOT_REQUEST == 2**64 - 1


@given(SEQS)
def test_seq_round_trips(seq: int) -> None:
    assert len(encode_seq(seq)) == SEQ_BYTES
    assert decode_seq(encode_seq(seq)) == seq


# --- live messages -------------------------------------------------------------------------------


@given(st.binary(max_size=16), SEQS, st.binary(max_size=64))
def test_live_messages_round_trip(topic: bytes, seq: int, payload: bytes) -> None:
    frames = live_frames(topic, seq, payload)
    assert frames == [topic, encode_seq(seq), payload]
    assert parse_live(frames) == SeqFrames(topic, seq, payload)


def test_malformed_live_messages_say_why() -> None:
    assert parse_live([b"kv", encode_seq(5)]) == Malformed(
        "frame_count", "2 frames, expected 3 (topic, seq, payload)"
    )
    assert parse_live([b"kv", b"\x05", PAYLOAD]) == Malformed(
        "seq_size", "seq frame of 1 bytes, expected 8"
    )
    four = parse_live([b"kv", encode_seq(5), PAYLOAD, b""])
    assert isinstance(four, Malformed) and four.problem == "frame_count"


# --- replay requests and replies -----------------------------------------------------------------


@given(SEQS)
def test_replay_requests_round_trip(start_seq: int) -> None:
    request = replay_request(start_seq)
    assert request == [b"", encode_seq(start_seq)]
    assert parse_replay_request(request) == start_seq


def test_a_snapshot_request_is_a_replay_request_from_the_highest_seq() -> None:
    assert replay_request(SNAPSHOT_REQUEST) == [b"", b"\xff" * 8]
    assert parse_replay_request([b"", b"\xff" * 8]) == SNAPSHOT_REQUEST


def test_malformed_replay_requests_say_why() -> None:
    bad_size = parse_replay_request([b"", b"\x00\x01"])
    assert bad_size == Malformed("seq_size", "seq frame of 2 bytes, expected 8")
    for frames in ([encode_seq(0)], [b"x", encode_seq(0)], [b"", encode_seq(0), b""]):
        malformed = parse_replay_request(frames)
        assert isinstance(malformed, Malformed) and malformed.problem == "frame_count"


@given(st.binary(max_size=16), SEQS, st.binary(min_size=1, max_size=64))
def test_replies_round_trip_with_the_topic_frame(topic: bytes, seq: int, payload: bytes) -> None:
    frames = reply_frames(topic, seq, payload)
    assert frames == [b"", topic, encode_seq(seq), payload]
    assert parse_reply(frames) == SeqFrames(topic, seq, payload)


def test_replies_before_vllm_pr_45177_have_no_topic_frame() -> None:
    frames = reply_frames(None, 7, PAYLOAD)
    assert frames == [b"", encode_seq(7), PAYLOAD]
    assert parse_reply(frames) == SeqFrames(b"", 7, PAYLOAD)


def test_the_end_marker_ends_a_reply_in_either_form() -> None:
    assert parse_reply([b"", *END_MARKER]) == ReplyEnd()
    assert parse_reply([b"", END_SEQ_FRAME, b""]) == ReplyEnd()
    # seq 2**64 - 1 with a payload is a batch, not the end marker
    assert parse_reply([b"", b"kv", END_SEQ_FRAME, PAYLOAD]) == SeqFrames(
        b"kv", SNAPSHOT_REQUEST, PAYLOAD
    )


def test_malformed_replies_say_why() -> None:
    expected = "expected ['', topic, seq, payload] or ['', seq, payload]"
    assert parse_reply([b""]) == Malformed("frame_count", f"1 frames, {expected}")
    no_delimiter = parse_reply([b"x", encode_seq(1), PAYLOAD])
    assert no_delimiter == Malformed("frame_count", f"3 frames, {expected}")
    assert parse_reply([b"", b"kv", b"\x01", PAYLOAD]) == Malformed(
        "seq_size", "seq frame of 1 bytes, expected 8"
    )


@given(st.lists(st.binary(max_size=12), max_size=6))
def test_the_parsers_never_raise(frames: list[bytes]) -> None:
    assert isinstance(parse_live(frames), SeqFrames | Malformed)
    assert isinstance(parse_reply(frames), SeqFrames | ReplyEnd | Malformed)
    assert isinstance(parse_replay_request(frames), int | Malformed)


# --- endpoints -----------------------------------------------------------------------------------


def test_endpoint_offsets_follow_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_inproc_endpoints_get_a_rank_suffix() -> None:
    assert offset_endpoint_port("inproc://kv", 0) == "inproc://kv"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"  # rank 0: unchanged


def test_wildcards_ipc_and_inproc_bind_and_hosts_connect() -> None:
    for endpoint in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert should_bind(endpoint), endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://engine-0:5557", "tcp://10.0.0.1:5557"):
        assert not should_bind(endpoint), endpoint


def test_the_contract_loads_neither_zmq_nor_the_publisher() -> None:
    """What follows an engine imports the contract, and the bridge's pure core with it, without
    pulling in zmq, threads of a publisher, or the publisher itself."""
    check = (
        "import sys, hmakv.producer.protocol, hmakv.bridge.config; "
        "loaded = {'zmq', 'hmakv.producer.publisher'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", check], check=True)
