"""A fleet of reference engines behind one router, on a simulated clock: one seeded run.

Each engine is the reference engine without its model: vLLM's scheduler and hybrid cache manager
(``producer.engine``), a ``SyntheticSampler`` for tokens, and its real KV events. Time is a
discrete-event clock: a step is scheduled when it starts (as vLLM's is), lasts what
``StepCost`` says for the tokens it computes, and its results (first tokens, finished requests,
the step's event batch) take effect when it ends; the batch reaches the routers ``event_lag``
seconds later (the pipeline's engine-to-index latency). Requests arrive on a seeded
``ArrivalSchedule``; the router picks an engine for each from its prefix estimate and the
engines' load at that instant.

Engines may also serve background traffic of their own (``Background``): requests that arrive at
one engine without a routing decision, as the demo's engines serve their own workloads. They
load the engines and fill their caches like any request, and are left out of the report.

Everything is deterministic for a seed: the same run gives the same numbers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.engine.scheduler import Scheduler, StepResult, SyntheticSampler
from hmakv.producer.engine.workloads import ArrivalSchedule, RequestSpec, Workload
from hmakv.producer.events import KVEventBatch
from hmakv.producer.hashing import BlockHasher
from hmakv.producer.recorder import EventRecorder
from hmakv.routing.costs import StepCost
from hmakv.routing.estimates import Prompt
from hmakv.routing.policies import EngineLoad, Router


@dataclass(frozen=True)
class FleetSpec:
    """The engines: how many, their model's cache layout, and vLLM's batching limits."""

    engines: int
    profile: ModelProfile
    token_budget: int = 2048
    max_running: int = 64
    cost: StepCost = field(default_factory=StepCost)
    event_lag: float = 0.02
    """Seconds from a step's end to its events reaching the routers (Apache Kafka's p50 here)."""


@dataclass(frozen=True)
class Background:
    """An engine's own traffic: ``workload``'s requests at ``arrivals``, never routed."""

    engine: int
    workload: Workload
    arrivals: list[float]


@dataclass
class RequestOutcome:
    """One request's life, for the report."""

    request_id: str
    engine: int
    arrival: float
    prompt_tokens: int
    predicted_hit: int | None
    cached_tokens: int | None = None
    """The engine's real prefix hit at first admission (vLLM's ``num_cached_tokens``)."""
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False


@dataclass
class EngineTotals:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0
    requests: int = 0


@dataclass
class RunResult:
    requests: list[RequestOutcome]
    """The routed requests (background requests are not reported)."""
    engines: list[EngineTotals]
    simulated_s: float


class PromptHasher:
    """A prompt's block hashes as a router computes them, remembered across runs of a study."""

    def __init__(self, profile: ModelProfile, block_size: int) -> None:
        self._hasher = BlockHasher(profile.hash_fn, profile.hash_seed)
        self._block_size = block_size
        self._known: dict[tuple[int, ...], tuple[int, ...]] = {}

    def prompt(self, token_ids: tuple[int, ...]) -> Prompt:
        hashes = self._known.get(token_ids)
        if hashes is None:
            external_hashes = self._hasher.external_hashes(token_ids, self._block_size)
            hashes = self._known[token_ids] = tuple(external_hashes)
        return Prompt(len(token_ids), hashes)


class _Engine:
    def __init__(self, spec: FleetSpec, clock: Callable[[], float], seed: int) -> None:
        profile = spec.profile
        recorder = EventRecorder(profile.groups, clock=clock)
        self.manager = HybridCacheManager(profile, recorder)
        sampler = SyntheticSampler(profile.dims.vocab_size, seed=seed)
        self.scheduler = Scheduler(
            self.manager, sampler, token_budget=spec.token_budget, max_running=spec.max_running
        )
        self.busy = False
        self.totals = EngineTotals()

    def load(self) -> EngineLoad:
        usable = self.manager.pool.num_blocks - 1  # the null block is never free
        return EngineLoad(
            self.scheduler.num_waiting,
            self.scheduler.num_running,
            1.0 - self.manager.num_free_blocks / usable,
        )


_DELIVER, _STEP_END, _ARRIVAL = 0, 1, 2  # at one instant: events first, then steps, arrivals


class _Simulation:
    def __init__(
        self,
        spec: FleetSpec,
        router: Router,
        workload: Workload,
        hasher: PromptHasher,
        seed: int,
        background: Sequence[Background],
    ) -> None:
        self._spec = spec
        self._router = router
        self._workload = workload
        self._hasher = hasher
        self._background = list(background)
        self.now = 0.0
        self._engines = [_Engine(spec, self._clock, seed) for _ in range(spec.engines)]
        self._queue: list[tuple[float, int, int, int, object]] = []
        self._order = itertools.count()
        self.requests: dict[str, RequestOutcome] = {}
        self._unrouted: dict[str, tuple[Workload, str]] = {}
        """Background requests by their id in the engine: their workload and their own id."""

    def _clock(self) -> float:
        return self.now

    def _push(self, at: float, kind: int, engine: int, payload: object = None) -> None:
        heapq.heappush(self._queue, (at, kind, next(self._order), engine, payload))

    def run(self, arrivals: list[float], horizon: float) -> RunResult:
        for at in arrivals:
            self._push(at, _ARRIVAL, -1)
        for number, background in enumerate(self._background):
            for at in background.arrivals:
                self._push(at, _ARRIVAL, background.engine, number)
        while self._queue and self._queue[0][0] <= horizon:
            at, kind, _, engine, payload = heapq.heappop(self._queue)
            self.now = at
            if kind == _ARRIVAL and engine < 0:
                self._arrive()
            elif kind == _ARRIVAL:
                self._arrive_unrouted(payload)  # type: ignore[arg-type]
            elif kind == _STEP_END:
                self._end_step(engine, payload)  # type: ignore[arg-type]
            else:
                self._router.observe(engine, payload, at)  # type: ignore[arg-type]
        routed = [r for r in self.requests.values() if r.request_id not in self._unrouted]
        return RunResult(routed, [e.totals for e in self._engines], self.now)

    def _arrive(self) -> None:
        spec = self._workload.next_request()
        if spec is None:
            return
        prompt = self._hasher.prompt(spec.prompt_token_ids)
        loads = [engine.load() for engine in self._engines]
        choice = self._router.choose(prompt, loads, self.now)
        self.requests[spec.request_id] = RequestOutcome(
            spec.request_id, choice.worker, self.now, prompt.num_tokens, choice.predicted_hit
        )
        self._submit(choice.worker, spec)

    def _arrive_unrouted(self, number: int) -> None:
        background = self._background[number]
        spec = background.workload.next_request()
        if spec is None:
            return
        request_id = f"background-{number}-{spec.request_id}"
        self._unrouted[request_id] = (background.workload, spec.request_id)
        spec = RequestSpec(request_id, spec.prompt_token_ids, spec.max_tokens)
        self.requests[request_id] = RequestOutcome(
            request_id, background.engine, self.now, len(spec.prompt_token_ids), None
        )
        self._submit(background.engine, spec)

    def _submit(self, index: int, spec: RequestSpec) -> None:
        engine = self._engines[index]
        engine.scheduler.add_request(spec.request_id, spec.prompt_token_ids, spec.max_tokens)
        engine.totals.requests += 1
        if not engine.busy:
            self._start_step(index)

    def _start_step(self, index: int) -> None:
        engine = self._engines[index]
        result = engine.scheduler.step()
        prefill = decode_context = 0
        for chunk in result.chunks:
            outcome = self.requests[chunk.request_id]
            if chunk.start_pos >= outcome.prompt_tokens and len(chunk.token_ids) == 1:
                decode_context += chunk.start_pos + 1
                engine.totals.decode_tokens += 1
            else:
                prefill += len(chunk.token_ids)
        engine.totals.prefill_tokens += prefill
        duration = self._spec.cost.seconds(prefill, decode_context)
        engine.totals.busy_s += duration
        engine.busy = True
        self._push(self.now + duration, _STEP_END, index, result)

    def _end_step(self, index: int, result: StepResult) -> None:
        for admitted in result.admitted:
            outcome = self.requests[admitted.request_id]
            if admitted.first:
                outcome.cached_tokens = admitted.num_cached_tokens
        for chunk in result.chunks:
            outcome = self.requests[chunk.request_id]
            done = chunk.start_pos + len(chunk.token_ids) >= outcome.prompt_tokens
            if done and outcome.first_token_at is None:
                outcome.first_token_at = self.now
        for finished in result.finished:
            outcome = self.requests[finished.request_id]
            outcome.finished_at = self.now
            outcome.aborted = finished.reason.value != "length"
            workload, request_id = self._unrouted.get(
                finished.request_id, (self._workload, finished.request_id)
            )
            workload.finished(request_id, finished.output_token_ids, completed=not outcome.aborted)
        if result.batch is not None:
            self._deliver(index, result.batch)
        engine = self._engines[index]
        engine.busy = False
        if engine.scheduler.has_work:
            self._start_step(index)

    def _deliver(self, index: int, batch: KVEventBatch) -> None:
        self._push(self.now + self._spec.event_lag, _DELIVER, index, batch)


def arrival_times(schedule: ArrivalSchedule) -> list[float]:
    """Every arrival of a schedule with a duration, in order."""
    times: list[float] = []
    while (at := schedule.next_arrival) is not None:
        times.extend([at] * schedule.due(at))
    return times


def simulate(
    spec: FleetSpec,
    router: Router,
    workload: Workload,
    arrivals: list[float],
    *,
    hasher: PromptHasher,
    seed: int = 0,
    drain_s: float = 60.0,
    background: Sequence[Background] = (),
) -> RunResult:
    """One router on one request stream; requests still unserved ``drain_s`` after the last
    arrival are reported as such."""
    last = max([*arrivals[-1:], *(at for b in background for at in b.arrivals[-1:])], default=0.0)
    simulation = _Simulation(spec, router, workload, hasher, seed, background)
    return simulation.run(arrivals, last + drain_s)
