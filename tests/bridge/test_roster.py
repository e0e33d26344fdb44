"""The bound socket's roster: which worker each topic and DP rank name, without a socket.

The roster's owner is played by ``Owner``, whose channels are the workers' names: what a rule
decides is then plain to read (a worker's name, or the reason a message has none).
"""

from __future__ import annotations

import pytest

from hmakv.bridge.config import EngineConfig, WorkerAddress
from hmakv.bridge.frames import RejectReason
from hmakv.bridge.roster import (
    LLMD_TOPICS,
    RETIRE_SILENT_AFTER_S,
    BoundRoster,
    Refusal,
    TopicConvention,
)


class Owner:
    """What the service does for the roster: channels by worker, joins and retirements."""

    def __init__(
        self,
        max_workers: int = 8,
        convention: TopicConvention | None = LLMD_TOPICS,
        join_keys: frozenset[bytes] | None = None,
        joins_per_minute: int = 1000,
    ) -> None:
        self.now = 0.0
        self.channels: dict[str, str] = {}
        self.joined: list[WorkerAddress] = []
        self.retired: list[str] = []
        self.roster = BoundRoster(
            self.channels,
            self.join,
            self.retire,
            max_workers=max_workers,
            convention=convention,
            join_keys=join_keys,
            joins_per_minute=joins_per_minute,
            clock=lambda: self.now,
        )

    def route(self, topic: bytes, rank: int | None, sender: bytes | None = None) -> str:
        """The worker named, or why none is."""
        routed = self.roster.route(topic, rank, sender)
        return routed.detail if isinstance(routed, Refusal) else routed

    def join(self, address: WorkerAddress) -> str:
        self.joined.append(address)
        self.channels[address.worker] = address.worker
        return address.worker

    def retire(self, worker: str) -> None:
        del self.channels[worker]
        self.retired.append(worker)

    def configure(self, engine: EngineConfig) -> None:
        self.roster.add(engine)
        for address in engine.workers():
            self.channels[address.worker] = address.worker


def bound(
    name: str, topic: str, dp_ranks: tuple[int, ...] | None = None, key: bytes | None = None
) -> EngineConfig:
    return EngineConfig(name, None, None, topic=topic, dp_ranks=dp_ranks, public_key=key)


# --- configured engines --------------------------------------------------------------------------


def test_a_configured_topic_names_its_engines_worker_for_each_rank_it_has() -> None:
    owner = Owner()
    owner.configure(bound("a", "kv-a", dp_ranks=(0, 1)))
    owner.configure(bound("b", "kv-b"))
    assert owner.route(b"kv-a", 0) == "a-dp0"
    assert owner.route(b"kv-a", 1) == "a-dp1"
    assert owner.route(b"kv-b", None) == owner.route(b"kv-b", 0) == "b"
    assert owner.route(b"kv-a", 2) == "engine 'a' has no DP rank 2 (see its dp_ranks)"
    assert owner.route(b"kv-b", 1) == "engine 'b' has no DP rank 1 (see its dp_ranks)"
    assert owner.joined == []  # a configured engine's workers are its owner's from the start


def test_a_removed_engines_topic_is_unknown_and_a_namesake_topic_stays() -> None:
    """A connected engine may have a bound one's topic: removing it keeps the bound one known."""
    owner = Owner()
    owner.configure(bound("a", "kv-a"))
    owner.roster.remove(EngineConfig("c", "tcp://h:1", None, topic="kv-a"))
    assert owner.route(b"kv-a", 0) == "a"
    owner.roster.remove(bound("a", "kv-a"))
    assert "no configured engine's" in str(owner.route(b"kv-a", 0))


# --- topics nobody configured --------------------------------------------------------------------


@pytest.mark.parametrize("topic", [b"kv-events", b"", b"kv@pod", b"kv@@m", b"kv@a/b@m"])
def test_a_topic_of_no_engine_and_no_convention_is_refused(topic: bytes) -> None:
    owner = Owner()
    reason = owner.route(topic, 0)
    assert reason == f"topic {topic!r} is no configured engine's and not kv@<pod-id>@<model>"
    assert owner.joined == [] and owner.channels == {}


def test_without_a_convention_only_configured_engines_are_routed() -> None:
    """The default (no --join-by-topic): a made-up llm-d topic joins nobody (issue 16)."""
    owner = Owner(convention=None)
    reason = owner.route(b"kv@intruder@llama", 0)
    assert reason == (
        "topic b'kv@intruder@llama' is no configured engine's (others join only --join-by-topic)"
    )
    assert owner.joined == [] and owner.channels == {}


def test_an_llmd_topic_makes_its_pod_a_worker_per_rank_on_its_first_message() -> None:
    owner = Owner()
    assert owner.route(b"kv@pod-7@meta-llama/Llama-3.1-8B", None) == "pod-7"
    assert owner.route(b"kv@pod-7@meta-llama/Llama-3.1-8B", 1) == "pod-7-dp1"
    assert owner.route(b"kv@pod-7@meta-llama/Llama-3.1-8B", 0) == "pod-7"  # known now
    assert owner.joined == [  # no replay endpoint: llm-d's pods publish only
        WorkerAddress("pod-7", None, None, None),
        WorkerAddress("pod-7-dp1", 1, None, None),
    ]


def test_two_pods_with_one_worker_id_are_not_taken_for_each_other() -> None:
    """Pod "p" at rank 1 and pod "p-dp1" at rank 0 are both worker "p-dp1": the first keeps it."""
    owner = Owner()
    assert owner.route(b"kv@p@m", 1) == "p-dp1"
    assert owner.route(b"kv@p-dp1@m", 0) == "worker 'p-dp1' is pod 'p''s, not pod 'p-dp1''s"
    assert [address.worker for address in owner.joined] == ["p-dp1"]


def test_a_pod_named_as_a_configured_engine_is_refused() -> None:
    owner = Owner()
    owner.configure(bound("pod-x", "kv-x"))
    reason = owner.route(b"kv@pod-x@m", 0)
    assert reason == "worker 'pod-x' is a configured engine with another topic"
    assert owner.joined == []


def test_at_max_workers_a_new_pod_waits_for_one_silent_long_enough() -> None:
    """llm-d replaces pods under new names: the one silent longest gives its place, once silent
    for RETIRE_SILENT_AFTER_S; should it speak again, it joins anew."""
    owner = Owner(max_workers=2)
    owner.route(b"kv@pod-a@m", 0)
    owner.route(b"kv@pod-b@m", 0)
    refused = owner.route(b"kv@pod-c@m", 0)
    assert refused == "more than 2 workers named by topic (--max-workers)"
    owner.now = 10.0
    owner.route(b"kv@pod-a@m", 0)  # pod-a speaks: pod-b is the one silent longest
    owner.now = RETIRE_SILENT_AFTER_S - 1
    assert owner.route(b"kv@pod-c@m", 0) == refused  # pod-b silent, not long enough
    owner.now = RETIRE_SILENT_AFTER_S
    assert owner.route(b"kv@pod-c@m", 0) == "pod-c"
    assert owner.retired == ["pod-b"] and set(owner.channels) == {"pod-a", "pod-c"}
    owner.now += RETIRE_SILENT_AFTER_S
    assert owner.route(b"kv@pod-b@m", 0) == "pod-b"  # back, in pod-a's place
    assert owner.retired == ["pod-b", "pod-a"]
    assert [address.worker for address in owner.joined] == ["pod-a", "pod-b", "pod-c", "pod-b"]


def test_configured_engines_do_not_count_against_max_workers() -> None:
    owner = Owner(max_workers=1)
    owner.configure(bound("a", "kv-a", dp_ranks=(0, 1)))
    assert owner.route(b"kv@pod-a@m", 0) == "pod-a"


def test_another_adapters_convention_names_workers_the_same_way() -> None:
    """The seam for engine adapters: a convention names the engine instance behind a topic."""

    def instance(topic: bytes) -> str | None:
        text = topic.decode()
        return text.removeprefix("sglang-") if text.startswith("sglang-") else None

    owner = Owner(convention=TopicConvention("sglang-<id>", instance))
    assert owner.route(b"sglang-node-3", 2) == "node-3-dp2"
    assert owner.route(b"kv@pod-7@m", 0) == (
        "topic b'kv@pod-7@m' is no configured engine's and not sglang-<id>"
    )


# --- undecodable messages ------------------------------------------------------------------------


def test_only_a_configured_engine_with_one_worker_takes_an_undecodable_message() -> None:
    """An undecodable payload names no DP rank: only a topic with one worker says whose it is,
    and a frame nobody can read must not make a pod join."""
    owner = Owner()
    owner.configure(bound("a", "kv-a"))
    owner.configure(bound("b", "kv-b", dp_ranks=(0, 1)))
    owner.configure(bound("c", "kv-c", dp_ranks=(0,)))
    assert owner.roster.sole_channel(b"kv-a", None) == "a"
    assert owner.roster.sole_channel(b"kv-b", None) is None
    assert owner.roster.sole_channel(b"kv-c", None) == "c-dp0"
    assert owner.roster.sole_channel(b"kv@pod-7@m", None) is None
    assert owner.roster.sole_channel(b"kv-events", None) is None
    assert owner.joined == []


# --- CURVE: the sender's key -------------------------------------------------------------------

KEY_A, KEY_B, KEY_POD, KEY_POD2 = (bytes([65 + i]) * 40 for i in range(4))  # shaped as z85 keys


def test_with_curve_a_configured_topic_is_taken_only_from_its_engines_key() -> None:
    owner = Owner(convention=None, join_keys=frozenset())
    owner.configure(bound("a", "kv-a", key=KEY_A))
    owner.configure(bound("b", "kv-b", key=KEY_B))
    assert owner.route(b"kv-a", 0, KEY_A) == "a"
    refused = owner.roster.route(b"kv-a", 0, KEY_B)  # engine b posing as engine a
    assert isinstance(refused, Refusal) and refused.reason is RejectReason.KEY_MISMATCH
    assert "engine 'a'" in refused.detail and KEY_B.decode() in refused.detail
    assert owner.roster.sole_channel(b"kv-a", KEY_B) is None  # b's garbage cannot clear a
    assert owner.roster.sole_channel(b"kv-a", KEY_A) == "a"
    assert owner.roster.admits(KEY_A) and owner.roster.admits(KEY_B)
    assert not owner.roster.admits(KEY_POD)
    owner.roster.remove(bound("b", "kv-b", key=KEY_B))
    assert not owner.roster.admits(KEY_B)  # a removed engine may no longer connect


def test_with_curve_workers_join_by_topic_only_from_join_keys_and_stay_theirs() -> None:
    owner = Owner(join_keys=frozenset({KEY_POD, KEY_POD2}))
    owner.configure(bound("a", "kv-a", key=KEY_A))
    assert owner.roster.admits(KEY_POD) and owner.roster.admits(KEY_A)
    refused = owner.roster.route(b"kv@pod-1@m", 0, KEY_A)  # an engine's key is no join key
    assert (
        isinstance(refused, Refusal)
        and refused.reason is RejectReason.KEY_MISMATCH
        and owner.joined == []
    )
    assert owner.route(b"kv@pod-1@m", 0, KEY_POD) == "pod-1"
    assert owner.route(b"kv@pod-1@m", 0, KEY_POD) == "pod-1"
    taken = owner.roster.route(b"kv@pod-1@m", 0, KEY_POD2)  # another join key on pod-1's topic
    assert isinstance(taken, Refusal) and taken.reason is RejectReason.KEY_MISMATCH
    assert owner.route(b"kv@pod-2@m", 0, KEY_POD2) == "pod-2"


def test_one_source_joins_at_most_its_rate_and_others_are_not_held_up() -> None:
    owner = Owner(join_keys=frozenset({KEY_POD, KEY_POD2}), joins_per_minute=3)
    assert [owner.route(f"kv@p{i}@m".encode(), 0, KEY_POD) for i in range(3)] == ["p0", "p1", "p2"]
    refused = owner.roster.route(b"kv@p3@m", 0, KEY_POD)
    assert isinstance(refused, Refusal) and refused.reason is RejectReason.JOIN_RATE_EXCEEDED
    assert owner.route(b"kv@q0@m", 0, KEY_POD2) == "q0"  # another source has its own bucket
    assert owner.route(b"kv@p0@m", 0, KEY_POD) == "p0"  # joined workers are not joins
    owner.now += 20.0  # a third of a minute: one more join
    assert owner.route(b"kv@p3@m", 0, KEY_POD) == "p3"
    assert isinstance(owner.roster.route(b"kv@p4@m", 0, KEY_POD), Refusal)


def test_without_curve_the_peer_address_is_the_source_of_a_join() -> None:
    owner = Owner(joins_per_minute=1)
    assert owner.roster.route(b"kv@p0@m", 0, None, b"10.0.0.1") == "p0"
    refused = owner.roster.route(b"kv@p1@m", 0, None, b"10.0.0.1")
    assert isinstance(refused, Refusal) and refused.reason is RejectReason.JOIN_RATE_EXCEEDED
    assert owner.roster.route(b"kv@q0@m", 0, None, b"10.0.0.2") == "q0"
    assert owner.roster.route(b"kv@p0@m", 0, None, b"10.0.0.9") == "p0"  # not a join: no key
