"""Fuzzing the bridge's frame handling: ``split_live``, ``split_reply`` and ``decode_payload`` (and
the protocol parsers under them) on arbitrary multipart messages. None of them raises; a
``Rejected`` always carries one ``RejectReason`` of the step that refused it, a readable detail
and the very frames it refused; what passes is what the protocol and the limits allow.
"""

from __future__ import annotations

from fuzz_kit import fuzz_settings, mutations_of, valid_payloads
from hypothesis import event, given
from hypothesis import strategies as st

from hmakv.bridge.frames import (
    EventLimits,
    Rejected,
    RejectReason,
    decode_payload,
    over_limit,
    split_live,
    split_reply,
)
from hmakv.producer.events import DecodedBatch, WireDecodeError, decode, encode
from hmakv.producer.protocol import (
    END_SEQ_FRAME,
    SEQ_BYTES,
    SNAPSHOT_REQUEST,
    Malformed,
    ReplyEnd,
    SeqFrames,
    encode_seq,
    parse_replay_request,
)

SPLIT_REASONS = {RejectReason.FRAME_COUNT, RejectReason.SEQ_SIZE}
LIVE_REASONS = SPLIT_REASONS | {RejectReason.TOPIC_MISMATCH}
PAYLOAD_REASONS = {
    RejectReason.PAYLOAD_OVERSIZE,
    RejectReason.PAYLOAD_UNDECODABLE,
    RejectReason.HASHES_OVER_LIMIT,
    RejectReason.TOKEN_IDS_OVER_LIMIT,
    RejectReason.EXTRA_KEYS_OVER_LIMIT,
    RejectReason.LOOKAHEAD_OVER_LIMIT,
}
TOPIC = b"engine-0"

seq_frames = st.one_of(
    st.integers(0, 2**64 - 1).map(encode_seq),
    st.sampled_from([END_SEQ_FRAME, encode_seq(0), encode_seq(SNAPSHOT_REQUEST)]),
    st.binary(max_size=2 * SEQ_BYTES),
)
topics = st.one_of(st.just(TOPIC), st.just(b""), st.binary(max_size=12))
payloads = st.one_of(
    valid_payloads(), mutations_of(valid_payloads()), st.just(b""), st.binary(max_size=64)
)
any_frame = st.one_of(seq_frames, topics, payloads)
frame_lists = st.one_of(
    st.lists(any_frame, max_size=7),
    st.tuples(topics, seq_frames, payloads).map(list),  # live
    st.tuples(st.just(b""), topics, seq_frames, payloads).map(list),  # reply
    st.tuples(st.just(b""), seq_frames, payloads).map(list),  # reply before vLLM PR #45177
    st.tuples(st.just(b""), st.just(b""), st.just(END_SEQ_FRAME), st.just(b"")).map(list),  # end
    st.tuples(st.just(b""), seq_frames).map(list),  # a replay request
)
# Small limits, so that every limit is met by some batch; large ones, so that none is.
limits = st.one_of(
    st.just(EventLimits()),
    st.builds(
        EventLimits,
        max_hashes_per_event=st.integers(0, 4) | st.just(2**16),
        max_hashes_per_batch=st.integers(0, 8) | st.just(2**18),
        max_token_ids_per_event=st.integers(0, 64) | st.just(2**20),
        max_items=st.integers(0, 3),
    ),
)
max_bytes = st.one_of(st.just(64 * 1024 * 1024), st.integers(0, 512))


def check_rejected(rejected: Rejected, frames: list[bytes], reasons: set[RejectReason]) -> None:
    assert isinstance(rejected.reason, RejectReason)
    assert rejected.reason in reasons, rejected
    assert isinstance(rejected.detail, str) and rejected.detail
    assert rejected.frames is frames  # the dead letter keeps the evidence as it came


@fuzz_settings(500)
@given(frame_lists, st.one_of(st.none(), st.just(TOPIC), topics))
def test_split_live_never_raises(frames: list[bytes], topic: bytes | None) -> None:
    message = split_live(frames, topic)
    event(message.reason.value if isinstance(message, Rejected) else "split")
    if isinstance(message, Rejected):
        check_rejected(message, frames, LIVE_REASONS)
        assert (message.seq is not None) == (message.reason is RejectReason.TOPIC_MISMATCH)
        return
    assert isinstance(message, SeqFrames)
    assert len(frames) == 3 and len(frames[1]) == SEQ_BYTES
    assert message == (frames[0], int.from_bytes(frames[1], "big"), frames[2])
    assert topic is None or message.topic == topic


@fuzz_settings(500)
@given(frame_lists)
def test_split_reply_never_raises(frames: list[bytes]) -> None:
    message = split_reply(frames)
    event(message.reason.value if isinstance(message, Rejected) else type(message).__name__)
    if isinstance(message, Rejected):
        check_rejected(message, frames, SPLIT_REASONS)
        assert message.seq is None
        return
    assert len(frames) in (3, 4) and frames[0] == b"" and len(frames[-2]) == SEQ_BYTES
    if isinstance(message, ReplyEnd):
        assert frames[-2] == END_SEQ_FRAME and frames[-1] == b""
        return
    assert isinstance(message, SeqFrames)
    assert message.seq == int.from_bytes(frames[-2], "big") and message.payload == frames[-1]
    assert message.topic == (frames[1] if len(frames) == 4 else b"")


@fuzz_settings(300)
@given(frame_lists)
def test_parse_replay_request_never_raises(frames: list[bytes]) -> None:
    request = parse_replay_request(frames)
    if isinstance(request, Malformed):
        assert request.problem in ("frame_count", "seq_size") and request.detail
    else:
        assert frames == [b"", encode_seq(request)]


@fuzz_settings(600)
@given(topics, st.integers(0, 2**64 - 1).map(encode_seq), payloads, max_bytes, limits)
def test_decode_payload_never_raises(
    topic: bytes, seq: bytes, payload: bytes, most: int, event_limits: EventLimits
) -> None:
    frames = [topic, seq, payload]
    message = split_live(frames, None)
    assert isinstance(message, SeqFrames)
    decoded = decode_payload(message, frames, most, event_limits)
    event(decoded.reason.value if isinstance(decoded, Rejected) else "decoded")
    if isinstance(decoded, Rejected):
        check_rejected(decoded, frames, PAYLOAD_REASONS)
        assert decoded.seq == message.seq
        if decoded.reason is RejectReason.PAYLOAD_OVERSIZE:
            assert len(payload) > most
        elif decoded.reason is RejectReason.PAYLOAD_UNDECODABLE:
            assert _undecodable(payload)
        else:  # the limit it names is one the batch goes past
            batch = decode(payload).batch
            assert over_limit(batch, event_limits) == (decoded.reason, decoded.detail)
        return
    assert isinstance(decoded, DecodedBatch)
    assert len(payload) <= most
    assert over_limit(decoded.batch, event_limits) is None
    assert encode(decoded.batch) == encode(decode(payload).batch)  # bytes: a NaN ts compares


def _undecodable(payload: bytes) -> bool:
    try:
        decode(payload)
    except WireDecodeError:
        return True
    return False
