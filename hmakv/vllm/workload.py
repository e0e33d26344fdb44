"""Seeded prompts for real vLLM: the traffic shapes where prefix caches earn their keep.

Token ids are bytes (0-255), which every model ``hmakv.vllm.models`` builds reads as one token
each. The mix: chats that grow turn by turn, questions over shared long documents, agent loops
that append tool outputs, branches that keep only the start of an earlier prompt (a user editing
an earlier turn), a prompt cut to whole blocks sent twice (vLLM caps a hit one token short of
the prompt, so the retry computes the last block again: a second copy of its hash, and window
groups that store no hash for it), and bursts of requests sharing a new long prefix. With the
small block pools of the profiles, it fills the cache within a few dozen prompts, so vLLM
evicts, and evicts sliding-window blocks while the full-attention ones of the same prefix stay.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from hmakv.vllm.profiles import CPU_BLOCK_SIZE

TOKENS = 256
BLOCK = CPU_BLOCK_SIZE
CHAT, DOCUMENT, AGENT, BRANCH, BURST, REPEAT = (
    "chat",
    "document",
    "agent",
    "branch",
    "burst",
    "repeat",
)
KINDS = (CHAT, DOCUMENT, AGENT, BRANCH, BURST, REPEAT)
WEIGHTS = (0.3, 0.2, 0.2, 0.1, 0.1, 0.1)
SYSTEM_PROMPTS = 3
DOCUMENTS = 4
BURST_LENGTH = 3
RECENT = 32


class VllmPrompts:
    """An endless, reproducible stream of prompts no longer than ``max_tokens``."""

    def __init__(self, seed: int, max_tokens: int = 1000) -> None:
        self._rng = random.Random(seed)
        self._max_tokens = max_tokens
        self._systems = [self._tokens(96, 160) for _ in range(SYSTEM_PROMPTS)]
        self._documents = [self._tokens(380, 700) for _ in range(DOCUMENTS)]
        self._chats: list[tuple[int, ...]] = []
        self._agents: list[tuple[int, ...]] = []
        self._recent: deque[tuple[int, ...]] = deque(maxlen=RECENT)
        self._burst: list[tuple[int, ...]] = []

    def next_prompt(self) -> tuple[int, ...]:
        kind = self._rng.choices(KINDS, WEIGHTS)[0]
        prompt = self._burst.pop() if self._burst else self._make(kind)
        prompt = prompt[: self._max_tokens]
        self._recent.append(prompt)
        return prompt

    def _make(self, kind: str) -> tuple[int, ...]:
        if kind == CHAT:
            return self._grow(self._chats, lambda: self._tokens(20, 80))
        if kind == AGENT:
            return self._grow(self._agents, lambda: self._tokens(60, 200))
        if kind == DOCUMENT:
            return self._rng.choice(self._documents) + self._tokens(10, 40)
        if kind == REPEAT and self._recent:
            earlier = self._rng.choice(self._recent)
            cut = earlier[: max(BLOCK, len(earlier) // BLOCK * BLOCK)]
            self._burst = [cut]  # and its retry, next
            return cut
        if kind == BRANCH and self._recent:
            earlier = self._rng.choice(self._recent)
            return earlier[: round(len(earlier) * self._rng.uniform(0.3, 0.9))] + self._tokens(
                8, 48
            )
        prefix = self._tokens(450, 650)
        self._burst = [prefix + self._tokens(10, 60) for _ in range(BURST_LENGTH - 1)]
        return prefix + self._tokens(10, 60)

    def _grow(
        self, threads: list[tuple[int, ...]], turn: Callable[[], tuple[int, ...]]
    ) -> tuple[int, ...]:
        """The next turn of a random thread; a thread past the context starts over."""
        if not threads or self._rng.random() < 0.25:
            threads.append(self._rng.choice(self._systems) + turn())
            return threads[-1]
        index = self._rng.randrange(len(threads))
        grown = threads[index] + self._tokens(8, 30) + turn()
        if len(grown) > self._max_tokens:
            grown = self._rng.choice(self._systems) + turn()
        threads[index] = grown
        return grown

    def _tokens(self, low: int, high: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(TOKENS) for _ in range(self._rng.randint(low, high)))
