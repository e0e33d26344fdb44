"""The probe's prompts: shaped like the engines' own traffic, plus follow-ups of routed ones.

Each engine's workload is rebuilt here with the engine's seed and pool size, so the probe's
prompts share system prompts and documents with what the engines serve. Follow-ups extend a
prompt the probe already routed, like a chat's next turn, which is where a router's prefix hits
come from; branches keep only the start of a routed prompt (a user editing an earlier turn), so
their hit ends where the sliding-window copies were freed early while the request ran: where an
HMA-aware and a group-blind index disagree once the cache is under pressure.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Sequence

from hmakv.demo.config import EngineSpec
from hmakv.producer.engine.profiles import ModelProfile, get_profile
from hmakv.producer.engine.runner import context_tokens
from hmakv.producer.engine.workloads import Workload, make_workload

FOLLOW_UP_SHARE = 0.35
BRANCH_SHARE = 0.25
BRANCH_CUT = (0.3, 0.9)
FOLLOW_UP_TOKENS = (4, 48)
RECENT_PROMPTS = 256


def sized(spec: EngineSpec) -> ModelProfile:
    """The engine's profile with its pool size: the workloads' prompt lengths depend on it."""
    profile = get_profile(spec.profile)
    if spec.num_blocks is None:
        return profile
    return dataclasses.replace(profile, num_blocks=spec.num_blocks)


class PromptSource:
    """Fresh prompts from the engines' workloads, and follow-ups of prompts routed before."""

    def __init__(self, engines: Sequence[EngineSpec], seed: int) -> None:
        profiles = [sized(spec) for spec in engines]
        self._vocab_size = min(profile.dims.vocab_size for profile in profiles)
        self._max_tokens = min(context_tokens(profile) for profile in profiles)
        self._workloads: list[Workload] = [
            make_workload(
                spec.workload,
                seed=spec.seed,
                vocab_size=self._vocab_size,
                context_tokens=context_tokens(profile),
            )
            for spec, profile in zip(engines, profiles, strict=True)
        ]
        self._rng = random.Random(seed)
        self._recent: deque[tuple[int, ...]] = deque(maxlen=RECENT_PROMPTS)

    def next_prompt(self) -> tuple[int, ...]:
        """A prompt no engine rejects: never longer than the smallest engine's context."""
        draw = self._rng.random()
        if self._recent and draw < FOLLOW_UP_SHARE:
            prompt = self._follow_up(self._rng.choice(self._recent))
        elif self._recent and draw < FOLLOW_UP_SHARE + BRANCH_SHARE:
            prompt = self._branch(self._rng.choice(self._recent))
        else:
            prompt = self._fresh()
        return prompt[: self._max_tokens]

    def routed(self, prompt: tuple[int, ...]) -> None:
        self._recent.append(prompt)

    def _fresh(self) -> tuple[int, ...]:
        while True:
            spec = self._rng.choice(self._workloads).next_request()
            if spec is not None:
                return spec.prompt_token_ids

    def _follow_up(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        return prompt + self._new_tokens()

    def _branch(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        cut = round(len(prompt) * self._rng.uniform(*BRANCH_CUT))
        return prompt[:cut] + self._new_tokens()

    def _new_tokens(self) -> tuple[int, ...]:
        count = self._rng.randint(*FOLLOW_UP_TOKENS)
        return tuple(self._rng.randrange(self._vocab_size) for _ in range(count))
