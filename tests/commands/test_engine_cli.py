"""``hmakv engine`` as users run it: the installed command, its options, signals, and
``hmakv decode --zmq`` watching it live (the issue's "done when")."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from hmakv.cli import build_parser, main
from hmakv.kafka.process import free_port
from hmakv.producer.events import decode
from hmakv.producer.protocol import decode_seq

HMAKV = Path(sys.executable).with_name("hmakv")
WAIT_S = 20.0  # bound on every wait; no test sleeps for a fixed time


@contextmanager
def engine_process(*options: str) -> Iterator[subprocess.Popen[str]]:
    command = [str(HMAKV), "engine", "--no-model", "--status-interval", "0", *options]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def receive_seqs(sub: zmq.Socket[bytes], count: int) -> list[int]:
    """Seqs of the next ``count`` messages, each checked to decode."""
    seqs: list[int] = []
    deadline = time.monotonic() + WAIT_S
    while len(seqs) < count:
        assert time.monotonic() < deadline, f"only {len(seqs)} of {count} batches arrived"
        if sub.poll(50):
            _, seq, payload = sub.recv_multipart()
            decode(payload)
            seqs.append(decode_seq(seq))
    return seqs


def last_seq_in_summary(stderr: str) -> int:
    match = re.search(r"last seq (\d+), (\d+) batches sent, 0 dropped", stderr)
    assert match, stderr
    return int(match.group(1))


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_engine_cleanly_after_sending_every_batch(
    stop_signal: signal.Signals,
) -> None:
    port = free_port()
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.bind(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        with engine_process("--rate", "50", "--endpoint", f"tcp://127.0.0.1:{port}") as process:
            received = receive_seqs(sub, 5)
            process.send_signal(stop_signal)
            _, stderr = process.communicate(timeout=WAIT_S)
            assert process.returncode == 0, stderr
            last = last_seq_in_summary(stderr)
            deadline = time.monotonic() + WAIT_S
            while last not in received:  # the drained publisher sent its last batch
                assert time.monotonic() < deadline, f"seq {last} never arrived"
                received += receive_seqs(sub, 1)
    assert "engine summary after" in stderr
    assert "Traceback" not in stderr


def test_decode_shows_the_engine_live() -> None:
    port = free_port()
    with engine_process(
        "--profile", "gpt-oss-like", "--workload", "chat", "--rate", "50",
        "--endpoint", f"tcp://*:{port}",
    ):  # fmt: skip
        decoded = subprocess.run(
            [str(HMAKV), "decode", "--zmq", f"tcp://127.0.0.1:{port}", "--count", "8",
             "--timeout", "10"],
            capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip
    assert decoded.returncode == 0, decoded.stderr
    batches = [json.loads(line) for line in decoded.stdout.splitlines()]
    assert len(batches) == 8
    seqs = [batch["seq"] for batch in batches]
    assert seqs == sorted(seqs)
    stores = [e for batch in batches for e in batch["events"] if e["type"] == "BlockStored"]
    assert stores
    for event in stores:
        expected = {0: ("full_attention", None), 1: ("sliding_window", 128)}[event["group_idx"]]
        assert (event["kv_cache_spec_kind"], event["kv_cache_spec_sliding_window"]) == expected
    assert {e["group_idx"] for e in stores} <= {0, 1}
    assert all(batch["data_parallel_rank"] == 0 for batch in batches)


def test_without_a_model_the_engine_never_imports_torch() -> None:
    """torch is an optional extra: ``--no-model`` must run where it is not installed."""
    arguments = ["engine", "--no-model", "--duration", "0.2", "--status-interval", "0",
                 "--endpoint", f"tcp://127.0.0.1:{free_port()}"]  # fmt: skip
    check = (
        f"import sys; from hmakv.cli import main; code = main({arguments!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=WAIT_S)


def test_options_come_from_the_environment_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HMAKV_ENGINE_PROFILE", "swa-small")
    monkeypatch.setenv("HMAKV_ENGINE_NO_MODEL", "1")
    monkeypatch.setenv("HMAKV_ENGINE_API", "127.0.0.1:8300")
    monkeypatch.setenv("HMAKV_ENGINE_RATE", "3.5")
    monkeypatch.setenv("HMAKV_ENGINE_REPLAY_ENDPOINT", "tcp://*:5560")
    monkeypatch.setenv("HMAKV_ENGINE_DP_RANK", "2")
    monkeypatch.setenv("HMAKV_ENGINE_BUFFER_STEPS", "64")

    args = build_parser().parse_args(["engine", "--rate", "7", "--hwm", "10"])

    assert args.profile == "swa-small"
    assert args.no_model is True
    assert args.api == ("127.0.0.1", 8300)
    assert args.rate == 7.0
    assert args.replay_endpoint == "tcp://*:5560"
    assert args.dp_rank == 2
    assert (args.buffer_steps, args.hwm) == (64, 10)
    assert (args.endpoint, args.workload, args.duration) == ("tcp://*:5557", "chat", None)


@pytest.mark.parametrize(
    ("arguments", "environment", "message"),
    [
        (["--rate", "0"], {}, "--rate: invalid positive number value"),
        (["--api", "8300"], {}, "--api: invalid HOST:PORT value"),
        (["--profile", "llama"], {}, "--profile: invalid choice"),
        (["--workload", "poetry"], {}, "--workload: invalid choice"),
        (["--hwm", "-1"], {}, "--hwm: invalid non-negative integer value"),
        ([], {"HMAKV_ENGINE_DURATION": "soon"}, "--duration: invalid positive number value"),
        # A variable is checked as its flag is, choices too.
        ([], {"HMAKV_ENGINE_PROFILE": "llama"}, "--profile: invalid choice: 'llama'"),
        ([], {"HMAKV_ENGINE_WORKLOAD": "poetry"}, "--workload: invalid choice: 'poetry'"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    arguments: list[str],
    environment: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["engine", *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_endpoint_in_use_exits_1_saying_which() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as holder:
        holder.setsockopt(zmq.LINGER, 0)
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        with engine_process(
            "--replay-endpoint", f"tcp://127.0.0.1:{port}",
            "--endpoint", f"tcp://127.0.0.1:{free_port()}",
        ) as process:  # fmt: skip
            _, stderr = process.communicate(timeout=WAIT_S)
    assert process.returncode == 1
    assert (
        f"cannot open the ZMQ sockets: Address already in use (addr='tcp://127.0.0.1:{port}')"
        in (stderr)
    )
