"""vLLM's ZMQ transport for KV events: the frames on each socket, and a codec for them.

* PUB socket, one message per batch: ``[topic (utf-8), seq, payload (msgpack KVEventBatch)]``;
  ``seq`` is 8 bytes, big-endian, unsigned, counting from 0 per publisher (one engine life).
* ROUTER replay socket: a DEALER sends ``[b"", start_seq]`` and gets ``[b"", topic, seq,
  payload]`` for every batch still kept with ``seq >= start_seq``, in order (``[b"", seq,
  payload]``, no topic frame, before vLLM PR #45177), then the end marker: topic and payload
  empty, seq -1 (signed).
* ``start_seq = SNAPSHOT_REQUEST`` (2**64 - 1) asks hmakv's publisher for a snapshot
  (``producer.publisher`` says what comes back); vLLM's keeps no seq that high and answers with
  the end marker alone.
* DP rank ``r`` of an engine uses port + ``r`` (tcp) or an ``_dp<r>`` suffix (inproc).
* Wildcard, ipc and inproc endpoints bind; an endpoint naming a host connects.

The parsers never raise: a frame anyone able to reach a socket sends is data, so they return a
``Malformed`` with one ``FrameProblem`` label out of a fixed set and a readable detail. Standard
library only, so that whatever follows an engine can import the contract without zmq.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

SEQ_BYTES = 8
END_SEQ = -1
"""The seq of the end marker that closes every replay or snapshot reply."""
END_SEQ_FRAME = END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True)
END_MARKER = (b"", END_SEQ_FRAME, b"")
"""The end marker's topic, seq and payload frames (a reply puts the empty delimiter first)."""
SNAPSHOT_REQUEST = 2**64 - 1
"""The start_seq of a replay request that asks for a snapshot instead of buffered batches."""

_LIVE_FRAMES = 3  # topic, seq, payload
_REPLY_FRAMES = 4  # delimiter, topic, seq, payload
_OLD_REPLY_FRAMES = 3  # delimiter, seq, payload: before vLLM PR #45177
_REQUEST_FRAMES = 2  # delimiter, start_seq


class SeqFrames(NamedTuple):
    """A well-formed message: topic, seq and a payload still to decode. A named tuple, as one
    is made per message: a frozen dataclass takes twice as long to build."""

    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplyEnd:
    """The end marker of a replay or snapshot reply."""


FrameProblem = Literal["frame_count", "seq_size"]
"""What is wrong with a message's frames, as a stable label (a metric's, a log's)."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """Frames that are not a message of the protocol: ``problem`` says which way, ``detail``
    says it for a person."""

    problem: FrameProblem
    detail: str


def encode_seq(seq: int) -> bytes:
    """A seq frame; raises ``OverflowError`` for a seq outside 0..2**64-1."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The seq of a seq frame (unsigned); the caller checks its size (see the parsers)."""
    return int.from_bytes(frame, "big")


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """A PUB message."""
    return [topic, encode_seq(seq), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the ROUTER: every kept batch from ``start_seq`` on, or, with
    ``SNAPSHOT_REQUEST``, a snapshot."""
    return [b"", encode_seq(start_seq)]


def reply_frames(topic: bytes | None, seq: int, payload: bytes) -> list[bytes]:
    """One batch of a reply as the DEALER receives it; ``topic`` None: the form before vLLM PR
    #45177, without the topic frame."""
    if topic is None:
        return [b"", encode_seq(seq), payload]
    return [b"", topic, encode_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> SeqFrames | Malformed:
    """A PUB message as a SUB socket receives it."""
    if len(frames) != _LIVE_FRAMES:
        detail = f"{len(frames)} frames, expected 3 (topic, seq, payload)"
        return Malformed("frame_count", detail)
    topic, seq_frame, payload = frames
    if len(seq_frame) != SEQ_BYTES:
        return _bad_seq_size(seq_frame)
    return SeqFrames(topic, int.from_bytes(seq_frame, "big"), payload)


def parse_reply(frames: Sequence[bytes]) -> SeqFrames | ReplyEnd | Malformed:
    """A replay or snapshot reply message as the DEALER receives it, with or without the topic
    frame (the topic is ``b""`` without one)."""
    if len(frames) not in (_REPLY_FRAMES, _OLD_REPLY_FRAMES) or frames[0]:
        detail = f"{len(frames)} frames, expected ['', topic, seq, payload] or ['', seq, payload]"
        return Malformed("frame_count", detail)
    topic = frames[1] if len(frames) == _REPLY_FRAMES else b""
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != SEQ_BYTES:
        return _bad_seq_size(seq_frame)
    if seq_frame == END_SEQ_FRAME and not payload:
        return ReplyEnd()
    return SeqFrames(topic, int.from_bytes(seq_frame, "big"), payload)


def parse_replay_request(frames: Sequence[bytes]) -> int | Malformed:
    """The start_seq of a replay request as the DEALER sent it (a ROUTER puts the client's
    identity frame before these)."""
    if len(frames) != _REQUEST_FRAMES or frames[0]:
        detail = f"{len(frames)} frames, expected ['', start_seq]"
        return Malformed("frame_count", detail)
    if len(frames[1]) != SEQ_BYTES:
        return _bad_seq_size(frames[1])
    return int.from_bytes(frames[1], "big")


def _bad_seq_size(seq_frame: bytes) -> Malformed:
    detail = f"seq frame of {len(seq_frame)} bytes, expected {SEQ_BYTES}"
    return Malformed("seq_size", detail)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Give each DP rank its own endpoint the way vLLM does, so clients find ranks where they look.

    tcp: port + rank; inproc: ``_dp<rank>`` suffix; rank 0 and ``None`` unchanged; any other
    transport with a rank above 0 is rejected, as vLLM rejects it.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" not in endpoint:
        raise ValueError(f"cannot offset {endpoint!r} by DP rank: use tcp:// or inproc://")
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + data_parallel_rank}"


def should_bind(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: stable endpoints (wildcards, ipc, inproc) bind, host
    addresses connect (to a subscriber that binds)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )
