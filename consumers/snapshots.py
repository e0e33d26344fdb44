"""Index snapshots with the Kafka offsets they reflect, kept in a file or in a compacted topic.

A follower that restarts restores its newest snapshot and consumes from the offsets saved with
it, so a restart costs time in the size of the index, not in the length of the log.

One snapshot is a ``Snapshot`` struct (msgpack), zlib-compressed into a *blob*. The index state
and the offsets are captured together, between two applied batches, so the offsets say exactly
which records the state already contains.

In Kafka (``<prefix>.snapshots``, compacted) a blob is larger than a record may be, so it is cut
into chunks keyed ``<follower>/<snapshot id>/<n>``, all in the partition of the follower's key;
then a small ``SnapshotManifest`` under the key ``<follower>`` lists the chunks' offsets. The
manifest is written last, so a follower that dies mid-save leaves the previous manifest and its
chunks intact; the chunks of the previous snapshot are deleted (tombstones) once the new
manifest is written. Loading scans the partition backwards from its end for the newest manifest,
so it reads what was written after that manifest, never the topic's whole history. A save that
died before its manifest leaves chunks no manifest names; they stay until deleted by hand.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
from aiokafka.structs import TopicPartition

from hmakv.kvlog.kafka_client import (
    KafkaSecurity,
    StartedProducer,
    TopicSpec,
    create_consumer,
    ensure_topics,
    partition_for,
    start_producer,
    stop_consumer,
    topic_partitions,
)
from hmakv.kvlog.records import WorkerState

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
# Below aiokafka's default max_request_size (1 MiB) with room for the record's key and framing.
DEFAULT_CHUNK_BYTES = 768 * 1024
_TOPIC_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
# Small segments let compaction drop replaced snapshots soon (the active segment never compacts).
_TOPIC_SEGMENT_BYTES = 64 * 1024 * 1024
_FIRST_SCAN_WINDOW = 64
_FETCH_TIMEOUT_MS = 1000
_EMPTY_FETCHES_AT_END = 3


class SnapshotError(RuntimeError):
    """A stored snapshot that cannot be used (corrupt, truncated, another format)."""


class PartitionOffset(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The next offset to consume from one partition: everything before it is in the index."""

    topic: str
    partition: int
    offset: int


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    """What a follower needs to resume: the index, the offsets it reflects, the worker states.

    ``worker_states`` are the latest ``WorkerState`` records read, kept for what the index does
    not hold (the bridge's last forwarded seq, the endpoint). ``key_partitions`` says which
    events partition each (worker, group) came from, so that a group-mode follower knows after a
    restart which of its state belongs to partitions it no longer reads.
    """

    format: int
    follower_id: str
    created: float
    offsets: list[PartitionOffset]
    worker_states: list[WorkerState]
    index: bytes
    key_partitions: list[tuple[str, int, int]] = msgspec.field(default_factory=list)


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)


def pack(snapshot: Snapshot) -> bytes:
    """The stored form; level 1 because the bulk (block hashes) is random and barely shrinks."""
    return zlib.compress(_snapshot_encoder.encode(snapshot), 1)


def unpack(blob: bytes) -> Snapshot:
    try:
        snapshot = _snapshot_decoder.decode(zlib.decompress(blob))
    except (zlib.error, msgspec.DecodeError) as exc:
        raise SnapshotError(f"unreadable snapshot: {exc}") from exc
    if snapshot.format != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"snapshot format {snapshot.format}, this follower reads only {SNAPSHOT_FORMAT}"
        )
    return snapshot


def check_follower_id(follower_id: str) -> None:
    """A follower's id keys its snapshot, whose chunks are keyed ``<id>/<snapshot>/<n>``."""
    if "/" in follower_id or not follower_id:
        raise ValueError(f"follower id must be non-empty and contain no '/': {follower_id!r}")


class SnapshotStore(Protocol):
    """Where a follower keeps its newest snapshot blob."""

    def describe(self) -> str: ...

    async def save(self, blob: bytes) -> None: ...

    async def load(self) -> bytes | None:
        """The newest blob, or None when there is none yet."""

    async def close(self) -> None: ...


class FileSnapshotStore:
    """One file, replaced atomically: a crash mid-write leaves the previous snapshot."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        return f"file:{self.path}"

    async def save(self, blob: bytes) -> None:
        await asyncio.to_thread(self._write, blob)

    def _write(self, blob: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("wb") as file:
            file.write(blob)
            file.flush()
            os.fsync(file.fileno())
        partial.replace(self.path)

    async def load(self) -> bytes | None:
        try:
            return await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            return None

    async def close(self) -> None:
        return None


class SnapshotManifest(msgspec.Struct, frozen=True, gc=False):
    """Where one snapshot's chunks are: their offsets in the follower's partition, in order."""

    snapshot_id: str
    created: float
    chunk_offsets: list[int]
    size: int
    crc32: int


_manifest_encoder = msgspec.msgpack.Encoder()
_manifest_decoder = msgspec.msgpack.Decoder(SnapshotManifest)


class KafkaSnapshotStore:
    """Snapshots in a compacted topic under the follower's key; see the module for the layout."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        follower_id: str,
        *,
        security: KafkaSecurity | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        check_follower_id(follower_id)
        self.bootstrap = bootstrap
        self.topic = topic
        self.follower_id = follower_id
        self._security = security
        self._chunk_bytes = chunk_bytes
        self._key = follower_id.encode()
        self._producer: StartedProducer | None = None
        self._partition: int | None = None
        # The chunk keys of the snapshot the current manifest names: deleted after the next one.
        self._live_chunk_keys: list[bytes] = []

    def describe(self) -> str:
        return f"kafka:{self.topic} key {self.follower_id}"

    async def save(self, blob: bytes) -> None:
        producer = await self._started_producer()
        partition = await self._follower_partition()
        snapshot_id = uuid.uuid4().hex
        chunk_keys = self._chunk_keys(snapshot_id, max(1, -(-len(blob) // self._chunk_bytes)))
        size = self._chunk_bytes
        deliveries = [
            await producer.send(
                self.topic, blob[number * size : (number + 1) * size], key=key, partition=partition
            )
            for number, key in enumerate(chunk_keys)
        ]
        offsets = [(await delivery).offset for delivery in deliveries]
        manifest = SnapshotManifest(snapshot_id, time.time(), offsets, len(blob), zlib.crc32(blob))
        await producer.send_and_wait(
            self.topic, _manifest_encoder.encode(manifest), key=self._key, partition=partition
        )
        await self._delete(self._live_chunk_keys, partition)
        self._live_chunk_keys = chunk_keys

    async def _delete(self, keys: Sequence[bytes], partition: int) -> None:
        producer = await self._started_producer()
        deliveries = [
            await producer.send(self.topic, None, key=key, partition=partition) for key in keys
        ]
        for delivery in deliveries:
            await delivery

    async def load(self) -> bytes | None:
        partition = await self._follower_partition()
        consumer = create_consumer(
            self.bootstrap,
            client_id=f"hmakv-snapshots-{self.follower_id}",
            security=self._security,
        )
        try:  # stopped even when start fails: it holds a client and its connections
            await consumer.start()
            tp = TopicPartition(self.topic, partition)
            consumer.assign([tp])
            manifest = await _newest_manifest(consumer, tp, self._key)
            if manifest is None:
                return None
            chunk_keys = self._chunk_keys(manifest.snapshot_id, len(manifest.chunk_offsets))
            blob = await _read_chunks(consumer, tp, manifest, chunk_keys)
        finally:
            await stop_consumer(consumer)
        self._live_chunk_keys = chunk_keys
        return blob

    def _chunk_keys(self, snapshot_id: str, count: int) -> list[bytes]:
        return [f"{self.follower_id}/{snapshot_id}/{number}".encode() for number in range(count)]

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.producer.stop()
            self._producer = None

    async def _started_producer(self) -> Any:
        if self._producer is None:
            self._producer = await start_producer(
                self.bootstrap,
                client_id=f"hmakv-snapshots-{self.follower_id}",
                security=self._security,
            )
        return self._producer.producer

    async def _follower_partition(self) -> int:
        """Create the topic if needed; every record of this follower goes to its key's partition."""
        if self._partition is None:
            await ensure_topics(
                self.bootstrap,
                [
                    TopicSpec(
                        self.topic,
                        config={
                            "cleanup.policy": "compact",
                            "max.message.bytes": str(_TOPIC_MAX_MESSAGE_BYTES),
                            "segment.bytes": str(_TOPIC_SEGMENT_BYTES),
                        },
                    )
                ],
                security=self._security,
            )
            partitions = await topic_partitions(self.bootstrap, self.topic, self._security)
            if not partitions:
                raise SnapshotError(f"snapshot topic {self.topic!r} has no partitions")
            self._partition = partition_for(self._key, partitions)
        return self._partition


async def _newest_manifest(
    consumer: Any, tp: TopicPartition, key: bytes
) -> SnapshotManifest | None:
    """Scan back from the end in doubling windows: only what follows the manifest is read."""
    begin = (await consumer.beginning_offsets([tp]))[tp]
    high = (await consumer.end_offsets([tp]))[tp]
    window = _FIRST_SCAN_WINDOW
    while high > begin:
        low = max(begin, high - window)
        newest: SnapshotManifest | None = None
        for record in await _read_range(consumer, tp, low, high):
            if record.key == key and record.value is not None:
                newest = _decode_manifest(record.value)
        if newest is not None:
            return newest
        high, window = low, window * 2
    return None


async def _read_range(consumer: Any, tp: TopicPartition, low: int, high: int) -> list[Any]:
    """Records with ``low <= offset < high``.

    Compaction may have removed every record up to ``high``: then fetches come back empty and the
    position never gets there, so a few empty fetches in a row end the range.
    """
    consumer.seek(tp, low)
    records: list[Any] = []
    empty_fetches = 0
    while await consumer.position(tp) < high and empty_fetches < _EMPTY_FETCHES_AT_END:
        fetched = (await consumer.getmany(tp, timeout_ms=_FETCH_TIMEOUT_MS)).get(tp, [])
        empty_fetches = 0 if fetched else empty_fetches + 1
        records.extend(r for r in fetched if r.offset < high)
    return records


def _decode_manifest(value: bytes) -> SnapshotManifest:
    try:
        return _manifest_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"unreadable snapshot manifest: {exc}") from exc


async def _read_chunks(
    consumer: Any, tp: TopicPartition, manifest: SnapshotManifest, chunk_keys: list[bytes]
) -> bytes:
    wanted = dict(zip(manifest.chunk_offsets, chunk_keys, strict=True))
    first, last = manifest.chunk_offsets[0], manifest.chunk_offsets[-1]
    chunks = {
        record.offset: record.value
        for record in await _read_range(consumer, tp, first, last + 1)
        if wanted.get(record.offset) == record.key and record.value is not None
    }
    if len(chunks) != len(wanted):
        raise SnapshotError(
            f"snapshot {manifest.snapshot_id}: {len(wanted) - len(chunks)} of {len(wanted)} "
            "chunks are gone from the topic"
        )
    blob = b"".join(chunks[offset] for offset in manifest.chunk_offsets)
    if len(blob) != manifest.size or zlib.crc32(blob) != manifest.crc32:
        raise SnapshotError(f"snapshot {manifest.snapshot_id}: size or checksum does not match")
    return blob


def open_store(
    target: str, *, bootstrap: str, topic: str, follower_id: str, security: KafkaSecurity | None
) -> SnapshotStore | None:
    """``kafka``, ``file:PATH`` or ``none`` (the ``--snapshot-to`` forms) as a store."""
    if target == "none":
        return None
    if target == "kafka":
        return KafkaSnapshotStore(bootstrap, topic, follower_id, security=security)
    if target.startswith("file:") and len(target) > len("file:"):
        return FileSnapshotStore(Path(target.removeprefix("file:")))
    raise ValueError(f"snapshot target must be kafka, file:PATH or none, got {target!r}")
