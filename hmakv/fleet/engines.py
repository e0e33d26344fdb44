"""Stand-in engines: the producer's own publisher, each engine's, publishing synthetic steps.

Every engine is a ``ZmqEventPublisher`` as inside vLLM or the reference engine (its PUB socket,
sequence numbers and replay ring), publishing one batch per step with a seeded shape instead of a
scheduler's: engines with a model or a scheduler would take the cores that the pipeline under
measurement needs. The engines share one process per core; each still has its own publisher.

A step stores 6 chunks of 4 blocks, 3 chunks per group, and removes, per group, the 12 blocks it
stored ``RESIDENT_STEPS`` steps earlier (from then on: 8 events a step), so every worker holds a
bounded, known set of blocks, and an index that applied every event holds exactly
``expected_state`` of each worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

from hmakv.kafka.process import free_port
from hmakv.producer.events import (
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from hmakv.producer.publisher import ZmqEventPublisher

GroupOf = tuple[int, str, int | None]
"""A stand-in's KV-cache group: its index, kind and sliding window."""

GROUPS: tuple[GroupOf, ...] = ((0, "full_attention", None), (1, "sliding_window", 128))
GROUP_IDS = [group for group, _, _ in GROUPS]
BLOCK_TOKENS = 16
CHUNKS_PER_STEP = 6  # stores, alternating between the groups
BLOCKS_PER_CHUNK = 4
RESIDENT_STEPS = 64
# Stand-ins share the machine's cores with what is measured: their idle publisher threads look
# for work every 5 ms instead of every 1 ms (16 threads polling each millisecond cost half a core
# here). It adds up to 5 ms to every measured latency.
FLUSH_MS = 5
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it modulo 2**64 is a bijection


def mixed(number: int) -> ExternalBlockHash:
    """A hash-like u64 for a number below 2**64: distinct numbers give distinct hashes."""
    return number * _MIX % 2**64


def block_hash(engine: int, step: int, chunk: int, block: int) -> ExternalBlockHash:
    """Distinct for every (step, chunk, block) of an engine."""
    return mixed((engine << 40) + step * 100 + chunk * BLOCKS_PER_CHUNK + block)


def group_store(
    block_hashes: list[ExternalBlockHash], group: GroupOf, token_ids: list[int] | None = None
) -> BlockStored:
    """A GPU store of 16-token blocks in ``group``, as vLLM reports it for a hybrid model."""
    group_idx, kind, window = group
    return BlockStored(
        block_hashes,
        None,
        token_ids or [],
        BLOCK_TOKENS,
        None,
        "GPU",
        None,
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def _chunks_of(group_idx: int) -> range:
    return range(group_idx, CHUNKS_PER_STEP, len(GROUPS))


def step_batch(step: int, engine: int) -> KVEventBatch:
    """Step ``step`` (from 1) of ``engine``: its stores, then the removals of step - R."""
    events: list[KVEvent] = []
    for chunk in range(CHUNKS_PER_STEP):
        hashes = [block_hash(engine, step, chunk, b) for b in range(BLOCKS_PER_CHUNK)]
        tokens = list(range(BLOCKS_PER_CHUNK * BLOCK_TOKENS))
        events.append(group_store(hashes, GROUPS[chunk % len(GROUPS)], tokens))
    old = step - RESIDENT_STEPS
    if old >= 1:
        for group_idx, _, _ in GROUPS:
            hashes = [
                block_hash(engine, old, chunk, b)
                for chunk in _chunks_of(group_idx)
                for b in range(BLOCKS_PER_CHUNK)
            ]
            events.append(BlockRemoved(hashes, "GPU", group_idx=group_idx))
    return KVEventBatch(time.time(), events, 0)


@dataclass(frozen=True)
class ExpectedState:
    """What an index that applied every step of every engine holds and counted."""

    blocks_stored: int
    blocks_removed: int
    events: int
    resident_per_group: int  # of each worker, in each group

    @classmethod
    def of(cls, engines: int, steps: int) -> ExpectedState:
        blocks = CHUNKS_PER_STEP * BLOCKS_PER_CHUNK
        removing = max(0, steps - RESIDENT_STEPS)
        return cls(
            blocks_stored=engines * steps * blocks,
            blocks_removed=engines * removing * blocks,
            events=engines * (steps * CHUNKS_PER_STEP + removing * len(GROUPS)),
            resident_per_group=min(steps, RESIDENT_STEPS) * blocks // len(GROUPS),
        )


def status_mib(field: str, pid: int | str = "self") -> float:
    """A memory field of a process's ``/proc`` status (VmRSS, VmHWM: its peak), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def engine_name(index: int) -> str:
    return f"e{index}"


def free_ports(count: int) -> list[int]:
    """Distinct free ports below the ephemeral range: one that ``bind(0)`` hands out can become
    the local end of a Kafka client's connection before the engine or bridge binds it (seen
    with 64 engines: the bridge's health port was taken)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


@dataclass(frozen=True)
class EngineSpec:
    index: int
    port: int
    replay_port: int

    @property
    def name(self) -> str:
        return engine_name(self.index)


def engine_main(specs: list[EngineSpec], count: int, rate: float, go: Event, stop: Event) -> None:
    """Several engines' publishers: publish ``count`` steps on each at ``rate`` per second and
    engine (0: flat out), then keep the replay rings up until told to stop, since the bridge may
    still be catching up from them."""
    publishers = [
        ZmqEventPublisher(
            0,
            f"tcp://*:{spec.port}",  # a wildcard binds, as vLLM's default endpoint does
            f"tcp://127.0.0.1:{spec.replay_port}",
            buffer_steps=count + 1,
            max_queue_size=count + 1,
            flush_interval_ms=FLUSH_MS,
        )
        for spec in specs
    ]
    # The events are built before the clock starts; each batch is stamped when published.
    steps = {
        spec.index: [step_batch(step, spec.index).events for step in range(1, count + 1)]
        for spec in specs
    }
    go.wait()
    started = time.monotonic()
    for step in range(1, count + 1):
        if rate:
            delay = started + step / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        for spec, publisher in zip(specs, publishers, strict=True):
            publisher.publish(KVEventBatch(time.time(), steps[spec.index][step - 1], 0))
    stop.wait()
    for publisher in publishers:
        publisher.shutdown()


@contextmanager
def engines(count: int, steps: int, rate: float) -> Iterator[tuple[list[EngineSpec], Event]]:
    """``count`` engines in one process per core, waiting for the returned event to publish
    ``steps`` steps each at ``rate`` steps per second and engine (0: as fast as they can)."""
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    ports = free_ports(2 * count)
    specs = [EngineSpec(i, ports[2 * i], ports[2 * i + 1]) for i in range(count)]
    hosts = min(count, os.cpu_count() or 1)
    processes = [
        ctx.Process(
            target=engine_main, args=(specs[host::hosts], steps, rate, go, stop), daemon=True
        )
        for host in range(hosts)
    ]
    for process in processes:
        process.start()
    try:
        yield specs, go
    finally:
        stop.set()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
