"""What each router believes a worker holds of a prompt: the prefix estimates under study.

All four read the same thing, one engine batch after another as the pipeline delivers them (or,
for the approximate one, nothing but the router's own decisions), and answer a prompt's predicted
hit in tokens per worker:

- ``HmaIndexEstimate``: hmakv's ``KVIndex``, fed through the bridge's own ``fan_out``: vLLM's
  hybrid hit rule over every group; with ``speculation``, each routed prompt is also held
  speculatively by its worker (``KVIndex.speculate``, what ``POST /v1/routed`` does) until its
  events settle it or the TTL the index would choose runs out;
- ``HashSetEstimate(keep=every group)``, "removal means gone": one set of hashes per worker, any
  group's removal of a hash removes it (what a group-blind index does with vLLM's HMA events);
- ``HashSetEstimate(keep=full attention)``: only full-attention groups' events are kept
  (Dynamo's filter for hybrid models);
- ``RoutingHistory``: the router's own routing history with a TTL, no events (Dynamo's
  ``--no-router-kv-events``, SGLang's cache_aware router).

The group-blind ones answer the longest run of the prompt's blocks they hold, from the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hmakv.bridge.fanout import fan_out
from hmakv.consumers.index import KVIndex
from hmakv.consumers.speculation import SpeculationTtl
from hmakv.kvlog.answers import speculative_hit
from hmakv.producer.events import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
    KVEventBatch,
)
from hmakv.producer.hashing import external


@dataclass(frozen=True)
class Prompt:
    """A prompt as a router sees it: its length and its block hashes at ``hash_block_size``."""

    num_tokens: int
    block_hashes: tuple[int, ...]


class PrefixEstimate(Protocol):
    """A router's knowledge of what each worker caches."""

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        """An engine batch, as the pipeline delivers it at ``now``."""

    def routed(self, worker: int, prompt: Prompt, now: float) -> None:
        """The router sent ``prompt`` to ``worker`` at ``now``."""

    def hits(self, prompt: Prompt, now: float) -> list[int]:
        """The predicted hit in tokens on each worker, in worker order."""


class HmaIndexEstimate:
    """hmakv: the index the ``hmakv index`` service runs, fed the records the bridge makes."""

    def __init__(
        self,
        workers: int,
        groups: Sequence[GroupSpec],
        hash_block_size: int,
        *,
        speculation: SpeculationTtl | None = None,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        self.index = KVIndex(hash_block_size=hash_block_size)
        self._speculation = speculation
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._names = [f"engine-{worker}" for worker in range(workers)]
        self._groups = list(range(len(groups)))
        self._seqs = [0] * workers
        for name in self._names:
            self.index.set_catalog(name, dict(enumerate(groups)))

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        seq = self._seqs[worker]
        self._seqs[worker] = seq + 1
        for record in fan_out(self._names[worker], 0, seq, batch, self._groups):
            self.index.apply(record)
        if self._speculation is not None:
            self._speculation.observe(now - batch.ts)

    def routed(self, worker: int, prompt: Prompt, now: float) -> None:
        if self._speculation is not None:
            expires_at = now + self._speculation.ttl_s()
            name = self._names[worker]
            self.index.speculate(
                name,
                prompt.block_hashes,
                prompt.num_tokens,
                expires_at=expires_at,
                prefill_chunk_tokens=self._prefill_chunk_tokens,
            )

    def hits(self, prompt: Prompt, now: float) -> list[int]:
        if self._speculation is not None:
            self.index.expire_speculation(now)
        answers = self.index.score(prompt.block_hashes, prompt.num_tokens, details=False)
        by_name = {answer.worker: speculative_hit(answer) for answer in answers}
        return [by_name.get(name, 0) for name in self._names]


class HashSetEstimate:
    """A group-blind index: a set of hashes per worker, from the groups ``keep`` accepts."""

    def __init__(
        self,
        workers: int,
        groups: Sequence[GroupSpec],
        hash_block_size: int,
        *,
        keep: Callable[[GroupSpec], bool],
    ) -> None:
        self._held: list[set[int]] = [set() for _ in range(workers)]
        self._kept = {group for group, spec in enumerate(groups) if keep(spec)}
        self._hash_block_size = hash_block_size

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        held = self._held[worker]
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif (event.group_idx or 0) not in self._kept:
                continue
            elif isinstance(event, BlockStored):
                held.update(_as_ints(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                held.difference_update(_as_ints(event.block_hashes))

    def routed(self, worker: int, prompt: Prompt, now: float) -> None:
        """Learns only from events."""

    def hits(self, prompt: Prompt, now: float) -> list[int]:
        return [
            _prefix_tokens(prompt, self._hash_block_size, held.__contains__) for held in self._held
        ]


class RoutingHistory:
    """An approximate index: each worker holds what was routed to it, for ``ttl`` seconds."""

    def __init__(self, workers: int, hash_block_size: int, *, ttl: float) -> None:
        self._expiry: list[dict[int, float]] = [{} for _ in range(workers)]
        self._hash_block_size = hash_block_size
        self._ttl = ttl

    def observe(self, worker: int, batch: KVEventBatch, now: float) -> None:
        """No events: the point of this design."""

    def routed(self, worker: int, prompt: Prompt, now: float) -> None:
        expiry = self._expiry[worker]
        until = now + self._ttl
        for block_hash in prompt.block_hashes:
            expiry[block_hash] = until
        if len(expiry) > 4 * len(prompt.block_hashes) + 4096:  # drop the expired now and then
            self._expiry[worker] = {h: t for h, t in expiry.items() if t > now}

    def hits(self, prompt: Prompt, now: float) -> list[int]:
        return [
            _prefix_tokens(prompt, self._hash_block_size, _Unexpired(expiry, now))
            for expiry in self._expiry
        ]


@dataclass(frozen=True)
class _Unexpired:
    expiry: dict[int, float]
    now: float

    def __call__(self, block_hash: int) -> bool:
        return self.expiry.get(block_hash, 0.0) > self.now


def full_attention(spec: GroupSpec) -> bool:
    return spec.kind in FULL_ATTENTION_KINDS


def every_group(spec: GroupSpec) -> bool:
    return True


def _as_ints(hashes: Sequence[ExternalBlockHash]) -> list[int]:
    """vLLM's external form: an int, or a whole digest whose last 8 bytes are that int."""
    return [h if isinstance(h, int) else external(h) for h in hashes]


def _prefix_tokens(prompt: Prompt, block_size: int, held: Callable[[int], bool]) -> int:
    """The held blocks from the first on, as tokens; like vLLM's, at most ``num_tokens - 1``
    in whole blocks (the last token is always computed)."""
    most = (prompt.num_tokens - 1) // block_size
    blocks = 0
    for block_hash in prompt.block_hashes[:most]:
        if not held(block_hash):
            break
        blocks += 1
    return blocks * block_size
