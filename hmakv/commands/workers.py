"""``hmakv workers list|retire|forget``: the operator's hand on the workers topic.

The bridge retires a worker itself when it leaves the fleet through a reload (SIGHUP) or is an
llm-d pod replaced at ``--max-workers``. A worker whose bridge went away with it, or that left
through a restart with fewer ``--engine`` flags, has no one to say so: ``retire`` writes its
latest state again as ``retired``, and consumers drop it and ignore its records of that epoch.
``forget`` writes a tombstone, once the events topic holds none of the worker's records (after
its retention), so that the compacted topic forgets it too. Exit codes: 0 done, 1 Kafka failed
(out of reach), 2 bad usage, security settings Kafka refuses (a wrong password, an untrusted
certificate) or a worker the topic does not know.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from hmakv.argtypes import add_command, add_kafka_options, kafka_security
from hmakv.bridge.resume import read_worker_states
from hmakv.kvlog.kafka_client import (
    KafkaRefusedError,
    KafkaSecurity,
    check_access,
    start_producer,
    topic_partitions,
)
from hmakv.kvlog.records import RETIRED, Topics, WorkerState, encode
from hmakv.producer.events import GroupSpec

EXIT_OK, EXIT_KAFKA, EXIT_USAGE = 0, 1, 2

HELP = "list, retire or forget workers in the workers topic"
DESCRIPTION = (
    "List the workers topic, retire workers no bridge follows any more, forget "
    "workers whose records are past retention."
)

EPILOG = """\
examples:
  hmakv workers list --kafka 127.0.0.1:9092
  hmakv workers retire engine-a-dp0 engine-a-dp1 --kafka 127.0.0.1:9092  # no bridge follows it
  hmakv workers forget engine-a-dp0 --kafka 127.0.0.1:9092   # its records are past retention

Retire only a worker no bridge follows any more: a bridge still following one goes on writing
its epoch, which consumers then ignore (remove it from the bridge's engines instead: on SIGHUP
the bridge retires it itself).
"""


class WorkersError(Exception):
    """A request the topic cannot satisfy; the message says why (exit 2)."""


def register(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = _add_action(actions, "list", "every worker's latest state")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    for action, what in (
        ("retire", "write workers' latest states again, retired"),
        ("forget", "write tombstones: the topic forgets workers"),
    ):
        named = _add_action(actions, action, what)
        named.add_argument("workers", nargs="+", metavar="WORKER")
    parser.set_defaults(func=run)


def _add_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, what: str
) -> argparse.ArgumentParser:
    """An action's parser, with the Kafka options (after the action, as every action takes
    them)."""
    action = add_command(actions, name, help=what, parent="workers")
    add_kafka_options(action, "PREFIX.workers")
    return action


def run(args: argparse.Namespace) -> int:
    try:
        security = kafka_security(args)
    except ValueError as error:  # bad usage, as the bridge and index say it
        print(f"hmakv workers: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(_run(args, security))
    except (WorkersError, KafkaRefusedError) as error:
        print(f"hmakv workers: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KafkaError, OSError) as error:
        print(f"hmakv workers: Kafka at {args.kafka}: {error!r}", file=sys.stderr)
        return EXIT_KAFKA


async def _run(args: argparse.Namespace, security: KafkaSecurity) -> int:
    topic = Topics(args.topic_prefix).workers
    await check_access(args.kafka, security)
    partitions = await topic_partitions(args.kafka, topic, security)
    if not partitions:
        raise WorkersError(f"no topic {topic} (no bridge has run with this prefix)")
    states = await read_worker_states(args.kafka, topic, partitions, security=security)
    if args.action == "list":
        _print_states(states, as_json=args.json)
        return EXIT_OK
    chosen = _known(states, args.workers)
    started = await start_producer(args.kafka, client_id="hmakv-workers", security=security)
    try:
        for state in chosen:
            write = _retire if args.action == "retire" else _forget
            await write(started.producer, topic, state)
    finally:
        await started.producer.stop()
    return EXIT_OK


async def _retire(producer: AIOKafkaProducer, topic: str, state: WorkerState) -> None:
    if state.health == RETIRED:
        print(f"{state.worker}: retired already (epoch {state.epoch})")
        return
    retired = msgspec.structs.replace(state, health=RETIRED)
    await producer.send_and_wait(topic, encode(retired), key=retired.key())
    print(f"{state.worker}: retired at epoch {state.epoch}")


async def _forget(producer: AIOKafkaProducer, topic: str, state: WorkerState) -> None:
    await producer.send_and_wait(topic, None, key=state.key())
    print(f"{state.worker}: forgotten")


def _known(states: dict[str, WorkerState], workers: Sequence[str]) -> list[WorkerState]:
    """The named workers' states, each once however often named; none is written unless every
    name is known (a typo)."""
    named = list(dict.fromkeys(workers))
    unknown = [worker for worker in named if worker not in states]
    if unknown:
        raise WorkersError(f"not in the workers topic: {', '.join(unknown)}")
    return [states[worker] for worker in named]


def _print_states(states: dict[str, WorkerState], *, as_json: bool) -> None:
    now = time.time()
    if as_json:
        for worker in sorted(states):
            print(json.dumps(msgspec.to_builtins(states[worker])))
        return
    print(
        f"{'worker':<24} {'epoch':>5} {'last seq':>9} {'health':<9} {'engine ts age':>13}  groups"
    )
    for worker in sorted(states):
        state = states[worker]
        age = f"{now - state.ts:.0f} s" if state.ts else "-"
        print(
            f"{worker:<24} {state.epoch:>5} {state.last_seq:>9} {state.health:<9} {age:>13}  "
            f"{_groups(state.groups)}"
        )


def _groups(groups: dict[int, GroupSpec]) -> str:
    parts = []
    for group, spec in sorted(groups.items()):
        text = f"{group}:{spec.kind}/{spec.block_size}"
        if spec.sliding_window is not None:
            text += f" w{spec.sliding_window}"
        if spec.chunk_size is not None:
            text += f" c{spec.chunk_size}"
        parts.append(text)
    return " ".join(parts) or "-"
