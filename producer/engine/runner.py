"""The reference engine as a process: workload -> scheduler -> cache manager -> events on ZMQ.

One thread, the engine thread (whoever calls ``Engine.run``), owns the scheduler, the cache
manager and the model, as vLLM's engine core owns its scheduler. Everything else reaches that
state only by queueing a command that the loop runs between steps: the HTTP API's threads wait
on a future, and the publisher's snapshot provider is called from ``publish()`` or
``service_snapshot_requests()``, both on this thread. That is why a lookup answered through the
API, or a snapshot, is always the cache exactly as of the last published seq.

Each loop turn: submit the requests the arrival schedule says are due, run queued commands, then
either run one scheduler step (whose batch the recorder hands to the publisher) or, when there is
nothing to do, wait briefly for a command; then serve any pending snapshot request and print the
status line when its interval is up.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from hmakv.producer.curve import CurveSettings
from hmakv.producer.engine.api import (
    TOKEN_ID_LIMIT,
    AdmissionResult,
    ApiServer,
    EngineStopped,
    LookupResult,
    RequestRejected,
)
from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.profiles import ModelProfile, get_profile
from hmakv.producer.engine.scheduler import (
    FinishedRequest,
    FinishReason,
    Scheduler,
    StepResult,
    SyntheticSampler,
    TokenSampler,
)
from hmakv.producer.engine.workloads import (
    MIN_CONTEXT_TOKENS,
    ArrivalSchedule,
    Workload,
    make_workload,
)
from hmakv.producer.events import KVEvent
from hmakv.producer.publisher import ZmqEventPublisher
from hmakv.producer.recorder import EventRecorder

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.005
"""Longest an idle loop sleeps: bounds how late a snapshot request or a stop is noticed."""
API_REQUEST_PREFIX = "api-"


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``hmakv engine`` can set; defaults are the command's defaults."""

    profile: str = "gpt-oss-like"
    workload: str = "chat"
    rate: float = 10.0
    use_model: bool = True
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # the replay ring (vLLM's KVEventsConfig.buffer_steps)
    hwm: int = 100_000  # the PUB socket's send high-water mark (vLLM's KVEventsConfig.hwm)
    bind: bool = False  # bind ``endpoint`` even where it names a host (vLLM's rule otherwise)
    curve: CurveSettings | None = field(default=None, repr=False)  # see producer.curve
    topic: str = ""
    worker_name: str = "engine"
    dp_rank: int = 0
    device: str | None = None
    seed: int = 0
    duration: float | None = None
    num_blocks: int | None = None
    api: tuple[str, int] | None = None
    status_interval: float = 5.0
    token_budget: int = 512
    max_running: int = 64
    max_waiting: int = 1024
    """Arrivals beyond this many waiting requests are dropped (and counted): an engine that
    cannot keep up with ``rate`` must not grow its queue without bound."""


def context_tokens(profile: ModelProfile) -> int:
    """The longest prompt workloads should send this profile.

    A quarter of what the pool holds for one request if every group grew with it (a
    conservative bound: windowed groups hold less), so several requests fit at once.
    """
    smallest_block = min(spec.block_size for spec in profile.groups)
    capacity = (profile.num_blocks - 1) * smallest_block // len(profile.groups)
    return max(MIN_CONTEXT_TOKENS, capacity // 4)


def sized_profile(config: EngineConfig) -> ModelProfile:
    profile = get_profile(config.profile)
    if config.num_blocks is None:
        return profile
    return dataclasses.replace(profile, num_blocks=config.num_blocks)


@dataclass
class EngineCounters:
    """Totals since start; the status line reports their rates, the summary their values."""

    steps: int = 0
    scheduled_tokens: int = 0
    batches: int = 0
    events: int = 0
    submitted: int = 0
    admitted: int = 0
    cached_tokens: int = 0
    """Prefix-hit tokens over all first admissions."""
    prompt_tokens: int = 0
    """Prompt tokens over all first admissions, the denominator of the hit rate."""
    finished: int = 0
    too_long: int = 0
    preemptions: int = 0
    arrivals_dropped: int = 0

    def add_step(self, result: StepResult) -> None:
        self.steps += 1
        self.scheduled_tokens += result.num_scheduled_tokens
        if result.batch is not None:
            self.batches += 1
            self.events += len(result.batch.events)
        for admitted in result.admitted:
            if admitted.first:
                self.admitted += 1
                self.cached_tokens += admitted.num_cached_tokens
                self.prompt_tokens += admitted.num_prompt_tokens
        self.preemptions += len(result.preempted)
        for finished in result.finished:
            self.finished += 1
            self.too_long += finished.reason is FinishReason.TOO_LONG


@dataclass(frozen=True)
class EngineSummary:
    """What a run did, printed at exit."""

    elapsed_s: float
    counters: EngineCounters
    last_seq: int
    sent: int
    dropped: int
    running: int
    waiting: int

    def text(self) -> str:
        c = self.counters
        hit_rate = c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        return "\n".join(
            [
                f"engine summary after {self.elapsed_s:.1f} s:",
                f"  steps {c.steps}, tokens computed {c.scheduled_tokens}",
                f"  requests: {c.submitted} submitted, {c.admitted} admitted, "
                f"{c.finished} finished ({c.too_long} too long for the cache), "
                f"{c.preemptions} preemptions, {c.arrivals_dropped} arrivals dropped, "
                f"{self.running} running and {self.waiting} waiting at exit",
                f"  prefix hits: {c.cached_tokens} of {c.prompt_tokens} prompt tokens "
                f"({hit_rate:.1%})",
                f"  events: {c.events} in {c.batches} batches; last seq {self.last_seq}, "
                f"{self.sent} batches sent, {self.dropped} dropped",
            ]
        )


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_Command = tuple[Future[Any], Callable[[Future[Any]], None]]


class Engine:
    """The reference engine with its publisher, workload and (optionally) HTTP API.

    Build it, call ``run()`` on the thread that is to own the engine state, and stop it with
    ``request_stop()`` from anywhere (a signal handler, another thread) or let ``duration`` end
    it. ``run()`` returns once the publisher has drained; ``close()`` releases everything if
    ``run()`` was never called.
    """

    def __init__(
        self, config: EngineConfig, *, report: Callable[[str], None] = _stderr_line
    ) -> None:
        self.config = config
        self.profile = sized_profile(config)
        self._report = report
        self._model_device: str | None = None
        self._workload: Workload = make_workload(
            config.workload,
            seed=config.seed,
            vocab_size=self.profile.dims.vocab_size,
            context_tokens=context_tokens(self.profile),
        )
        self._arrivals = ArrivalSchedule(config.rate, seed=config.seed, duration=config.duration)
        self.publisher = ZmqEventPublisher(
            config.dp_rank,
            config.endpoint,
            config.replay_endpoint,
            config.buffer_steps,
            config.hwm,
            topic=config.topic,
            snapshot_provider=self._resident_events,
            bind=config.bind,
            curve=config.curve,
        )
        try:
            recorder = EventRecorder(
                self.profile.groups, self.publisher, data_parallel_rank=config.dp_rank
            )
            self.manager = HybridCacheManager(self.profile, recorder)
            sampler = self._sampler()
            self.scheduler = Scheduler(
                self.manager,
                sampler,
                token_budget=config.token_budget,
                max_running=config.max_running,
            )
            self._api = None if config.api is None else ApiServer(config.api, self)
        except BaseException:
            self.publisher.shutdown()
            raise
        self.counters = EngineCounters()
        # Not a SimpleQueue: on CPython 3.11 its get(timeout=...) can block forever when a
        # signal interrupts it near the deadline, and the engine thread waits here between
        # steps, where SIGTERM lands (tests/producer/engine/test_runner.py has the signal storm).
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._admission_waiters: dict[str, Future[AdmissionResult]] = {}
        self._api_requests = 0
        self._stop = threading.Event()
        self._closing = threading.Lock()  # orders enqueue against close: no command is stranded
        self._closed = False
        self._started = self._last_status = time.monotonic()
        self._status_counters = dataclasses.replace(self.counters)

    # --- control, from any thread -------------------------------------------------------------

    @property
    def api_url(self) -> str | None:
        return None if self._api is None else self._api.url

    @property
    def token_id_limit(self) -> int:
        """Token ids must be below this: the model's vocabulary, or what the wire can carry."""
        return self.profile.dims.vocab_size if self.config.use_model else TOKEN_ID_LIMIT

    def request_stop(self) -> None:
        """Ask the loop to stop after its current step; safe from signal handlers."""
        self._stop.set()

    def request(self, token_ids: Sequence[int], max_tokens: int) -> Future[AdmissionResult]:
        """Queue a request; the future resolves when it is admitted, with the hit it got."""
        return self._enqueue(lambda future: self._submit_api_request(token_ids, max_tokens, future))

    def lookup(self, token_ids: Sequence[int]) -> Future[LookupResult]:
        """The prefix hit a prompt would get now, and the last published seq it reflects."""
        return self._enqueue(lambda future: future.set_result(self._lookup(token_ids)))

    def status(self) -> Future[dict[str, object]]:
        return self._enqueue(lambda future: future.set_result(self._status_document()))

    # --- the engine thread --------------------------------------------------------------------

    def run(self) -> EngineSummary:
        """Serve until stopped or ``duration`` is up, then shut down cleanly."""
        self._report(self._banner())
        if self._api is not None:
            self._api.start()
        self._started = self._last_status = time.monotonic()
        try:
            while not self._stop.is_set():
                elapsed = time.monotonic() - self._started
                if self.config.duration is not None and elapsed >= self.config.duration:
                    break
                self._turn(elapsed)
        finally:
            self.close()
        return self.summary()

    def close(self) -> None:
        """Stop the API, fail whatever still waits on the engine, drain the publisher."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self._fail_waiters()
        if self._api is not None:
            self._api.close()
        self.publisher.shutdown()

    def summary(self) -> EngineSummary:
        stats = self.publisher.stats()
        return EngineSummary(
            elapsed_s=time.monotonic() - self._started,
            counters=dataclasses.replace(self.counters),
            last_seq=stats.published - 1,
            sent=stats.sent,
            dropped=stats.dropped_queue_full + stats.dropped_at_shutdown,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
        )

    def _turn(self, elapsed: float) -> None:
        self._submit_arrivals(elapsed)
        self._run_commands()
        if self.scheduler.has_work:
            self._step()
        else:
            self._wait_for_command(elapsed)
        self.publisher.service_snapshot_requests()
        self._maybe_report_status()

    def _sampler(self) -> TokenSampler:
        if not self.config.use_model:
            return SyntheticSampler(self.profile.dims.vocab_size, seed=self.config.seed)
        from hmakv.producer.engine.model_sampler import ModelSampler  # torch only when a model runs

        sampler = ModelSampler(self.manager, seed=self.config.seed, device=self.config.device)
        self._model_device = str(sampler.device)
        return sampler

    def _traffic(self) -> str:
        if self._workload.name == "none":
            return "no workload (API requests only)"
        return f"workload {self._workload.name} at {self.config.rate:g} requests/s"

    def _banner(self) -> str:
        config = self.config
        model = "no model" if self._model_device is None else f"model on {self._model_device}"
        replay = self.publisher.replay_endpoint
        return (
            f"engine {config.worker_name!r}: profile {self.profile.name} "
            f"({self.profile.num_blocks} blocks), {model}, {self._traffic()}; "
            f"publishing on {self.publisher.endpoint}"
            + (f", replay on {replay}" if replay else "")
            + (f"; API on {self.api_url}" if self._api is not None else "")
        )

    def _submit_arrivals(self, elapsed: float) -> None:
        for _ in range(self._arrivals.due(elapsed)):
            if self.scheduler.num_waiting >= self.config.max_waiting:
                self._drop_arrival()
                continue
            spec = self._workload.next_request()
            if spec is None:
                return
            self.scheduler.add_request(spec.request_id, spec.prompt_token_ids, spec.max_tokens)
            self.counters.submitted += 1

    def _drop_arrival(self) -> None:
        if not self.counters.arrivals_dropped:
            logger.warning(
                "engine cannot keep up with %.1f requests/s: %d requests waiting, dropping "
                "arrivals (the summary counts them)",
                self.config.rate,
                self.config.max_waiting,
            )
        self.counters.arrivals_dropped += 1

    def _step(self) -> None:
        result = self.scheduler.step()
        self.counters.add_step(result)
        if self._admission_waiters:
            self._answer_admissions(result)
        for finished in result.finished:
            self._route_finished(finished)

    def _route_finished(self, finished: FinishedRequest) -> None:
        if finished.request_id.startswith(API_REQUEST_PREFIX):
            waiter = self._admission_waiters.pop(finished.request_id, None)
            if waiter is not None:  # never admitted
                waiter.set_exception(RequestRejected(_too_long_message(finished, self.profile)))
            return
        self._workload.finished(
            finished.request_id,
            finished.output_token_ids,
            completed=finished.reason is FinishReason.LENGTH,
        )

    def _answer_admissions(self, result: StepResult) -> None:
        seq = self._last_seq()
        for admitted in result.admitted:
            waiter = self._admission_waiters.pop(admitted.request_id, None)
            if waiter is not None:
                waiter.set_result(
                    AdmissionResult(
                        request_id=admitted.request_id,
                        num_cached_tokens=admitted.num_cached_tokens,
                        num_prompt_tokens=admitted.num_prompt_tokens,
                        seq=seq,
                    )
                )

    def _submit_api_request(
        self, token_ids: Sequence[int], max_tokens: int, future: Future[AdmissionResult]
    ) -> None:
        self._api_requests += 1
        request_id = f"{API_REQUEST_PREFIX}{self._api_requests}"
        self.scheduler.add_request(request_id, token_ids, max_tokens)
        self.counters.submitted += 1
        self._admission_waiters[request_id] = future

    def _lookup(self, token_ids: Sequence[int]) -> LookupResult:
        return LookupResult(
            num_cached_tokens=self.manager.lookup(token_ids),
            num_prompt_tokens=len(token_ids),
            seq=self._last_seq(),
        )

    def _status_document(self) -> dict[str, object]:
        return {
            "worker_name": self.config.worker_name,
            "data_parallel_rank": self.config.dp_rank,
            "profile": self.profile.name,
            "groups": [
                {"group_idx": index, **msgspec.structs.asdict(spec)}
                for index, spec in enumerate(self.profile.groups)
            ],
            "hash_fn": self.profile.hash_fn,
            "hash_seed": self.profile.hash_seed,
            "num_blocks": self.profile.num_blocks,
            "free_blocks": self.manager.num_free_blocks,
            "blocks_used": self.scheduler.blocks_in_use(),
            "blocks_cached": self._blocks_cached(),
            "seq": self._last_seq(),
            "steps": self.counters.steps,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "model": self.config.use_model,
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "topic": self.config.topic,
            "publisher": dataclasses.asdict(self.publisher.stats()),
        }

    def _blocks_cached(self) -> list[int]:
        per_group = Counter(content.group for content in self.manager.pool.cached_contents())
        return [per_group[group] for group in range(len(self.profile.groups))]

    def _resident_events(self) -> list[KVEvent]:
        """The snapshot provider: every cached block, group by group (engine thread only)."""
        return [event for group in self.manager.resident_blocks() for event in group]

    def _last_seq(self) -> int:
        return self.publisher.stats().published - 1

    # --- commands -----------------------------------------------------------------------------

    def _enqueue(self, action: Callable[[Future[T]], None]) -> Future[T]:
        future: Future[T] = Future()
        with self._closing:
            if self._closed:
                future.set_exception(EngineStopped("the engine has stopped"))
            else:
                self._commands.put((future, action))
        return future

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._run_command(command)

    def _wait_for_command(self, elapsed: float) -> None:
        timeout = IDLE_WAIT_S
        next_arrival = self._arrivals.next_arrival
        if next_arrival is not None:
            timeout = max(0.0, min(timeout, next_arrival - elapsed))
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            return
        self._run_command(command)

    @staticmethod
    def _run_command(command: _Command) -> None:
        future, action = command
        if not future.set_running_or_notify_cancel():
            return
        try:
            action(future)
        except Exception as error:  # a bad query must not stop the engine
            if not future.done():
                future.set_exception(error)

    def _fail_waiters(self) -> None:
        stopped = EngineStopped("the engine stopped before answering")
        for waiter in self._admission_waiters.values():
            waiter.set_exception(stopped)
        self._admission_waiters.clear()
        while True:
            try:
                future, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)

    # --- status -------------------------------------------------------------------------------

    def _maybe_report_status(self) -> None:
        interval = self.config.status_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_status < interval:
            return
        self._report(self._status_line(now - self._last_status, now - self._started))
        self._last_status = now
        self._status_counters = dataclasses.replace(self.counters)

    def _status_line(self, window: float, elapsed: float) -> str:
        before, now = self._status_counters, self.counters
        pool = self.profile.num_blocks - 1
        used = self.scheduler.blocks_in_use()
        cached = self._blocks_cached()
        groups = ", ".join(
            f"g{index} {spec.kind} {used[index] / pool:.0%} used {cached[index] / pool:.0%} cached"
            for index, spec in enumerate(self.profile.groups)
        )
        return (
            f"[{self.config.worker_name}] {elapsed:.0f} s | "
            f"{(now.steps - before.steps) / window:.0f} steps/s | "
            f"{(now.scheduled_tokens - before.scheduled_tokens) / window:.0f} tokens/s | "
            f"{(now.events - before.events) / window:.0f} events/s | "
            f"seq {self._last_seq()} | running {self.scheduler.num_running} "
            f"waiting {self.scheduler.num_waiting} | cache {groups}"
        )


def _too_long_message(finished: FinishedRequest, profile: ModelProfile) -> str:
    return (
        f"a prompt of {len(finished.prompt_token_ids)} tokens does not fit the KV cache of "
        f"{profile.num_blocks} blocks shared by {len(profile.groups)} groups"
    )
