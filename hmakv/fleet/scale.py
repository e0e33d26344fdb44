"""One index at fleet scale: ``workers`` x ``blocks`` resident blocks in each of two cache groups.

Built in a fresh process of its own (``spawn``), so that its RSS is the index's and the
interpreter's, nothing of the caller's: the state goes in through ``KVIndex.apply`` of the
bridge's own records (``fan_out``), then prompts are scored as ``/v1/score`` scores them.

Every worker holds the fleet's ``SHARED_PROMPTS`` system prompts (``SHARED_BLOCKS`` blocks each,
as every engine serving the same application caches them) and its own conversations after them,
distinct from every other worker's, in a full-attention group and a 128-token sliding-window
group (the same hashes in both, as vLLM hashes a hybrid model's blocks). A prompt is a system
prompt and ``prompt_blocks`` - ``SHARED_BLOCKS`` blocks of one worker's conversation: every
worker hits the system prompt, one worker the whole prompt.

Then the score's worst case: a ladder prompt, of which worker i of W holds the first (i+1)/W
(``ladder_held``), so that nearly every worker has an answer of its own and the fleet splits into
as many parts as the prompt has blocks. It is scored first as the index is once built, with
CPython's default collector (``ladder_default_gc``), then, as every other score here, after
``kvlog.heap.tune_garbage_collector``, which ``hmakv index`` runs once caught up: the heap is
frozen out of the collector, whose full collections of a large heap were the ladder's tail.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from hmakv.bridge.fanout import fan_out
from hmakv.consumers.api import HashingDefaults, ScoreApi
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.index import KVIndex
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.stats import ScoreStats
from hmakv.fleet.engines import BLOCK_TOKENS, GROUP_IDS, GROUPS, group_store, mixed, status_mib
from hmakv.kvlog.answers import ScoreResponse, WorkerHit
from hmakv.kvlog.heap import tune_garbage_collector
from hmakv.kvlog.records import Topics
from hmakv.producer.events import ExternalBlockHash, KVEventBatch

TARGET_WORKERS = 1000
TARGET_SCORE_P99_US = 1000.0
TARGET_RSS_MIB = 4096.0
SHARED_PROMPTS = 16
SHARED_BLOCKS = 64  # 1,024 tokens
STORE_BLOCKS = 1024  # blocks per stored event (a long prefill's)
WARM_UP_PROMPTS = 20
LADDER_SCORES = 50  # times the ladder prompt is scored, each way
ROUTER_TOP = 4  # the best workers a router's request asks for
_SHARED_BASE = 1 << 62  # shared blocks' numbers sit above every worker's
_LADDER_BASE = 1 << 61


@dataclass(frozen=True)
class ScalePlan:
    workers: int = 1000
    blocks: int = 100_000  # resident per worker, in each group
    prompts: int = 200
    prompt_blocks: int = 512  # 8,192 tokens
    seed: int = 0


@dataclass(frozen=True)
class LadderReport:
    """The ladder prompt's scores: the worst case, an answer per worker."""

    hits: int  # distinct hits in its answer
    p50_us: float
    p99_us: float
    hit_only_p50_us: float  # details=False
    hit_only_p99_us: float
    right: bool  # every worker's hit is its share, a whole one best


@dataclass(frozen=True)
class RouterAnswerReport:
    """The router's request served in-process (``ScoreApi.score_reply``: decode, score, the
    follower's view, best, encode), block hashes in msgpack, lean: every worker, then the best
    ``ROUTER_TOP`` only."""

    p50_us: float
    p99_us: float
    bytes: int  # the answer's, the last prompt's
    top_p50_us: float
    top_p99_us: float
    top_bytes: int
    top_right: bool  # every top answer was the whole answer's first workers


@dataclass(frozen=True)
class ScaleReport:
    workers: int
    blocks_per_worker: int
    resident_entries: int  # (worker, group, block)
    build_seconds: float
    block_updates_per_s: float
    rss_before_mib: float
    rss_mib: float
    peak_rss_mib: float
    bytes_per_entry: float  # RSS growth over resident entries
    score_p50_us: float
    score_p99_us: float
    hit_only_p50_us: float  # details=False
    hit_only_p99_us: float
    best_hits_right: (
        int  # prompts whose best worker is the one holding them, all but the last block
    )
    prompts: int
    ladder: LadderReport  # the heap frozen, as the index runs once caught up
    ladder_default_gc: LadderReport  # before: CPython's default collector
    router_answer: RouterAnswerReport


def shared_block(prompt: int, block: int) -> ExternalBlockHash:
    return mixed(_SHARED_BASE + prompt * SHARED_BLOCKS + block)


def own_block(worker: int, block: int) -> ExternalBlockHash:
    return mixed((worker << 32) + block)


def ladder_block(block: int) -> ExternalBlockHash:
    return mixed(_LADDER_BASE + block)


def ladder_held(worker: int, plan: ScalePlan) -> int:
    """The ladder prompt's first blocks the worker holds: worker i of W the first (i+1)/W."""
    return plan.prompt_blocks * (worker + 1) // plan.workers


def own_blocks(plan: ScalePlan, worker: int) -> int:
    return plan.blocks - SHARED_PROMPTS * SHARED_BLOCKS - ladder_held(worker, plan)


def worker_batches(worker: int, plan: ScalePlan) -> Iterator[KVEventBatch]:
    """What a worker's engine stored, in events of up to ``STORE_BLOCKS`` blocks per group."""
    hashes = [shared_block(p, b) for p in range(SHARED_PROMPTS) for b in range(SHARED_BLOCKS)]
    hashes += [ladder_block(b) for b in range(ladder_held(worker, plan))]
    hashes += [own_block(worker, b) for b in range(own_blocks(plan, worker))]
    for start in range(0, len(hashes), STORE_BLOCKS):
        chunk = hashes[start : start + STORE_BLOCKS]
        yield KVEventBatch(0.0, [group_store(chunk, group) for group in GROUPS], 0)


def build(plan: ScalePlan) -> KVIndex:
    index = KVIndex()
    for worker in range(plan.workers):
        name = f"w{worker}"
        for seq, batch in enumerate(worker_batches(worker, plan)):
            for record in fan_out(name, 0, seq, batch, GROUP_IDS):
                index.apply(record)
    return index


def prompt(worker: int, system: int, start: int, plan: ScalePlan) -> list[ExternalBlockHash]:
    """System prompt ``system``, then ``worker``'s conversation from its block ``start``."""
    own = plan.prompt_blocks - SHARED_BLOCKS
    return [shared_block(system, b) for b in range(SHARED_BLOCKS)] + [
        own_block(worker, start + b) for b in range(own)
    ]


def _timed_scores(
    index: KVIndex,
    hashes: list[ExternalBlockHash],
    num_tokens: int,
    full: list[float],
    hit_only: list[float],
) -> list[WorkerHit]:
    """The prompt scored with every detail, then without; each one's seconds appended."""
    began = time.perf_counter()
    hits = index.score(hashes, num_tokens)
    full.append(time.perf_counter() - began)
    began = time.perf_counter()
    index.score(hashes, num_tokens, details=False)
    hit_only.append(time.perf_counter() - began)
    return hits


def _quantiles_us(seconds: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(seconds, n=100)
    return 1e6 * cuts[49], 1e6 * cuts[98]


def measure(plan: ScalePlan) -> ScaleReport:
    """Build the index and score ``plan.prompts`` prompts; run it in a fresh process."""
    gc.collect()
    rss_before = status_mib("VmRSS")
    started = time.perf_counter()
    index = build(plan)
    build_seconds = time.perf_counter() - started
    gc.collect()
    rss = status_mib("VmRSS")
    ladder_default_gc = _score_ladder(index, plan)
    tune_garbage_collector()
    entries = plan.workers * plan.blocks * len(GROUPS)
    rng = random.Random(plan.seed)
    cases = []
    for _ in range(plan.prompts):
        worker, system = rng.randrange(plan.workers), rng.randrange(SHARED_PROMPTS)
        cases.append((worker, system, rng.randrange(own_blocks(plan, worker) // 2)))
    num_tokens = plan.prompt_blocks * BLOCK_TOKENS
    for worker, system, start in cases[:WARM_UP_PROMPTS]:  # as a long-running index is warm
        index.score(prompt(worker, system, start, plan), num_tokens)
    full: list[float] = []
    hit_only: list[float] = []
    right = 0
    for worker, system, start in cases:
        hits = _timed_scores(index, prompt(worker, system, start, plan), num_tokens, full, hit_only)
        # vLLM computes a prompt's last token: its last block is never a hit.
        whole = hits[0].hit_blocks == plan.prompt_blocks - 1
        right += hits[0].worker == f"w{worker}" and whole
    score_p50, score_p99 = _quantiles_us(full)
    hit_p50, hit_p99 = _quantiles_us(hit_only)
    return ScaleReport(
        workers=plan.workers,
        blocks_per_worker=plan.blocks,
        resident_entries=entries,
        build_seconds=build_seconds,
        block_updates_per_s=entries / build_seconds,
        rss_before_mib=rss_before,
        rss_mib=rss,
        peak_rss_mib=status_mib("VmHWM"),
        bytes_per_entry=(rss - rss_before) * 2**20 / entries,
        score_p50_us=score_p50,
        score_p99_us=score_p99,
        hit_only_p50_us=hit_p50,
        hit_only_p99_us=hit_p99,
        best_hits_right=right,
        prompts=plan.prompts,
        ladder=_score_ladder(index, plan),
        ladder_default_gc=ladder_default_gc,
        router_answer=_served(index, [prompt(*case, plan) for case in cases], num_tokens),
    )


def _served(
    index: KVIndex, prompts: list[list[ExternalBlockHash]], num_tokens: int
) -> RouterAnswerReport:
    """Each prompt asked of the score API as a router asks: every worker, then the top ones."""
    follower = Follower(FollowerConfig("127.0.0.1:1", Topics("unused")), clock=lambda: 0.0)
    follower.index = index  # never started: no broker, only the API's answers
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats, hashing=HashingDefaults())
    timed: dict[bool, list[float]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    right = True
    for hashes in prompts:
        answers = {}
        for top in (False, True):
            request = {"block_hashes": hashes, "num_tokens": num_tokens, "details": False}
            body = msgspec.msgpack.encode(request | ({"top": ROUTER_TOP} if top else {}))
            began = time.perf_counter()
            reply = api.score_reply(body, True, began)
            timed[top].append(time.perf_counter() - began)
            sizes[top] = len(reply.body)
            answers[top] = msgspec.msgpack.decode(reply.body, type=ScoreResponse)
        right = right and answers[True].workers == answers[False].workers[:ROUTER_TOP]
    p50, p99 = _quantiles_us(timed[False])
    top_p50, top_p99 = _quantiles_us(timed[True])
    return RouterAnswerReport(p50, p99, sizes[False], top_p50, top_p99, sizes[True], right)


def _score_ladder(index: KVIndex, plan: ScalePlan) -> LadderReport:
    """The ladder prompt scored ``LADDER_SCORES`` times with every detail and as many without."""
    hashes = [ladder_block(b) for b in range(plan.prompt_blocks)]
    num_tokens = plan.prompt_blocks * BLOCK_TOKENS
    full: list[float] = []
    hit_only: list[float] = []
    for _ in range(LADDER_SCORES):
        hits = _timed_scores(index, hashes, num_tokens, full, hit_only)
    # The last block is never a hit (vLLM computes the prompt's last token).
    shares = {
        f"w{worker}": min(ladder_held(worker, plan), plan.prompt_blocks - 1)
        for worker in range(plan.workers)
    }
    right = {hit.worker: hit.hit_blocks for hit in hits} == shares
    right = right and hits[0].hit_blocks == plan.prompt_blocks - 1
    p50, p99 = _quantiles_us(full)
    hit_p50, hit_p99 = _quantiles_us(hit_only)
    return LadderReport(len(set(shares.values())), p50, p99, hit_p50, hit_p99, right)


def _child(plan: ScalePlan, results: mp.Queue) -> None:  # type: ignore[type-arg]
    results.put(measure(plan))


def measure_alone(plan: ScalePlan) -> ScaleReport:
    """``measure`` in a fresh interpreter, so that its RSS is its own."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_child, args=(plan, results))
    process.start()
    report: ScaleReport = results.get()
    process.join()
    return report


def scale_targets(reports: list[ScaleReport]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    for report in reports:
        if report.workers == TARGET_WORKERS:
            met[f"{report.workers} workers: score p99 {report.score_p99_us:,.0f} us < 1 ms"] = (
                report.score_p99_us < TARGET_SCORE_P99_US
            )
            met[f"{report.workers} workers: RSS {report.rss_mib:,.0f} MiB < 4 GiB"] = (
                report.rss_mib < TARGET_RSS_MIB
            )
            ladder_p99 = report.ladder.hit_only_p99_us
            met[
                f"{report.workers} workers, the ladder: hit-only p99 {ladder_p99:,.0f} us < 1 ms"
            ] = ladder_p99 < TARGET_SCORE_P99_US
        met[f"{report.workers} workers: every best worker right"] = (
            report.best_hits_right == report.prompts
        )
        met[f"{report.workers} workers: every worker's ladder hit right"] = report.ladder.right
        met[f"{report.workers} workers: every top answer the whole answer's first"] = (
            report.router_answer.top_right
        )
    return met


def scale_table(reports: list[ScaleReport]) -> str:
    header = (
        f"{'workers':>8}{'blocks':>9}{'entries':>13}{'build s':>9}{'updates/s':>12}"
        f"{'RSS MiB':>9}{'peak':>8}{'B/entry':>9}{'score p50':>11}{'p99':>8}"
        f"{'hit p50':>9}{'p99':>8}{'right':>9}{'ladder hits':>12}{'p50':>8}{'p99':>8}"
        f"{'hit p50':>9}{'p99':>8}{'default gc p99':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        lines.append(
            f"{r.workers:>8,}{r.blocks_per_worker:>9,}{r.resident_entries:>13,}"
            f"{r.build_seconds:>9.1f}{r.block_updates_per_s:>12,.0f}{r.rss_mib:>9,.0f}"
            f"{r.peak_rss_mib:>8,.0f}{r.bytes_per_entry:>9.1f}{r.score_p50_us:>11,.0f}"
            f"{r.score_p99_us:>8,.0f}{r.hit_only_p50_us:>9,.0f}{r.hit_only_p99_us:>8,.0f}"
            f"{f'{r.best_hits_right}/{r.prompts}':>9}{r.ladder.hits:>12,}{r.ladder.p50_us:>8,.0f}"
            f"{r.ladder.p99_us:>8,.0f}{r.ladder.hit_only_p50_us:>9,.0f}"
            f"{r.ladder.hit_only_p99_us:>8,.0f}{r.ladder_default_gc.hit_only_p99_us:>15,.0f}"
        )
    lines.append(
        f"the router's answer served in-process (lean, block hashes in msgpack): every worker, "
        f"then the best {ROUTER_TOP}"
    )
    for r in reports:
        a = r.router_answer
        lines.append(
            f"{r.workers:>8,} workers: every worker p50 {a.p50_us:,.0f} / p99 {a.p99_us:,.0f} "
            f"us, {a.bytes:,} bytes; best {ROUTER_TOP} p50 {a.top_p50_us:,.0f} / p99 "
            f"{a.top_p99_us:,.0f} us, {a.top_bytes:,} bytes ({a.p99_us / a.top_p99_us:.1f}x "
            f"sooner at p99); {'right' if a.top_right else 'WRONG'}"
        )
    if len(reports) > 1:
        small, large = reports[0], reports[-1]
        lines.append(
            f"{large.workers} workers / {small.workers}: score p99 "
            f"{large.score_p99_us / small.score_p99_us:.1f}x, hit-only p99 "
            f"{large.hit_only_p99_us / small.hit_only_p99_us:.1f}x, bytes per entry "
            f"{large.bytes_per_entry / small.bytes_per_entry:.2f}x"
        )
    return "\n".join(lines)
