"""The index's snapshot format (format 2): what ``KVIndex.snapshot`` writes and ``restore`` reads.

One place for the bytes: the msgpack structs, their encoder and decoder, the format check and
how a packed int travels. ``KVIndex`` turns its structure into these structs and back; the
follower wraps the bytes, with the offsets they reflect, in ``snapshots.Snapshot``.

Why it is shaped this way:

- A distinct hash costs its hash (9 bytes for a uint64) and one int with every group's bitset
  over the slots in use, lane after lane, without padding or lane 0 (the OR of the others,
  rebuilt on restore): the same bytes whatever lane width the index that wrote it had.
- An int that outgrows msgpack's 64 bits (more than 64 slots' worth of lanes) goes as
  little-endian bytes.
- Fields added since format 2 began have defaults, so older snapshots of the same format still
  restore; format 1 (one dict per group and medium) is refused, and the follower reads the log.
- No counters: they are Prometheus counters, which start at zero with each process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from hmakv.consumers.block_table import Table
from hmakv.kvlog.records import Health
from hmakv.producer.events import ExternalBlockHash, GroupSpec

FORMAT = 2
_WIRE_INT_LIMIT = 1 << 64


class WorkerSnapshot(msgspec.Struct, array_like=True, gc=False):
    name: str
    slot: int
    epoch: int
    health: Health
    groups: dict[int, GroupSpec]
    last_seq: dict[int, int]
    resident: list[tuple[int, str, int]]
    next_event: dict[int, int] = {}  # absent from snapshots made before records could be split
    hash_lookahead: int = 0  # absent from snapshots made before lookahead hashing


class MediumSnapshot(msgspec.Struct, array_like=True, gc=False):
    medium: str
    hashes: list[ExternalBlockHash]
    # Packed bitsets (slot ``s`` of the ``p``-th lane at bit ``p * slots + s``): an int while it
    # fits msgpack's 64 bits, else little-endian bytes.
    owners: list[int | bytes]
    copies: list[tuple[int, int, ExternalBlockHash, int]]  # group, slot, hash, extra copies


class _Format(msgspec.Struct, gc=False):
    format: int


class IndexSnapshot(msgspec.Struct, kw_only=True, gc=False):
    format: int = FORMAT
    slots: int  # bits per group in a packed int
    lanes: list[int]  # the group of each lane, in lane order
    workers: list[WorkerSnapshot]
    media: list[MediumSnapshot]
    # The counters older snapshots hold are ignored.
    retired: dict[str, int] = {}  # absent from snapshots made before workers could retire


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexSnapshot)
_format_decoder = msgspec.msgpack.Decoder(_Format)


def encode(snapshot: IndexSnapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode(data: bytes) -> IndexSnapshot:
    """The saved state; ``ValueError`` for another format, read first so that an older layout
    is refused by its number, not by a field it lacks."""
    saved_format = _format_decoder.decode(data).format
    if saved_format != FORMAT:
        raise ValueError(f"unsupported index snapshot format {saved_format}")
    return _decoder.decode(data)


def medium_snapshot(
    medium: str,
    owners: Table,
    copies: Mapping[tuple[int, int], Mapping[ExternalBlockHash, int]],
    packed: Callable[[int], int],
) -> MediumSnapshot:
    """One medium's holders, each packed int in the wire's lanes (``packed``), and its extra
    copies per (group, slot) as flat rows."""
    held_by = sorted(owners.items())  # the same bytes for the same state, whatever the table
    return MediumSnapshot(
        medium=medium,
        hashes=[block_hash for block_hash, _ in held_by],
        owners=[_owners_to_wire(packed(held)) for _, held in held_by],
        copies=[
            (group, slot, block_hash, extra)
            for (group, slot), extras in copies.items()
            for block_hash, extra in extras.items()
        ],
    )


def _owners_to_wire(held: int) -> int | bytes:
    if held < _WIRE_INT_LIMIT:
        return held
    return held.to_bytes((held.bit_length() + 7) // 8, "little")


def owners_from_wire(held: int | bytes) -> int:
    return held if isinstance(held, int) else int.from_bytes(held, "little")
