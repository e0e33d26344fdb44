"""Seeded request streams for the reference engine, shaped like the traffic prefix caching is for.

A router's prefix-hit estimate only matters when prompts share prefixes, and how they share them
decides what the cache keeps and evicts. So each workload reproduces one sharing pattern:

- ``chat``: conversations that open with one of a few shared system prompts; every later turn's
  prompt is the previous prompt plus the model's answer plus new user text, so a turn hits the
  whole previous turn if it is still cached;
- ``agentic``: the same shape with a long shared prompt of tool definitions and long tool
  outputs appended step after step;
- ``documents``: many users asking questions about the same few long documents;
- ``random-prefix``: stress: prompts cut from many random prefixes at unaligned lengths plus a
  random tail, so blocks are shared partly, duplicated by concurrent requests, and evicted all the
  time;
- ``burst``: bursts of requests sharing a new long prefix, which only routing that knows where
  the burst's first request went can keep together;
- ``none``: no traffic of its own (requests come only from the engine's HTTP API).

A workload decides what is asked, an ``ArrivalSchedule`` decides when. Both draw from their own
``random.Random(seed)``, so the same seed and the same answers (``finished`` calls, in the same
order) give the same requests. Sizes scale with ``context_tokens``, the longest prompt the engine
wants to see, so one workload fits a small test pool and a large one alike.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MIN_CONTEXT_TOKENS = 64
"""Below this the sharing patterns degenerate (a system prompt shorter than one block)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request a workload wants served: its prompt and how many tokens to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


class Workload(Protocol):
    """A source of requests that may depend on the answers to earlier ones."""

    @property
    def name(self) -> str: ...

    def next_request(self) -> RequestSpec | None:
        """The next request to submit, or None when this workload generates none."""

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """A request of this workload ended with these generated tokens; ``completed`` is False
        when the engine aborted it (its output is then partial)."""


class UnknownWorkload(KeyError):
    """No workload has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class _TokenSource:
    """Random token ids below the vocabulary size, from the workload's own seeded generator."""

    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(
                f"a workload needs a vocabulary of at least 2 tokens, got {vocab_size}"
            )
        self.rng = rng
        self._vocab_size = vocab_size

    def tokens(self, count: int) -> tuple[int, ...]:
        randrange = self.rng.randrange
        return tuple(randrange(self._vocab_size) for _ in range(count))

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(*bounds)


def _workload_source(seed: int, vocab_size: int, context_tokens: int) -> _TokenSource:
    """A workload's token source, seeded with ``seed``, once its context size is checked."""
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(
            f"context_tokens must be at least {MIN_CONTEXT_TOKENS}, got {context_tokens}"
        )
    return _TokenSource(random.Random(seed), vocab_size)


@dataclass
class _Conversation:
    conversation_id: int
    history: tuple[int, ...]
    turns: int
    turns_wanted: int


class ConversationWorkload:
    """Conversations that open with one of a few shared prompts and grow turn by turn.

    Every later turn's prompt is the previous prompt plus the model's answer plus new text, so a
    turn hits the whole previous turn if it is still cached. A conversation waiting for its next
    turn is served before a new one starts, as returning users (or an agent's next step) keep
    such traffic mostly follow-ups. A conversation ends after its drawn number of turns, when the
    next turn would exceed ``context_tokens``, or when a turn was aborted. Subclasses set the
    shape: how long the shared openers, the appended text and the answers are, as fractions of
    ``context_tokens``.
    """

    name = "conversation"
    opener_fraction = (8, 4)
    """An opener is ``context_tokens // a`` to ``context_tokens // b`` tokens long."""
    appended_fraction = 16
    """New text per turn: 4 to ``context_tokens // appended_fraction`` tokens (at least 8)."""
    answer_fraction = 32
    """An answer: 4 to ``context_tokens // answer_fraction`` tokens (at least 8)."""
    num_openers = 4
    max_turns = 6

    def __init__(self, *, seed: int, vocab_size: int, context_tokens: int) -> None:
        self._source = _workload_source(seed, vocab_size, context_tokens)
        self._context_tokens = context_tokens
        longest, shortest = self.opener_fraction
        opener_bounds = (context_tokens // longest, context_tokens // shortest)
        self.system_prompts = tuple(
            self._source.tokens(self._source.between(opener_bounds))
            for _ in range(self.num_openers)
        )
        self._user_bounds = (4, max(8, context_tokens // self.appended_fraction))
        self._output_bounds = (4, max(8, context_tokens // self.answer_fraction))
        self._ready: deque[_Conversation] = deque()
        self._in_flight: dict[str, tuple[_Conversation, tuple[int, ...]]] = {}
        self._conversations = 0

    def next_request(self) -> RequestSpec:
        conversation = self._ready.popleft() if self._ready else self._new_conversation()
        prompt = conversation.history + self._source.tokens(self._source.between(self._user_bounds))
        request_id = f"{self.name}-{conversation.conversation_id}-{conversation.turns}"
        conversation.turns += 1
        self._in_flight[request_id] = (conversation, prompt)
        return RequestSpec(request_id, prompt, self._source.between(self._output_bounds))

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        entry = self._in_flight.pop(request_id, None)
        if entry is None or not completed:
            return
        conversation, prompt = entry
        history = prompt + tuple(output_token_ids)
        longest_next = len(history) + self._user_bounds[1] + self._output_bounds[1]
        if conversation.turns < conversation.turns_wanted and longest_next <= self._context_tokens:
            conversation.history = history
            self._ready.append(conversation)

    def _new_conversation(self) -> _Conversation:
        self._conversations += 1
        rng = self._source.rng
        return _Conversation(
            conversation_id=self._conversations,
            history=rng.choice(self.system_prompts),
            turns=0,
            turns_wanted=rng.randint(1, self.max_turns),
        )


class ChatWorkload(ConversationWorkload):
    """Multi-turn chat: a few shared system prompts, short user turns and answers."""

    name = "chat"


class AgenticWorkload(ConversationWorkload):
    """Agentic loops: a long shared prompt of tool definitions, then step after step appending
    the model's tool call and the tool's (long) output, up to ten steps.

    Each step's prompt is much longer than what it adds, so nearly all of it is a cache hit on
    the engine that served the previous step, and a miss anywhere else.
    """

    name = "agentic"
    opener_fraction = (4, 3)
    appended_fraction = 8
    answer_fraction = 32
    num_openers = 2
    max_turns = 10


class DocumentsWorkload:
    """Many users asking about a few long documents: prompt = document + question.

    Document popularity is skewed (the first is asked about most), as hot documents are in
    practice, so the cache holds the popular ones while the rest come and go.
    """

    name = "documents"

    def __init__(
        self, *, seed: int, vocab_size: int, context_tokens: int, num_documents: int = 3
    ) -> None:
        self._source = _workload_source(seed, vocab_size, context_tokens)
        document_bounds = (context_tokens // 3, context_tokens // 2)
        self.documents = tuple(
            self._source.tokens(self._source.between(document_bounds)) for _ in range(num_documents)
        )
        self._weights = [1.0 / (rank + 1) for rank in range(num_documents)]
        self._question_bounds = (8, max(16, context_tokens // 32))
        self._output_bounds = (4, max(8, context_tokens // 64))
        self._requests = 0

    def next_request(self) -> RequestSpec:
        rng = self._source.rng
        document = rng.choices(self.documents, weights=self._weights)[0]
        question = self._source.tokens(self._source.between(self._question_bounds))
        self._requests += 1
        return RequestSpec(
            f"doc-{self._requests}",
            document + question,
            self._source.between(self._output_bounds),
        )

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """Answers do not feed later questions."""


class RandomPrefixWorkload:
    """Stress: prompts cut at random lengths from many random prefixes, plus a random tail.

    Cuts rarely fall on block boundaries and prefixes outnumber what the cache holds, so every
    kind of partial hit, duplicate copy (two requests computing the same blocks at once) and
    eviction shows up quickly.
    """

    name = "random-prefix"

    def __init__(
        self, *, seed: int, vocab_size: int, context_tokens: int, num_prefixes: int = 32
    ) -> None:
        self._source = _workload_source(seed, vocab_size, context_tokens)
        self.prefixes = tuple(self._source.tokens(context_tokens // 2) for _ in range(num_prefixes))
        self._tail_bounds = (1, context_tokens // 4)
        self._output_bounds = (1, 16)
        self._requests = 0

    def next_request(self) -> RequestSpec:
        rng = self._source.rng
        prefix = rng.choice(self.prefixes)
        cut = prefix[: rng.randint(0, len(prefix))]
        tail = self._source.tokens(self._source.between(self._tail_bounds))
        self._requests += 1
        return RequestSpec(
            f"rand-{self._requests}", cut + tail, self._source.between(self._output_bounds)
        )

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """Answers do not feed later prompts."""


class BurstWorkload:
    """Bursts of requests sharing a new long prefix: ``burst_size`` questions about a document
    no engine has seen, then the next document.

    The first request of a burst can hit nothing; the others hit the whole prefix only if they go
    where the first went, which a router learns from events that may not have arrived yet when
    the burst's requests arrive close together (``ArrivalSchedule(burst_size=...)``).
    """

    name = "burst"

    def __init__(
        self, *, seed: int, vocab_size: int, context_tokens: int, burst_size: int = 8
    ) -> None:
        if burst_size < 1:
            raise ValueError(f"burst_size must be at least 1, got {burst_size}")
        self._source = _workload_source(seed, vocab_size, context_tokens)
        self.burst_size = burst_size
        self._prefix_bounds = (context_tokens // 2, context_tokens * 3 // 4)
        self._question_bounds = (8, max(16, context_tokens // 32))
        self._output_bounds = (4, max(8, context_tokens // 64))
        self._prefix: tuple[int, ...] = ()
        self._requests = 0

    def next_request(self) -> RequestSpec:
        if self._requests % self.burst_size == 0:
            self._prefix = self._source.tokens(self._source.between(self._prefix_bounds))
        question = self._source.tokens(self._source.between(self._question_bounds))
        burst, member = divmod(self._requests, self.burst_size)
        self._requests += 1
        return RequestSpec(
            f"burst-{burst}-{member}",
            self._prefix + question,
            self._source.between(self._output_bounds),
        )

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """Answers do not feed later prompts."""


class NoWorkload:
    """No traffic: an engine that serves only what its HTTP API is sent."""

    name = "none"

    def next_request(self) -> None:
        return None

    def finished(
        self, request_id: str, output_token_ids: Sequence[int], *, completed: bool = True
    ) -> None:
        """Nothing to follow up."""


WORKLOADS = ("chat", "agentic", "documents", "random-prefix", "burst", "none")


def make_workload(name: str, *, seed: int, vocab_size: int, context_tokens: int) -> Workload:
    """The workload called ``name``; the error lists the names there are."""
    if name == "chat":
        return ChatWorkload(seed=seed, vocab_size=vocab_size, context_tokens=context_tokens)
    if name == "agentic":
        return AgenticWorkload(seed=seed, vocab_size=vocab_size, context_tokens=context_tokens)
    if name == "documents":
        return DocumentsWorkload(seed=seed, vocab_size=vocab_size, context_tokens=context_tokens)
    if name == "random-prefix":
        return RandomPrefixWorkload(seed=seed, vocab_size=vocab_size, context_tokens=context_tokens)
    if name == "burst":
        return BurstWorkload(seed=seed, vocab_size=vocab_size, context_tokens=context_tokens)
    if name == "none":
        return NoWorkload()
    raise UnknownWorkload(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")


class ArrivalSchedule:
    """Poisson arrivals at ``rate`` requests per second, for ``duration`` seconds if given.

    With ``burst_size`` above 1, requests come in bursts of that many: bursts start as a Poisson
    process at ``rate / burst_size``, and a burst's requests follow one another at exponential
    gaps of mean ``burst_spacing`` seconds (the shape ``BurstWorkload`` is for).

    Arrival times are drawn ahead from a seeded generator and compared with the caller's clock,
    so the sequence of times is reproducible while the wall clock decides only how many are due.
    """

    def __init__(
        self,
        rate: float,
        *,
        seed: int,
        duration: float | None = None,
        burst_size: int = 1,
        burst_spacing: float = 0.005,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        if burst_size < 1:
            raise ValueError(f"burst_size must be at least 1, got {burst_size}")
        if not burst_spacing > 0:
            raise ValueError(f"burst_spacing must be positive, got {burst_spacing}")
        self._burst_rate = rate / burst_size
        self._burst_size = burst_size
        self._spacing = burst_spacing
        self._rng = random.Random(seed)
        self._duration = duration
        self._burst_start = self._rng.expovariate(self._burst_rate)
        self._in_burst = 0
        self._next = self._burst_start

    @property
    def next_arrival(self) -> float | None:
        """Seconds from the start at which the next request arrives; None once past duration."""
        if self._duration is not None and self._next > self._duration:
            return None
        return self._next

    def due(self, elapsed: float) -> int:
        """How many arrivals happened up to ``elapsed`` seconds that were not yet counted."""
        count = 0
        limit = elapsed if self._duration is None else min(elapsed, self._duration)
        while self._next <= limit:
            count += 1
            self._advance()
        return count

    def _advance(self) -> None:
        self._in_burst += 1
        if self._in_burst < self._burst_size:
            self._next += self._rng.expovariate(1 / self._spacing)
            return
        self._in_burst = 0
        self._burst_start += self._rng.expovariate(self._burst_rate)
        self._next = max(self._next, self._burst_start)
