"""Memory amplification: how much index memory one engine batch can make, with and without the
limits (issue 16: a 28.8 MB batch once grew the index from 118 to 462 MB).

Each case is one batch on the path it takes through the pipeline, in one process: the bridge's
decode and checks (``bridge.frames.decode_payload`` with its ``EventLimits``), its fan-out into
Kafka records, the consumer's decode of each record and ``KVIndex.apply`` (with its
``max_blocks_per_worker``). Kafka and ZMQ only carry the bytes, so they are left out. Memory is
counted by ``tracemalloc``: what the index keeps once the batch is applied (retained), and the
most held at once on the way (peak), each against the payload's size. "Unbounded" is the
pipeline as it was, every limit off; "limits" the defaults.

    python benchmarks/amplification.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import write_report

from hmakv.bridge.fanout import fan_out
from hmakv.bridge.frames import EventLimits, Rejected, decode_payload
from hmakv.consumers.index import KVIndex
from hmakv.fleet.engines import group_store
from hmakv.kvlog.records import decode_event_record, encode
from hmakv.producer.events import ExternalBlockHash, KVEvent, KVEventBatch
from hmakv.producer.events import encode as encode_batch
from hmakv.producer.protocol import SeqFrames

DEFAULT_JSON = Path(__file__).parent / "results" / "amplification.json"
UNBOUNDED = EventLimits(2**62, 2**62, 2**62, 2**62)
SEED = 20261203
MIB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    name: str
    stores: int  # events of one group each, round robin over two groups
    hashes_per_store: int
    small_hashes: bool = False  # 0, 1, 2, ...: 1 to 5 bytes each on the wire instead of 9

    def batch(self) -> KVEventBatch:
        rng = random.Random(SEED)
        groups = ((0, "full_attention", None), (1, "sliding_window", 128))
        events: list[KVEvent] = []
        for store in range(self.stores):
            hashes: list[ExternalBlockHash] = (
                list(range(store * self.hashes_per_store, (store + 1) * self.hashes_per_store))
                if self.small_hashes
                else [rng.getrandbits(64) for _ in range(self.hashes_per_store)]
            )
            events.append(group_store(hashes, groups[store % 2]))
        return KVEventBatch(1.0, events)


CASES = (
    Case("a busy step: 8 stores of 256", 8, 256),
    Case("at the batch limit: 4 stores of 65,536", 4, 65_536),
    Case("at the limit, small ints: 4 x 65,536", 4, 65_536, small_hashes=True),
    Case("issue 16's: 50 stores of 65,536 (28.8 MB)", 50, 65_536),
)
QUICK = CASES[:3]


def through_pipeline(payload: bytes, limits: EventLimits, index: KVIndex) -> str:
    """One batch from the bridge's decode to the index; what became of it."""
    decoded = decode_payload(SeqFrames(b"kv", 1, payload), [payload], 2**62, limits)
    if isinstance(decoded, Rejected):
        return f"refused: {decoded.reason.value}"
    for record in fan_out("w", 0, 1, decoded.batch, (0, 1)):
        index.apply(decode_event_record(encode(record)))
    del decoded
    return f"applied, {index.counters.blocks_refused} blocks refused"


def measure(
    payload: bytes, limits: EventLimits, make_index: Callable[[], KVIndex]
) -> dict[str, Any]:
    index = make_index()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    outcome = through_pipeline(payload, limits, index)
    gc.collect()
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "outcome": outcome,
        "retained_mib": (retained - before) / MIB,
        "peak_mib": (peak - before) / MIB,
        "retained_x": (retained - before) / len(payload),
        "peak_x": (peak - before) / len(payload),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--quick", action="store_true", help="leave out the 28.8 MB batch")
    args = parser.parse_args()
    rows = []
    header = f"{'batch':44} {'payload':>9} | {'unbounded: kept':>16} {'peak':>7} | "
    print(header + f"{'limits: kept':>13} {'peak':>7}  outcome")
    for case in QUICK if args.quick else CASES:
        payload = encode_batch(case.batch())
        unbounded = measure(payload, UNBOUNDED, lambda: KVIndex(max_blocks_per_worker=2**62))
        limited = measure(payload, EventLimits(), KVIndex)
        rows.append(
            {
                "case": case.name,
                "payload_mib": len(payload) / MIB,
                "unbounded": unbounded,
                "limits": limited,
            }
        )
        print(
            f"{case.name:44} {len(payload) / MIB:7.2f}MB | "
            f"{unbounded['retained_mib']:7.1f}MB {unbounded['retained_x']:5.1f}x "
            f"{unbounded['peak_x']:5.1f}x | {limited['retained_mib']:6.1f}MB "
            f"{limited['retained_x']:4.1f}x {limited['peak_x']:5.1f}x  {limited['outcome']}"
        )
    report = {"python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    write_report(args.json, report)


if __name__ == "__main__":
    main()
