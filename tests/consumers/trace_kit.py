"""The vLLM trace walked probe by probe against a running index's HTTP API.

``tests/data/vllm-trace-swa-small-seed1.jsonl.gz`` (see tests/data/README.md) holds every event
batch vLLM's own KVCacheManager emitted (groups: full attention, sliding window 32, sliding
window 64) and probes: the prefix hit vLLM found for a prompt right after a given batch. Before
each probe the batches since the last one are delivered (how is the caller's business: straight
to Kafka, or through the bridge), the walk waits until the index applied them in every group,
then asks /v1/score with the probe's token ids, which the API hashes itself (sha256_cbor, seed 0,
as the trace was recorded).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from follower_kit import wait_until

from hmakv.bridge.fanout import fan_out
from hmakv.producer.events import KVEventBatch, decode

TRACE = Path(__file__).parents[1] / "data" / "vllm-trace-swa-small-seed1.jsonl.gz"
PROBES = 120


@dataclass(frozen=True)
class Batch:
    seq: int
    payload: bytes

    @property
    def decoded(self) -> KVEventBatch:
        return decode(self.payload).batch


@dataclass(frozen=True)
class Outcome:
    after_seq: int
    expected_hit_tokens: int
    hit_tokens: int
    group_blind_hit_tokens: int


def _lines() -> Iterator[dict[str, Any]]:
    with gzip.open(TRACE, "rt") as lines:
        for line in lines:
            yield json.loads(line)


def trace_groups() -> range:
    config = next(_lines())
    assert config["kind"] == "config"
    return range(len(config["groups"]))


async def walk(
    deliver: Callable[[list[Batch]], Awaitable[None]],
    worker: str,
    index_url: str,
    http: aiohttp.ClientSession,
) -> list[Outcome]:
    """Every probe's answer from the index, each asked once its batches were applied."""
    groups = trace_groups()
    pending: list[Batch] = []
    wanted: dict[int, int] = {}  # group -> the last seq with a record for it
    outcomes = []
    for line in _lines():
        if line["kind"] == "batch":
            batch = Batch(line["seq"], bytes.fromhex(line["payload_hex"]))
            pending.append(batch)
            for record in fan_out(worker, 0, batch.seq, batch.decoded, groups):
                wanted[record.group_idx] = record.seq
        elif line["kind"] == "probe":
            await deliver(pending)
            pending = []
            await wait_until(
                lambda: _applied(http, index_url, worker, wanted), f"seq {line['after_seq']}"
            )
            outcomes.append(await _score(http, index_url, worker, line))
    return outcomes


async def _applied(
    http: aiohttp.ClientSession, index_url: str, worker: str, wanted: dict[int, int]
) -> bool:
    async with http.get(f"{index_url}/v1/workers") as response:
        views = {view["worker"]: view for view in (await response.json())["workers"]}
    applied = {int(group): seq for group, seq in views.get(worker, {}).get("last_seq", {}).items()}
    return all(applied.get(group, -1) >= seq for group, seq in wanted.items())


async def _score(
    http: aiohttp.ClientSession, index_url: str, worker: str, probe: dict[str, Any]
) -> Outcome:
    body = {"token_ids": probe["token_ids"], "workers": [worker]}
    async with http.post(f"{index_url}/v1/score", json=body) as response:
        assert response.status == 200, await response.text()
        [hit] = (await response.json())["workers"]
    return Outcome(
        after_seq=probe["after_seq"],
        expected_hit_tokens=probe["expected_hit_tokens"],
        hit_tokens=hit["hit_tokens"],
        group_blind_hit_tokens=hit["group_blind_hit_tokens"],
    )


def agreement(outcomes: list[Outcome]) -> tuple[float, float]:
    """Share of probes answered exactly: HMA-aware, and group-blind."""
    hma = sum(o.hit_tokens == o.expected_hit_tokens for o in outcomes)
    blind = sum(o.group_blind_hit_tokens == o.expected_hit_tokens for o in outcomes)
    return hma / len(outcomes), blind / len(outcomes)
