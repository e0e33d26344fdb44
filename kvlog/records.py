"""The Kafka record contract: topic names, keys, headers and value structs.

The bridge writes these records and the consumers read them; nothing else defines a record.

- ``<prefix>.events``: one ``EventRecord`` per (engine batch, cache group), key
  ``"<worker>/<group_idx>"`` so that one worker's group keeps its order in one partition.
- ``<prefix>.workers`` (compacted): one ``WorkerState`` per worker, key ``"<worker>"``.
- ``<prefix>.deadletter``: one ``DeadLetter`` per frame the bridge could not decode.

Delivery is at least once; a consumer makes it exactly-once in effect by ignoring any
(worker, epoch, group) event it has already applied: by seq, and within a seq by ``first_event``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from hmakv.producer.events import (
    MAX_GROUP_IDX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVEvent,
)

DEFAULT_TOPIC_PREFIX = "hmakv"

Health = Literal["live", "replaying", "degraded"]
HEALTH_STATES: tuple[Health, ...] = ("live", "replaying", "degraded")
# A worker no bridge follows any more: see ``WorkerState``.
Retired = Literal["retired"]
RETIRED: Retired = "retired"


class Topics(msgspec.Struct, frozen=True):
    """The topic names for one deployment, all derived from one prefix."""

    prefix: str = DEFAULT_TOPIC_PREFIX

    @property
    def events(self) -> str:
        return f"{self.prefix}.events"

    @property
    def workers(self) -> str:
        return f"{self.prefix}.workers"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def snapshots(self) -> str:
        return f"{self.prefix}.snapshots"


def worker_id(name: str, data_parallel_rank: int | None) -> str:
    """A worker per engine endpoint, or per DP rank when the endpoint has several ranks.

    ``/`` separates worker and group in keys, so it may not appear in a name.
    """
    if "/" in name or not name:
        raise ValueError(f"worker name must be non-empty and contain no '/': {name!r}")
    return name if data_parallel_rank is None else f"{name}-dp{data_parallel_rank}"


def event_key(worker: str, group_idx: int) -> bytes:
    return f"{worker}/{group_idx}".encode()


_MAX_GROUP_DIGITS = len(str(MAX_GROUP_IDX))


def parse_event_key(key: bytes) -> tuple[str, int]:
    """Inverse of ``event_key``; raises ``RecordDecodeError`` on a malformed key.

    A key comes from the log, which anyone with write access can fill: only ASCII digits, and not
    too many of them, make a group index (``str.isdigit`` also accepts "²", on which ``int``
    fails, and ``int`` refuses strings past 4300 digits).
    """
    worker, sep, group = key.decode("utf-8", "replace").rpartition("/")
    if (
        not sep
        or not worker
        or not group.isascii()
        or not group.isdigit()
        or len(group) > _MAX_GROUP_DIGITS
    ):
        raise RecordDecodeError(f"malformed event key {key!r}: expected b'<worker>/<group>'")
    return worker, int(group)


# A record's first event is a position among one batch's events for one group (a scheduler
# step's: far fewer). The bound keeps what a consumer counts from it (``first_event`` plus the
# record's events) an int its snapshot can hold: past 2**64 - 1, every snapshot failed.
MAX_FIRST_EVENT = 2**32 - 1
FirstEvent = Annotated[int, msgspec.Meta(ge=0, le=MAX_FIRST_EVENT)]
# A worker's epoch counts its engine's lives from 0, and its epoch + 1 is where a retired one
# comes back: past 2**63 - 1 that no longer fits the int a snapshot holds. A seq is the engine's
# signed 64-bit frame (-1 for the clear that opens an epoch).
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 2)]
Seq = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]


class EventRecord(msgspec.Struct, frozen=True, gc=False):
    """One engine batch's events for one cache group, in the engine's order.

    ``seq`` is the engine publisher's sequence number of the batch; ``epoch`` is raised by the
    bridge each time that worker's sequence restarts, so two lives of one engine never mix. A
    clear of the worker arrives as a record whose events are ``[AllBlocksCleared()]`` in every
    known group. A clear the bridge makes carries a seq that keeps ``(epoch, seq)`` in order
    within a key: -1 for the clear that opens an engine's new life (whose seqs start at 0
    again), otherwise the last seq it accounts for; its ``ts`` is the bridge's clock.

    ``first_event`` is the position of the record's first event among the batch's events for
    its group. It is 0 but where a group's events are too many for one Kafka record (an engine's
    snapshot of a large cache) and are split, in order, over records of the same seq. A consumer
    that keeps how many events of its last seq it applied takes each event once, even from a
    batch sent again and split elsewhere (by a bridge with another record size limit). A record
    from before the field existed decodes to 0; one outside 0..``MAX_FIRST_EVENT`` does not
    decode.
    """

    worker: str
    epoch: Epoch
    seq: Seq
    ts: float
    group_idx: int
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    first_event: FirstEvent = 0

    def headers(self) -> list[tuple[str, bytes]]:
        """Kafka headers repeating the routing fields, for tools that do not decode values."""
        return EventHeaders(self.worker).of(self)


class EventHeaders:
    """``EventRecord.headers`` for one worker's records, each header made once and reused.

    The bridge writes a record per group of every engine batch, and the records of one worker
    differ only in group, and in epoch and seq from batch to batch: making the four headers anew
    for each record cost more than the fan-out.
    """

    def __init__(self, worker: str) -> None:
        self._worker = ("worker", worker.encode())
        self._groups: dict[int, tuple[str, bytes]] = {}
        self._epoch = self._seq = (-2, ("", b""))  # (number, its header): none yet

    def of(self, record: EventRecord) -> list[tuple[str, bytes]]:
        group = self._groups.get(record.group_idx)
        if group is None:
            group = self._groups[record.group_idx] = ("group", str(record.group_idx).encode())
        if self._epoch[0] != record.epoch:
            self._epoch = (record.epoch, ("epoch", str(record.epoch).encode()))
        if self._seq[0] != record.seq:
            self._seq = (record.seq, ("seq", str(record.seq).encode()))
        headers = [self._worker, group, self._epoch[1], self._seq[1]]
        if record.first_event:
            headers.append(("first_event", str(record.first_event).encode()))
        return headers


class WorkerState(msgspec.Struct, frozen=True, gc=False):
    """The bridge's view of one worker, compacted to the latest per worker.

    ``last_seq`` is the last engine seq forwarded in ``epoch`` (-1 before the first); a bridge
    restarting resumes replay from ``last_seq + 1``. ``ts`` is the engine's timestamp of that
    batch (0.0 before the first), which lets a consumer tell how current the worker is.
    ``groups`` maps group_idx to its spec as learned from stores (or configured).

    ``health`` ``"retired"``: the worker left the fleet (removed from every bridge's engines, or
    an llm-d pod replaced at ``--max-workers``) and nothing follows its cache any more. Consumers
    drop it and ignore its records of ``epoch`` and before, however late they read them (its
    groups' partitions lag the workers topic, or retention has not removed them yet). Should it
    come back, the bridge follows it from ``epoch + 1``, a new life from the consumers' view. The
    state stays in the compacted topic; a tombstone (no value) forgets the worker entirely, once
    the events topic holds none of its records.
    """

    worker: str
    epoch: Epoch
    last_seq: Seq
    health: Health | Retired
    groups: dict[int, GroupSpec]
    ts: float
    data_parallel_rank: int | None = None
    endpoint: str | None = None

    def key(self) -> bytes:
        return self.worker.encode()


class DeadLetter(msgspec.Struct, frozen=True, gc=False):
    """A ZMQ message the bridge could not use, kept raw with the reason it was rejected."""

    source: str
    reason: str
    detail: str
    frames: list[bytes]
    ts: float

    def headers(self) -> list[tuple[str, bytes]]:
        return [("source", self.source.encode()), ("reason", self.reason.encode())]


class RecordDecodeError(ValueError):
    """A Kafka record that is not a valid hmakv record; the message says what was wrong.

    The only exception the decoders raise, whatever the bytes: anyone who can write the log can
    put any value there, and a record that crashed its reader would crash it again on every read.
    """


class _StoreWithoutTokens(BlockStored, tag="BlockStored"):
    """A store as ``decode_event_record(..., token_ids=False)`` gives it: its token ids left
    undecoded (``msgspec.Raw``, a view of the record's bytes). The index never reads them, and
    making an int per token was a quarter of decoding a record."""

    token_ids: msgspec.Raw  # type: ignore[assignment]


class _RecordWithoutTokens(EventRecord, frozen=True):
    events: list[_StoreWithoutTokens | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(EventRecord)
_event_decoder_without_tokens = msgspec.msgpack.Decoder(_RecordWithoutTokens)
_worker_decoder = msgspec.msgpack.Decoder(WorkerState)
_deadletter_decoder = msgspec.msgpack.Decoder(DeadLetter)
# An extra key is any msgpack value, nested as deep as the bytes say: msgspec gives up past
# Python's recursion limit with a RecursionError, which is the record's fault like any other.
_DECODE_FAILURES = (msgspec.DecodeError, RecursionError)


def encode(record: EventRecord | WorkerState | DeadLetter) -> bytes:
    return _encoder.encode(record)


def decode_event_record(value: bytes, *, token_ids: bool = True) -> EventRecord:
    """``token_ids=False``: each store's ``token_ids`` stays its msgpack (``msgspec.Raw``),
    for a reader that never looks at them; they are still checked to be one msgpack value."""
    decoder = _event_decoder if token_ids else _event_decoder_without_tokens
    try:
        return decoder.decode(value)
    except _DECODE_FAILURES as exc:
        raise RecordDecodeError(f"bad event record: {exc}") from exc


def decode_worker_state(value: bytes) -> WorkerState:
    try:
        return _worker_decoder.decode(value)
    except _DECODE_FAILURES as exc:
        raise RecordDecodeError(f"bad worker state: {exc}") from exc


def decode_dead_letter(value: bytes) -> DeadLetter:
    try:
        return _deadletter_decoder.decode(value)
    except _DECODE_FAILURES as exc:
        raise RecordDecodeError(f"bad dead letter: {exc}") from exc
