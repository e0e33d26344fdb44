"""The ZMQ publisher over real sockets on loopback: vLLM's PUB + ROUTER protocol and hmakv's
additions (leading clear, drops as gaps, non-blocking replies, snapshots, draining shutdown)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq

from hmakv.kafka.process import free_port
from hmakv.producer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from hmakv.producer.protocol import END_SEQ_FRAME, SNAPSHOT_REQUEST, decode_seq, replay_request
from hmakv.producer.publisher import ZmqEventPublisher

WAIT_MS = 5000  # bound on every wait for a message; tests never sleep for a fixed time
TOPIC = "kv-events"


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def removal(block_hash: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved([block_hash], "GPU")])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def endpoints() -> tuple[str, str]:
    """A PUB endpoint that binds (vLLM's wildcard form) and a replay endpoint on loopback."""
    return f"tcp://*:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.subscribe(TOPIC.encode())
    return sub


def replay_client(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    return dealer


def local(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(WAIT_MS), "no message within the wait bound"
    return sock.recv_multipart()


def receive_live(sub: zmq.Socket[bytes]) -> tuple[int, KVEventBatch]:
    topic, seq, payload = receive(sub)
    assert topic == TOPIC.encode()
    return decode_seq(seq), decode(payload)


def probe() -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[])


def queue_is_empty(publisher: ZmqEventPublisher) -> bool:
    stats = publisher.stats()
    return stats.sent + stats.dropped_queue_full == stats.published


def join_live_stream(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish empty probe batches until the subscription has propagated, then consume every
    probe; returns the last seq assigned, with the publisher idle and its counters settled, so
    the batches published next arrive in full."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while not sub.poll(10):
        assert time.monotonic() < deadline, "subscription never propagated"
        publisher.publish(probe())
    wait_until(lambda: queue_is_empty(publisher), "the probes are sent")
    publisher.publish(probe())  # the queue is empty, so this one cannot be dropped
    last = publisher.stats().published - 1
    while receive_live(sub)[0] != last:
        pass
    wait_until(lambda: queue_is_empty(publisher), "the last probe is counted")
    return last


def request_replay(dealer: zmq.Socket[bytes], start_seq: int) -> list[tuple[int, KVEventBatch]]:
    """Send a replay request the vLLM way and collect the reply up to the end marker."""
    dealer.send_multipart(replay_request(start_seq))
    return read_reply(dealer)


def read_reply(dealer: zmq.Socket[bytes]) -> list[tuple[int, KVEventBatch]]:
    reply: list[tuple[int, KVEventBatch]] = []
    while True:
        empty, topic, seq, payload = receive(dealer)
        assert empty == b""
        if seq == END_SEQ_FRAME:
            assert (topic, payload) == (b"", b"")
            return reply
        assert topic == TOPIC.encode()
        reply.append((decode_seq(seq), decode(payload)))


def publisher(endpoints: tuple[str, str], **options: Any) -> ZmqEventPublisher:
    pub_endpoint, replay_endpoint = endpoints
    return ZmqEventPublisher(
        data_parallel_rank=options.pop("data_parallel_rank", 0),
        endpoint=pub_endpoint,
        replay_endpoint=replay_endpoint,
        topic=TOPIC,
        **options,
    )


class ForeignBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """Shaped like vLLM's own KVEventBatch, but not hmakv's class."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_live_batches_arrive_in_order_with_consecutive_seqs(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    with publisher(endpoints, data_parallel_rank=0) as pub:
        sub = subscriber(ctx, local(pub.endpoint))
        last = join_live_stream(pub, sub)
        for block_hash in range(200):
            pub.publish(removal(block_hash))
        pub.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=7))
        pub.publish(ForeignBatch(ts=2.0, events=[BlockRemoved([2**64 - 1], "CPU")]))

        received = [receive_live(sub) for _ in range(202)]

    assert [seq for seq, _ in received] == list(range(last + 1, last + 203))
    assert [batch.events for _, batch in received[:200]] == [
        [BlockRemoved([block_hash], "GPU")] for block_hash in range(200)
    ]
    assert {batch.data_parallel_rank for _, batch in received[:200]} == {0}
    assert received[200][1] == KVEventBatch(1.0, [AllBlocksCleared()], 7)
    assert received[201][1] == KVEventBatch(2.0, [BlockRemoved([2**64 - 1], "CPU")], 0)


def test_an_idle_publisher_dozes_and_the_next_batch_wakes_it(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """An idle engine costs no CPU (the thread stops polling every millisecond), yet a batch
    published then still goes out: publish() sees the thread dozing and wakes it."""
    with publisher(endpoints) as pub:
        sub = subscriber(ctx, local(pub.endpoint))
        last = join_live_stream(pub, sub)
        handoff = pub._handoff
        for spell in range(3):
            wait_until(lambda: handoff.dozing, "the idle publisher thread dozes")
            pub.publish(removal(spell))
            assert not handoff.dozing  # taken down by publish(), which woke the thread
            seq, batch = receive_live(sub)
            assert (seq, batch.events) == (last + 1 + spell, [BlockRemoved([spell], "GPU")])


def test_seq_zero_is_an_all_blocks_cleared(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    with publisher(endpoints, data_parallel_rank=3) as pub:
        wait_until(lambda: pub.stats().sent == 1, "seq 0 is sent")
        reply = request_replay(replay_client(ctx, pub.replay_endpoint or ""), 0)

    assert reply[0][0] == 0
    assert reply[0][1].events == [AllBlocksCleared()]
    assert reply[0][1].data_parallel_rank == 3


@pytest.mark.parametrize(
    ("start_seq", "expected_seqs"),
    [(0, range(11)), (6, range(6, 11)), (10, range(10, 11)), (11, range(0)), (2**63, range(0))],
)
def test_replay_sends_buffered_batches_from_start_seq_then_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoints: tuple[str, str],
    start_seq: int,
    expected_seqs: range,
) -> None:
    with publisher(endpoints) as pub:
        for block_hash in range(1, 11):
            pub.publish(removal(block_hash))
        dealer = replay_client(ctx, pub.replay_endpoint or "")
        wait_until(lambda: pub.stats().sent == 11, "all batches are in the ring")
        reply = request_replay(dealer, start_seq)

    assert [seq for seq, _ in reply] == list(expected_seqs)
    for seq, batch in reply[1 if start_seq == 0 else 0 :]:
        assert batch.events == [BlockRemoved([seq], "GPU")]


def test_malformed_replay_request_is_counted_and_ignored(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    with publisher(endpoints) as pub:
        wait_until(lambda: pub.stats().sent == 1, "seq 0 is sent")
        dealer = replay_client(ctx, pub.replay_endpoint or "")
        dealer.send_multipart([b"", b"\x00\x01"])  # a 2-byte start_seq
        assert [seq for seq, _ in request_replay(dealer, 0)] == [0]
        assert pub.stats().replay_requests_invalid == 1


def test_replay_starts_at_oldest_seq_the_ring_kept(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    with publisher(endpoints, buffer_steps=4) as pub:
        for block_hash in range(1, 11):
            pub.publish(removal(block_hash))
        dealer = replay_client(ctx, pub.replay_endpoint or "")
        wait_until(lambda: pub.stats().sent == 11, "all batches are in the ring")
        reply = request_replay(dealer, 0)

    assert [seq for seq, _ in reply] == [7, 8, 9, 10]


def test_dp_rank_offsets_both_tcp_ports_and_stamps_batches(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub_port, replay_port = free_port() - 2, free_port() - 2
    pub = ZmqEventPublisher(
        data_parallel_rank=2,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
    )
    with pub:
        sub = subscriber(ctx, f"tcp://127.0.0.1:{pub_port + 2}")
        last = join_live_stream(pub, sub)
        pub.publish(removal(1))
        live = receive_live(sub)
        reply = request_replay(replay_client(ctx, f"tcp://127.0.0.1:{replay_port + 2}"), last + 1)

    assert pub.endpoint == f"tcp://*:{pub_port + 2}"
    assert live == (last + 1, KVEventBatch(live[1].ts, [BlockRemoved([1], "GPU")], 2))
    assert reply == [live]


def test_dp_rank_suffixes_inproc_endpoints(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(2, "inproc://kv", "inproc://kv-replay", topic=TOPIC, context=ctx)
    with pub:
        sub = subscriber(ctx, "inproc://kv_dp2")
        last = join_live_stream(pub, sub)
        reply = request_replay(replay_client(ctx, "inproc://kv-replay_dp2"), last)

    assert [seq for seq, _ in reply] == [last]


def test_a_taken_replay_port_fails_the_constructor(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    taken = ctx.socket(zmq.ROUTER)
    taken.bind(endpoints[1])
    with pytest.raises(zmq.ZMQError):
        publisher(endpoints)
    with ZmqEventPublisher(0, endpoints[0]) as pub:  # the PUB port was released
        assert pub.replay_endpoint is None


def test_publisher_connects_to_a_subscriber_that_binds(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    port = free_port()
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.subscribe(TOPIC.encode())
    with ZmqEventPublisher(0, f"tcp://127.0.0.1:{port}", topic=TOPIC) as pub:
        last = join_live_stream(pub, sub)
        pub.publish(removal(5))
        assert receive_live(sub)[0] == last + 1


def test_bind_serves_a_host_address_such_as_loopback_only(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """vLLM's rule binds only wildcards, so a publisher could not serve loopback alone; with
    ``bind`` it binds the host address it is given (issue 16)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with ZmqEventPublisher(0, endpoint, topic=TOPIC, bind=True) as pub:
        sub = subscriber(ctx, endpoint)
        last = join_live_stream(pub, sub)
        pub.publish(removal(5))
        assert receive_live(sub)[0] == last + 1
        taken = ctx.socket(zmq.PUB)
        with pytest.raises(zmq.ZMQError):  # the port is this publisher's, on loopback
            taken.bind(endpoint)
        taken.close(linger=0)


def test_full_queue_drops_batches_but_keeps_their_seqs(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """The ring (1000 seqs) turns three times during the burst: the slots of dropped seqs must
    not replay what an older seq left in them."""
    with publisher(endpoints, max_queue_size=1, buffer_steps=1000) as pub:
        sub = subscriber(ctx, local(pub.endpoint))
        first = join_live_stream(pub, sub) + 1
        before = pub.stats()
        for block_hash in range(3000):  # far faster than the publisher thread can send
            pub.publish(removal(block_hash))
        wait_until(lambda: queue_is_empty(pub), "the burst is sent or dropped")
        pub.publish(removal(3000))  # the queue is empty again: sent
        wait_until(lambda: queue_is_empty(pub), "the last batch is sent")
        stats = pub.stats()
        received = [receive_live(sub) for _ in range(stats.sent - before.sent)]
        replayed = request_replay(replay_client(ctx, pub.replay_endpoint or ""), 0)

    dropped = stats.dropped_queue_full - before.dropped_queue_full
    assert dropped > 0, "publish() must drop, not wait for room in the queue"
    assert stats.published == stats.sent + stats.dropped_queue_full
    for seq, batch in received:
        assert batch.events == [BlockRemoved([seq - first], "GPU")]
    seqs = [seq for seq, _ in received]
    assert seqs == sorted(seqs) and seqs[-1] == first + 3000
    assert len(set(range(first, first + 3001)) - set(seqs)) == dropped
    kept = [(seq, batch) for seq, batch in received if seq > first + 3000 - 1000]
    assert replayed == kept, "the replay ring must skip dropped seqs, not shift past them"


UNENCODABLE_EVENTS: dict[str, object] = {
    "a foreign object": object(),
    "a hash beyond 64 bits": BlockRemoved([2**64], "GPU"),  # msgspec: OverflowError
    "a lone surrogate": BlockStored([1], None, [1] * 16, 16, None, "GPU", "\ud800"),  # ValueError
}


@pytest.mark.parametrize("event", list(UNENCODABLE_EVENTS.values()), ids=list(UNENCODABLE_EVENTS))
def test_batch_that_cannot_be_encoded_goes_out_as_a_clear_and_is_counted(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str], event: object
) -> None:
    """Whatever msgspec raises for one batch, the publisher thread goes on (had it ended,
    nothing more would be sent, and nothing would tell the engine). The seq carries a clear,
    live and in replay: a gap there could never be replayed, and the worker would stay degraded
    for good (issue 16)."""
    with publisher(endpoints) as pub:
        sub = subscriber(ctx, local(pub.endpoint))
        last = join_live_stream(pub, sub)
        pub.publish(ForeignBatch(ts=1.0, events=[event]))
        pub.publish(removal(1))
        seq, cleared = receive_live(sub)
        assert seq == last + 1 and cleared.events == [AllBlocksCleared()]
        assert receive_live(sub)[0] == last + 2
        stats = pub.stats()
        assert stats.encode_errors == 1
        assert stats.published == stats.sent + stats.encode_errors
        dealer = replay_client(ctx, pub.replay_endpoint or "")
        dealer.send_multipart(replay_request(last + 1))
        reply = receive(dealer)
        assert decode_seq(reply[2]) == last + 1 and decode(reply[3]).events == [AllBlocksCleared()]


def test_shutdown_timeout_bounds_the_drain_and_counts_what_is_left(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints, shutdown_timeout=0.0)
    for block_hash in range(5000):
        pub.publish(removal(block_hash))
    pub.shutdown()

    stats = pub.stats()
    assert stats.dropped_at_shutdown > 0
    assert stats.published == stats.sent + stats.dropped_queue_full + stats.dropped_at_shutdown


def big_batch(block_hash: int, tokens: int) -> KVEventBatch:
    """About 5 bytes per token on the wire."""
    token_ids = list(range(100_000, 100_000 + tokens))
    return KVEventBatch(
        time.time(), [BlockStored([block_hash], None, token_ids, 16, None, "GPU", None)]
    )


def test_replay_client_that_never_reads_cannot_stall_live_publishing(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """300 batches of ~50 kB overflow every buffer between ROUTER and a DEALER that never reads."""
    pub = publisher(endpoints, replay_hwm=1, replay_timeout=0.3)
    with pub:
        sub = subscriber(ctx, local(pub.endpoint))
        last = join_live_stream(pub, sub)
        for block_hash in range(300):
            pub.publish(big_batch(block_hash, 10_000))
        for _ in range(300):
            receive_live(sub)
        stuck = ctx.socket(zmq.DEALER)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.connect(pub.replay_endpoint or "")
        stuck.send_multipart(replay_request(0))

        wait_until(lambda: pub.stats().replay_requests == 1, "the replay started")
        for block_hash in range(50):
            pub.publish(removal(block_hash))
        live = [receive_live(sub)[0] for _ in range(50)]
        wait_until(lambda: pub.stats().replays_abandoned == 1, "the stuck replay is abandoned")

    assert live == list(range(last + 301, last + 351))
    assert pub.stats().replays_completed == 0


def test_requests_past_max_replies_are_ignored_and_counted_until_a_reply_ends(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """A client that floods the ROUTER with requests and reads nothing holds at most
    ``max_replies`` replies; once they are abandoned, a request is answered again."""
    pub = publisher(endpoints, replay_hwm=1, replay_timeout=0.5, max_replies=2)
    with pub:
        for block_hash in range(300):
            pub.publish(big_batch(block_hash, 10_000))
        wait_until(lambda: pub.stats().sent == 301, "all batches are in the ring")
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.RCVHWM, 1)
        flood.setsockopt(zmq.RCVBUF, 4096)
        flood.connect(pub.replay_endpoint or "")
        for _ in range(3):
            flood.send_multipart(replay_request(0))
        flood.send_multipart(replay_request(SNAPSHOT_REQUEST))
        wait_until(lambda: pub.stats().replay_requests_refused == 2, "two requests ignored")
        assert (pub.stats().replay_requests, pub.stats().snapshot_requests) == (2, 0)
        wait_until(lambda: pub.stats().replays_abandoned == 2, "the stuck replies abandoned")
        reply = request_replay(replay_client(ctx, pub.replay_endpoint or ""), 295)
    assert [seq for seq, _ in reply] == list(range(295, 301))
    assert pub.stats().replay_requests_refused == 2


class RequestFlood:
    """Clients that send replay requests without pause, until stopped (a broken or hostile
    client), each from a thread of its own."""

    def __init__(self, endpoint: str, frames: list[bytes], clients: int = 2) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send, args=(endpoint, frames)) for _ in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def _send(self, endpoint: str, frames: list[bytes]) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.connect(endpoint)
        while not self._stop.is_set():
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart(frames, zmq.NOBLOCK)
        dealer.close(linger=0)
        ctx.term()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def test_a_flood_of_replay_requests_holds_up_neither_live_batches_nor_shutdown(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """The publisher thread reads a bounded number of requests per turn: while clients send
    without pause, live batches still go out and shutdown still ends (both waited for until
    the flood stopped)."""
    pub = publisher(endpoints, max_replies=1, shutdown_timeout=0.5)
    sub = subscriber(ctx, local(pub.endpoint))
    last = join_live_stream(pub, sub)
    flood = RequestFlood(pub.replay_endpoint or "", replay_request(0))
    try:
        wait_until(lambda: pub.stats().replay_requests_refused > 1000, "the flood is read")
        for block_hash in range(10):
            pub.publish(removal(block_hash))
        live = [receive_live(sub)[0] for _ in range(10)]  # each within WAIT_MS, flood or not
        closing = threading.Thread(target=pub.shutdown)
        closing.start()
        closing.join(WAIT_MS / 1000)
        assert not closing.is_alive(), "shutdown waited for the flood to end"
    finally:
        flood.stop()
        pub.shutdown()
    assert live == list(range(last + 1, last + 11))


def test_reply_held_up_while_the_ring_turns_still_sends_each_seqs_own_payload(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """10 MB of replay stalls at the client; 50 new batches then turn the 50-seq ring over the
    batch the stalled reply holds."""
    with publisher(endpoints, buffer_steps=50, replay_hwm=1, replay_timeout=60.0) as pub:
        for block_hash in range(1, 50):
            pub.publish(big_batch(block_hash, 40_000))
        wait_until(lambda: queue_is_empty(pub), "the ring is full")
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 4096)
        slow.connect(pub.replay_endpoint or "")
        slow.send_multipart(replay_request(1))
        wait_until(lambda: pub.stats().replay_batches_sent > 0, "the replay has started")
        for block_hash in range(50, 100):
            pub.publish(big_batch(block_hash, 10))
        wait_until(lambda: queue_is_empty(pub), "the ring has turned")
        reply = read_reply(slow)

    assert 0 < len(reply) < 49, "the reply was cut short by the turn"
    for seq, batch in reply:
        (event,) = batch.events
        assert isinstance(event, BlockStored) and event.block_hashes == [seq]


def test_replay_to_a_client_that_disconnects_is_abandoned_at_once(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    with publisher(endpoints, replay_hwm=1, replay_timeout=60.0) as pub:
        for block_hash in range(300):
            pub.publish(big_batch(block_hash, 10_000))
        wait_until(lambda: queue_is_empty(pub), "the big batches are in the ring")
        leaving = ctx.socket(zmq.DEALER)
        leaving.setsockopt(zmq.RCVHWM, 1)
        leaving.connect(pub.replay_endpoint or "")
        leaving.send_multipart(replay_request(0))
        receive(leaving)
        leaving.close(linger=0)
        wait_until(lambda: pub.stats().replays_abandoned == 1, "the reply is abandoned")


Block = tuple[int, ExternalBlockHash]  # (group_idx, hash)


def stored_event(group: int, block_hash: ExternalBlockHash) -> BlockStored:
    return BlockStored([block_hash], None, [1] * 16, 16, None, "GPU", None, group_idx=group)


def drop_zero_counts(counts: Counter[Block]) -> None:
    """Unlike ``+counts``, keeps negative counts, so a removal applied twice shows."""
    for block in [block for block, copies in counts.items() if copies == 0]:
        del counts[block]


class EngineModel:
    """The test's engine: resident copies per (group, hash), changed step by step; its snapshot
    provider lists them the way a block pool would."""

    def __init__(self) -> None:
        self.resident: Counter[Block] = Counter()

    def step(self, stored: Sequence[Block], removed: Sequence[Block]) -> KVEventBatch:
        self.resident.update(stored)
        self.resident.subtract(removed)
        drop_zero_counts(self.resident)
        events: list[KVEvent] = [stored_event(*block) for block in stored]
        events += [
            BlockRemoved([block_hash], "GPU", group_idx=group) for group, block_hash in removed
        ]
        return KVEventBatch(time.time(), events)

    def snapshot(self) -> list[KVEvent]:
        return [stored_event(*block) for block in sorted(self.resident.elements())]


def apply(state: Counter[Block], batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            state.clear()
        elif isinstance(event, BlockStored):
            state.update((event.group_idx or 0, h) for h in event.block_hashes)
        else:
            state.subtract((event.group_idx or 0, h) for h in event.block_hashes)
    drop_zero_counts(state)


def request_snapshot(
    dealer: zmq.Socket[bytes], engine_step: Callable[[], None]
) -> list[tuple[int, KVEventBatch]]:
    """Ask for a snapshot, running engine steps until the reply starts, as a live engine would."""
    dealer.send_multipart(replay_request(SNAPSHOT_REQUEST))
    deadline = time.monotonic() + WAIT_MS / 1000
    while not dealer.poll(5):
        assert time.monotonic() < deadline, "no snapshot reply"
        engine_step()
    return read_reply(dealer)


def test_snapshot_is_the_state_after_seq_s_and_live_batches_after_s_complete_it(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    engine = EngineModel()
    pub = publisher(endpoints, snapshot_provider=engine.snapshot, snapshot_chunk_events=3)
    step_no = 0

    def busy_step() -> None:
        """Two copies of a new block, one copy of the previous one removed: a snapshot that is
        off by one seq miscounts the copies."""
        nonlocal step_no
        step_no += 1
        previous = [((step_no - 1) % 2, step_no - 1)] if step_no > 1 else []
        pub.publish(engine.step(stored=[(step_no % 2, step_no)] * 2, removed=previous))

    with pub:
        sub = subscriber(ctx, local(pub.endpoint))
        join_live_stream(pub, sub)
        for _ in range(5):
            busy_step()
        snapshot = request_snapshot(replay_client(ctx, pub.replay_endpoint or ""), busy_step)
        for _ in range(5):
            busy_step()
        last = pub.stats().published - 1
        live = [receive_live(sub)]
        while live[-1][0] != last:
            live.append(receive_live(sub))

    seqs = {seq for seq, _ in snapshot}
    assert len(seqs) == 1 and len(snapshot) > 1
    (s,) = seqs
    events = [event for _, batch in snapshot for event in batch.events]
    assert events[0] == AllBlocksCleared()
    assert all(isinstance(event, BlockStored) for event in events[1:])
    assert all(len(batch.events) <= 3 for _, batch in snapshot)
    state: Counter[Block] = Counter()
    for _, batch in snapshot:
        apply(state, batch)
    for seq, batch in live:
        if seq > s:
            apply(state, batch)
    assert state == engine.resident
    assert pub.stats().snapshots_sent == 1  # counted: the publisher has stopped


def test_idle_engine_serves_snapshots_at_the_last_assigned_seq(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    engine = EngineModel()
    provider_threads = []

    def provider() -> list[KVEvent]:
        provider_threads.append(threading.current_thread())
        return engine.snapshot()

    with publisher(endpoints, snapshot_provider=provider) as pub:
        pub.publish(engine.step(stored=[(0, 1), (0, 2), (1, 2)], removed=[]))
        pub.publish(engine.step(stored=[(1, 4)], removed=[(0, 2)]))
        snapshot = request_snapshot(
            replay_client(ctx, pub.replay_endpoint or ""), pub.service_snapshot_requests
        )

    assert [seq for seq, _ in snapshot] == [2]
    assert provider_threads == [threading.current_thread()], (
        "the provider runs on the engine thread"
    )
    state: Counter[Block] = Counter()
    apply(state, snapshot[0][1])
    assert state == engine.resident


def test_snapshot_request_the_engine_never_serves_gets_the_end_marker_after_the_timeout(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    engine = EngineModel()
    with publisher(endpoints, snapshot_provider=engine.snapshot, replay_timeout=0.2) as pub:
        reply = request_snapshot(replay_client(ctx, pub.replay_endpoint or ""), lambda: None)
        assert reply == []
        assert pub.stats().snapshots_unavailable == 1


def test_a_snapshot_leaves_out_the_events_it_cannot_encode_and_counts_them(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    """Chunks are encoded as they are sent; an event that does not encode is left out of its
    chunk, and the reply still ends with the end marker. Abandoning the reply instead left a
    worker without a snapshot, degraded for good (issue 16); without the event, consumers know
    less than the engine holds, never more."""
    good = BlockRemoved([7], "GPU")
    events: list[KVEvent] = [BlockRemoved([2**64], "GPU"), good, BlockRemoved([2**65], "GPU")]
    with publisher(endpoints, snapshot_provider=lambda: events, snapshot_chunk_events=2) as pub:
        sub = subscriber(ctx, local(pub.endpoint))
        last = join_live_stream(pub, sub)
        reply = request_snapshot(
            replay_client(ctx, pub.replay_endpoint or ""), pub.service_snapshot_requests
        )
        assert [event for _, batch in reply for event in batch.events] == [AllBlocksCleared(), good]
        # The publisher thread counts a reply once its end marker is out: the client may read
        # the marker first.
        wait_until(lambda: pub.stats().snapshots_sent == 1, "the snapshot counted as sent")
        stats = pub.stats()
        assert stats.snapshot_events_unencodable == 2 and stats.replays_abandoned == 0
        pub.publish(removal(7))
        assert receive_live(sub)[0] == last + 1


def failing_provider() -> list[KVEvent]:
    raise RuntimeError("block pool unavailable")


@pytest.mark.parametrize("provider", [None, failing_provider])
def test_snapshot_request_without_a_snapshot_gets_only_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoints: tuple[str, str],
    provider: Callable[[], list[KVEvent]] | None,
) -> None:
    with publisher(endpoints, snapshot_provider=provider) as pub:
        reply = request_snapshot(
            replay_client(ctx, pub.replay_endpoint or ""), pub.service_snapshot_requests
        )
        assert reply == []
        assert pub.stats().snapshots_unavailable == 1


def test_shutdown_sends_everything_queued_then_refuses_publish(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    pub = publisher(endpoints, shutdown_timeout=10.0)
    sub = subscriber(ctx, local(pub.endpoint))
    last = join_live_stream(pub, sub)
    for block_hash in range(2000):
        pub.publish(removal(block_hash))
    pub.shutdown()

    assert [receive_live(sub)[0] for _ in range(2000)] == list(range(last + 1, last + 2001))
    assert pub.stats().sent == pub.stats().published
    with pytest.raises(RuntimeError):
        pub.publish(removal(0))


class VllmStyleSubscriber:
    """Written the way vLLM's example subscriber is: SUB for live batches, DEALER for replay,
    and on every gap a replay request from the first missing seq."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay: str) -> None:
        self.sub = subscriber(ctx, endpoint)
        self.replay = replay_client(ctx, replay)
        self.next_seq = 0
        self.applied: list[tuple[int, KVEventBatch]] = []

    def poll_once(self) -> None:
        if not self.sub.poll(1):
            return
        seq, batch = receive_live(self.sub)
        if seq > self.next_seq:
            for replayed_seq, replayed in request_replay(self.replay, self.next_seq):
                if self.next_seq <= replayed_seq < seq:
                    self.apply(replayed_seq, replayed)
        if seq == self.next_seq:
            self.apply(seq, batch)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.applied.append((seq, batch))
        self.next_seq = seq + 1


def test_late_joining_vllm_style_subscriber_gets_every_batch_exactly_once(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[str, str]
) -> None:
    published: list[KVEventBatch] = []

    def engine_step() -> None:
        published.append(removal(len(published)))
        pub.publish(published[-1])

    with publisher(endpoints) as pub:
        for _ in range(30):
            engine_step()
        client = VllmStyleSubscriber(ctx, local(pub.endpoint), pub.replay_endpoint or "")
        deadline = time.monotonic() + WAIT_MS / 1000
        while client.next_seq <= len(published):  # seq 0 is the leading clear
            assert time.monotonic() < deadline, "the subscriber never caught up"
            if len(published) < 60 or not client.applied:  # step on until it hears something
                engine_step()
            client.poll_once()

    assert [seq for seq, _ in client.applied] == list(range(len(published) + 1))
    assert client.applied[0][1].events == [AllBlocksCleared()]
    assert [batch for _, batch in client.applied[1:]] == published
