"""The index against vLLM itself, on traces recorded from vLLM (see tests/data/README.md).

``vllm-trace-swa-small-seed1.jsonl.gz`` comes from vLLM's own KVCacheManager (groups full
attention, sliding window 32 and sliding window 64); ``vllm-real-gemma3-swa64-seed7.jsonl.gz``
from a real vLLM 0.32.0 server on the CPU (a sliding window 64 group, then full attention; its
probes' hits are the ``cached_tokens`` vLLM reported). Each holds every event batch vLLM
published and probes: the prefix hit vLLM itself found for a prompt right after a given batch.
The batches go in as the bridge will send them (one worker, epoch 0, one record per batch and
group) and every probe's prediction must equal vLLM's. The simplifications peers make are
measured on the same probes and must each get some wrong, or the trace would not be telling the
indexes apart.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from test_index_model import ReferenceIndex

from hmakv.consumers.index import KVIndex
from hmakv.kvlog.records import EventRecord
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    decode,
)

DATA = Path(__file__).parents[1] / "data"
WORKER = "vllm-0"


class Config(msgspec.Struct, tag_field="kind", tag="config"):
    groups: list[str]
    block_size: int

    @property
    def full_attention_groups(self) -> list[int]:
        return [i for i, name in enumerate(self.groups) if name.startswith("full")]


class Batch(msgspec.Struct, tag_field="kind", tag="batch"):
    seq: int
    payload_hex: str


class Probe(msgspec.Struct, tag_field="kind", tag="probe"):
    after_seq: int
    token_ids: list[int]
    block_hashes: list[ExternalBlockHash]
    expected_hit_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Trace(msgspec.Struct, frozen=True):
    path: Path
    probes: int

    @property
    def config(self) -> Config:
        config = trace_lines(self.path)[0]
        assert isinstance(config, Config)
        return config


TRACES = {
    "kv-cache-manager": Trace(DATA / "vllm-trace-swa-small-seed1.jsonl.gz", probes=120),
    "real-vllm-server": Trace(DATA / "vllm-real-gemma3-swa64-seed7.jsonl.gz", probes=79),
}


@pytest.fixture(params=sorted(TRACES))
def trace(request: pytest.FixtureRequest) -> Trace:
    return TRACES[request.param]


def trace_lines(path: Path) -> list[Config | Batch | Probe]:
    decoder = msgspec.json.Decoder(Config | Batch | Probe)
    with gzip.open(path, "rb") as lines:
        return [decoder.decode(line) for line in lines]


def records_of(seq: int, batch: KVEventBatch, groups: range) -> list[EventRecord]:
    """One record per group, as the bridge splits a batch: a clear reaches every group."""
    by_group: dict[int, list[KVEvent]] = {}
    for event in batch.events:
        targets = groups if isinstance(event, AllBlocksCleared) else [event.group_idx or 0]
        for group in targets:
            by_group.setdefault(group, []).append(event)
    return [
        EventRecord(WORKER, 0, seq, batch.ts, group, events)
        for group, events in sorted(by_group.items())
    ]


def replay(trace: Trace, apply: Callable[[EventRecord], object]) -> Iterator[Probe]:
    """Feed the trace's batches in order, yielding each probe once its batch is applied."""
    config, *lines = trace_lines(trace.path)
    assert isinstance(config, Config)
    groups = range(len(config.groups))
    batch_seqs = [line.seq for line in lines if isinstance(line, Batch)]
    applied = -1
    for line in lines:
        if isinstance(line, Batch):
            batch = decode(bytes.fromhex(line.payload_hex)).batch
            for record in records_of(line.seq, batch, groups):
                apply(record)
            applied = line.seq
        elif isinstance(line, Probe):
            # Exactly the batches up to after_seq are in: none later, none missing.
            assert applied == max((seq for seq in batch_seqs if seq <= line.after_seq), default=-1)
            yield line


def test_every_probe_matches_vllm(trace: Trace) -> None:
    index = KVIndex(hash_block_size=trace.config.block_size)
    probes = 0
    for probe in replay(trace, index.apply):
        [score] = index.score(probe.block_hashes, probe.num_tokens)
        assert score.hit_tokens == probe.expected_hit_tokens, probe.after_seq
        probes += 1
    counters = index.counters
    assert probes == trace.probes
    assert counters.anomalies == 0  # vLLM never removes what it did not store
    # The trace exercises what the index exists for: SWA copies evicted while the full-attention
    # copy stays, and duplicate copies of one hash in one group.
    assert counters.partial_evictions > 0
    assert counters.duplicate_copies > 0


def agreement(
    trace: Trace, predict: Callable[[Probe], int], apply: Callable[[EventRecord], object]
) -> float:
    probes = list(_predictions(trace, predict, apply))
    return sum(got == probe.expected_hit_tokens for probe, got in probes) / len(probes)


def _predictions(
    trace: Trace, predict: Callable[[Probe], int], apply: Callable[[EventRecord], object]
) -> Iterator[tuple[Probe, int]]:
    for probe in replay(trace, apply):
        yield probe, predict(probe)


def test_simpler_indexes_get_probes_wrong(trace: Trace, capsys: pytest.CaptureFixture[str]) -> None:
    """Sets, removal-means-gone, full attention only, group-blind: each misses some probes."""
    size, full = trace.config.block_size, trace.config.full_attention_groups
    counting = KVIndex(hash_block_size=size)
    sets = ReferenceIndex(size, counting=False)
    gone = ReferenceIndex(size, counting=False, removal_means_gone=True)
    full_only = ReferenceIndex(size)
    blind = KVIndex(hash_block_size=size)
    rates = {
        "HMA rule + counts (this index)": agreement(
            trace,
            lambda p: counting.score(p.block_hashes, p.num_tokens)[0].hit_tokens,
            counting.apply,
        ),
        "HMA rule + sets": agreement(
            trace, lambda p: sets.hit_tokens(WORKER, p.block_hashes, p.num_tokens), sets.apply
        ),
        "removal means gone": agreement(
            trace, lambda p: gone.hit_tokens(WORKER, p.block_hashes, p.num_tokens), gone.apply
        ),
        "full attention only": agreement(
            trace,
            lambda p: full_only.hit_tokens(WORKER, p.block_hashes, p.num_tokens, only_groups=full),
            full_only.apply,
        ),
        "group-blind": agreement(
            trace,
            lambda p: blind.score(p.block_hashes, p.num_tokens)[0].group_blind_hit_tokens,
            blind.apply,
        ),
    }
    with capsys.disabled():
        print("\nagreement with vLLM on", trace.path.name)
        for name, rate in rates.items():
            print(f"  {name:32s} {rate:6.1%}")
    assert rates.pop("HMA rule + counts (this index)") == 1.0
    assert all(rate < 1.0 for rate in rates.values()), rates


def test_the_real_servers_trace_holds_vllms_window_stores() -> None:
    """What a real vLLM server sends for a sliding-window group, and the index above must take:
    stores listing fewer hashes than their token ids cover, and stores listing none at all."""
    config, *lines = trace_lines(TRACES["real-vllm-server"].path)
    assert isinstance(config, Config)
    stores = [
        event
        for line in lines
        if isinstance(line, Batch)
        for event in decode(bytes.fromhex(line.payload_hex)).batch.events
        if isinstance(event, BlockStored) and event.kv_cache_spec_kind == "sliding_window"
    ]
    short = [s for s in stores if 0 < len(s.block_hashes) * config.block_size < len(s.token_ids)]
    empty = [s for s in stores if not s.block_hashes and s.token_ids]
    assert short and empty
    assert all(s.parent_block_hash is not None for s in empty)
