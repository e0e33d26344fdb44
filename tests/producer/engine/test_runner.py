"""The engine end to end, in-process, over real ZMQ and HTTP on loopback.

What a consumer receives must be enough to know the engine's cache: live batches plus replay
form a gap-free sequence, they decode as vLLM's own typed structs, and replayed into a counting
index they give exactly the engine's resident blocks, at the snapshot's seq and at the end. The
API must report the hits the engine really grants, at a seq an index can catch up to.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import msgspec
import pytest
import zmq
from engine_replay import CountingIndex, probe_hashes, resident_counts
from engine_stream import (
    WAIT_S,
    Subscriber,
    batches_up_to,
    counts,
    events_of,
    replay,
    snapshot,
    wait_until,
)

from hmakv.kafka.process import free_port
from hmakv.producer.engine.api import EngineStopped
from hmakv.producer.engine.hit_rule import find_longest_cache_hit
from hmakv.producer.engine.runner import Engine, EngineConfig, EngineSummary
from hmakv.producer.events import BlockRemoved, BlockStored, KVEventBatch


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextmanager
def running(engine: Engine) -> Iterator[Future[EngineSummary]]:
    """Run the engine on its own thread (its engine thread); stop and join it on exit."""
    summary: Future[EngineSummary] = Future()

    def serve() -> None:
        try:
            summary.set_result(engine.run())
        except BaseException as error:
            summary.set_exception(error)

    thread = threading.Thread(target=serve, name="test-engine")
    thread.start()
    try:
        yield summary
    finally:
        engine.request_stop()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the engine did not stop"


def engine_config(pub_port: int, replay_port: int, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "profile": "gpt-oss-like",
        "workload": "chat",
        "rate": 40.0,
        "use_model": False,
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "status_interval": 0.0,
    }
    return EngineConfig(**(settings | overrides))


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy


def call(url: str, method: str, path: str, body: object = None) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    try:
        with _opener.open(request, timeout=WAIT_S) as response:
            return response.status, json.load(response)
    except HTTPError as error:
        return error.code, json.load(error)


def test_published_events_reproduce_the_engine_cache_and_its_snapshot(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub_port, replay_port = free_port(), free_port()
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    subscriber = Subscriber(ctx, pub_port, topic="kv-events")
    # A small pool, so that blocks are evicted and removals are part of what must add up.
    config = engine_config(pub_port, replay_port, num_blocks=120, topic="kv-events")
    engine = Engine(config, report=lambda line: None)

    with running(engine) as result:
        subscriber.receive_until(lambda s: s.last_seq >= 60, "60 batches arrived")
        snapshot_seq, snapshot_events = snapshot(ctx, replay_endpoint)
        replayed = replay(ctx, replay_endpoint, 0)
    summary = result.result(WAIT_S)
    subscriber.receive_until(lambda s: s.last_seq >= summary.last_seq, "the last batch arrived")
    payloads = replayed | subscriber.payloads

    at_snapshot = CountingIndex(2)
    at_snapshot.apply(events_of(batches_up_to(payloads, snapshot_seq)))
    from_snapshot = CountingIndex(2)
    from_snapshot.apply(snapshot_events)
    assert counts(at_snapshot.counts) == counts(from_snapshot.counts)

    batches = batches_up_to(payloads, summary.last_seq)
    at_end = CountingIndex(2)
    at_end.apply(events_of(batches))
    assert counts(at_end.counts) == counts(resident_counts(engine.manager))
    assert at_end.unknown_removals == 0
    assert any(isinstance(e, BlockRemoved) for e in events_of(batches)), "the pool was to evict"
    assert subscriber.topics == {b"kv-events"}


HMAKV = Path(sys.executable).with_name("hmakv")


def lines_until(process: subprocess.Popen[str], text: str) -> str:
    """Its stderr up to the first line with ``text`` (or to its end, should it exit first)."""
    assert process.stderr is not None
    lines = []
    while line := process.stderr.readline():
        lines.append(line)
        if text in line:
            break
    return "".join(lines)


def test_the_installed_command_publishes_what_its_snapshot_holds(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub_port, replay_port = free_port(), free_port()
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    subscriber = Subscriber(ctx, pub_port)
    command = [
        str(HMAKV), "engine", "--profile", "gpt-oss-like", "--workload", "chat", "--no-model",
        "--rate", "50", "--num-blocks", "120", "--status-interval", "0.5",
        "--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint", replay_endpoint,
    ]  # fmt: skip
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            subscriber.receive_until(lambda s: len(s.payloads) >= 10, "10 batches arrived")
            snapshot_seq, snapshot_events = snapshot(ctx, replay_endpoint)
            replayed = replay(ctx, replay_endpoint, 0)
            status = lines_until(process, "steps/s")  # a status line, then it may stop
            process.send_signal(signal.SIGTERM)  # it runs until told: no step hurries the test
            _, rest = process.communicate(timeout=WAIT_S)
            stderr = status + rest
        finally:
            process.kill()
    assert process.returncode == 0, stderr
    last_seq = int(re.findall(r"last seq (\d+)", stderr)[-1])
    subscriber.receive_until(lambda s: s.last_seq >= last_seq, "the last batch arrived")

    at_snapshot = CountingIndex(2)
    at_snapshot.apply(events_of(batches_up_to(replayed | subscriber.payloads, snapshot_seq)))
    from_snapshot = CountingIndex(2)
    from_snapshot.apply(snapshot_events)
    assert counts(at_snapshot.counts) == counts(from_snapshot.counts)
    assert sum(map(len, from_snapshot.counts)) > 0
    batches_up_to(replayed | subscriber.payloads, last_seq)  # gap-free to the end, all decode
    assert "steps/s" in stderr and "engine summary after" in stderr


def test_the_wire_is_vllms_with_the_hma_group_catalog(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub_port, replay_port = free_port(), free_port()
    subscriber = Subscriber(ctx, pub_port)
    engine = Engine(engine_config(pub_port, replay_port, dp_rank=0), report=lambda line: None)
    with running(engine):
        subscriber.receive_until(lambda s: len(s.payloads) >= 20, "20 batches arrived")

    stores = []
    for payload in subscriber.payloads.values():
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)  # vLLM's typed decode
        assert batch.data_parallel_rank == 0
        stores += [e for e in batch.events if isinstance(e, BlockStored)]
    groups = engine.profile.groups
    assert {e.group_idx for e in stores} == {0, 1}
    for event in stores:
        spec = groups[event.group_idx or 0]
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
            spec.kind,
            spec.sliding_window,
        )
        assert event.block_size == spec.block_size
        assert len(event.token_ids) == len(event.block_hashes) * spec.block_size
        assert event.medium == "GPU"


@pytest.fixture
def api_engine() -> Iterator[tuple[Engine, str]]:
    """An engine serving only its API, and its replay endpoint."""
    replay_port = free_port()
    config = engine_config(free_port(), replay_port, workload="none", api=("127.0.0.1", 0))
    engine = Engine(config, report=lambda line: None)
    with running(engine):
        yield engine, f"tcp://127.0.0.1:{replay_port}"


def test_the_api_reports_the_hits_the_engine_really_grants(
    api_engine: tuple[Engine, str], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    engine, replay_endpoint = api_engine
    url = engine.api_url
    assert url is not None
    first = list(range(100))
    probe = first[:80] + [500] * 30

    status, served = call(url, "POST", "/v1/requests", {"token_ids": first, "max_tokens": 2})
    assert status == 200
    assert (served["num_cached_tokens"], served["num_prompt_tokens"]) == (0, 100)
    status, looked_up = call(url, "POST", "/v1/lookup", {"token_ids": probe})
    assert status == 200
    assert looked_up["num_cached_tokens"] == 80  # five whole blocks of the first prompt
    assert looked_up["seq"] >= served["seq"] >= 1

    # An index that has applied every batch up to the lookup's seq predicts the same hit. The
    # batches went out before the subscription could take effect: replay is how one catches up.
    index = CountingIndex(2)
    index.apply(events_of(batches_up_to(replay(ctx, replay_endpoint, 0), looked_up["seq"])))
    profile = engine.profile
    predicted = find_longest_cache_hit(
        profile.groups, probe_hashes(profile, probe), len(probe) - 1, index.is_cached
    )
    assert predicted == looked_up["num_cached_tokens"]

    status, second = call(url, "POST", "/v1/requests", {"token_ids": probe})
    assert status == 200
    assert second["num_cached_tokens"] == looked_up["num_cached_tokens"]
    assert second["request_id"] != served["request_id"]


def test_the_api_status_names_the_catalog_and_the_progress(
    api_engine: tuple[Engine, str],
) -> None:
    engine, _ = api_engine
    url = engine.api_url
    assert url is not None
    call(url, "POST", "/v1/requests", {"token_ids": list(range(64)), "max_tokens": 1})

    status, document = call(url, "GET", "/v1/status")

    assert status == 200
    assert document["profile"] == "gpt-oss-like"
    assert document["groups"] == [
        {
            "group_idx": 0,
            "kind": "full_attention",
            "block_size": 16,
            "sliding_window": None,
            "chunk_size": None,
        },
        {
            "group_idx": 1,
            "kind": "sliding_window",
            "block_size": 16,
            "sliding_window": 128,
            "chunk_size": None,
        },
    ]
    assert (document["hash_fn"], document["hash_seed"]) == ("sha256_cbor", "0")
    assert document["steps"] >= 1 and document["seq"] >= 1
    assert document["blocks_cached"] == [4, 4]
    assert document["blocks_used"] == [0, 0]  # the request finished
    assert document["free_blocks"] == document["num_blocks"] - 1
    # what became of every seq, and of every replay and snapshot request, by the publisher
    assert document["publisher"]["published"] == document["seq"] + 1
    assert document["publisher"]["dropped_queue_full"] == 0
    assert "replay_requests_refused" in document["publisher"]


@pytest.mark.parametrize(
    ("method", "path", "body", "code", "message"),
    [
        ("POST", "/v1/requests", b"{not json", 400, "not JSON"),
        ("POST", "/v1/requests", [1, 2], 400, "JSON object"),
        ("POST", "/v1/requests", {"token_ids": []}, 400, "non-empty list"),
        ("POST", "/v1/lookup", {"token_ids": [1, "2"]}, 400, "token_ids[1]"),
        ("POST", "/v1/lookup", {"token_ids": [1, -2]}, 400, "token_ids[1]"),
        ("POST", "/v1/lookup", {"token_ids": [True]}, 400, "token_ids[0]"),
        ("POST", "/v1/requests", {"token_ids": [1], "max_tokens": 0}, 400, "max_tokens"),
        ("POST", "/v1/requests", {"prompt": [1]}, 400, "unknown field(s) prompt"),
        ("POST", "/v1/requests", {"token_ids": list(range(20_000))}, 400, "does not fit"),
        # Ids the wire cannot carry once made the engine's next batch unencodable (issue 16).
        ("POST", "/v1/requests", {"token_ids": [1, 2**64]}, 400, "token_ids[1]"),
        ("POST", "/v1/requests", {"token_ids": [2**32]}, 400, "0..4294967295"),
        ("POST", "/v1/requests", b'{"token_ids": [' + b"9" * 5000 + b"]}", 400, "not JSON"),
        ("POST", "/v1/lookup", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        ("GET", "/v1/requests", None, 405, "use POST"),
        ("POST", "/v1/status", {}, 405, "use GET"),
        ("GET", "/v2/nothing", None, 404, "no such endpoint"),
    ],
)
def test_the_api_refuses_bad_requests_with_a_clear_message(
    api_engine: tuple[Engine, str],
    method: str,
    path: str,
    body: object,
    code: int,
    message: str,
) -> None:
    url = api_engine[0].api_url
    assert url is not None
    status, document = call(url, method, path, body)
    assert status == code
    assert message in document["error"]


def test_with_the_model_on_the_engine_serves_and_checks_the_vocabulary(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub_port, replay_port = free_port(), free_port()
    subscriber = Subscriber(ctx, pub_port)
    config = engine_config(
        pub_port,
        replay_port,
        profile="swa-small",
        use_model=True,
        device="cpu",
        api=("127.0.0.1", 0),
    )
    engine = Engine(config, report=lambda line: None)
    with running(engine) as result:
        url = engine.api_url
        assert url is not None
        status, served = call(url, "POST", "/v1/requests", {"token_ids": list(range(50))})
        assert status == 200 and served["num_prompt_tokens"] == 50
        status, refused = call(url, "POST", "/v1/lookup", {"token_ids": [1, 512]})
        assert status == 400 and "0..511" in refused["error"]
        subscriber.receive_until(lambda s: len(s.payloads) >= 10, "10 batches arrived")
    summary = result.result(WAIT_S)

    assert summary.counters.finished > 0
    assert summary.counters.events > 0
    assert summary.dropped == 0


def test_status_lines_report_rates_and_cache_use_per_group() -> None:
    lines: list[str] = []
    config = engine_config(free_port(), free_port(), status_interval=0.05)
    engine = Engine(config, report=lines.append)
    with running(engine) as result:
        wait_until(lambda: sum("steps/s" in line for line in lines) >= 3, "3 status lines")
    summary = result.result(WAIT_S)

    assert lines[0].startswith("engine 'engine': profile gpt-oss-like")
    status = [line for line in lines if "steps/s" in line]
    for line in status:
        for part in ("tokens/s", "events/s", "seq ", "g0 full_attention", "g1 sliding_window"):
            assert part in line
    assert "events:" in summary.text() and "prefix hits:" in summary.text()


def test_arrivals_beyond_the_waiting_limit_are_dropped_and_counted() -> None:
    config = engine_config(free_port(), free_port(), rate=10.0, max_waiting=5)
    engine = Engine(config, report=lambda line: None)
    try:
        engine._submit_arrivals(10.0)  # about 100 arrivals at once, on this (engine) thread
        assert engine.scheduler.num_waiting == 5
        assert engine.counters.submitted == 5
        assert engine.counters.arrivals_dropped > 50
    finally:
        engine.close()


def test_queries_to_a_stopped_engine_fail_instead_of_hanging() -> None:
    engine = Engine(
        engine_config(free_port(), free_port(), workload="none"), report=lambda line: None
    )
    pending = engine.lookup([1, 2, 3])  # queued, never run: the loop has not started
    engine.close()

    assert isinstance(pending.exception(timeout=WAIT_S), EngineStopped)
    assert isinstance(engine.status().exception(timeout=WAIT_S), EngineStopped)


SIGNAL_STORM = """
import os, signal, threading, time
from hmakv.producer.engine.runner import Engine, EngineConfig

signal.signal(signal.SIGUSR1, lambda signum, frame: None)
engine = Engine(EngineConfig(
    profile="swa-small", workload="none", use_model=False, duration=3.0,
    endpoint="tcp://127.0.0.1:{pub}", replay_endpoint="tcp://127.0.0.1:{replay}",
))

def storm():
    while True:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.0005)

threading.Thread(target=storm, daemon=True).start()
engine.run()
print("stopped")
"""


def test_the_engine_thread_keeps_turning_through_a_storm_of_signals() -> None:
    """Signals landing while the idle engine waits for commands must never wedge it: SIGTERM
    arrives exactly there. (CPython 3.11's SimpleQueue.get(timeout) could block forever.)"""
    script = SIGNAL_STORM.format(pub=free_port(), replay=free_port())
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr[-2000:]
