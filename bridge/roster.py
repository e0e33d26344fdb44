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

With CURVE (``join_keys`` given) ZMQ tells each message's sender too, by its client key: a
configured engine's topic is taken only from that engine's key, a worker joins by topic only
from one of ``join_keys`` and is then taken from that key only, and ``admits`` says which keys
may connect at all (the ZAP handler asks it). Without CURVE anyone who reaches the socket may
use any topic, and only the allow-list of topics holds; a message's ``peer`` (its sender's IP
address) then stands for its source in the rate of joins.

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
from hmakv.bridge.frames import RejectReason
from hmakv.kvlog.records import worker_id

log = logging.getLogger(__name__)

# A worker named by topic that has sent nothing for this long may give its place to a new one at
# --max-workers: llm-d replaces pods under new names, and the old ones never publish again.
RETIRE_SILENT_AFTER_S = 300.0
# New workers one source may name by topic per minute (--max-joins-per-minute): a fleet's pods
# come up a few at a time, and a burst past it only waits.
DEFAULT_JOINS_PER_MINUTE = 120

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
    """A worker that joined by topic: its engine instance, when it last sent something, and
    (with CURVE) the key it joined with."""

    instance: str
    last_seen: float  # the roster's clock
    sender: bytes | None


@dataclass(frozen=True)
class Refusal:
    """Why a message has no channel, as the dead letter's reason and detail say it."""

    detail: str
    reason: RejectReason = RejectReason.WORKER_UNKNOWN


class JoinRate:
    """A token bucket per source: at most ``per_minute`` joins a minute, as many at once.

    The source is the sender's CURVE key, or without CURVE its IP address: all it can be known
    by without proof, so pods behind one address share a bucket. Without a bound, one source
    could fill ``--max-workers`` with made-up workers in a moment and keep real new pods out.
    Full buckets are forgotten, so the table holds only sources that joined within the last
    minute.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self._capacity = float(per_minute)
        self._per_second = per_minute / 60.0
        self._clock = clock
        self._buckets: dict[bytes | None, tuple[float, float]] = {}  # tokens, when

    def take(self, source: bytes | None) -> bool:
        """Whether the source may join one more worker now (and count it)."""
        now = self._clock()
        tokens, when = self._buckets.get(source, (self._capacity, now))
        tokens = min(self._capacity, tokens + (now - when) * self._per_second)
        if tokens < 1.0:
            self._buckets[source] = (tokens, now)
            return False
        self._buckets[source] = (tokens - 1.0, now)
        if len(self._buckets) > 1024:
            self._forget_full(now)
        return True

    def _forget_full(self, now: float) -> None:
        refill = self._per_second
        self._buckets = {
            source: (tokens, when)
            for source, (tokens, when) in self._buckets.items()
            if tokens + (now - when) * refill < self._capacity
        }


class BoundRoster(Generic[Channel]):
    """The bound socket's engines and workers; ``route`` names each message's channel.

    Without a ``convention`` only configured engines are followed: anyone who can reach the
    bound socket could otherwise make up a worker and write the index. ``join_keys`` (None:
    no CURVE) are the client keys that may join workers by topic.

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
        join_keys: frozenset[bytes] | None = None,
        joins_per_minute: int = DEFAULT_JOINS_PER_MINUTE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._channels = channels
        self._join = join
        self._retire = retire
        self._max_workers = max_workers
        self._convention = convention
        self._join_keys = join_keys
        self._clock = clock
        self._by_topic: dict[bytes, EngineConfig] = {}
        self._joined: dict[str, _Joined] = {}
        self._admitted = join_keys or frozenset()  # replaced whole: the ZAP thread reads it
        self._joins_per_minute = joins_per_minute
        self._join_rate = JoinRate(joins_per_minute, clock)

    def add(self, engine: EngineConfig) -> None:
        """A configured engine that connects to the bound socket: known by its topic."""
        self._by_topic[engine.topic.encode()] = engine
        self._count_keys()

    def remove(self, engine: EngineConfig) -> None:
        """The engine is followed no more. A connected engine may share a bound one's topic: its
        removal leaves the bound one known."""
        topic = engine.topic.encode()
        known = self._by_topic.get(topic)
        if known is not None and known.name == engine.name:
            del self._by_topic[topic]
            self._count_keys()

    @property
    def joins_by_topic(self) -> bool:
        """Whether a topic no configured engine has may name a worker (``--join-by-topic``)."""
        return self._convention is not None

    def admits(self, key: bytes) -> bool:
        """Whether a client with this CURVE key (z85) may connect: a configured engine's, or one
        that may join by topic. Safe to call from the ZAP handler's thread."""
        return key in self._admitted

    def _count_keys(self) -> None:
        keys = (engine.public_key for engine in self._by_topic.values())
        configured = frozenset(key for key in keys if key is not None)
        self._admitted = configured.union(self._join_keys or ())

    def route(
        self, topic: bytes, rank: int | None, sender: bytes | None, peer: bytes | None = None
    ) -> Channel | Refusal:
        """The channel of a message on the bound socket, or why it has none; ``sender`` is its
        client key (None without CURVE), ``peer`` its IP address (the source of a join without
        CURVE)."""
        engine = self._by_topic.get(topic)
        if engine is not None:
            if self._join_keys is not None and sender != engine.public_key:
                return self._wrong_key(f"engine {engine.name!r}", topic, sender)
            return self._configured(engine, rank)
        if self._convention is None:
            detail = f"topic {topic!r} is no configured engine's (others join only --join-by-topic)"
            return Refusal(detail)
        instance = self._convention.instance(topic)
        if instance is None:
            pattern = self._convention.pattern
            return Refusal(f"topic {topic!r} is no configured engine's and not {pattern}")
        return self._named(instance, rank, topic, sender, peer)

    def sole_channel(self, topic: bytes, sender: bytes | None) -> Channel | None:
        """The channel of a configured engine with one worker, if the topic (and, with CURVE,
        the sender) is its. A message that does not decode names no DP rank; an instance's topic
        may stand for several ranks, and a frame nobody can read must not make a worker join."""
        engine = self._by_topic.get(topic)
        if engine is None or (self._join_keys is not None and sender != engine.public_key):
            return None
        workers = engine.workers()
        return self._channels.get(workers[0].worker) if len(workers) == 1 else None

    @staticmethod
    def _wrong_key(owner: str, topic: bytes, sender: bytes | None) -> Refusal:
        key = (sender or b"").decode("ascii", "replace")
        detail = f"topic {topic!r} is {owner}'s, sent by another key ({key})"
        return Refusal(detail, RejectReason.KEY_MISMATCH)

    def _configured(self, engine: EngineConfig, rank: int | None) -> Channel | Refusal:
        address = engine.worker_for_rank(rank)
        if address is None:
            return Refusal(f"engine {engine.name!r} has no DP rank {rank} (see its dp_ranks)")
        return self._channels[address.worker]

    def _named(
        self,
        instance: str,
        rank: int | None,
        topic: bytes,
        sender: bytes | None,
        peer: bytes | None,
    ) -> Channel | Refusal:
        """The channel of an instance's worker, joining it if it is new and there is room."""
        worker = instance if rank in (None, 0) else worker_id(instance, rank)
        channel = self._channels.get(worker)
        joined = self._joined.get(worker)
        if channel is not None and joined is not None:
            if joined.instance != instance:  # pod "p" at rank 1 and pod "p-dp1" are both "p-dp1"
                detail = f"worker {worker!r} is pod {joined.instance!r}'s, not pod {instance!r}'s"
                return Refusal(detail)
            if joined.sender != sender:
                return self._wrong_key(f"worker {worker!r}", topic, sender)
            joined.last_seen = self._clock()
            return channel
        if channel is not None:
            return Refusal(f"worker {worker!r} is a configured engine with another topic")
        if self._join_keys is not None and sender not in self._join_keys:
            return self._wrong_key("no configured engine", topic, sender)
        source = sender if sender is not None else peer
        if not self._join_rate.take(source):  # first: a join refused here retires no one
            detail = f"more than {self._joins_per_minute} new workers a minute from one source"
            return Refusal(detail, RejectReason.JOIN_RATE_EXCEEDED)
        if len(self._joined) >= self._max_workers and not self._retire_silent():
            return Refusal(f"more than {self._max_workers} workers named by topic (--max-workers)")
        self._joined[worker] = _Joined(instance, self._clock(), sender)
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
