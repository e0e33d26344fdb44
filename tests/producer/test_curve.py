"""CURVE on the publisher's sockets, over real ZMQ sockets on loopback (issue 16): only a client
that knows the engine's public key reads it, only admitted client keys connect, and a publisher
that connects proves its key to the server it connects to."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from hmakv.kafka.process import free_port
from hmakv.producer.curve import (
    CurveError,
    CurveGate,
    CurveSettings,
    KeyPair,
    connect_to,
    load_key_pair,
    load_public_key,
    load_public_keys,
    serve,
)
from hmakv.producer.events import BlockRemoved, KVEventBatch
from hmakv.producer.protocol import decode_seq, replay_request
from hmakv.producer.publisher import ZmqEventPublisher

TOPIC = "kv-events"
WAIT_MS = 5000


def key_pair(directory: Path, name: str) -> KeyPair:
    _, secret_file = zmq.auth.create_certificates(directory, name)
    return load_key_pair(secret_file)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def removal(block_hash: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved([block_hash], "GPU")])


def reads_live(pub: ZmqEventPublisher, sub: zmq.Socket[bytes], within_s: float = 3.0) -> bool:
    """Whether ``sub`` receives the publisher's batches within ``within_s`` of publishing."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        pub.publish(removal(1))
        if sub.poll(20):
            topic, seq, _ = sub.recv_multipart()
            return topic == TOPIC.encode() and decode_seq(seq) >= 0
    return False


def client(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, keys: KeyPair | None, server: bytes
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        connect_to(sock, keys, server)
    return sock


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_keys_load_from_certificates_and_z85_and_bad_ones_name_the_problem(
    tmp_path: Path,
) -> None:
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "engine")
    pair = load_key_pair(secret_file)
    assert load_public_key(public_file) == pair.public
    assert load_public_key(pair.public.decode()) == pair.public
    assert load_public_keys(str(tmp_path)) == {pair.public}
    assert pair.secret.decode() not in repr(pair)
    with pytest.raises(CurveError, match="public key only"):
        load_key_pair(public_file)
    with pytest.raises(CurveError, match="no CURVE certificate"):
        load_key_pair(tmp_path / "missing.key_secret")
    with pytest.raises(CurveError, match="neither a certificate file nor"):
        load_public_key("not-a-key")
    with pytest.raises(CurveError, match="z85"):
        load_public_key("~" * 40)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveError, match=r"no \*\.key file"):
        load_public_keys(str(empty))


def test_a_curve_publisher_is_read_only_by_clients_that_know_its_key_and_it_admits(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    engine, bridge, stranger = (key_pair(tmp_path, n) for n in ("engine", "bridge", "stranger"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    curve = CurveSettings(engine, clients=frozenset({bridge.public}))
    with ZmqEventPublisher(
        0, endpoint, replay, topic=TOPIC, bind=True, curve=curve, context=zmq.Context()
    ) as pub:
        admitted = client(ctx, zmq.SUB, bridge, engine.public)
        admitted.connect(endpoint)
        admitted.subscribe(TOPIC.encode())
        assert reads_live(pub, admitted)

        plain = client(ctx, zmq.SUB, None, b"")
        plain.connect(endpoint)
        plain.subscribe(b"")
        not_admitted = client(ctx, zmq.SUB, stranger, engine.public)
        not_admitted.connect(endpoint)
        not_admitted.subscribe(b"")
        wrong_server = client(ctx, zmq.SUB, bridge, stranger.public)  # someone posing as it
        wrong_server.connect(endpoint)
        wrong_server.subscribe(b"")
        for _ in range(20):
            pub.publish(removal(2))
        assert not any(s.poll(300) for s in (plain, not_admitted, wrong_server))
        wait_for(lambda: pub.stats().clients_refused >= 1, "the stranger's handshake is refused")

        dealer = client(ctx, zmq.DEALER, bridge, engine.public)
        dealer.connect(replay)
        dealer.send_multipart(replay_request(0))
        assert dealer.poll(WAIT_MS), "the admitted client's replay got no reply"
        intruder = client(ctx, zmq.DEALER, stranger, engine.public)
        intruder.connect(replay)
        intruder.send_multipart(replay_request(0))
        assert not intruder.poll(500), "a key the engine does not admit was served a replay"
        for sock in (admitted, plain, not_admitted, wrong_server, dealer, intruder):
            sock.close(linger=0)


def test_a_publisher_that_connects_proves_its_key_to_the_server(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """The ``--bind-sub`` topology: the bridge binds and serves; ZMQ stamps each message with
    the publisher's key, and the gate refuses a key it does not know."""
    engine, bridge, stranger = (key_pair(tmp_path, n) for n in ("engine", "bridge", "stranger"))
    gate = CurveGate(ctx, lambda key: key == engine.public)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    serve(sub, bridge)
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.subscribe(b"")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        with pytest.raises(ValueError, match="server's public key"):
            ZmqEventPublisher(0, endpoint, topic=TOPIC, curve=CurveSettings(engine))
        with ZmqEventPublisher(
            0, endpoint, topic=TOPIC, curve=CurveSettings(engine, server_key=bridge.public)
        ) as pub:
            deadline = time.monotonic() + WAIT_MS / 1000
            while not sub.poll(20):
                assert time.monotonic() < deadline, "nothing arrived from the admitted engine"
                pub.publish(removal(3))
            first = sub.recv(copy=False)
            assert first.get("User-Id") == engine.public.decode()
        with ZmqEventPublisher(
            0, endpoint, topic=TOPIC, curve=CurveSettings(stranger, server_key=bridge.public)
        ) as pub:
            while sub.poll(100):  # what the admitted engine left behind
                sub.recv_multipart()
            for _ in range(20):
                pub.publish(removal(4))
                time.sleep(0.02)
            assert not sub.poll(300), "a key the gate does not admit got a message through"
        assert gate.refused >= 1
    finally:
        sub.close(linger=0)
        gate.stop()
