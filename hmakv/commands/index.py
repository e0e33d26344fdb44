"""``hmakv index``: follow the KV-event log in Kafka, serve /v1/score and /metrics.

Wiring only: the follower, the API and the exporter live in ``consumers``. SIGTERM and SIGINT
stop it cleanly: applied offsets committed (group mode), a final snapshot, clients closed.
Once caught up it tunes the garbage collector (``kvlog.heap``).
Exit codes: 0 after a clean stop, 1 after a failure (Kafka out of reach, say), 2 for a
configuration that cannot run, security settings Kafka refuses among them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import signal
import socket
from pathlib import Path

from aiokafka.errors import KafkaConnectionError

from hmakv.argtypes import (
    add_kafka_options,
    add_listen,
    add_seconds,
    host_port,
    kafka_security,
    non_negative_int,
    positive_float,
    positive_int,
)
from hmakv.consumers.api import ApiLimits, HashingDefaults
from hmakv.consumers.follower import MODES, Follower, FollowerConfig
from hmakv.consumers.freshness import (
    DEFAULT_MAX_BROKER_SILENCE_S,
    DEFAULT_MAX_WORKER_LAG,
    FreshnessLimits,
)
from hmakv.consumers.index import (
    DEFAULT_HASH_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS_PER_WORKER,
    DEFAULT_TIER_WEIGHTS,
)
from hmakv.consumers.service import DEFAULT_HOST, DEFAULT_PORT, IndexService, ServiceConfig
from hmakv.consumers.speculation import (
    DEFAULT_CEILING_S,
    DEFAULT_FLOOR_S,
    DEFAULT_MULTIPLIER,
    DEFAULT_TTL_S,
)
from hmakv.kvlog.heap import tune_garbage_collector
from hmakv.kvlog.kafka_client import KafkaRefusedError
from hmakv.kvlog.records import Topics
from hmakv.producer.hashing import HASH_FUNCTIONS

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_USAGE = 2
READY_POLL_S = 0.5

HELP = "follow the KV-event log in Kafka; serve /v1/score, /v1/workers and /metrics"
DESCRIPTION = (
    "Rebuild every worker's KV-cache residency from Kafka (HMA-aware: per cache "
    "group and medium), answer which worker holds a prompt's prefix, export Prometheus "
    "metrics, and snapshot the index so that a restart does not re-read the log."
)

EPILOG = """\
modes:
  replica  every instance reads every partition: each answers score queries on its own
  group    a consumer group splits the partitions: for scaling metrics and analytics

examples:
  hmakv index --kafka 127.0.0.1:9092
  hmakv index --kafka kafka:9092 --listen 10.0.0.8:8181 --snapshot-to file:/var/lib/hmakv/index
  hmakv index --kafka kafka:9092 --listen 0.0.0.0:8181 --router-listen 0.0.0.0:8182
  curl -s localhost:8181/v1/score -d '{"token_ids": [1, 2, 3]}'"""


def _tier_weights(text: str) -> list[tuple[str, float]]:
    """``MEDIUM=WEIGHT``, or several separated by commas (as one HMAKV_INDEX_TIER_WEIGHT holds
    them)."""
    return [_tier_weight(part) for part in text.split(",") if part]


def _tier_weight(text: str) -> tuple[str, float]:
    medium, sep, weight = text.partition("=")
    value = float(weight)
    if not sep or not medium or not (value >= 0 and math.isfinite(value)):
        raise ValueError(text)
    return medium.upper(), value


def _snapshot_target(text: str) -> str:
    if text in ("kafka", "none") or (text.startswith("file:") and len(text) > len("file:")):
        return text
    raise ValueError(text)


def _speculative_ttl(text: str) -> float | None:
    """``auto`` (None: follow the measured event lag) or a positive number of seconds."""
    return None if text == "auto" else positive_float(text)


_tier_weights.__name__ = "MEDIUM=WEIGHT[,...]"
_snapshot_target.__name__ = "kafka, file:PATH or none"
_speculative_ttl.__name__ = "auto or SECONDS"


def register(parser: argparse.ArgumentParser) -> None:
    _add_kafka_options(parser)
    _add_freshness_options(parser)
    _add_snapshot_options(parser)
    _add_api_options(parser)
    parser.set_defaults(func=run)


def _add_kafka_options(parser: argparse.ArgumentParser) -> None:
    add_kafka_options(parser, "PREFIX.events, .workers, .snapshots")
    add = parser.add_argument
    add(
        "--mode",
        choices=MODES,
        default="replica",
        help="replica: read every partition; group: share them in a consumer group",
    )
    add("--group-id", default="hmakv-index", help="consumer group in group mode")
    add(
        "--follower-id",
        default=socket.gethostname(),
        help="this instance's name: Kafka client id and snapshot key; keep it stable across "
        "restarts (default: the host name, here %(default)s)",
    )
    add(
        "--ready-max-lag",
        type=non_negative_int,
        default="1000",
        help="/readyz answers 200 once caught up with the log ends seen at start, or once at "
        "most this many records are left",
    )


def _add_freshness_options(parser: argparse.ArgumentParser) -> None:
    add_seconds(
        parser,
        "--fetch-max-wait",
        "how long a fetch may wait at the broker for records: Apache Kafka answers as soon as "
        "one arrives, Tansu only when this passes (so it bounds the index's staleness there)",
        default=f"{FollowerConfig.fetch_max_wait_s:g}",
    )
    add_seconds(
        parser,
        "--max-broker-silence",
        "seconds without an answer from Kafka after which /readyz answers 503 and every worker "
        "is stale (never best in /v1/score), until Kafka answers again",
        default=f"{DEFAULT_MAX_BROKER_SILENCE_S:g}",
    )
    parser.add_argument(
        "--max-worker-lag",
        type=non_negative_int,
        default=str(DEFAULT_MAX_WORKER_LAG),
        metavar="SEQS",
        help="a worker more than this many seqs behind what the bridge forwarded is stale: "
        "marked so in /v1/score and /v1/workers, and never best",
    )
    parser.add_argument(
        "--speculative-ttl",
        type=_speculative_ttl,
        default="auto",
        metavar="auto|SECONDS",
        help=f"how long a prompt's blocks count as held by the worker POST /v1/routed names, "
        f"unless its events settle them first; auto: {DEFAULT_MULTIPLIER:g} x the recent p99 "
        f"event lag within {DEFAULT_FLOOR_S:g}-{DEFAULT_CEILING_S:g} s ({DEFAULT_TTL_S:g} s "
        f"until a lag is measured)",
    )
    parser.add_argument(
        "--speculative-prefill-chunk",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="the engines' max_num_batched_tokens: a prompt POST /v1/routed names also counts "
        "the mamba states its prefill caches where its chunks stop, not only the last one "
        "(default: only the last)",
    )


def _add_snapshot_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--snapshot-to",
        type=_snapshot_target,
        default="kafka",
        help="kafka (the compacted PREFIX.snapshots topic), file:PATH, or none",
    )
    add_seconds(
        parser,
        "--snapshot-interval",
        "seconds between snapshots; 0: only at exit",
        default="60",
        zero=True,
    )


def _add_api_options(parser: argparse.ArgumentParser) -> None:
    add_listen(parser, "the API and /metrics", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}")
    add = parser.add_argument
    add(
        "--router-listen",
        type=host_port,
        metavar="HOST:PORT",
        help="also serve POST /v1/score and /v1/routed here, for routers: a lean HTTP/1.1 "
        "listener with about a third of the main port's HTTP cost (same answers, limits and "
        "token); off by default",
    )
    add(
        "--hash-fn",
        choices=HASH_FUNCTIONS,
        default="sha256_cbor",
        help="block hash function for token_ids, as the engines' --prefix-caching-hash-algo",
    )
    add(
        "--hash-seed", default="0", help="the engines' PYTHONHASHSEED, which NONE_HASH derives from"
    )
    add(
        "--block-size",
        type=positive_int,
        default=str(DEFAULT_HASH_BLOCK_SIZE),
        help="tokens per hashed block: the engines' smallest block size",
    )
    default_weights = ",".join(f"{m}={w}" for m, w in DEFAULT_TIER_WEIGHTS.items())
    add(
        "--tier-weight",
        type=_tier_weights,
        action="extend",
        metavar="MEDIUM=WEIGHT[,...]",
        help=f"weight of a cache tier in the score, repeatable; a medium without a weight is "
        f"not scored (default {default_weights})",
    )
    add(
        "--max-blocks-per-worker",
        type=positive_int,
        default=str(DEFAULT_MAX_BLOCKS_PER_WORKER),
        metavar="BLOCKS",
        help="blocks the index keeps for one worker (~100 bytes each); stores past it are "
        "refused and counted (hmakv_index_blocks_refused_total)",
    )
    limits = ApiLimits()
    for option, value, what in (
        ("max-body-bytes", limits.max_body_bytes, "bytes in a request body"),
        ("max-prompt-tokens", limits.max_prompt_tokens, "token ids in a score request"),
        ("max-prompt-blocks", limits.max_prompt_blocks, "block hashes in a score request"),
        ("max-concurrent", limits.max_concurrent, "requests in progress (more get 429)"),
    ):
        add(f"--{option}", type=positive_int, default=value, help=f"most {what}")
    add_seconds(
        parser,
        "--idle-timeout",
        "close a connection that waits this long for its next complete request head",
        default=str(limits.idle_timeout),
    )
    add_seconds(
        parser,
        "--read-timeout",
        "answer 408 to a body not read in this long",
        default=str(limits.read_timeout),
    )
    add(
        "--api-token-file",
        type=_token_file,
        metavar="PATH",
        help="a file holding the bearer token that /v1/score and /v1/workers then want",
    )


def _token_file(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read the token file: {error}") from None
    if not token:
        raise argparse.ArgumentTypeError(f"the token file {path} is empty")
    return token


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The parsed options as the service's configuration; ValueError on a bad combination."""
    host, port = args.listen
    follower = FollowerConfig(
        bootstrap=args.kafka,
        topics=Topics(args.topic_prefix),
        mode=args.mode,
        group_id=args.group_id,
        follower_id=args.follower_id,
        security=kafka_security(args),
        hash_block_size=args.block_size,
        tier_weights=dict(args.tier_weight or DEFAULT_TIER_WEIGHTS),
        max_blocks_per_worker=args.max_blocks_per_worker,
        snapshot_interval_s=args.snapshot_interval,
        ready_max_lag=args.ready_max_lag,
        freshness=FreshnessLimits(
            max_broker_silence_s=args.max_broker_silence, max_worker_lag=args.max_worker_lag
        ),
        speculative_ttl_s=args.speculative_ttl,
        speculative_prefill_chunk_tokens=args.speculative_prefill_chunk,
        fetch_max_wait_s=args.fetch_max_wait,
    )
    return ServiceConfig(
        follower=follower,
        host=host,
        port=port,
        snapshot_to=args.snapshot_to,
        hashing=HashingDefaults(hash_fn=args.hash_fn, seed=args.hash_seed),
        limits=ApiLimits(
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompt_blocks=args.max_prompt_blocks,
            max_concurrent=args.max_concurrent,
            idle_timeout=args.idle_timeout,
            read_timeout=args.read_timeout,
        ),
        api_token=args.api_token_file,
        router_listen=args.router_listen,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = service_config(args)
    except ValueError as exc:
        log.error("%s", exc)
        return EXIT_BAD_USAGE
    try:
        asyncio.run(_serve(config))
    except KafkaRefusedError as exc:  # a wrong password or CA: restarting cannot help
        log.error("the index did not start: %s", exc)
        return EXIT_BAD_USAGE
    except KafkaConnectionError as exc:  # an outage, not a bug: one line, for its supervisor
        log.error("the index stopped: %s (Kafka at %s)", exc, config.follower.bootstrap)
        return EXIT_RUNTIME_FAILURE
    except OSError as exc:  # --listen's port taken, a snapshot path or SSL file unusable
        log.error("the index stopped: %s", exc)
        return EXIT_RUNTIME_FAILURE
    except Exception:
        log.exception("the index stopped on an error")
        return EXIT_RUNTIME_FAILURE
    return EXIT_OK


async def _serve(config: ServiceConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    service = IndexService(config)
    tuning = asyncio.create_task(_tune_once_caught_up(service.follower))
    try:
        await service.run_until(stop)
    finally:
        tuning.cancel()


async def _tune_once_caught_up(follower: Follower) -> None:
    """The index's heap is built once the log is read to where it ended at start (or the
    snapshot restored and what followed it read): freeze it then, once."""
    while not follower.ready:
        await asyncio.sleep(READY_POLL_S)
    tune_garbage_collector()
    log.info("caught up: %d objects frozen out of the garbage collector", gc.get_freeze_count())
