"""The probing router for real vLLM servers: predict, serve, and compare with ``cached_tokens``.

vLLM has no side-effect-free lookup: the only way to learn its real hit for a prompt is to serve
the prompt, and serving it caches it. So each probe, for every server at once:

1. waits until the server's event stream is quiet and the index holds exactly what vLLM
   published (``hmakv.vllm.witness`` says how that is known);
2. asks ``/v1/score`` once, checking that the index did not move while it answered;
3. sends the prompt as a real ``/v1/completions`` request to every server, and compares each
   server's ``usage.prompt_tokens_details.cached_tokens`` with the index's two answers;
4. throws away (counts as raced) any comparison where vLLM had published a batch before the
   request went out that the index did not hold when it answered.

Every server serves every prompt, so each probe also judges a routing decision: would the
worker the index picked have had the longest real hit? The servers' caches still differ, since
their layouts and pool sizes do, and so do their evictions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from hmakv.demo.client import (
    EngineGroup,
    EngineStatus,
    IndexClient,
    VllmClient,
)
from hmakv.demo.probe import (
    CATCH_UP_TIMEOUT_S,
    POLL_INTERVAL_S,
    Comparison,
    ProbeStats,
    RoutedRequest,
    by_worker,
    judge_decisions,
    probe_until,
    same_state,
)
from hmakv.kvlog.answers import ScoreResponse, WorkerView
from hmakv.vllm.profiles import HASH_FN, HASH_SEED, VllmProfile
from hmakv.vllm.witness import EventWitness, WitnessState
from hmakv.vllm.workload import VllmPrompts

log = logging.getLogger(__name__)

QUIET_S = 0.05
"""How long a server's stream must be silent before its newest seq is taken as its state."""
FINAL_QUIET_S = 0.5


@dataclass(frozen=True)
class VllmEngine:
    """One real vLLM server: its API, the witness of its events, the profile it serves."""

    client: VllmClient
    witness: EventWitness
    profile: VllmProfile
    num_gpu_blocks: int

    @property
    def name(self) -> str:
        return self.client.name

    async def status(self) -> EngineStatus:
        """What the demo's monitor reads from a reference engine, here from the witness."""
        state = self.witness.state
        return EngineStatus(
            worker_name=self.name,
            profile=self.profile.name,
            groups=[
                EngineGroup(group, spec.kind, spec.block_size, spec.sliding_window)
                for group, spec in sorted(state.catalog.items())
            ],
            seq=state.last_seq,
            num_blocks=self.num_gpu_blocks,
            blocks_cached=[],
            hash_fn=HASH_FN,
            hash_seed=HASH_SEED,
        )


def holds_exactly(view: WorkerView, state: WitnessState, through: int) -> bool:
    """Whether the index's state of the worker is vLLM's after batch ``through``: every group's
    applied seq is the newest batch at or before it that reached the group."""
    groups = set(view.groups) | set(view.last_seq) | set(state.catalog)
    return all(
        view.last_seq.get(group) == state.expected_last_seq(group, through) for group in groups
    )


@dataclass(frozen=True)
class _Pending:
    """A probe served but not judged yet: what the index said, and what vLLM answered."""

    prompt: tuple[int, ...]
    through: dict[str, int]
    sent_at: float
    actual: dict[str, int]
    predictions: dict[str, tuple[int, int] | str]
    best: str | None


class VllmProber:
    """Runs probes one after another until stopped; ``stats`` is read by the others."""

    def __init__(
        self,
        engines: Sequence[VllmEngine],
        index: IndexClient,
        prompts: VllmPrompts,
        *,
        clock: Callable[[], float],
        pause_s: float = 0.0,
        keep_prompts: bool = False,
    ) -> None:
        self._engines = list(engines)
        self._index = index
        self._prompts = prompts
        self._clock = clock
        self._pause_s = pause_s
        self.stats = ProbeStats()
        self._pending: deque[_Pending] = deque()
        self.judged: list[tuple[tuple[int, ...], list[Comparison]]] | None = (
            [] if keep_prompts else None
        )
        """With ``keep_prompts``: every judged prompt with its comparisons (to record traces)."""
        self.raced_by_cause: Counter[str] = Counter()
        """Why comparisons were thrown away: the index never caught up, it moved while it
        scored, or vLLM had published a batch the index did not hold."""

    async def run(self, stop: asyncio.Event) -> None:
        """Probe until ``stop`` is set, then judge the probes still waiting for their fence."""
        await probe_until(stop, self.probe, self._prompts.next_prompt, self.stats, self._pause_s)
        await self.drain()

    async def drain(self) -> None:
        """Judge the probes still waiting for their fence, once every server's stream is quiet."""
        await self._settle(quiet_s=FINAL_QUIET_S)
        self._judge(final=True)

    async def probe(self, prompt: tuple[int, ...]) -> None:
        """One prompt to every server; judged once the witnesses have seen past it."""
        self.stats.probes += 1
        self.stats.attempts += 1
        through = await self._settle()
        started = time.monotonic()
        views = await self._catch_up(through)
        predictions: dict[str, tuple[int, int] | str] = {}
        best = None
        if views is not None:
            self.stats.catch_up_s.append(time.monotonic() - started)
            answer = await self._index.score(prompt)
            views_after = by_worker(await self._index.workers())
            predictions = self._predictions(answer, views, views_after, through)
            best = answer.best
        sent_at = time.time()
        served = await asyncio.gather(*(e.client.complete(prompt) for e in self._engines))
        actual = {e.name: real.cached_tokens for e, real in zip(self._engines, served, strict=True)}
        await self._await_stores(prompt, actual, sent_at)
        if views is None:
            self.stats.raced += len(self._engines)
            self.raced_by_cause["no catch-up"] += len(self._engines)
        else:
            self._pending.append(_Pending(prompt, through, sent_at, actual, predictions, best))
        self._judge(final=False)

    async def _await_stores(
        self, prompt: tuple[int, ...], actual: dict[str, int], sent_at: float
    ) -> None:
        """Wait for the batch of each request that must have stored a block: a full block past
        the hit was computed, and vLLM stores every block it fills. Its arrival fences the
        request (see ``_judge``), so the next probe starts from vLLM's exact state."""
        for engine in self._engines:
            full_blocks = len(prompt) // engine.profile.block_size * engine.profile.block_size
            if full_blocks > actual[engine.name]:
                await engine.witness.wait_for(partial(engine.witness.state.fenced, sent_at))

    def _predictions(
        self,
        answer: ScoreResponse,
        views: dict[str, WorkerView],
        views_after: dict[str, WorkerView],
        through: dict[str, int],
    ) -> dict[str, tuple[int, int] | str]:
        """Each worker's (HMA-aware, group-blind) hit, or why it cannot be compared."""
        hits = {hit.worker: (hit.hit_tokens, hit.group_blind_hit_tokens) for hit in answer.workers}
        predictions: dict[str, tuple[int, int] | str] = {}
        for engine in self._engines:
            predicted = hits.get(engine.name, (0, 0) if through[engine.name] < 0 else None)
            if predicted is None:
                predictions[engine.name] = "not scored"
            elif not self._unmoved(engine, views, views_after):
                predictions[engine.name] = "index moved"
            else:
                predictions[engine.name] = predicted
        return predictions

    def _judge(self, *, final: bool) -> None:
        """Compare the probes whose every server has published past them (or all, at the end).

        A batch vLLM stamped after a request went out proves every batch before the request
        has reached the witness (one PUB stream keeps its order), so only then is it known
        whether vLLM published something the index did not hold.
        """
        while self._pending:
            pending = self._pending[0]
            fenced = all(e.witness.state.fenced(pending.sent_at) for e in self._engines)
            if not (fenced or final):
                return
            self._pending.popleft()
            self._compare(pending)

    def _compare(self, pending: _Pending) -> None:
        found: list[Comparison] = []
        for engine in self._engines:
            predicted = pending.predictions[engine.name]
            seq = pending.through[engine.name]
            if not isinstance(predicted, str) and engine.witness.state.published_late(
                seq, pending.sent_at
            ):
                predicted = "published late"
            if isinstance(predicted, str):
                self.stats.raced += 1
                self.raced_by_cause[predicted] += 1
                continue
            found.append(
                Comparison(
                    at_s=self._clock(),
                    worker=engine.name,
                    seq=seq,
                    prompt_tokens=len(pending.prompt),
                    actual=pending.actual[engine.name],
                    hma=predicted[0],
                    group_blind=predicted[1],
                )
            )
        self.stats.comparisons.extend(found)
        if self.judged is not None:
            self.judged.append((pending.prompt, found))
        if len(found) == len(self._engines):
            judge_decisions(self.stats, found)
        self._record_route(pending.best, found)

    def _record_route(self, best: str | None, found: Sequence[Comparison]) -> None:
        chosen = next((c for c in found if c.worker == best), None)
        if chosen is not None:
            self.stats.routed.append(
                # no /v1/routed here: the speculative prediction is the confirmed one
                RoutedRequest(self._clock(), chosen.worker, chosen.hma, chosen.hma, chosen.actual)
            )

    async def _settle(self, quiet_s: float = QUIET_S) -> dict[str, int]:
        seqs = await asyncio.gather(*(e.witness.settle(quiet_s) for e in self._engines))
        return {e.name: seq for e, seq in zip(self._engines, seqs, strict=True)}

    async def _catch_up(self, through: dict[str, int]) -> dict[str, WorkerView] | None:
        """The index's views once it holds exactly each server's state; None on timeout."""
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while True:
            views = by_worker(await self._index.workers())
            await self._overtaken(views, through)
            if all(self._holds(e, views.get(e.name), through) for e in self._engines):
                return views
            if time.monotonic() >= deadline:
                self._log_missed(views, through)
                return None
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _overtaken(self, views: dict[str, WorkerView], through: dict[str, int]) -> None:
        """The index applied a seq the witness has not seen yet (the stream was quiet for
        ``QUIET_S`` but not done): wait for the witness to see it, and take its state then."""
        for engine in self._engines:
            view = views.get(engine.name)
            applied = max(view.last_seq.values(), default=-1) if view else -1
            if applied > through[engine.name]:
                await engine.witness.wait_for(partial(engine.witness.state.reached, applied))
                through[engine.name] = await engine.witness.settle(QUIET_S)

    def _log_missed(self, views: dict[str, WorkerView], through: dict[str, int]) -> None:
        for engine in self._engines:
            view, state = views.get(engine.name), engine.witness.state
            expected = {
                group: state.expected_last_seq(group, through[engine.name])
                for group in state.catalog
            }
            log.warning(
                "%s: the index did not reach vLLM's seq %d within %.0f s: applied %s, expected %s",
                engine.name,
                through[engine.name],
                CATCH_UP_TIMEOUT_S,
                view.last_seq if view else None,
                expected,
            )

    @staticmethod
    def _unmoved(
        engine: VllmEngine, before: dict[str, WorkerView], after: dict[str, WorkerView]
    ) -> bool:
        """The index did not change this worker while it scored (absent both times counts)."""
        view = before.get(engine.name)
        if view is None:
            return engine.name not in after
        return same_state(view, after.get(engine.name))

    @staticmethod
    def _holds(engine: VllmEngine, view: WorkerView | None, through: dict[str, int]) -> bool:
        if through[engine.name] < 0:  # nothing published yet: nothing to hold
            return view is None or not view.last_seq
        return (
            view is not None
            and view.health == "live"
            and holds_exactly(view, engine.witness.state, through[engine.name])
        )
