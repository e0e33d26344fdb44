"""``hmakv bridge``: follow engines' KV-cache events over ZMQ and write them to Kafka.

Wiring only: flags (or their variables) into ``BridgeSettings`` and engine configs, signals
into the service's life cycle (SIGTERM/SIGINT: deliver what is queued and stop; SIGHUP: reload
the ``--engines`` file). Exit codes: 0 after a clean stop, 1 after a failure that stopped forwarding
(a bug; restarted, the bridge resumes where it was), 2 for a configuration that cannot run,
security settings Kafka refuses among them (a wrong password, an untrusted certificate).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from hmakv.argtypes import (
    add_kafka_options,
    add_listen,
    add_seconds,
    curve_key_pair,
    curve_public_keys,
    kafka_security,
    non_negative_float,
    positive_int,
)
from hmakv.bridge.config import (
    ConfigError,
    EngineConfig,
    Shard,
    check_unique,
    load_engines_file,
    parse_engine_flags,
)
from hmakv.bridge.frames import EventLimits
from hmakv.bridge.roster import DEFAULT_JOINS_PER_MINUTE
from hmakv.bridge.service import BridgeService, BridgeSettings, check_topology
from hmakv.bridge.tracking import DEFAULT_MAX_BUFFERED
from hmakv.kvlog.heap import tune_garbage_collector
from hmakv.kvlog.kafka_client import KafkaRefusedError
from hmakv.kvlog.logs import JsonFormatter

log = logging.getLogger("hmakv.bridge")

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_BAD_CONFIG = 2
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")

HELP = "follow engines' KV-cache events (ZMQ) and write them to Kafka"

DESCRIPTION = """\
Follow vLLM-compatible KV-cache event publishers over ZeroMQ and write their batches to Kafka:
one record per (batch, cache group) on <prefix>.events keyed "<worker>/<group>", each worker's
epoch, groups, last seq and health on the compacted <prefix>.workers, and every frame that cannot
be used on <prefix>.deadletter. Gaps are replayed from the engine's replay endpoint; an engine
restart starts a new epoch opening with a clear; what cannot be recovered clears the worker and
marks it degraded. A restarted bridge resumes where the workers topic says it stopped.

Engines come from --engine flags, HMAKV_BRIDGE_ENGINE (';'-separated) and --engines FILE (TOML,
reloaded on SIGHUP). Either the bridge connects to each engine's PUB endpoint, or engines
connect to --bind-sub and are told apart by topic (configured, or with --join-by-topic llm-d's
kv@<pod-id>@<model>).
"""

EPILOG = """\
engines file (TOML):
  [[engines]]
  name = "engine-a"
  endpoint = "tcp://10.0.0.5:5557"      # omit when the engine connects to --bind-sub
  replay = "tcp://10.0.0.5:5560"        # optional: gaps are lost without it
  topic = "kv-events"                   # the engine's ZMQ topic (default "")
  dp_ranks = [0, 1]                     # optional: one worker per rank, ports offset by rank
  shard = 1                             # optional: the --shard INDEX that follows it
  public_key = "keys/engine-a.key"      # with --curve-secret-key: its certificate, or z85 key
  groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk_size = 8192 } }

endpoints: /healthz (alive), /readyz (Kafka reachable and every source connected or failed),
/metrics (Prometheus, hmakv_bridge_*), on --listen.

examples:
  hmakv bridge --kafka 127.0.0.1:9092 --engine engine-a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5560
  hmakv bridge --engines engines.toml --listen 10.0.0.7:9400   # one interface, not 0.0.0.0
  hmakv bridge --engines engines.toml --shard 1/2    # half the fleet; another bridge runs 0/2
  hmakv bridge --bind-sub 'tcp://*:5557' --kafka kafka:9092
  hmakv keys generate bridge --dir keys   # then: --curve-secret-key keys/bridge.key_secret"""


LOG_FORMATS = ("text", "json")


def register(parser: argparse.ArgumentParser) -> None:
    _add_engine_options(parser)
    add_kafka_options(parser, "PREFIX.events, .workers, .deadletter", default="127.0.0.1:9092")
    _add_kafka_tuning(parser)
    add_listen(parser, "/healthz, /readyz and /metrics")
    _add_flow_options(parser)
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        env_var="HMAKV_LOG_FORMAT",
        help="log lines as text or as JSON objects",
    )
    parser.set_defaults(func=run)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--engines", type=Path, metavar="FILE", help="TOML file of engines, reloaded on SIGHUP")
    add(
        "--engine",
        action="extend",
        type=_engine_flags,
        default=[],
        metavar="NAME=ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N][,shard=I][,key=K]",
        help="an engine to connect to; repeatable, or several separated by ';' (key: its CURVE "
        "public key, a certificate file or the z85 key)",
    )
    add(
        "--curve-secret-key",
        type=curve_key_pair,
        metavar="FILE",
        help="CURVE: the bridge's .key_secret file (hmakv keys generate); every engine then "
        "needs its public key, and only it can publish on its topic on --bind-sub",
    )
    add(
        "--join-keys",
        type=curve_public_keys,
        metavar="DIR|FILE|KEY",
        help="CURVE: public keys (a directory of *.key files) that may join workers with "
        "--join-by-topic; each worker is then taken from its key only",
    )
    add(
        "--bind-sub",
        metavar="ENDPOINT",
        help="bind a SUB socket engines connect to, e.g. tcp://*:5557",
    )
    add(
        "--bind-sub-ranks",
        type=positive_int,
        default="1",
        metavar="N",
        help="DP ranks of the engines that connect to --bind-sub: vLLM offsets each rank's port, "
        "so the bridge binds PORT..PORT+N-1",
    )
    add(
        "--shard",
        type=_shard,
        default="0/1",
        metavar="INDEX/COUNT",
        help="follow only the engines pinned to INDEX (shard=I) or, unpinned, whose name hashes "
        "to it, to split a fleet between COUNT bridges",
    )


def _add_kafka_tuning(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--partitions", type=positive_int, default="6", help="partitions of topics it creates")
    add("--replication", type=positive_int, default="1", help="replication of topics it creates")
    add("--compression", choices=COMPRESSIONS, default="none", help="producer compression")
    add(
        "--linger-ms",
        type=non_negative_float,
        default="2",
        metavar="MS",
        help="how long a small chunk of records may wait for more before it is sent to Kafka, "
        "while an earlier chunk is unacknowledged (an idle producer sends at once)",
    )
    add(
        "--max-record-bytes",
        type=positive_int,
        default=str(8 * 1024 * 1024),
        metavar="BYTES",
        help="largest event record; a group's larger one is split over several, a batch with an "
        "event larger on its own is lost and its worker degraded",
    )
    add_seconds(
        parser,
        "--state-interval",
        "write each worker's resume point at most this often",
        default="1",
    )


def _add_flow_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--max-replays", type=positive_int, default="4", help="replays and snapshots in flight")
    add_seconds(
        parser,
        "--replay-timeout",
        "give a replay up after this long without a reply message; its gap is then lost",
        default="5",
    )
    add(
        "--queue-size",
        type=positive_int,
        default="10000",
        metavar="BATCHES",
        help="batches held for Kafka; while it is full the bridge stops receiving and the "
        "engines' queues and replay rings hold the rest",
    )
    add(
        "--rcvhwm",
        type=positive_int,
        default="1000",
        metavar="MESSAGES",
        help="ZMQ receive high-water mark per SUB socket: what one socket may hold while "
        "intake is paused",
    )
    add(
        "--max-buffered",
        type=positive_int,
        default=str(DEFAULT_MAX_BUFFERED),
        metavar="BATCHES",
        help="live batches held per worker during a replay; more wait for the next replay",
    )
    add(
        "--join-by-topic",
        action="store_true",
        help="on --bind-sub, let engines that are not in --engines join when their topic is "
        "llm-d's kv@<pod-id>@<model> (off: refused and dead-lettered, since anyone who reaches "
        "the socket could write the index)",
    )
    add(
        "--max-workers",
        type=positive_int,
        default="1024",
        help="workers accepted by topic on --bind-sub; past it a new one replaces one silent "
        "for 5 minutes",
    )
    add(
        "--max-joins-per-minute",
        type=positive_int,
        default=str(DEFAULT_JOINS_PER_MINUTE),
        help="new workers one source (a CURVE key; without CURVE the whole socket) may name by "
        "topic a minute; more are dead-lettered as join_rate_exceeded",
    )
    add(
        "--max-payload-bytes",
        type=positive_int,
        default=str(64 * 1024 * 1024),
        metavar="BYTES",
        help="dead-letter larger payloads",
    )
    limits = EventLimits()
    add(
        "--max-hashes-per-event",
        type=positive_int,
        default=str(limits.max_hashes_per_event),
        metavar="HASHES",
        help="dead-letter a batch with an event listing more block hashes (consumers keep each "
        "one: ~100 bytes for 1 to 9 on the wire); a configured engine's is then a loss",
    )
    add(
        "--max-hashes-per-batch",
        type=positive_int,
        default=str(limits.max_hashes_per_batch),
        metavar="HASHES",
        help="likewise for the hashes of all a batch's events",
    )
    add(
        "--max-token-ids-per-event",
        type=positive_int,
        default=str(limits.max_token_ids_per_event),
        metavar="TOKENS",
        help="likewise for a store's token ids",
    )
    add_seconds(
        parser,
        "--quiet-catch-up",
        "replay from a worker's next seq when nothing came from it for this long, 0 never (what "
        "was lost at the end of a burst waits for the engine's next batch otherwise)",
        default="5",
        zero=True,
    )
    add_seconds(
        parser, "--shutdown-timeout", "on SIGTERM, time to deliver what is queued", default="10"
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        engines = _engines(args)
        check_topology(settings, engines)
    except (ConfigError, ValueError) as error:
        print(f"hmakv bridge: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    return asyncio.run(_serve(settings, engines, args))


def _settings(args: argparse.Namespace) -> BridgeSettings:
    return BridgeSettings(
        kafka=args.kafka,
        topic_prefix=args.topic_prefix,
        partitions=args.partitions,
        replication=args.replication,
        compression=None if args.compression == "none" else args.compression,
        bind_sub=args.bind_sub,
        bind_sub_ranks=args.bind_sub_ranks,
        listen=args.listen,
        max_replays=args.max_replays,
        replay_timeout=args.replay_timeout,
        queue_size=args.queue_size,
        rcvhwm=args.rcvhwm,
        linger=args.linger_ms / 1000,
        max_buffered=args.max_buffered,
        max_payload_bytes=args.max_payload_bytes,
        limits=EventLimits(
            max_hashes_per_event=args.max_hashes_per_event,
            max_hashes_per_batch=args.max_hashes_per_batch,
            max_token_ids_per_event=args.max_token_ids_per_event,
        ),
        max_record_bytes=args.max_record_bytes,
        max_workers=args.max_workers,
        max_joins_per_minute=args.max_joins_per_minute,
        join_by_topic=args.join_by_topic,
        state_interval=args.state_interval,
        shutdown_timeout=args.shutdown_timeout,
        quiet_catch_up=args.quiet_catch_up,
        security=kafka_security(args),
        curve_keys=args.curve_secret_key,
        join_keys=args.join_keys or frozenset(),
    )


def _engines(args: argparse.Namespace) -> list[EngineConfig]:
    return _shard_of(args, _fleet(args))


def _fleet(args: argparse.Namespace) -> list[EngineConfig]:
    """Every engine configured, whichever shard follows it."""
    engines = parse_engine_flags(args.engine)
    if args.engines is not None:
        engines += load_engines_file(args.engines)
    if not engines and args.bind_sub is None:
        raise ConfigError("no engines: give --engine, --engines or --bind-sub")
    return check_unique(engines)


def _shard_of(args: argparse.Namespace, engines: list[EngineConfig]) -> list[EngineConfig]:
    shard: Shard = args.shard
    if shard.count > 1 and args.bind_sub is not None:
        raise ConfigError(
            "--shard splits the engines bridges connect to; with --bind-sub, point each engine "
            "at one bridge's endpoint instead"
        )
    mine = shard.select(engines)
    if shard.count > 1:
        log.info("shard %s: following %d of %d engines", shard, len(mine), len(engines))
    return mine


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


async def _serve(
    settings: BridgeSettings, engines: list[EngineConfig], args: argparse.Namespace
) -> int:
    service = BridgeService(settings, engines)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    reloads: set[asyncio.Task[None]] = set()
    # Also without an engines file: SIGHUP's default action would end the bridge unflushed.
    loop.add_signal_handler(signal.SIGHUP, lambda: _schedule_reload(service, args, reloads))
    starting = asyncio.create_task(service.start())
    stopped = asyncio.create_task(stopping.wait())
    await asyncio.wait([starting, stopped], return_when="FIRST_COMPLETED")
    crashed = asyncio.create_task(service.wait_crashed())
    if starting.done():
        if (error := starting.exception()) is not None:  # --listen's port taken, say
            log.critical("the bridge did not start: %s", error)
            await service.stop()
            return EXIT_BAD_CONFIG if isinstance(error, KafkaRefusedError) else EXIT_CRASHED
        tune_garbage_collector()
        await asyncio.wait([stopped, crashed], return_when="FIRST_COMPLETED")
    else:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
    log.info("stopping: delivering what is queued")
    await service.stop()
    if crashed.done():
        log.critical("the bridge stopped after a failure; restarted, it resumes where it was")
        return EXIT_CRASHED
    crashed.cancel()
    return EXIT_OK


def _schedule_reload(
    service: BridgeService, args: argparse.Namespace, running: set[asyncio.Task[None]]
) -> None:
    task = asyncio.create_task(reload_engines(service, args))
    running.add(task)
    task.add_done_callback(running.discard)


async def reload_engines(service: BridgeService, args: argparse.Namespace) -> None:
    """What SIGHUP does: read the configuration again and follow it; one that cannot run is
    logged and the current engines kept."""
    try:
        fleet = _fleet(args)
        await service.reload(_shard_of(args, fleet), fleet=[engine.name for engine in fleet])
    except ConfigError as error:
        log.error("SIGHUP: engines not reloaded, keeping the current ones: %s", error)


def _engine_flags(text: str) -> list[str]:
    """One --engine, or several separated by ';' (as one HMAKV_BRIDGE_ENGINE holds them)."""
    return [part for part in text.split(";") if part.strip()]
