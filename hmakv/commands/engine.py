"""``hmakv engine``: run the reference hybrid engine and publish its KV events like vLLM does.

It is the stand-in for a vLLM fleet in demos and tests: a seeded workload drives a
continuous-batching scheduler over the hybrid cache manager (and the toy torch model unless
``--no-model``), and every step's events go out on vLLM's ZMQ protocol. Wiring only: the engine
itself is ``producer.engine.runner``, imported when the command runs so that other subcommands
never pay for it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import zmq

from hmakv.argtypes import (
    add_seconds,
    curve_key_pair,
    curve_public_key,
    curve_public_keys,
    host_port,
    non_negative_int,
    positive_float,
    positive_int,
)
from hmakv.producer.curve import CurveSettings
from hmakv.producer.engine.profiles import PROFILES
from hmakv.producer.engine.workloads import WORKLOADS

EXIT_OK = 0
EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_USAGE = 2

HELP = "run the reference hybrid engine, publishing vLLM-compatible KV events on ZMQ"
DESCRIPTION = (
    "Run the reference hybrid engine (vLLM's KV-cache manager semantics, a toy "
    "torch model) on a seeded workload and publish its KV-cache events over vLLM's ZMQ "
    "protocol."
)

EPILOG = """\
A status line goes to stderr every --status-interval seconds and a summary at exit; SIGINT and
SIGTERM stop the engine cleanly, sending every queued batch first.

examples:
  hmakv engine --profile gpt-oss-like --workload chat
  hmakv engine --no-model --workload documents --rate 50 --bind \\
      --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5560 --api 127.0.0.1:8300
  hmakv decode --zmq tcp://127.0.0.1:5557     # watch it, in another terminal"""


def register(parser: argparse.ArgumentParser) -> None:
    _add_engine_options(parser)
    _add_publisher_options(parser)
    _add_run_options(parser)
    parser.set_defaults(func=run)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--profile",
        choices=sorted(PROFILES),
        default="gpt-oss-like",
        help="model profile: its KV-cache groups",
    )
    add(
        "--num-blocks",
        type=positive_int,
        help="override the profile's block pool size (null block included)",
    )
    add(
        "--no-model",
        action="store_true",
        help="run the scheduler and cache without the torch model (synthetic tokens)",
    )
    add(
        "--device",
        help="torch device for the model, e.g. cpu or cuda:0 (default: cuda if available)",
    )
    add(
        "--token-budget",
        type=positive_int,
        default="512",
        help="tokens per step, vLLM's max_num_batched_tokens",
    )
    add(
        "--max-running",
        type=positive_int,
        default="64",
        help="requests per step, vLLM's max_num_seqs",
    )


def _add_publisher_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--endpoint",
        default="tcp://*:5557",
        help="ZMQ PUB endpoint; wildcards bind, host addresses connect (unless --bind)",
    )
    add(
        "--bind",
        action="store_true",
        help="bind --endpoint even where it names a host (tcp://127.0.0.1:5557: loopback only)",
    )
    add("--replay-endpoint", help="ZMQ ROUTER endpoint for replay and snapshot requests")
    add(
        "--buffer-steps",
        type=non_negative_int,
        default="10000",
        help="batches the replay ring keeps (vLLM's buffer_steps); a gap reaching further "
        "back is resynced by a snapshot",
    )
    add(
        "--hwm",
        type=non_negative_int,
        default="100000",
        help="ZMQ send high-water mark of the PUB socket, in batches (vLLM's hwm; 0: none): "
        "past it a subscriber that does not keep up misses batches, which it replays",
    )
    add("--topic", default="", help="ZMQ topic (default empty)")
    add("--worker-name", default="engine", help="this engine's name in status output")
    add(
        "--dp-rank",
        type=non_negative_int,
        default="0",
        help="data-parallel rank: offsets tcp ports and stamps batches, as vLLM does",
    )
    add(
        "--curve-secret-key",
        type=curve_key_pair,
        metavar="FILE",
        help="CURVE on both sockets: this engine's .key_secret file (hmakv keys generate)",
    )
    add(
        "--curve-server-key",
        type=curve_public_key,
        metavar="FILE|KEY",
        help="CURVE: the public key of the bridge an --endpoint that connects reaches",
    )
    add(
        "--curve-clients",
        type=curve_public_keys,
        metavar="DIR|FILE|KEY",
        help="CURVE: the only client keys (the bridges') that may read what this engine "
        "binds; without it any client that knows the engine's public key may",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--workload",
        choices=WORKLOADS,
        default="chat",
        help="traffic: chat, documents, random-prefix, or none (API only)",
    )
    add(
        "--rate",
        type=positive_float,
        default="10",
        help="workload requests per second, Poisson arrivals",
    )
    add("--seed", type=int, default="0", help="seed of the workload and the model weights")
    add(
        "--duration",
        type=positive_float,
        help="stop after this many seconds (default: run until SIGINT or SIGTERM)",
    )
    add(
        "--api",
        type=host_port,
        metavar="HOST:PORT",
        help="serve the HTTP API (requests, lookup, status) here, e.g. 127.0.0.1:8300",
    )
    add_seconds(
        parser,
        "--status-interval",
        "seconds between status lines on stderr, 0 for none",
        default="5",
        zero=True,
    )


def _curve(args: argparse.Namespace) -> CurveSettings | None:
    if args.curve_secret_key is None:
        if args.curve_server_key is not None or args.curve_clients is not None:
            raise ValueError("--curve-server-key and --curve-clients need --curve-secret-key")
        return None
    return CurveSettings(args.curve_secret_key, args.curve_server_key, args.curve_clients)


def run(args: argparse.Namespace) -> int:
    from hmakv.producer.engine.runner import Engine, EngineConfig  # the engine only when it runs

    try:
        curve = _curve(args)
    except ValueError as error:
        return _fail(str(error), EXIT_BAD_USAGE)

    config = EngineConfig(
        profile=args.profile,
        workload=args.workload,
        rate=args.rate,
        use_model=not args.no_model,
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint,
        buffer_steps=args.buffer_steps,
        hwm=args.hwm,
        bind=args.bind,
        curve=curve,
        topic=args.topic,
        worker_name=args.worker_name,
        dp_rank=args.dp_rank,
        device=args.device,
        seed=args.seed,
        duration=args.duration,
        num_blocks=args.num_blocks,
        api=args.api,
        status_interval=args.status_interval,
        token_budget=args.token_budget,
        max_running=args.max_running,
    )
    try:
        engine = Engine(config)
    except zmq.ZMQError as error:
        return _fail(f"cannot open the ZMQ sockets: {error}", EXIT_RUNTIME_FAILURE)
    except ImportError as error:
        return _fail(
            f"the model needs torch ({error}): install hmakv[engine], or run with --no-model",
            EXIT_RUNTIME_FAILURE,
        )
    except (OSError, RuntimeError) as error:
        return _fail(f"cannot start the engine: {error}", EXIT_RUNTIME_FAILURE)
    except ValueError as error:
        return _fail(str(error), EXIT_BAD_USAGE)
    with _stop_on_signals(engine.request_stop):
        summary = engine.run()
    _report(summary.text())
    return EXIT_OK


@contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGINT and SIGTERM stop the engine loop instead of killing it mid-step."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed on the main thread
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        stop()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> int:
    _report(f"hmakv engine: {message}")
    return code
