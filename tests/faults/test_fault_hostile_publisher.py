"""Scenario 8: a hostile publisher on the bridge's ``--bind-sub`` socket, beside real engines
that connect to it (vLLM's topology when its endpoint names a host).

Without CURVE, anyone who reaches the socket can send: a topic no engine is configured with is
refused (``worker_unknown``), malformed frames on a configured engine's topic too, each counted
by reason and dead-lettered raw; the index follows the real engines regardless. With CURVE
(``--curve-secret-key``, engines with key pairs), a key the bridge does not know fails the
handshake, and an admitted engine posing as another is refused as ``key_mismatch``: its batch
never reaches the index.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from fault_kit import BRIDGE, ENGINES, EngineSetup, Pipeline, pipeline

from hmakv.demo.processes import hmakv_command
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.kvlog.records import DeadLetter, decode_dead_letter
from hmakv.producer.curve import connect_to, load_key_pair, load_public_key
from hmakv.producer.events import BlockStored, KVEventBatch, encode
from hmakv.producer.hashing import BlockHasher, external
from hmakv.producer.protocol import encode_seq, live_frames

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

BLOCK_SIZE = 16
INTRUDER_TOPIC = b"kv-intruder"


def topic(name: str) -> str:
    return f"kv-{name}"


def bound(endpoint: str, *args: str, keys: Path | None = None) -> tuple[EngineSetup, ...]:
    """The engines, connecting to the bridge's bound socket, each on a topic of its own."""
    return tuple(
        dataclasses.replace(
            engine,
            topic=topic(engine.name),
            connect_to=endpoint,
            args=(*engine.args, *args, *curve_args(engine.name, keys)),
            public_key=None if keys is None else keys / f"{engine.name}.key",
        )
        for engine in ENGINES
    )


def curve_args(name: str, keys: Path | None) -> tuple[str, ...]:
    if keys is None:
        return ()
    bridge_key = str(keys / "bridge.key")
    return (
        "--curve-secret-key", str(keys / f"{name}.key_secret"),
        "--curve-server-key", bridge_key,
        "--curve-clients", bridge_key,
    )  # fmt: skip


def generate_keys(directory: Path, *names: str) -> None:
    for name in names:
        command = [*hmakv_command(), "keys", "generate", name, "--dir", str(directory)]
        subprocess.run(command, check=True, capture_output=True, timeout=60)


def claimed_store(prompt: tuple[int, ...]) -> bytes:
    """A valid batch saying its sender holds ``prompt`` in full attention: what a router would
    then send there."""
    hashes = BlockHasher().block_hashes(prompt, BLOCK_SIZE)
    store = BlockStored(
        [external(h) for h in hashes],
        None,
        list(prompt[: len(hashes) * BLOCK_SIZE]),
        BLOCK_SIZE,
        None,
        "GPU",
        None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    return encode(KVEventBatch(time.time(), [store], 0))


@contextmanager
def hostile_publisher(endpoint: str, keys: Path | None = None) -> Iterator[zmq.Socket[bytes]]:
    """A PUB socket of the test's own on the bridge's bound socket; with ``keys`` (a secret key
    file, and the bridge's public key beside it) a CURVE client."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    try:
        if keys is not None:
            server_key = load_public_key(str(keys.parent / "bridge.key"))
            connect_to(pub, load_key_pair(keys), server_key)
        pub.connect(endpoint)
        yield pub
    finally:
        context.destroy(linger=0)


async def rejected(fleet: Pipeline) -> dict[str, float]:
    page = await fleet.bridge_metrics()
    return page.by_label(f"{BRIDGE}_frames_rejected_total", "reason")


async def send_until_rejected(
    fleet: Pipeline, pub: zmq.Socket[bytes], frames: list[bytes], reason: str
) -> None:
    """Send ``frames`` until the bridge has rejected them once for ``reason``: a PUB socket
    drops what it sends before its connection is made."""
    before = (await rejected(fleet)).get(reason, 0)

    async def counted() -> bool:
        if (await rejected(fleet)).get(reason, 0) > before:
            return True
        pub.send_multipart(frames)
        return False

    await fleet.until(counted, f"the bridge rejected a message as {reason}")


async def dead_letters(fleet: Pipeline) -> list[DeadLetter]:
    return [decode_dead_letter(v) for v in await fleet.read_topic(fleet.topics.deadletter)]


def reasons(letters: list[DeadLetter]) -> Counter[str]:
    return Counter(letter.reason for letter in letters)


async def test_a_hostile_publisher_on_the_bound_socket_is_refused_counted_and_dead_lettered(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    endpoint = f"tcp://{LOOPBACK}:{free_port()}"
    async with pipeline(
        tmp_path, kafka_bootstrap, bound(endpoint), bridge_args=("--bind-sub", endpoint)
    ) as fleet:
        await fleet.serve(20)
        await fleet.settle()
        victim = topic("engine-a").encode()
        seq = await fleet.seq("engine-a")
        claimed = tuple(fleet.rng.randrange(1, 500) for _ in range(4 * BLOCK_SIZE))
        sent = {
            "worker_unknown": live_frames(INTRUDER_TOPIC, 1, claimed_store(claimed)),
            "payload_undecodable": live_frames(victim, seq + 1, b"\xc1 not msgpack"),
            "frame_count": [victim, encode_seq(seq)],
            "seq_size": [victim, b"\x00\x01", claimed_store(claimed)],
        }
        with hostile_publisher(endpoint) as pub:
            for reason, frames in sent.items():
                await send_until_rejected(fleet, pub, frames, reason)
        await fleet.serve(20)
        await fleet.settle()
        agreement = await fleet.assert_agreement([claimed])
        counts = await rejected(fleet)
        letters = await dead_letters(fleet)
        views = await fleet.workers()
        page = await fleet.bridge_metrics()
    assert set(views) == {"engine-a", "engine-b"}, "the intruder's topic made no worker"
    assert agreement.by_prompt[claimed]["engine-a"].hma == 0, "nobody holds the claimed prompt"
    for reason, frames in sent.items():
        assert counts[reason] >= 1
        assert reasons(letters)[reason] == counts[reason], f"every {reason} message kept"
        kept = [letter.frames for letter in letters if letter.reason == reason]
        assert all(each == frames for each in kept), f"{reason}: dead-lettered raw"
    # Garbage at the victim's next seq is a loss for the victim alone (the real batch at that
    # seq then looks like a restart: a new epoch, rebuilt from the ring): never a wrong answer.
    unrecoverable = page.by_label(f"{BRIDGE}_gaps_unrecoverable_total", "worker")
    assert unrecoverable == {"engine-a": 1, "engine-b": 0}
    assert (views["engine-b"].epoch, views["engine-a"].health) == (0, "live")


async def test_with_curve_an_engine_posing_as_another_is_refused_as_key_mismatch(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, "bridge", "engine-a", "engine-b", "stranger")
    endpoint = f"tcp://{LOOPBACK}:{free_port()}"
    bridge_args = ("--bind-sub", endpoint, "--curve-secret-key", str(keys / "bridge.key_secret"))
    engines = bound(endpoint, keys=keys)
    async with pipeline(tmp_path, kafka_bootstrap, engines, bridge_args=bridge_args) as fleet:
        await fleet.serve(20)
        await fleet.settle()
        seq = await fleet.seq("engine-a")
        claimed = tuple(fleet.rng.randrange(1, 500) for _ in range(4 * BLOCK_SIZE))
        posing = live_frames(topic("engine-a").encode(), seq + 1, claimed_store(claimed))
        with hostile_publisher(endpoint, keys / "engine-b.key_secret") as pub:
            await send_until_rejected(fleet, pub, posing, "key_mismatch")
        with hostile_publisher(endpoint, keys / "stranger.key_secret") as pub:

            async def refused() -> bool:
                page = await fleet.bridge_metrics()
                if page.total(f"{BRIDGE}_curve_handshakes_refused_total") >= 1:
                    return True
                pub.send_multipart(live_frames(topic("engine-b").encode(), 1, b""))
                return False

            await fleet.until(refused, "the stranger's handshake refused")
        await fleet.serve(20)
        await fleet.settle()
        agreement = await fleet.assert_agreement([claimed])
        counts = await rejected(fleet)
        letters = await dead_letters(fleet)
        page = await fleet.bridge_metrics()
        views = await fleet.workers()
    claim = agreement.by_prompt[claimed]["engine-a"]
    assert claim.hma == claim.actual == 0, "the posing engine's claim is not in the index"
    assert counts["key_mismatch"] >= 1
    assert reasons(letters) == Counter({"key_mismatch": counts["key_mismatch"]})
    assert all(letter.frames[-3:] == posing for letter in letters), "dead-lettered raw"
    assert page.total(f"{BRIDGE}_gaps_unrecoverable_total") == 0, "no loss for the victim"
    assert page.total(f"{BRIDGE}_epochs_started_total") == 0
    assert {(v.epoch, v.health) for v in views.values()} == {(0, "live")}
