"""How both services' long-lived heap meets CPython's cyclic garbage collector.

Each service builds a large, long-lived heap (the bridge its channels and trackers, the index its
workers, rosters and answers' caches) and then allocates a few hundred short-lived objects per
batch or request, almost none in cycles. With CPython's defaults the collector runs every 700
allocations, and each full collection walks the whole long-lived heap: about a fifth of the
bridge's CPU per batch, and 10-25 ms pauses in a 1,000-worker index's scores (BENCHMARKS.md,
bridge and "The score's worst case"). ``tune_garbage_collector`` collects once, then freezes what
is left (CPython never walks it again; refcounting still frees it) and collects the young less
often. Call it once the heap is built: at the bridge's start, and when the index has caught up.
An object frozen that later becomes part of unreachable cycle is never freed; collecting first
leaves only such later garbage, and little of either heap forms cycles.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # allocations between young collections (CPython: 700)


def tune_garbage_collector() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 100)
