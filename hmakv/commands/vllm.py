"""``hmakv vllm``: real vLLM on this machine's CPU, with a tiny hybrid model built locally.

``serve`` builds the profile's model if needed, prints where the server will listen, and then
becomes vLLM's OpenAI server (exec), so a supervisor's SIGTERM stops vLLM itself. vLLM must be
set up first by ``scripts/setup-vllm`` (its own venv; the venv's path is printed at the end).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hmakv.argtypes import add_command, positive_int
from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.vllm.profiles import PROFILES, VllmProfile
from hmakv.vllm.server import (
    DEFAULT_TOPIC,
    ServerPorts,
    VllmUnavailable,
    ensure_model,
    server_argv,
    server_env,
    vllm_venv,
)

EXIT_OK = 0
EXIT_RUNTIME_FAILURE = 1

HELP = "run real vLLM (CPU) with a tiny hybrid model and KV events on"
DESCRIPTION = "Real vLLM on the CPU: list the model profiles, build one, or serve it."

EPILOG = """\
examples:
  scripts/setup-vllm                                   # once: vLLM's own venv
  hmakv vllm profiles
  hmakv vllm serve --profile gemma3-swa64 --port 8000 --events-port 5557 --replay-port 5560
  hmakv decode --zmq tcp://127.0.0.1:5557 --topic kv-events     # watch its events"""


def register(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="vllm_action", metavar="ACTION", required=True)
    listing = actions.add_parser("profiles", help="the model profiles and their layer layouts")
    listing.set_defaults(func=list_profiles)
    model = _add_action(actions, "model", "build a profile's model (if not built) and print it")
    model.set_defaults(func=build)
    serve = _add_action(actions, "serve", "serve a profile with vLLM, KV events on")
    _add_serve_options(serve)
    serve.set_defaults(func=run_server)


def _add_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, what: str
) -> argparse.ArgumentParser:
    """An action's parser, with --profile."""
    action = add_command(actions, name, help=what, parent="vllm")
    action.add_argument(
        "--profile", choices=sorted(PROFILES), default="gemma3-swa64", help="model profile"
    )
    return action


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    for option, what in (
        ("port", "the OpenAI API's port"),
        ("events-port", "the KV events' PUB port"),
        ("replay-port", "the KV events' replay (ROUTER) port"),
    ):
        add(f"--{option}", type=positive_int, help=f"{what} (default: a free one)")
    add("--topic", default=DEFAULT_TOPIC, help="the KV events' ZMQ topic")
    add(
        "--num-gpu-blocks",
        type=positive_int,
        help="the block pool, vLLM's --num-gpu-blocks-override (default: the profile's, small "
        "so that the cache evicts)",
    )
    add(
        "--omp-threads",
        type=positive_int,
        default="1",
        help="vLLM's CPU threads (1: the pipeline needs the other core)",
    )
    add(
        "--hmakv-publisher",
        action="store_true",
        help="publish through hmakv's publisher (the vLLM plugin, HMAKV_VLLM_PUBLISHER=1)",
    )


def list_profiles(args: argparse.Namespace) -> int:
    for profile in PROFILES.values():
        layers = " ".join("full" if t == "full_attention" else "swa" for t in profile.layer_types)
        print(
            f"{profile.name:<18} {profile.architecture:<20} layers [{layers}] "
            f"window {profile.sliding_window} block {profile.block_size} "
            f"pool {profile.num_gpu_blocks}"
        )
    print(f"vLLM venv: {vllm_venv()}")
    return EXIT_OK


def build(args: argparse.Namespace) -> int:
    model = _built_model(PROFILES[args.profile])
    if model is None:
        return EXIT_RUNTIME_FAILURE
    print(model)
    return EXIT_OK


def run_server(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile]
    model = _built_model(profile)
    if model is None:
        return EXIT_RUNTIME_FAILURE
    ports = ServerPorts(
        api=args.port or free_port(),
        events=args.events_port or free_port(),
        replay=args.replay_port or free_port(),
    )
    argv = server_argv(profile, model, ports, topic=args.topic, num_gpu_blocks=args.num_gpu_blocks)
    env = {
        **os.environ,
        **server_env(hmakv_publisher=args.hmakv_publisher, omp_threads=args.omp_threads),
    }
    print(
        f"hmakv vllm serve: {profile.name} at http://{LOOPBACK}:{ports.api}, KV events "
        f"tcp://{LOOPBACK}:{ports.events} (replay tcp://{LOOPBACK}:{ports.replay}, topic "
        f"{args.topic!r}), {'hmakv' if args.hmakv_publisher else 'vLLM'}'s publisher",
        file=sys.stderr,
        flush=True,
    )
    os.execve(argv[0], argv, env)
    return EXIT_RUNTIME_FAILURE  # not reached: exec replaces this process


def _built_model(profile: VllmProfile) -> Path | None:
    """The profile's model folder, built first if need be; None, the reason on stderr, where
    vLLM's venv cannot build it."""
    try:
        return ensure_model(profile)
    except VllmUnavailable as error:
        print(f"hmakv vllm: {error}", file=sys.stderr)
        return None
