"""Recorded traffic through the routing study: what each router would have done with it.

The demo routes its probe prompts with hmakv's index alone, so it cannot say what another router
would have made of the same traffic. Here the prompts it sent, at the offsets it sent them, are
replayed on a simulated fleet (``cluster.simulate``, as ``hmakv bench routing`` does) behind
every router in turn, from empty engines each time, beside whatever background traffic of their
own the engines serve (``Background``, made afresh for each run).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.engine.workloads import RequestSpec
from hmakv.routing.cluster import Background, FleetSpec, PromptHasher, simulate
from hmakv.routing.study import ROUTERS, RunReport, make_router, summarize

RECORDED = "recorded"
"""The workload name replayed runs report."""


@dataclass(frozen=True)
class RecordedPrompt:
    """A prompt as it was sent: when (seconds, any origin) and what."""

    at_s: float
    token_ids: tuple[int, ...]


class RecordedTraffic:
    """The recorded prompts in their order, each asking ``max_tokens`` tokens."""

    name = RECORDED

    def __init__(self, prompts: Sequence[RecordedPrompt], max_tokens: int) -> None:
        self._prompts = iter(prompts)
        self._max_tokens = max_tokens
        self._count = 0

    def next_request(self) -> RequestSpec | None:
        prompt = next(self._prompts, None)
        if prompt is None:
            return None
        self._count += 1
        return RequestSpec(f"recorded-{self._count}", prompt.token_ids, self._max_tokens)

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """Recorded prompts are fixed: answers change nothing."""


def replay(
    profile: ModelProfile,
    prompts: Sequence[RecordedPrompt],
    *,
    engines: int,
    max_tokens: int,
    routers: Sequence[str] = ROUTERS,
    background: Callable[[], Sequence[Background]] = tuple,
    seed: int = 0,
) -> list[RunReport]:
    """One report per router: the prompts on ``engines`` empty engines of ``profile``.

    Arrivals keep the recorded offsets from the first prompt; prompts must be in time order.
    """
    if any(later.at_s < earlier.at_s for earlier, later in itertools.pairwise(prompts)):
        raise ValueError("recorded prompts must be in time order")
    spec = FleetSpec(engines=engines, profile=profile)
    block_size = hash_block_size(profile.groups)
    hasher = PromptHasher(profile, block_size)
    start = prompts[0].at_s if prompts else 0.0
    arrivals = [prompt.at_s - start for prompt in prompts]
    reports = []
    for name in routers:
        router = make_router(
            name, engines, profile.groups, block_size, seed=seed, token_budget=spec.token_budget
        )
        traffic = RecordedTraffic(prompts, max_tokens)
        result = simulate(
            spec, router, traffic, arrivals, hasher=hasher, seed=seed, background=background()
        )
        reports.append(summarize(profile.name, RECORDED, name, result))
    return reports
