"""ZMQ messages into values: a batch with its seq, an end marker, or a rejection with its reason.

Nothing here raises on bad input: a frame an engine (or anyone able to reach the socket) sends
is data, and the bridge must keep going whatever it is. A ``Rejected`` carries the raw frames and
one reason out of a fixed set, so that the dead-letter topic keeps the evidence and the
Prometheus label stays bounded.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from producer.events import DecodedBatch, WireDecodeError, decode

SEQ_BYTES = 8
END_SEQ = -1
_LIVE_FRAMES = 3  # topic, seq, payload
# Replies as a DEALER sees them: an empty delimiter, then topic (since vLLM PR #45177), seq,
# payload; the end marker has an empty payload and seq -1.
_REPLY_FRAMES = 4
_OLD_REPLY_FRAMES = 3
# The llm-d convention for a publisher's topic: kv@<pod-id>@<model>.
_LLMD_PREFIX = "kv@"


class RejectReason(enum.Enum):
    """Why a message was not used; the value is the Prometheus label and dead-letter header."""

    FRAME_COUNT = "frame_count"
    SEQ_SIZE = "seq_size"
    PAYLOAD_OVERSIZE = "payload_oversize"
    PAYLOAD_UNDECODABLE = "payload_undecodable"
    TOPIC_MISMATCH = "topic_mismatch"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    WORKER_UNKNOWN = "worker_unknown"


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    detail: str
    frames: list[bytes]
    seq: int | None = None  # known when the frames were well formed up to the payload


class SeqFrames(NamedTuple):
    """A well-formed message: topic, seq and a payload still to decode. A named tuple, as one
    is made per message: a frozen dataclass takes twice as long to build."""

    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplyEnd:
    """The end marker of a replay or snapshot reply."""


def split_live(frames: list[bytes], topic: bytes | None) -> SeqFrames | Rejected:
    """A PUB message; ``topic`` is the exact topic expected, or None for any."""
    if len(frames) != _LIVE_FRAMES:
        detail = f"{len(frames)} frames, expected 3 (topic, seq, payload)"
        return Rejected(RejectReason.FRAME_COUNT, detail, frames)
    message_topic, seq_frame, payload = frames
    if len(seq_frame) != SEQ_BYTES:
        detail = f"seq frame of {len(seq_frame)} bytes, expected {SEQ_BYTES}"
        return Rejected(RejectReason.SEQ_SIZE, detail, frames)
    seq = int.from_bytes(seq_frame, "big")
    if topic is not None and message_topic != topic:
        detail = f"topic {message_topic!r}, expected {topic!r}"
        return Rejected(RejectReason.TOPIC_MISMATCH, detail, frames, seq)
    return SeqFrames(message_topic, seq, payload)


def split_reply(frames: list[bytes]) -> SeqFrames | ReplyEnd | Rejected:
    """A replay or snapshot reply message, with or without the topic frame."""
    if len(frames) not in (_REPLY_FRAMES, _OLD_REPLY_FRAMES) or frames[0]:
        detail = f"{len(frames)} frames, expected ['', topic, seq, payload] or ['', seq, payload]"
        return Rejected(RejectReason.FRAME_COUNT, detail, frames)
    topic = frames[1] if len(frames) == _REPLY_FRAMES else b""
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != SEQ_BYTES:
        detail = f"seq frame of {len(seq_frame)} bytes, expected {SEQ_BYTES}"
        return Rejected(RejectReason.SEQ_SIZE, detail, frames)
    if int.from_bytes(seq_frame, "big", signed=True) == END_SEQ and not payload:
        return ReplyEnd()
    return SeqFrames(topic, int.from_bytes(seq_frame, "big"), payload)


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


def llmd_pod(topic: bytes) -> str | None:
    """The pod id of an llm-d style topic ``kv@<pod-id>@<model>``, or None if it is not one."""
    text = topic.decode("utf-8", "replace")
    if not text.startswith(_LLMD_PREFIX):
        return None
    pod, sep, model = text[len(_LLMD_PREFIX) :].partition("@")
    if not sep or not pod or not model or "/" in pod:
        return None
    return pod
