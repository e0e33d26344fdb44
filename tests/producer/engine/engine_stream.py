"""Test helpers: follow a running engine the way a consumer does, over real ZMQ on loopback.

A SUB socket binds and the engine's PUB connects to it (vLLM connects to host addresses), so the
test owns the port before the engine starts. Live delivery can miss the first batches (a PUB
sends nothing to a subscription that has not arrived yet), so ``complete`` fills gaps from the
replay endpoint, as the bridge does.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

import zmq

from hmakv.producer.events import ExternalBlockHash, KVEvent, KVEventBatch, decode
from hmakv.producer.protocol import END_SEQ_FRAME, SNAPSHOT_REQUEST, decode_seq, replay_request

WAIT_S = 20.0  # bound on every wait; tests never sleep for a fixed time


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


class Subscriber:
    """Every batch received live from one engine, by seq, payloads kept for wire checks."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int, topic: str = "") -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.payloads: dict[int, bytes] = {}
        self.topics: set[bytes] = set()

    def receive_until(self, condition: Callable[[Subscriber], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition(self):
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            if self.socket.poll(50):
                topic, seq, payload = self.socket.recv_multipart()
                self.topics.add(topic)
                self.payloads[decode_seq(seq)] = payload

    @property
    def last_seq(self) -> int:
        return max(self.payloads, default=-1)


def _dealer_request(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int
) -> list[tuple[int, bytes]]:
    """One replay-protocol request; the (seq, payload) pairs before the end marker."""
    with ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request(start_seq))
        replies: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "no reply from the replay endpoint"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ_FRAME:
                return replies
            replies.append((decode_seq(seq), payload))


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int = 0
) -> dict[int, bytes]:
    return dict(_dealer_request(ctx, endpoint, start_seq))


def snapshot(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> tuple[int, list[KVEvent]]:
    """The engine's resident blocks as of seq S, from a snapshot request: (S, events)."""
    replies = _dealer_request(ctx, endpoint, SNAPSHOT_REQUEST)
    assert replies, "the engine offered no snapshot"
    assert len({seq for seq, _ in replies}) == 1, "a snapshot carries one seq"
    events = [event for _, payload in replies for event in decode(payload).batch.events]
    return replies[0][0], events


def batches_up_to(payloads: dict[int, bytes], last: int) -> list[KVEventBatch]:
    """Batches 0..last in order; fails on a gap, since a consumer could not trust its state."""
    missing = [seq for seq in range(last + 1) if seq not in payloads]
    assert not missing, f"seqs {missing[:10]} were neither received nor replayed"
    return [decode(payloads[seq]).batch for seq in range(last + 1)]


def events_of(batches: Iterable[KVEventBatch]) -> list[KVEvent]:
    return [event for batch in batches for event in batch.events]


def counts(
    index_counts: list[Counter[ExternalBlockHash]],
) -> list[dict[ExternalBlockHash, int]]:
    """Comparable per-group counts (no zero entries)."""
    return [{h: n for h, n in group.items() if n > 0} for group in index_counts]
