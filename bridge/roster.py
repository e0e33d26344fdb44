"""Who sent each message on the bound socket: the seam for engine adapters.

Engines that connect to ``--bind-sub`` share one SUB socket, so a message's topic (and the DP
rank in its payload) is all that tells them apart. A ``BoundRoster`` knows the configured
engines by their topic, exactly; any other topic is refused, unless the operator opted in
(``--join-by-topic``) and it is put to a ``TopicConvention``, an engine
adapter's rule naming the engine instance behind a topic (llm-d's ``kv@<pod-id>@<model>``
today, ``LLMD_TOPICS``; another publisher's tomorrow). Such an instance's workers are named as a
configured engine's (``<instance>``, ``<instance>-dp<rank>`` above rank 0) and join on their
first message, up to ``max_workers``: at the limit, the one silent longest gives its place if it
has been silent for ``RETIRE_SILENT_AFTER_S`` (llm-d replaces pods under new names, and the old
ones never publish again).

The roster decides and its owner acts: it is given the channels by worker and two hooks, one
that makes a joining worker's channel and one that retires a worker, so its rules hold for any
channel type and are tested without a socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from hmakv.bridge.config import EngineConfig, WorkerAddress
from hmakv.kvlog.records import worker_id

log = logging.getLogger(__name__)

# A worker named by topic that has sent nothing for this long may give its place to a new one at
# --max-workers: llm-d replaces pods under new names, and the old ones never publish again.
RETIRE_SILENT_AFTER_S = 300.0

Channel = TypeVar("Channel")


@dataclass(frozen=True)
class TopicConvention:
    """An engine adapter's rule for the topics no configured engine has: ``instance`` names the
    engine instance a topic stands for (None: the topic is not one of the rule's), ``pattern``
    says the rule to whoever reads a dead letter's reason."""

    pattern: str
    instance: Callable[[bytes], str | None]


_LLMD_PREFIX = "kv@"


def llmd_pod(topic: bytes) -> str | None:
    """The pod id of an llm-d style topic ``kv@<pod-id>@<model>``, or None if it is not one."""
    text = topic.decode("utf-8", "replace")
    if not text.startswith(_LLMD_PREFIX):
        return None
    pod, sep, model = text[len(_LLMD_PREFIX) :].partition("@")
    if not sep or not pod or not model or "/" in pod:
        return None
    return pod


LLMD_TOPICS = TopicConvention("kv@<pod-id>@<model>", llmd_pod)


@dataclass
class _Joined:
    """A worker that joined by topic: its engine instance, and when it last sent something."""

    instance: str
    last_seen: float  # the roster's clock


class BoundRoster(Generic[Channel]):
    """The bound socket's engines and workers; ``route`` names each message's channel.

    Without a ``convention`` only configured engines are followed: anyone who can reach the
    bound socket could otherwise make up a worker and write the index.

    ``channels`` is the owner's map of every worker's channel (configured engines' included, so
    that a topic-named worker never takes a configured one's id); ``join`` makes, registers and
    starts the channel of a worker joining by topic; ``retire`` closes and retires a worker
    that joined by topic, and removes it from ``channels``.
    """

    def __init__(
        self,
        channels: Mapping[str, Channel],
        join: Callable[[WorkerAddress], Channel],
        retire: Callable[[str], None],
        *,
        max_workers: int,
        convention: TopicConvention | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._channels = channels
        self._join = join
        self._retire = retire
        self._max_workers = max_workers
        self._convention = convention
        self._clock = clock
        self._by_topic: dict[bytes, EngineConfig] = {}
        self._joined: dict[str, _Joined] = {}

    def add(self, engine: EngineConfig) -> None:
        """A configured engine that connects to the bound socket: known by its topic."""
        self._by_topic[engine.topic.encode()] = engine

    def remove(self, engine: EngineConfig) -> None:
        """The engine is followed no more. A connected engine may share a bound one's topic: its
        removal leaves the bound one known."""
        topic = engine.topic.encode()
        known = self._by_topic.get(topic)
        if known is not None and known.name == engine.name:
            del self._by_topic[topic]

    def route(self, topic: bytes, rank: int | None) -> Channel | str:
        """The channel of a message on the bound socket, or why it has none."""
        engine = self._by_topic.get(topic)
        if engine is not None:
            return self._configured(engine, rank)
        if self._convention is None:
            return f"topic {topic!r} is no configured engine's (others join only --join-by-topic)"
        instance = self._convention.instance(topic)
        if instance is None:
            pattern = self._convention.pattern
            return f"topic {topic!r} is no configured engine's and not {pattern}"
        return self._named(instance, rank, topic)

    def sole_channel(self, topic: bytes) -> Channel | None:
        """The channel of a configured engine with one worker, if the topic is its. A message
        that does not decode names no DP rank; an instance's topic may stand for several ranks,
        and a frame nobody can read must not make a worker join."""
        engine = self._by_topic.get(topic)
        if engine is None:
            return None
        workers = engine.workers()
        return self._channels.get(workers[0].worker) if len(workers) == 1 else None

    def _configured(self, engine: EngineConfig, rank: int | None) -> Channel | str:
        address = engine.worker_for_rank(rank)
        if address is None:
            return f"engine {engine.name!r} has no DP rank {rank} (see its dp_ranks)"
        return self._channels[address.worker]

    def _named(self, instance: str, rank: int | None, topic: bytes) -> Channel | str:
        """The channel of an instance's worker, joining it if it is new and there is room."""
        worker = instance if rank in (None, 0) else worker_id(instance, rank)
        channel = self._channels.get(worker)
        joined = self._joined.get(worker)
        if channel is not None and joined is not None:
            if joined.instance != instance:  # pod "p" at rank 1 and pod "p-dp1" are both "p-dp1"
                return f"worker {worker!r} is pod {joined.instance!r}'s, not pod {instance!r}'s"
            joined.last_seen = self._clock()
            return channel
        if channel is not None:
            return f"worker {worker!r} is a configured engine with another topic"
        if len(self._joined) >= self._max_workers and not self._retire_silent():
            return f"more than {self._max_workers} workers named by topic (--max-workers)"
        self._joined[worker] = _Joined(instance, self._clock())
        channel = self._join(WorkerAddress(worker, rank, None, None))
        log.info("worker %r joined through topic %r", worker, topic)
        return channel

    def _retire_silent(self) -> bool:
        """Retire the worker named by topic silent longest, if for ``RETIRE_SILENT_AFTER_S``;
        whether one was. Nothing says the pod is gone, but nothing follows it from now on, so
        consumers must not serve its cache; should it speak again, it comes back as a new life.
        """
        silent = min(self._joined, key=lambda worker: self._joined[worker].last_seen)
        idle = self._clock() - self._joined[silent].last_seen
        if idle < RETIRE_SILENT_AFTER_S:
            return False
        del self._joined[silent]
        self._retire(silent)
        log.info("worker %r retired after %.0f s without a message (--max-workers)", silent, idle)
        return True
