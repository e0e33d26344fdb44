"""One medium's table of the index: block hash -> packed holders, and the two loops that apply
a store and a removal of a run of blocks to it.

``BlockTable`` is ``hmakv_native.BlockTable`` where it is installed: the hashes held as u64s
natively (~17 bytes each, against ~100 in a dict: the int key, its entry, the table's slack) and
the loops run natively, one call per run of events (a record's consecutive stores, or removals,
on one medium). Without it, ``PyBlockTable``: a dict with the same methods, and the
specification, which tests/consumers/test_block_table.py checks the native one against. Only u64
hashes are held (what vLLM sends): a store refuses any other, a removal finds it missing, a
lookup finds nothing.

The index decides what a holder value becomes, once per distinct value in a run (the blocks of a
prefix mostly share one): ``derive(held)`` gives a store's new value, or None when the worker holds
the block in the group already (another copy); ``classify(held)`` gives a removal's (whether the
worker holds it in the group, whether a full-attention copy stays, what is left).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Protocol, TypeGuard

from hmakv.consumers.hit_rule import Column
from hmakv.producer.events import ExternalBlockHash

U64_LIMIT = 2**64
Derive = Callable[[int], int | None]
Classify = Callable[[int], tuple[bool, bool, int]]


class Table(Protocol):
    """What the index and the scoring read and write of a medium's table."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: ExternalBlockHash) -> int: ...
    def __setitem__(self, key: ExternalBlockHash, value: int) -> None: ...
    def __delitem__(self, key: ExternalBlockHash) -> None: ...
    def __iter__(self) -> Iterator[ExternalBlockHash]: ...
    def get(self, key: ExternalBlockHash, default: int, /) -> int: ...
    def get_many(self, keys: Sequence[ExternalBlockHash], default: int, /) -> list[int]: ...
    def runs(
        self, keys: Sequence[ExternalBlockHash], step: int, count: int, /
    ) -> tuple[list[int], list[int]]: ...
    def values(self) -> Iterable[int]: ...
    def items(self) -> Iterable[tuple[ExternalBlockHash, int]]: ...
    def map_values(self, change: Callable[[int], int], /) -> None: ...
    def store(
        self, hashes: Sequence[ExternalBlockHash], room: int, derive: Derive, /
    ) -> tuple[int, int, list[int]]: ...
    def remove(
        self,
        hashes: Sequence[ExternalBlockHash],
        classify: Classify,
        extra: dict[ExternalBlockHash, int] | None,
        /,
    ) -> tuple[int, int, int]: ...


def _u64(key: object) -> TypeGuard[int]:
    return type(key) is int and 0 <= key < U64_LIMIT


class PyBlockTable(dict[ExternalBlockHash, int]):
    """The specification: a dict, and the loops in Python."""

    def get_many(self, keys: Sequence[ExternalBlockHash], default: int, /) -> list[int]:
        return list(map(self.get, keys, repeat(default, len(keys))))

    def runs(
        self, keys: Sequence[ExternalBlockHash], step: int, count: int, /
    ) -> tuple[list[int], list[int]]:
        """The holders (0: none) of every ``step``-th key, the last of each step, up to ``count``
        of them, as a ``Column``'s runs: (each run's first position, then how many were read;
        each run's holders). A prompt's column for a group block of ``step`` hash blocks."""
        if step < 1:
            raise ValueError(f"step must be positive, got {step}")
        column = Column(self.get_many(keys[step - 1 : step * count : step], 0))
        return column.edges, column.held

    def map_values(self, change: Callable[[int], int], /) -> None:
        """Every value replaced by ``change(value)`` (the index re-spreading its lanes)."""
        for block_hash, held in self.items():
            self[block_hash] = change(held)

    def store(
        self, hashes: Sequence[ExternalBlockHash], room: int, derive: Derive, /
    ) -> tuple[int, int, list[int]]:
        """Each hash gets ``derive`` of its holders (0: none), up to ``room`` new entries; those
        ``derive`` answers None for are copies. Returns (added, refused, the copies' hashes)."""
        added = refused = 0
        copies: list[int] = []
        last: int | None = None
        stored: int | None = None
        for block_hash in hashes:
            if not _u64(block_hash):
                refused += 1
                continue
            held = self.get(block_hash, 0)
            if held is not last:  # a run of blocks with the same holders shares one new int
                last = held
                stored = derive(held)
            if stored is None:
                copies.append(block_hash)
            elif added >= room:
                refused += 1
            else:
                self[block_hash] = stored
                added += 1
        return added, refused, copies

    def remove(
        self,
        hashes: Sequence[ExternalBlockHash],
        classify: Classify,
        extra: dict[ExternalBlockHash, int] | None,
        /,
    ) -> tuple[int, int, int]:
        """One copy of each hash the worker holds (``classify``): a copy beyond the first in
        ``extra`` goes first, the last takes its holders to what is left (deleted at 0).
        Returns (hashes no longer held, hashes not held, full-attention copies left behind)."""
        dropped = missing = partial = 0
        last: int | None = None
        has = full_copy = False
        rest = 0
        for block_hash in hashes:
            held = self.get(block_hash, 0) if _u64(block_hash) else None
            if held is None:
                missing += 1
                continue
            if held is not last:
                last = held
                has, full_copy, rest = classify(held)
            if not has:
                missing += 1
                continue
            partial += full_copy
            if extra and block_hash in extra:
                left = extra[block_hash] - 1
                if left:
                    extra[block_hash] = left
                else:
                    del extra[block_hash]
                continue
            if rest:
                self[block_hash] = rest
            else:
                del self[block_hash]
            dropped += 1
        return dropped, missing, partial


def _native_table() -> Callable[[Iterable[tuple[ExternalBlockHash, int]]], Table] | None:
    try:
        from hmakv_native import BlockTable as Native
    except ImportError:
        return None
    return Native


_NATIVE = _native_table()
NATIVE_TABLE = _NATIVE is not None


def new_table(items: Iterable[tuple[ExternalBlockHash, int]] = ()) -> Table:
    """A table holding ``items``: the native one where it is installed."""
    return _NATIVE(items) if _NATIVE is not None else PyBlockTable(items)
