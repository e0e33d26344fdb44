"""The vLLM general plugin, against vLLM's documented publisher interface, without vLLM.

Real vLLM runs the plugin in tests/vllm (seconds to start, gigabytes to install); these fast
tests fake ``vllm.distributed.kv_events`` instead: an ``EventPublisherFactory`` that behaves like
vLLM's (a ``_registry`` holding "null" and "zmq", ``register_publisher`` refusing an existing name,
``create`` passing ``asdict(config)`` minus ``publisher`` and ``enable_kv_cache_events`` as
keywords), a ``KVEventsConfig`` dataclass with vLLM's fields, and msgspec event structs shaped
like vLLM's (array-like batch, events tagged with their class name and encoded as maps). The
ZMQ side is real: sockets on loopback, frames decoded by hmakv's decoder.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import zmq
import zmq.auth

from hmakv.bridge.frames import EventLimits, over_limit
from hmakv.kafka.process import free_port
from hmakv.producer import events as hmakv_events
from hmakv.producer import vllm_plugin
from hmakv.producer.curve import CurveError, connect_to, load_key_pair
from hmakv.producer.protocol import decode_seq
from hmakv.producer.publisher import ZmqEventPublisher

WAIT_S = 10.0


# --- vLLM's shapes ----------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


NEWER_FIELDS: dict[str, dict[str, None]] = {
    "BlockStored": dict.fromkeys(("locality", "ownership", "session_id", "lookahead_token_ids")),
    "BlockRemoved": dict.fromkeys(("locality", "ownership")),
}
"""What hmakv's structs add to these (older vLLM's) shapes, unset when decoded."""


@dataclasses.dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


@dataclasses.dataclass
class NewerKVEventsConfig(KVEventsConfig):
    """A later vLLM with config fields hmakv's publisher does not know."""

    reconciliation_enabled: bool = False
    reconciliation_digest_interval_s: float = 30.0


class NullEventPublisher:
    def publish(self, events: Any) -> None:
        return

    def shutdown(self) -> None:
        return


class VllmZmqEventPublisher(NullEventPublisher):
    """Stands for vLLM's own ZMQ publisher: only its identity in the registry matters here."""


def fake_kv_events_module() -> types.ModuleType:
    """A fresh ``vllm.distributed.kv_events`` whose factory acts like vLLM's."""

    class EventPublisherFactory:
        _registry: ClassVar[dict[str, Callable[..., Any]]] = {
            "null": NullEventPublisher,
            "zmq": VllmZmqEventPublisher,
        }

        @classmethod
        def register_publisher(cls, name: str, ctor: Callable[..., Any]) -> None:
            if name in cls._registry:
                raise KeyError(f"publisher '{name}' already registered")
            cls._registry[name] = ctor

        @classmethod
        def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> Any:
            if config is None or not config.enable_kv_cache_events or config.publisher == "null":
                return NullEventPublisher()
            config_dict = dataclasses.asdict(config)
            kind = config_dict.pop("publisher")
            config_dict.pop("enable_kv_cache_events")
            return cls._registry[kind](data_parallel_rank=data_parallel_rank, **config_dict)

    module = types.ModuleType("vllm.distributed.kv_events")
    module.EventPublisherFactory = EventPublisherFactory  # type: ignore[attr-defined]
    return module


@pytest.fixture
def kv_events(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = fake_kv_events_module()
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.ModuleType("vllm.distributed"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_events", module)
    return module


@pytest.fixture
def opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.OPT_IN_ENV, "1")


@pytest.fixture
def sub_port() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """A SUB socket bound on loopback; publishers connect to it as vLLM's do to a host."""
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        yield sub, port


def registry(module: types.ModuleType) -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = module.EventPublisherFactory._registry
    return table


# --- registration -----------------------------------------------------------------------------


def test_without_opt_in_the_registry_is_left_alone(
    kv_events: types.ModuleType, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(vllm_plugin.OPT_IN_ENV, raising=False)
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.__name__)

    vllm_plugin.register()

    assert registry(kv_events) == {"null": NullEventPublisher, "zmq": VllmZmqEventPublisher}
    assert any(
        r.levelno == logging.DEBUG and vllm_plugin.OPT_IN_ENV in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.usefixtures("opted_in")
def test_opting_in_puts_hmakv_in_place_of_zmq_once(kv_events: types.ModuleType) -> None:
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load general plugins more than once

    assert registry(kv_events) == {"null": NullEventPublisher, "zmq": vllm_plugin.create_publisher}
    with pytest.raises(KeyError, match="already registered"):
        kv_events.EventPublisherFactory.register_publisher("zmq", VllmZmqEventPublisher)


@pytest.mark.usefixtures("opted_in")
def test_opting_in_without_vllm_logs_an_error_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with caplog.at_level(logging.ERROR, logger=vllm_plugin.__name__):
        vllm_plugin.register()
    assert any("cannot be imported" in r.getMessage() for r in caplog.records)


def test_the_plugin_module_imports_without_importing_vllm() -> None:
    check = "import sys, producer.vllm_plugin; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=WAIT_S)


# --- the publisher vLLM gets --------------------------------------------------------------------


@pytest.mark.usefixtures("opted_in")
def test_create_yields_hmakv_publisher_on_the_configured_endpoints(
    kv_events: types.ModuleType,
) -> None:
    vllm_plugin.register()
    pub_port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )

    publisher = kv_events.EventPublisherFactory.create(config, data_parallel_rank=1)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        # vLLM's data-parallel convention: every port offset by the rank.
        assert publisher.endpoint == f"tcp://127.0.0.1:{pub_port + 1}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay_port + 1}"
    finally:
        publisher.shutdown()


@pytest.mark.usefixtures("opted_in")
def test_with_the_bind_variable_a_loopback_endpoint_is_served_not_connected(
    kv_events: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_plugin.BIND_ENV, "1")
    vllm_plugin.register()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    publisher = kv_events.EventPublisherFactory.create(config, data_parallel_rank=0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.connect(endpoint)  # works only if the publisher bound the loopback address
        sub.subscribe(b"")
        first = wait_for_subscription(publisher, sub)
        publisher.publish(vllm_step(0))
        assert sub.poll(int(WAIT_S * 1000))
        assert decode_seq(sub.recv_multipart()[1]) == first
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


@pytest.mark.usefixtures("opted_in")
def test_with_the_curve_variables_only_an_admitted_client_reads_the_engine(
    kv_events: types.ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, engine_secret = zmq.auth.create_certificates(tmp_path, "engine")
    bridge_public, bridge_secret = zmq.auth.create_certificates(tmp_path, "bridge")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path, "stranger")
    monkeypatch.setenv(vllm_plugin.CURVE_SECRET_KEY_ENV, engine_secret)
    monkeypatch.setenv(vllm_plugin.CURVE_CLIENTS_ENV, bridge_public)
    vllm_plugin.register()
    endpoint = f"tcp://*:{free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    publisher = kv_events.EventPublisherFactory.create(config, data_parallel_rank=0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine_key = load_key_pair(engine_secret).public
    try:
        subs = []
        for secret in (bridge_secret, stranger_secret):
            sub = ctx.socket(zmq.SUB)
            connect_to(sub, load_key_pair(secret), engine_key)
            sub.connect(endpoint.replace("*", "127.0.0.1"))
            sub.subscribe(b"")
            subs.append(sub)
        bridge, stranger = subs
        first = wait_for_subscription(publisher, bridge)
        publisher.publish(vllm_step(0))
        assert bridge.poll(int(WAIT_S * 1000))
        assert decode_seq(bridge.recv_multipart()[1]) == first
        assert not stranger.poll(200)
        assert publisher.stats().clients_refused >= 1
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


def test_a_curve_variable_without_the_secret_key_or_a_bad_key_stops_the_publisher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An engine meant to publish under CURVE must not start publishing in the clear."""
    monkeypatch.setenv(vllm_plugin.CURVE_SERVER_KEY_ENV, "x" * 40)
    with pytest.raises(ValueError, match=vllm_plugin.CURVE_SECRET_KEY_ENV):
        vllm_plugin.create_publisher(0, f"tcp://*:{free_port()}")
    monkeypatch.setenv(vllm_plugin.CURVE_SECRET_KEY_ENV, str(tmp_path / "missing.key_secret"))
    with pytest.raises(CurveError, match="no CURVE certificate"):
        vllm_plugin.create_publisher(0, f"tcp://*:{free_port()}")


def vllm_step(step: int) -> KVEventBatch:
    """A vLLM step batch as vLLM's scheduler hands it over: no rank yet, HMA fields set."""
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[2**64 - 1 - step, 7 + step],
                parent_block_hash=None if step == 0 else 7 + step - 1,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
            ),
            BlockRemoved(block_hashes=[step], medium="GPU", group_idx=0),
        ],
    )


def wait_for_subscription(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish empty batches until one arrives (a PUB drops what precedes the subscription);
    returns the seq of the first batch published after that."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        if sub.poll(20):
            break
    last_probe = publisher.stats().published - 1
    while True:  # drain the probes, up to the last: none arrives after the test's batches
        assert sub.poll(int(WAIT_S * 1000)), "a probe published after the subscription was lost"
        if decode_seq(sub.recv_multipart()[1]) == last_probe:
            return last_probe + 1


@pytest.mark.usefixtures("opted_in")
def test_vllm_batches_published_through_the_plugin_decode_to_the_same_events(
    kv_events: types.ModuleType, sub_port: tuple[zmq.Socket[bytes], int]
) -> None:
    sub, port = sub_port
    vllm_plugin.register()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{port}",
        topic="kv-events",
    )
    publisher = kv_events.EventPublisherFactory.create(config, data_parallel_rank=0)
    try:
        first_seq = wait_for_subscription(publisher, sub)
        sent = [vllm_step(step) for step in range(5)]
        for batch in sent:
            publisher.publish(batch)
        frames = []
        for _ in sent:
            assert sub.poll(int(WAIT_S * 1000)), "a published batch did not arrive"
            frames.append(sub.recv_multipart())
    finally:
        publisher.shutdown()

    assert [topic for topic, _, _ in frames] == [b"kv-events"] * 5
    assert [decode_seq(seq) for _, seq, _ in frames] == list(range(first_seq, first_seq + 5))
    for (_, _, payload), batch in zip(frames, sent, strict=True):
        decoded = hmakv_events.decode(payload)
        assert decoded.unknown_event_types == []
        assert decoded.batch.data_parallel_rank == 0  # stamped by the publisher, as vLLM's does
        assert [msgspec.structs.asdict(e) for e in decoded.batch.events] == [
            msgspec.structs.asdict(e) | NEWER_FIELDS[type(e).__name__] for e in batch.events
        ]
        assert msgspec.msgpack.decode(payload, type=KVEventBatch) == batch  # vLLM reads it back


@pytest.mark.usefixtures("opted_in")
def test_config_fields_from_a_newer_vllm_are_ignored_with_one_warning(
    kv_events: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    vllm_plugin.register()
    caplog.clear()  # registering says this fake vLLM has no scheduler to snapshot
    config = NewerKVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        reconciliation_enabled=True,
    )
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        publishers = [
            kv_events.EventPublisherFactory.create(config, data_parallel_rank=rank)
            for rank in (0, 1)
        ]
    for publisher in publishers:
        assert isinstance(publisher, ZmqEventPublisher)
        publisher.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reconciliation_digest_interval_s, reconciliation_enabled" in warnings[0]


def test_a_large_cache_is_snapshotted_in_stores_the_bridge_accepts() -> None:
    """A snapshot once listed a group's whole cache in one store; the bridge caps the hashes one
    event may list, so a large cache is many stores, with every copy of every hash still there."""
    cached: dict[bytes, object] = {}
    for block in range(10_000):
        key = block.to_bytes(32, "big") + (block % 2).to_bytes(4, "big")  # hash, then group id
        cached[key] = {1: object(), 2: object()} if block == 7 else object()
    spec = types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(block_size=16))
    manager = types.SimpleNamespace(
        block_pool=types.SimpleNamespace(
            cached_block_hash_to_block=types.SimpleNamespace(_cache=cached),
            kv_event_queue=[],
            medium="GPU",
        ),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[spec, spec]),
        kv_cache_event_metadata={0: ("full_attention", None), 1: ("sliding_window", 64)},
    )
    stores = vllm_plugin.snapshot_events(manager)
    assert all(
        isinstance(s, hmakv_events.BlockStored)
        and len(s.block_hashes) <= vllm_plugin.SNAPSHOT_HASHES_PER_STORE
        for s in stores
    )
    listed = Counter(
        (s.group_idx, h)
        for s in stores
        if isinstance(s, hmakv_events.BlockStored)
        for h in s.block_hashes
    )
    expected = Counter({(block % 2, block): 2 if block == 7 else 1 for block in range(10_000)})
    assert listed == expected
    per_chunk = vllm_plugin.SNAPSHOT_STORES_PER_CHUNK  # the publisher's batches of a snapshot
    for start in range(0, len(stores), per_chunk):
        chunk = hmakv_events.KVEventBatch(0.0, stores[start : start + per_chunk])
        assert over_limit(chunk, EventLimits()) is None
    worst = [stores[0]] * per_chunk  # a chunk of full stores: what the bridge must still take
    assert over_limit(hmakv_events.KVEventBatch(0.0, worst), EventLimits()) is None
