"""What the benchmark scripts share: waiting for a ZMQ subscriber, a quantile, the JSON report.
(The stand-in engines' stores, ``group_store``, are ``hmakv.fleet.engines``'.)

A script run as ``python benchmarks/NAME.py`` has this folder first on sys.path, so it imports
this module as ``harness``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hmakv.producer.events import KVEventBatch
from hmakv.producer.recorder import BatchSink


def wait_for_subscriber(ready: Connection, publisher: BatchSink) -> None:
    """Publish empty batches until the subscriber process says over ``ready`` that one arrived:
    a PUB socket drops whatever it sends before the subscription is live."""
    while not ready.poll(0.01):
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
    ready.recv()


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (0.0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))]


def write_report(path: Path, report: Mapping[str, Any], *, note: str = "") -> None:
    """Write ``report`` as indented JSON to ``path`` (making its folder) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}{note}")
