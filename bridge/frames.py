"""ZMQ messages into values: a batch with its seq, an end marker, or a rejection with its reason.

Nothing here raises on bad input: a frame an engine (or anyone able to reach the socket) sends
is data, and the bridge must keep going whatever it is. A ``Rejected`` carries the raw frames and
one reason out of a fixed set, so that the dead-letter topic keeps the evidence and the
Prometheus label stays bounded. The frames are parsed by ``producer.protocol``; what is added
here is the bridge's own checks (topic, payload size and decoding) and their reasons.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hmakv.producer.events import DecodedBatch, WireDecodeError, decode
from hmakv.producer.protocol import Malformed, ReplyEnd, SeqFrames, parse_live, parse_reply


class RejectReason(enum.Enum):
    """Why a message was not used; the value is the Prometheus label and dead-letter header."""

    FRAME_COUNT = "frame_count"  # these two: producer.protocol's FrameProblem labels
    SEQ_SIZE = "seq_size"
    PAYLOAD_OVERSIZE = "payload_oversize"
    PAYLOAD_UNDECODABLE = "payload_undecodable"
    TOPIC_MISMATCH = "topic_mismatch"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    WORKER_UNKNOWN = "worker_unknown"
    KEY_MISMATCH = "key_mismatch"  # CURVE: the topic is a worker's, the sender's key is not


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    detail: str
    frames: list[bytes]
    seq: int | None = None  # known when the frames were well formed up to the payload


def split_live(frames: list[bytes], topic: bytes | None) -> SeqFrames | Rejected:
    """A PUB message; ``topic`` is the exact topic expected, or None for any."""
    message = parse_live(frames)
    if isinstance(message, Malformed):
        return _rejected(message, frames)
    if topic is not None and message.topic != topic:
        detail = f"topic {message.topic!r}, expected {topic!r}"
        return Rejected(RejectReason.TOPIC_MISMATCH, detail, frames, message.seq)
    return message


def split_reply(frames: list[bytes]) -> SeqFrames | ReplyEnd | Rejected:
    """A replay or snapshot reply message, with or without the topic frame."""
    reply = parse_reply(frames)
    return _rejected(reply, frames) if isinstance(reply, Malformed) else reply


def _rejected(malformed: Malformed, frames: list[bytes]) -> Rejected:
    return Rejected(RejectReason(malformed.problem), malformed.detail, frames)


def decode_payload(
    message: SeqFrames, frames: list[bytes], max_bytes: int
) -> DecodedBatch | Rejected:
    if len(message.payload) > max_bytes:
        detail = f"payload of {len(message.payload)} bytes exceeds the limit of {max_bytes}"
        return Rejected(RejectReason.PAYLOAD_OVERSIZE, detail, frames, message.seq)
    try:
        return decode(message.payload, max_bytes=max_bytes)
    except WireDecodeError as error:
        return Rejected(RejectReason.PAYLOAD_UNDECODABLE, str(error), frames, message.seq)
