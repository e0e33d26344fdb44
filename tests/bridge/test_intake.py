"""The intake against real ZMQ PUB/SUB pairs: everything arrives, in order, batched per round."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import zmq

from hmakv.bridge.intake import Intake

WAIT_S = 10.0


class Gate:
    """Stands in for the Kafka queue's room: intake may receive while it is open."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()

    async def wait(self) -> None:
        await self.open.wait()


@contextlib.contextmanager
def pub_sub_pairs(count: int) -> Iterator[list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]]:
    """Pairs over ``inproc://``: a message sent is in its SUB socket when ``send`` returns, so
    a test can queue a backlog before the intake starts without waiting on a network."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pairs = []
    try:
        for index in range(count):
            pub = ctx.socket(zmq.PUB)
            pub.bind(f"inproc://intake-test-{index}")
            sub = ctx.socket(zmq.SUB)
            sub.connect(f"inproc://intake-test-{index}")
            sub.subscribe(b"")
            pairs.append((pub, sub))
        yield pairs
    finally:
        ctx.destroy(linger=0)


async def subscribed(pairs: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]) -> None:
    """Until every subscription reached its PUB (probes are sent until one arrives), and every
    probe is read: a last one marks the end."""
    for pub, sub in pairs:
        async with asyncio.timeout(WAIT_S):
            while not sub.poll(0):
                pub.send_multipart([b"probe"])
                await asyncio.sleep(0.01)
        pub.send_multipart([b"probes end"])
        while sub.recv_multipart() != [b"probes end"]:
            pass


@contextlib.asynccontextmanager
async def running(intake: Intake) -> AsyncIterator[None]:
    task = asyncio.create_task(intake.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(condition: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"never got {what}") from None


async def test_every_socket_delivers_everything_in_order_several_messages_a_round() -> None:
    gate = Gate()
    intake = Intake(gate.wait, tick=0.005)
    received: dict[int, list[bytes]] = defaultdict(list)
    rounds: list[int] = []
    with pub_sub_pairs(4) as pairs:
        await subscribed(pairs)
        for index, (_, sub) in enumerate(pairs):

            def handler(messages: list[list[bytes]], index: int = index) -> None:
                rounds.append(len(messages))
                received[index].extend(frames[1] for frames in messages)

            intake.add(sub, handler)
        async with running(intake):
            for n in range(200):
                for index, (pub, _) in enumerate(pairs):
                    pub.send_multipart([b"t", f"{index}:{n}".encode()])
                if n % 50 == 49:
                    await asyncio.sleep(0.02)  # bursts, as engines flush
            await until(lambda: sum(map(len, received.values())) == 800, "every message")
    for index in range(4):
        assert received[index] == [f"{index}:{n}".encode() for n in range(200)]
    assert max(rounds) > 1, "every round took one message: nothing was batched"


class Clock:
    """The intake's clock, moved by the test: how long the intake was idle is what it says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_sparse_traffic_is_taken_as_it_arrives_and_flowing_traffic_waits_a_tick() -> None:
    """A message more than a tick after the intake went idle is taken at once, and the intake
    goes idle again; one within a tick means traffic flows: its round is followed by a tick's
    sleep (30 s here, so that a message sent during it visibly waits)."""
    clock = Clock()
    intake = Intake(Gate().wait, tick=30.0, clock=clock)
    received: list[bytes] = []
    with pub_sub_pairs(1) as pairs:
        await subscribed(pairs)
        pub, sub = pairs[0]
        intake.add(sub, lambda messages: received.extend(m[1] for m in messages))
        async with running(intake):
            for n in range(3):  # each a minute after the intake went idle: no tick between
                clock.now += 60.0
                pub.send_multipart([b"t", str(n).encode()])
                await until(lambda n=n: len(received) == n + 1, f"sparse message {n}")
                await asyncio.sleep(0.01)  # the intake goes idle
            pub.send_multipart([b"t", b"flowing"])  # 0 s after it went idle: traffic flows
            await until(lambda: received[-1] == b"flowing", "the flowing message")
            pub.send_multipart([b"t", b"next"])
            # Not a timing assertion: the intake sleeps its 30 s tick before the next round.
            await asyncio.sleep(0.1)
            assert received == [b"0", b"1", b"2", b"flowing"]


async def test_nothing_is_received_while_the_queue_is_full_and_everything_after() -> None:
    gate = Gate()
    intake = Intake(gate.wait, tick=0.001)
    received: list[bytes] = []
    with pub_sub_pairs(1) as pairs:
        await subscribed(pairs)
        pub, sub = pairs[0]
        intake.add(sub, lambda messages: received.extend(m[1] for m in messages))
        async with running(intake):
            pub.send_multipart([b"t", b"first"])
            await until(lambda: received == [b"first"], "the first message")
            gate.open.clear()
            for n in range(100):
                pub.send_multipart([b"t", str(n).encode()])
            # Not a timing assertion: nothing may arrive while the gate is shut, however long.
            await asyncio.sleep(0.1)
            assert received == [b"first"]
            gate.open.set()
            await until(lambda: len(received) == 101, "the held messages")
    assert received[1:] == [str(n).encode() for n in range(100)]


async def test_a_removed_socket_is_no_longer_read() -> None:
    gate = Gate()
    intake = Intake(gate.wait, tick=0.001)
    received: dict[str, list[bytes]] = defaultdict(list)
    with pub_sub_pairs(2) as pairs:
        await subscribed(pairs)
        (pub_a, sub_a), (pub_b, sub_b) = pairs
        intake.add(sub_a, lambda messages: received["a"].extend(m[1] for m in messages))
        intake.add(sub_b, lambda messages: received["b"].extend(m[1] for m in messages))
        async with running(intake):
            pub_a.send_multipart([b"t", b"1"])
            await until(lambda: received["a"] == [b"1"], "a's first message")
            intake.remove(sub_a)
            pub_a.send_multipart([b"t", b"2"])
            pub_b.send_multipart([b"t", b"1"])
            await until(lambda: received["b"] == [b"1"], "b's message")
            await asyncio.sleep(0.05)
        assert sub_a.poll(1000) and sub_a.recv_multipart() == [b"t", b"2"]  # left in the socket
    assert received["a"] == [b"1"]


@pytest.mark.parametrize("limit", [1, 7])
async def test_a_socket_with_more_than_a_round_holds_gets_the_rest_next_rounds(limit: int) -> None:
    gate = Gate()
    intake = Intake(gate.wait, tick=0.001, round_limit=limit)
    rounds: list[int] = []
    with pub_sub_pairs(1) as pairs:
        await subscribed(pairs)
        pub, sub = pairs[0]
        for n in range(50):
            pub.send_multipart([b"t", str(n).encode()])
        intake.add(sub, lambda messages: rounds.append(len(messages)))
        async with running(intake):
            await until(lambda: sum(rounds) == 50, "every message")
    assert max(rounds) == limit


async def test_a_round_over_many_sockets_stops_at_its_message_budget() -> None:
    """However many sockets hold a backlog, a round hands over about ``round_messages`` (whole
    passes of one message per ready socket), then lets the event loop run; nothing is lost."""
    rounds = 0

    async def next_round() -> None:  # the intake asks for room before every round
        nonlocal rounds
        rounds += 1

    intake = Intake(next_round, tick=0.001, round_limit=64, round_messages=20)
    taken: dict[int, int] = defaultdict(int)  # round -> messages handed over in it
    received: dict[int, list[bytes]] = defaultdict(list)
    with pub_sub_pairs(8) as pairs:
        await subscribed(pairs)
        for index, (pub, sub) in enumerate(pairs):
            for n in range(50):
                pub.send_multipart([b"t", f"{index}:{n}".encode()])

            def handler(messages: list[list[bytes]], index: int = index) -> None:
                taken[rounds] += len(messages)
                received[index].extend(frames[1] for frames in messages)

            intake.add(sub, handler)
        async with running(intake):
            await until(lambda: sum(taken.values()) == 400, "every message")
    assert max(taken.values()) == 24  # three passes over 8 sockets reach 20
    for index in range(8):
        assert received[index] == [f"{index}:{n}".encode() for n in range(50)]


async def test_a_failing_handler_costs_its_own_messages_only() -> None:
    """A bug in one source's handling is logged; every socket keeps being read. (The tracker
    then sees the dropped seqs as a gap and replays them.)"""
    gate = Gate()
    intake = Intake(gate.wait, tick=0.001)
    received: dict[str, list[bytes]] = defaultdict(list)

    def fragile(messages: list[list[bytes]]) -> None:
        if any(m[1] == b"boom" for m in messages):
            raise RuntimeError("a bug")
        received["a"].extend(m[1] for m in messages)

    with pub_sub_pairs(2) as pairs:
        await subscribed(pairs)
        (pub_a, sub_a), (pub_b, sub_b) = pairs
        intake.add(sub_a, fragile)
        intake.add(sub_b, lambda messages: received["b"].extend(m[1] for m in messages))
        async with running(intake):
            pub_a.send_multipart([b"t", b"boom"])
            pub_b.send_multipart([b"t", b"1"])
            await until(lambda: received["b"] == [b"1"], "b's first message")
            pub_a.send_multipart([b"t", b"after"])
            pub_b.send_multipart([b"t", b"2"])
            await until(lambda: received["a"] == [b"after"], "a's message after the failure")
            await until(lambda: received["b"] == [b"1", b"2"], "b's second message")
