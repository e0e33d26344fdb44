"""The router-like probe client: where should this prompt go, and was the index right?

For each prompt it asks every engine for its real hit (``/v1/lookup``, which also gives the last
seq the engine published), waits for the index to apply that worker's events, asks the index
(``/v1/score``) and compares, worker by worker, the HMA-aware answer and the group-blind answer
with the real one. Then it routes the prompt to the best worker, telling the index
(``/v1/routed``: it holds the prompt's blocks there speculatively), so later prompts find their
prefixes cached, as a router's traffic does.

The engines keep changing while this happens, so a comparison only counts when both sides
describe the same moment of the engine's life, seq ``X``:

- the index holds exactly the worker's events up to ``X``: ``X`` is the newest seq it applied
  for the worker, and every other group's last applied seq is that group's newest record at or
  before ``X`` (``RecordLog`` knows which groups each seq reached in Kafka, and only answers for
  seqs it has read completely);
- the index did not move during the score call: ``/v1/workers`` shows that worker unchanged just
  before and just after it (the index answers on one event loop, so nothing else interleaves);
- the engine was asked while it was at ``X``: lookups run continuously from before the index is
  awaited until after it answered, and each answer is kept by the seq it reflects.

Anything else is a race, retried with fresh lookups a bounded number of times and then counted
as raced: never as agreement, never as disagreement.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
from aiokafka.errors import KafkaError

from hmakv.demo.client import (
    EngineClient,
    IndexClient,
    ServiceError,
)
from hmakv.demo.prompts import PromptSource
from hmakv.demo.recordlog import RecordLog
from hmakv.kvlog.answers import (
    Rank,
    ScoreResponse,
    WorkersResponse,
    WorkerView,
    best_worker,
    speculative_hit,
)
from hmakv.routing.replay import RecordedPrompt

MAX_ATTEMPTS = 4
CATCH_UP_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.005
MAX_ROUTED_IN_FLIGHT = 4
ROUTED_MAX_TOKENS = 8
DISAGREEMENT_EXAMPLES = 10
MAX_RECORDED_PROMPTS = 2000
"""Routed prompts kept for the summary's routing comparison: a long run keeps its first ones."""

EngineSamples = dict[str, dict[int, int]]
"""Per worker: the engine's real hit for the prompt, by the seq it was answered at."""


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's hit for one prompt at one seq: the engine's, and the index's two answers
    (the summary lists the disagreeing ones as they are)."""

    at_s: float
    worker: str
    seq: int
    prompt_tokens: int
    actual: int
    hma: int
    group_blind: int


@dataclass(frozen=True)
class RoutedRequest:
    """A prompt sent to the worker the index chose, with the hit predicted and the one granted.

    ``speculative`` is the prediction with the blocks of prompts routed earlier and not yet
    confirmed counted as held (the index's ``speculative_hit_tokens``): reported beside the
    confirmed one, never in the agreement figures.
    """

    at_s: float
    worker: str
    predicted: int
    speculative: int
    granted: int


@dataclass
class ProbeStats:
    """Everything the probe measured so far; the live view and the summary read it."""

    probes: int = 0
    attempts: int = 0
    raced: int = 0
    errors: int = 0
    comparisons: list[Comparison] = field(default_factory=list)
    catch_up_s: list[float] = field(default_factory=list)
    decisions: int = 0
    hma_decisions_right: int = 0
    blind_decisions_right: int = 0
    routed: list[RoutedRequest] = field(default_factory=list)
    routing_errors: int = 0
    speculated_blocks: int = 0
    """Blocks the index held speculatively for the routed prompts (``POST /v1/routed``)."""
    last_error: str | None = None
    traffic: list[RecordedPrompt] = field(default_factory=list)
    """The prompts routed, as they were sent (up to ``MAX_RECORDED_PROMPTS``)."""

    @property
    def hma_agreeing(self) -> int:
        return sum(1 for c in self.comparisons if c.hma == c.actual)

    @property
    def blind_agreeing(self) -> int:
        return sum(1 for c in self.comparisons if c.group_blind == c.actual)

    def disagreements(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.hma != c.actual][:DISAGREEMENT_EXAMPLES]


def reached(view: WorkerView | None, seq: int) -> bool:
    """Whether the index has applied some record of the worker at or after ``seq``."""
    return view is not None and applied_seq(view) >= seq


def applied_seq(view: WorkerView) -> int:
    """The newest seq the index applied for the worker, in any group (-1: none yet)."""
    return max(view.last_seq.values(), default=-1)


def holds_exactly(view: WorkerView, seq: int, log: RecordLog) -> bool:
    """Whether the index's state of the worker is the engine's state at ``seq`` (see above)."""
    groups = set(view.groups) | set(view.last_seq)
    return bool(groups) and all(
        view.last_seq.get(group)
        == log.last_record_at_or_before(view.worker, view.epoch, group, seq)
        for group in groups
    )


def same_state(view: WorkerView, later: WorkerView | None) -> bool:
    """Whether nothing that scoring reads changed for this live worker between two views."""
    return (
        later is not None
        and view.health == "live"
        and (view.epoch, view.health, view.groups, view.last_seq)
        == (later.epoch, later.health, later.groups, later.last_seq)
    )


async def probe_until(
    stop: asyncio.Event,
    probe: Callable[[tuple[int, ...]], Awaitable[None]],
    next_prompt: Callable[[], tuple[int, ...]],
    stats: ProbeStats,
    pause_s: float,
) -> None:
    """Probe until ``stop`` is set; failures are counted, and the loop goes on."""
    while not stop.is_set():
        try:
            await probe(next_prompt())
        except (ServiceError, KafkaError, OSError, TimeoutError) as error:
            stats.errors += 1
            stats.last_error = str(error)
        await asyncio.sleep(pause_s)


def judge_decisions(stats: ProbeStats, comparisons: Sequence[Comparison]) -> None:
    """Would routing by each answer have picked a worker with the longest real hit?

    Each answer picks as the index names its best workers (``kvlog.answers.best_worker``): the
    longest predicted hit, the first name among equal ones. An answer with no hit anywhere names
    no worker, and is right only when no worker had a real hit either.
    """
    best_actual = max(c.actual for c in comparisons)
    stats.decisions += 1
    stats.hma_decisions_right += _picks_right(comparisons, _hma_prediction, best_actual)
    stats.blind_decisions_right += _picks_right(comparisons, _blind_prediction, best_actual)


def _picks_right(
    comparisons: Sequence[Comparison], rank: Callable[[Comparison], Rank], best_actual: int
) -> bool:
    choice = best_worker(comparisons, rank)
    return (choice.actual if choice is not None else 0) == best_actual


def _hma_prediction(comparison: Comparison) -> Rank:
    return (comparison.hma,)


def _blind_prediction(comparison: Comparison) -> Rank:
    return (comparison.group_blind,)


def by_worker(answer: WorkersResponse) -> dict[str, WorkerView]:
    return {view.worker: view for view in answer.workers}


class Prober:
    """Runs probes one after another until stopped; ``stats`` is read by the others."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        index: IndexClient,
        log: RecordLog,
        prompts: PromptSource,
        *,
        clock: Callable[[], float],
        pause_s: float,
        seed: int = 0,
    ) -> None:
        self._engines = {engine.name: engine for engine in engines}
        self._index = index
        self._log = log
        self._prompts = prompts
        self._clock = clock
        self._pause_s = pause_s
        self._rng = random.Random(seed)
        self.stats = ProbeStats()
        self._routing: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        await probe_until(stop, self.probe, self._prompts.next_prompt, self.stats, self._pause_s)
        await self.drain()

    async def drain(self) -> None:
        """Wait for the routed requests still waiting to be admitted."""
        if self._routing:
            await asyncio.gather(*self._routing, return_exceptions=True)

    async def probe(self, prompt: tuple[int, ...]) -> None:
        self.stats.probes += 1
        pending = set(self._engines)
        matched: dict[str, Comparison] = {}
        answer: ScoreResponse | None = None
        for _ in range(MAX_ATTEMPTS):
            self.stats.attempts += 1
            answer, found = await self._attempt(prompt, pending)
            matched.update(found)
            pending -= set(found)
            if not pending:
                break
        self.stats.raced += len(pending)
        self.stats.comparisons.extend(matched.values())
        if len(matched) == len(self._engines):
            judge_decisions(self.stats, list(matched.values()))
        if answer is not None:
            self._route(prompt, answer)

    async def _attempt(
        self, prompt: tuple[int, ...], workers: set[str]
    ) -> tuple[ScoreResponse | None, dict[str, Comparison]]:
        samples: EngineSamples = {worker: {} for worker in workers}
        awaited = await self._sample_engines(prompt, samples)
        started = time.monotonic()
        views = await self._catch_up(prompt, awaited, samples)
        if views is None:
            return None, {}
        self.stats.catch_up_s.append(time.monotonic() - started)
        answer = await self._index.score(prompt)
        views_after = by_worker(await self._index.workers())
        await self._sample_engines(prompt, samples)
        hits = {hit.worker: hit for hit in answer.workers}
        found: dict[str, Comparison] = {}
        for worker in workers:
            view, hit = views.get(worker), hits.get(worker)
            if view is None or hit is None or not same_state(view, views_after.get(worker)):
                continue
            seq = applied_seq(view)
            actual = samples[worker].get(seq)
            if actual is None or not await self._holds_exactly(view, seq):
                continue
            found[worker] = Comparison(
                at_s=self._clock(),
                worker=worker,
                seq=seq,
                prompt_tokens=len(prompt),
                actual=actual,
                hma=hit.hit_tokens,
                group_blind=hit.group_blind_hit_tokens,
            )
        return answer, found

    async def _sample_engines(
        self, prompt: tuple[int, ...], samples: EngineSamples
    ) -> dict[str, int]:
        """Ask every engine once; keep each hit by its seq; return the seqs."""
        names = sorted(samples)
        answers = await asyncio.gather(*(self._engines[name].lookup(prompt) for name in names))
        for name, lookup in zip(names, answers, strict=True):
            samples[name][lookup.seq] = lookup.num_cached_tokens
        return {name: lookup.seq for name, lookup in zip(names, answers, strict=True)}

    async def _catch_up(
        self, prompt: tuple[int, ...], seqs: dict[str, int], samples: EngineSamples
    ) -> dict[str, WorkerView] | None:
        """The index's worker views once it has applied each worker's seq; None on timeout.

        The engines are asked again on every poll: the index will stop at some seq past the
        one awaited, and the engine's answer at that very seq is what it must be compared with.
        """
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while True:
            answer, _ = await asyncio.gather(
                self._index.workers(), self._sample_engines(prompt, samples)
            )
            views = by_worker(answer)
            if all(reached(views.get(worker), seq) for worker, seq in seqs.items()):
                return views
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _holds_exactly(self, view: WorkerView, seq: int) -> bool:
        if self._log.complete_through(view.worker) < seq:
            await self._log.sync()
        if self._log.complete_through(view.worker) < seq:
            return False
        return holds_exactly(view, seq, self._log)

    def _route(self, prompt: tuple[int, ...], answer: ScoreResponse) -> None:
        """Send the prompt to the index's best worker (any worker when none holds a prefix)."""
        if len(self._routing) >= MAX_ROUTED_IN_FLIGHT:
            return
        worker = answer.best or self._rng.choice(sorted(self._engines))
        if len(self.stats.traffic) < MAX_RECORDED_PROMPTS:
            self.stats.traffic.append(RecordedPrompt(self._clock(), prompt))
        hit = next((hit for hit in answer.workers if hit.worker == worker), None)
        predicted = (0, 0) if hit is None else (hit.hit_tokens, speculative_hit(hit))
        task = asyncio.create_task(self._send(worker, prompt, predicted))
        self._routing.add(task)
        task.add_done_callback(self._routing.discard)

    async def _send(self, worker: str, prompt: tuple[int, ...], predicted: tuple[int, int]) -> None:
        try:
            speculation = await self._index.routed(prompt, worker)
            self.stats.speculated_blocks += speculation.speculated_blocks
            admission = await self._engines[worker].request(prompt, ROUTED_MAX_TOKENS)
        except (ServiceError, OSError, TimeoutError) as error:
            self.stats.routing_errors += 1
            self.stats.last_error = str(error)
            return
        self._prompts.routed(prompt)
        self.stats.routed.append(
            RoutedRequest(self._clock(), worker, *predicted, admission.num_cached_tokens)
        )
