"""Wire benchmark: our encoder and tolerant decoder against vLLM's own typed msgspec structs.

The bridge decodes every frame of every engine, so the tolerant decoder must cost about what
vLLM's subscriber pays for a plain typed decode (the floor). The baseline structs below mirror
``vllm/distributed/kv_events.py`` and run in the same process, on the same payloads, with the
repeats interleaved so that a noisy machine slows both sides alike.

    python benchmarks/wire.py [--json PATH] [--repeats N] [--min-time SECONDS]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from harness import write_report

from hmakv.producer.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch, decode, encode

DEFAULT_JSON = Path(__file__).parent / "results" / "wire.json"
BLOCK_SIZE = 16
TOKENS_PER_STORE = 64
SEED = 20260601

# --- vLLM's structs, the baseline ----------------------------------------------------------------


class VllmArrayKVCacheEvent(
    msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False
):
    """vLLM before PR #42892 (with PR #40984's fields): events are tagged arrays."""


class VllmArrayBlockStored(VllmArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmArrayBlockRemoved(VllmArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmArrayKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmArrayBlockStored | VllmArrayBlockRemoved]
    data_parallel_rank: int | None = None


# vLLM 0.33.0 (PR #42892 and later): the same events, tagged maps now, with ``locality`` (PR
# #48281), ``ownership``, ``session_id`` and ``lookahead_token_ids`` at their end. A store has 16
# keys with its tag, so msgspec writes a map16 header for it: the field count is on the wire.


class VllmBlockStored(VllmArrayBlockStored, array_like=False, tag="BlockStored"):
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmArrayBlockRemoved, array_like=False, tag="BlockRemoved"):
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmArrayKVCacheEvent, array_like=False, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


# --- Workloads ---------------------------------------------------------------------------------


def step_batch(stores: int, removals: int, rng: random.Random) -> KVEventBatch:
    """One scheduler step: prompts of 64 tokens stored as 4 chained blocks, single-block evictions.

    Hashes are uniform 64-bit ints, as vLLM's last-8-bytes-of-sha256 are: half of them need
    msgpack's uint64 encoding.
    """
    events: list[KVEvent] = []
    for _ in range(stores):
        events.append(
            BlockStored(
                block_hashes=[rng.getrandbits(64) for _ in range(TOKENS_PER_STORE // BLOCK_SIZE)],
                parent_block_hash=rng.getrandbits(64),
                token_ids=[rng.randrange(200_000) for _ in range(TOKENS_PER_STORE)],
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
    events += [BlockRemoved([rng.getrandbits(64)], "GPU", 0) for _ in range(removals)]
    return KVEventBatch(time.time(), events, 0)


def array_encoded(batch: KVEventBatch) -> bytes:
    """The same batch as vLLM before PR #42892 sent it: every field, events as tagged arrays."""
    events: list[VllmArrayBlockStored | VllmArrayBlockRemoved] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            fields = msgspec.structs.asdict(event)
            for newer in ("locality", "ownership", "session_id", "lookahead_token_ids"):
                del fields[newer]
            events.append(VllmArrayBlockStored(**fields))
        elif isinstance(event, BlockRemoved):
            events.append(VllmArrayBlockRemoved(event.block_hashes, event.medium, event.group_idx))
    return msgspec.msgpack.encode(VllmArrayKVEventBatch(batch.ts, events, batch.data_parallel_rank))


# --- Timing ------------------------------------------------------------------------------------


class Case(msgspec.Struct):
    name: str
    operation: str
    events: int
    payload_bytes: int
    ours: Callable[[], object]
    baseline: Callable[[], object]


_vllm_encoder = msgspec.msgpack.Encoder()
_vllm_decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
_vllm_array_decoder = msgspec.msgpack.Decoder(VllmArrayKVEventBatch)


def cases() -> list[Case]:
    rng = random.Random(SEED)
    typical, large = step_batch(6, 2, rng), step_batch(30, 10, rng)
    return [
        *current_format_cases("typical", typical),
        *current_format_cases("large", large),
        array_format_case("typical, array events (vLLM < #42892)", typical),
    ]


def current_format_cases(name: str, batch: KVEventBatch) -> list[Case]:
    payload = encode(batch)
    vllm_batch = _vllm_decoder.decode(payload)
    if _vllm_encoder.encode(vllm_batch) != payload or decode(payload).batch != batch:
        raise AssertionError(f"{name}: ours and vLLM's structs disagree on the payload")
    size, count = len(payload), len(batch.events)
    return [
        Case(
            name,
            "encode",
            count,
            size,
            partial(encode, batch),
            partial(_vllm_encoder.encode, vllm_batch),
        ),
        Case(
            name,
            "decode",
            count,
            size,
            partial(decode, payload),
            partial(_vllm_decoder.decode, payload),
        ),
    ]


def array_format_case(name: str, batch: KVEventBatch) -> Case:
    """Fleets still on vLLM before PR #42892 send this; ours reads it on its fallback path."""
    payload = array_encoded(batch)
    if decode(payload).batch != batch:
        raise AssertionError(f"{name}: the array-encoded batch decodes to other events")
    return Case(
        name,
        "decode",
        len(batch.events),
        len(payload),
        partial(decode, payload),
        partial(_vllm_array_decoder.decode, payload),
    )


def iterations_for(function: Callable[[], object], min_time_s: float) -> int:
    """Enough iterations that one timed loop lasts ``min_time_s``, so timer overhead vanishes."""
    iterations = 1
    while True:
        if _loop_ns(function, iterations) >= min_time_s * 1e9:
            return iterations
        iterations *= 2


def _loop_ns(function: Callable[[], object], iterations: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(iterations):
        function()
    return time.perf_counter_ns() - start


def measure(case: Case, repeats: int, min_time_s: float) -> dict[str, Any]:
    iterations = iterations_for(case.baseline, min_time_s)
    ours_ns: list[float] = []
    baseline_ns: list[float] = []
    for _ in range(repeats):
        ours_ns.append(_loop_ns(case.ours, iterations) / iterations)
        baseline_ns.append(_loop_ns(case.baseline, iterations) / iterations)
    ours, baseline = statistics.median(ours_ns), statistics.median(baseline_ns)
    return {
        "case": case.name,
        "operation": case.operation,
        "events": case.events,
        "payload_bytes": case.payload_bytes,
        "iterations": iterations,
        "ours_ns_per_op": round(ours, 1),
        "ours_ops_per_s": round(1e9 / ours),
        "baseline_ns_per_op": round(baseline, 1),
        "baseline_ops_per_s": round(1e9 / baseline),
        "ratio": round(ours / baseline, 3),
    }


# --- Report ------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'case':<38} {'op':<7} {'bytes':>6} {'ours ns/op':>11} {'ours ops/s':>11} "
        f"{'vLLM ns/op':>11} {'vLLM ops/s':>11} {'ours/vLLM':>9}"
    )
    rows = [
        f"{r['case']:<38} {r['operation']:<7} {r['payload_bytes']:>6} "
        f"{r['ours_ns_per_op']:>11,.0f} {r['ours_ops_per_s']:>11,} "
        f"{r['baseline_ns_per_op']:>11,.0f} {r['baseline_ops_per_s']:>11,} {r['ratio']:>9.2f}"
        for r in results
    ]
    return "\n".join([header, "-" * len(header), *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per side (median)")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds per timed loop")
    args = parser.parse_args()

    results = [measure(case, args.repeats, args.min_time) for case in cases()]
    print(table(results))
    report = {
        "benchmark": "wire",
        "baseline": "plain msgspec typed decode/encode of vLLM's structs (vLLM's subscriber)",
        "python": platform.python_version(),
        "msgspec": msgspec.__version__,
        "machine": platform.machine(),
        "repeats": args.repeats,
        "statistic": "median",
        "results": results,
    }
    print()
    write_report(args.json, report)


if __name__ == "__main__":
    main()
