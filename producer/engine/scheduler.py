"""Continuous batching over the hybrid cache manager, the way vLLM's V1 scheduler batches.

Each ``step`` spends a token budget: running requests first, in arrival order (their next
prefill chunk or one decode token), then waiting requests, admitted first come first served while
budget, slots and blocks last. When a running request cannot get blocks, the request that
arrived last is preempted (its blocks freed, its tokens kept) and goes back to the front of the
queue, to be admitted again later with whatever prefix hit is left; vLLM's recompute preemption.
A request that does not fit even into an otherwise empty cache is aborted, since waiting would
never help. After the forward pass, requests whose tokens were all computed get their next token;
those that reached ``max_tokens`` finish. Then the step ends with exactly one
``HybridCacheManager.end_step()``, whose batch the recorder hands to its sink (the publisher).

Tokens come from a ``TokenSampler``: the torch model (``model_sampler.ModelSampler``), or, with
no model, ``SyntheticSampler``, which keeps the scheduler, the cache and the events exactly what
they would be while costing nothing.
"""

from __future__ import annotations

import enum
import sys
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.events import FULL_ATTENTION_KINDS, KVEventBatch


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: tokens ``start_pos..`` to compute now."""

    request_id: str
    token_ids: Sequence[int]
    start_pos: int


class TokenSampler(Protocol):
    """Computes a step's chunks and returns, per chunk, the token following its last one."""

    def sample(self, chunks: Sequence[ScheduledChunk]) -> list[int]: ...


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread function of (request, position)."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


class SyntheticSampler:
    """Tokens without a model: a fixed function of (seed, request id, position).

    Reproducible across processes (no ``hash()``, which ``PYTHONHASHSEED`` randomizes) and across
    preemptions, so a seeded run publishes the same events every time.
    """

    def __init__(self, vocab_size: int, *, seed: int = 0) -> None:
        self._vocab_size = vocab_size
        self._seed = seed

    def sample(self, chunks: Sequence[ScheduledChunk]) -> list[int]:
        return [self.token(c.request_id, c.start_pos + len(c.token_ids)) for c in chunks]

    def token(self, request_id: str, position: int) -> int:
        base = zlib.crc32(request_id.encode()) ^ (self._seed << 32)
        return _mix64(base ^ position * 0x9E3779B97F4A7C15 & _MASK64) % self._vocab_size


class FinishReason(enum.Enum):
    LENGTH = "length"
    """Generated ``max_tokens`` tokens."""
    TOO_LONG = "too_long"
    """Does not fit the KV cache even alone: it would wait forever."""


@dataclass(frozen=True)
class Admitted:
    """A request that got its blocks this step, and the prefix hit it got with them."""

    request_id: str
    num_cached_tokens: int
    num_prompt_tokens: int
    first: bool
    """False when the request is readmitted after a preemption."""


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    reason: FinishReason
    num_cached_tokens: int
    """The prefix hit at first admission; 0 if never admitted."""
    num_preemptions: int


@dataclass(frozen=True)
class StepResult:
    """What one step did, for counters, callers waiting on admissions, and tests."""

    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Admitted, ...]
    finished: tuple[FinishedRequest, ...]
    preempted: tuple[str, ...]
    batch: KVEventBatch | None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    outputs: list[int] = field(default_factory=list)

    def finished(self, reason: FinishReason) -> FinishedRequest:
        return FinishedRequest(
            request_id=self.request_id,
            prompt_token_ids=tuple(self.token_ids[: self.num_prompt_tokens]),
            output_token_ids=tuple(self.outputs),
            reason=reason,
            num_cached_tokens=self.num_cached_tokens or 0,
            num_preemptions=self.num_preemptions,
        )


class _StepBuilder:
    """The step in progress: its remaining budget and what it has done so far."""

    def __init__(self, token_budget: int) -> None:
        self.budget = token_budget
        self.chunks: list[ScheduledChunk] = []
        self.chunk_requests: list[_Request] = []
        self.admitted: list[Admitted] = []
        self.finished: list[FinishedRequest] = []
        self.preempted: list[str] = []

    def add_chunk(self, request: _Request, start: int, count: int) -> None:
        self.chunks.append(
            ScheduledChunk(request.request_id, request.token_ids[start : start + count], start)
        )
        self.chunk_requests.append(request)
        request.num_computed_tokens = start + count
        self.budget -= count


def max_model_len(profile: ModelProfile) -> int:
    """The longest sequence (prompt + output) the pool could hold with nothing else running.

    Only groups that keep every block count (full attention); windowed groups and mamba free
    blocks as a request grows. Like vLLM's ``max_model_len`` check, it refuses what can never
    run before it holds any block; a request within it can still outgrow the pool, and is then
    aborted when it is the only one left.
    """
    sizes = [spec.block_size for spec in profile.groups if spec.kind in FULL_ATTENTION_KINDS]
    if not sizes:
        return sys.maxsize
    pool = profile.num_blocks - 1
    low, high = 0, pool * max(sizes)  # blocks_for(high + 1) > pool
    while low < high:
        middle = (low + high + 1) // 2
        if sum(-(-middle // size) for size in sizes) <= pool:
            low = middle
        else:
            high = middle - 1
    return low


class Scheduler:
    """Continuous batching with chunked prefill over one ``HybridCacheManager``.

    ``token_budget`` is vLLM's ``max_num_batched_tokens`` and ``max_running`` its
    ``max_num_seqs``. Not thread-safe: one engine thread adds requests and steps.
    """

    def __init__(
        self,
        manager: HybridCacheManager,
        sampler: TokenSampler,
        *,
        token_budget: int = 512,
        max_running: int = 64,
    ) -> None:
        if token_budget < manager.alignment:
            # A mamba prefill advances in whole state blocks: a smaller budget would never move.
            raise ValueError(
                f"token_budget {token_budget} is below the cache alignment of "
                f"{manager.alignment} tokens"
            )
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.manager = manager
        self._sampler = sampler
        self.max_model_len = max_model_len(manager.profile)
        self.token_budget = token_budget
        self.max_running = max_running
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._known: set[str] = set()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int
    ) -> None:
        """Queue a request; it is admitted by a later ``step``."""
        if request_id in self._known:
            raise ValueError(f"request {request_id!r} is already queued or running")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be at least 1")
        self._known.add(request_id)
        tokens = list(prompt_token_ids)
        self._waiting.append(_Request(request_id, tokens, len(tokens), max_tokens))

    def step(self) -> StepResult:
        """Schedule, compute, sample, finish, and publish the step's events as one batch."""
        step = _StepBuilder(self.token_budget)
        if not self._schedule_running(step):
            self._admit_waiting(step)
        if step.chunks:
            tokens = self._sampler.sample(step.chunks)
            for request, token in zip(step.chunk_requests, tokens, strict=True):
                self._take_token(request, token, step)
        batch = self.manager.end_step()
        return StepResult(
            tuple(step.chunks),
            tuple(step.admitted),
            tuple(step.finished),
            tuple(step.preempted),
            batch,
        )

    def blocks_in_use(self) -> list[int]:
        """Per group, physical blocks held by running requests (shared prefix blocks once)."""
        held: list[set[int]] = [set() for _ in self.manager.profile.groups]
        for request in self._running:
            for group, table in enumerate(self.manager.block_table(request.request_id)):
                held[group].update(table)
        for ids in held:
            ids.discard(0)  # the null block marks skipped positions
        return [len(ids) for ids in held]

    def _schedule_running(self, step: _StepBuilder) -> bool:
        """Give running requests their next tokens; True if a preemption happened."""
        preempted = False
        index = 0
        while index < len(self._running) and step.budget > 0:
            request = self._running[index]
            start = request.num_computed_tokens
            count = self.manager.schedule(request.request_id, token_budget=step.budget)
            if count is None:
                # Retry with the room made; if the request itself went, the loop is over.
                self._preempt_last(request, step)
                preempted = True
                continue
            if count:
                step.add_chunk(request, start, count)
            index += 1
        return preempted

    def _preempt_last(self, needy: _Request, step: _StepBuilder) -> None:
        """Free the blocks of the request that arrived last, for ``needy``.

        If that is ``needy`` itself and nothing else runs, no amount of waiting gives it the
        blocks it lacks, so it is aborted instead of being queued again.
        """
        victim = self._running.pop()
        self.manager.finish(victim.request_id)
        if victim is needy and not self._running:
            self._known.discard(victim.request_id)
            step.finished.append(victim.finished(FinishReason.TOO_LONG))
            return
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._waiting.appendleft(victim)
        step.preempted.append(victim.request_id)

    def _admit_waiting(self, step: _StepBuilder) -> None:
        while self._waiting and step.budget > 0 and len(self._running) < self.max_running:
            request = self._waiting[0]
            if request.num_prompt_tokens + request.max_tokens > self.max_model_len:
                self._abort_waiting(step)
                continue
            admission = self.manager.admit(
                request.request_id, request.token_ids, token_budget=step.budget
            )
            if admission is None:
                if self._running or step.chunks:
                    return  # blocks or budget come back in a later step
                self._abort_waiting(step)  # an empty cache cannot fit it: it never will
                continue
            self._waiting.popleft()
            self._running.append(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = admission.num_cached_tokens
            step.admitted.append(
                Admitted(
                    request.request_id,
                    admission.num_cached_tokens,
                    len(request.token_ids),
                    first=request.num_preemptions == 0,
                )
            )
            step.add_chunk(request, admission.num_cached_tokens, admission.num_scheduled_tokens)

    def _abort_waiting(self, step: _StepBuilder) -> None:
        request = self._waiting.popleft()
        self._known.discard(request.request_id)
        step.finished.append(request.finished(FinishReason.TOO_LONG))

    def _take_token(self, request: _Request, token: int, step: _StepBuilder) -> None:
        """A sampled token counts only once all of the request's tokens are computed."""
        if request.num_computed_tokens < len(request.token_ids):
            return  # a prefill chunk short of the end: its last logits predict nothing new
        request.outputs.append(token)
        if len(request.outputs) >= request.max_tokens:
            self._running.remove(request)
            self.manager.finish(request.request_id)
            self._known.discard(request.request_id)
            step.finished.append(request.finished(FinishReason.LENGTH))
            return
        request.token_ids.append(token)
        self.manager.append_tokens(request.request_id, [token])
