"""Which engines the bridge follows: from ``--engine`` flags, the environment or a TOML file.

An engine is a name (its worker id), a PUB endpoint to connect to (or, when engines connect to
the bridge's bound SUB socket, the topic its messages carry), an optional replay endpoint, and
the DP ranks behind the endpoints (one worker per rank, ports offset by the rank as vLLM does).
Parsing never half-succeeds: a bad entry is a ``ConfigError`` naming the entry and the field.

TOML (``--engines engines.toml``, reloaded on SIGHUP)::

    [[engines]]
    name = "engine-a"
    endpoint = "tcp://10.0.0.5:5557"
    replay = "tcp://10.0.0.5:5560"
    topic = "kv-events"
    dp_ranks = [0, 1]
    shard = 1
    public_key = "keys/engine-a.key"   # CURVE: a certificate file (relative to this file) or z85
    groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk_size = 8192 } }
"""

from __future__ import annotations

import tomllib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from hmakv.kvlog.records import worker_id
from hmakv.producer.events import GROUP_KINDS, MAX_GROUP_IDX, GroupSpec
from hmakv.producer.protocol import offset_endpoint_port

_FLAG_OPTIONS = ("replay", "topic", "dp", "shard", "key")


class ConfigError(ValueError):
    """A configuration the bridge cannot run with; the message says where and why."""


@dataclass(frozen=True)
class EngineConfig:
    name: str
    endpoint: str | None = None
    replay: str | None = None
    topic: str = ""
    dp_ranks: tuple[int, ...] | None = None
    groups: Mapping[int, GroupSpec] = field(default_factory=dict)
    shard: int | None = None  # the --shard INDEX that follows this engine; None: by its name
    # CURVE: the engine's public key (z85). The bridge checks the engine's sockets by it where
    # it connects, and admits the engine by it (on its topic only) on --bind-sub.
    public_key: bytes | None = None

    def __post_init__(self) -> None:
        try:
            worker_id(self.name, None)
        except ValueError as error:
            raise ConfigError(f"engine {self.name!r}: {error}") from error
        for endpoint in (self.endpoint, self.replay):
            if endpoint is not None:
                self._check_endpoint(endpoint)
        if self.dp_ranks is not None:
            self._check_ranks(self.dp_ranks)
        try:
            for worker in self.workers():  # each DP rank's endpoints: vLLM offsets TCP ports
                self._check_ports(worker)
        except ValueError as error:  # a port that is no number, or one int() will not read
            raise ConfigError(f"engine {self.name!r}: {error}") from error
        if self.shard is not None and self.shard < 0:
            raise ConfigError(f"engine {self.name!r}: shard must be non-negative")

    def _check_endpoint(self, endpoint: str) -> None:
        """The bridge connects to an engine's endpoints, and ZMQ can only bind a ``*`` host:
        vLLM's default ``tcp://*:5557`` names no engine, and connecting to it fails."""
        if "://" not in endpoint:
            raise ConfigError(f"engine {self.name!r}: {endpoint!r} is not a ZMQ endpoint")
        if any(host == "*" for host, _ in _tcp_addresses(endpoint)):
            raise ConfigError(
                f"engine {self.name!r}: {endpoint!r} is a wildcard the engine binds; name the "
                "engine's host for the bridge to connect to, e.g. tcp://engine-host:5557"
            )

    def _check_ranks(self, ranks: tuple[int, ...]) -> None:
        """Each rank is a worker named after it: a repeated rank would be one worker twice, and
        ``True`` (an int to Python) a worker named ``-dpTrue``."""
        if not ranks or any(isinstance(r, bool) or r < 0 for r in ranks):
            raise ConfigError(
                f"engine {self.name!r}: dp_ranks must be non-negative integers, not empty"
            )
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"engine {self.name!r}: dp_ranks {list(ranks)} repeat a rank")

    @staticmethod
    def _check_ports(worker: WorkerAddress) -> None:
        """vLLM offsets a TCP port by the DP rank: past 65535 no engine can listen there.
        Raises ``ValueError``, for ``__post_init__`` to say which engine."""
        for endpoint in (worker.endpoint, worker.replay):
            addresses = _tcp_addresses(endpoint) if endpoint is not None else []
            port = addresses[-1][1] if addresses else ""
            if _is_digits(port) and int(port) > 65535:
                rank = worker.data_parallel_rank
                offset = f" (DP rank {rank}'s port: vLLM offsets it by the rank)" if rank else ""
                raise ValueError(f"{endpoint} is past port 65535{offset}")

    def workers(self) -> list[WorkerAddress]:
        """One worker per DP rank, with the endpoints vLLM gives that rank."""
        if self.dp_ranks is None:
            return [WorkerAddress(self.name, None, self.endpoint, self.replay, self.public_key)]
        return [
            WorkerAddress(
                worker_id(self.name, rank),
                rank,
                offset_endpoint_port(self.endpoint, rank),
                offset_endpoint_port(self.replay, rank),
                self.public_key,
            )
            for rank in self.dp_ranks
        ]

    def worker_for_rank(self, rank: int | None) -> WorkerAddress | None:
        """The worker a message with this DP rank belongs to (bound SUB socket: many engines)."""
        if self.dp_ranks is None:
            return self.workers()[0] if rank in (None, 0) else None
        return next((w for w in self.workers() if w.data_parallel_rank == rank), None)


@dataclass(frozen=True)
class WorkerAddress:
    worker: str
    data_parallel_rank: int | None
    endpoint: str | None
    replay: str | None
    public_key: bytes | None = None  # the engine's CURVE key: its sockets must prove it


@dataclass(frozen=True)
class Shard:
    """This bridge's part of a fleet split between ``count`` bridges (``--shard INDEX/COUNT``).

    One Python process forwards about 20,000 step batches per second (BENCHMARKS.md), so a
    larger fleet is split between bridges, each following the engines whose name hashes to its
    index. A worker's records, sequence tracking and resume point stay with one bridge, and the
    hash depends on the engine's name only: adding or removing engines never moves the others
    (a moved engine would be followed twice, or resumed from a stale point). With few engines
    the split is only roughly even; an engine's ``shard`` setting pins it where it should go.
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: need 0 <= INDEX < COUNT")

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        if not sep or not _is_digits(index) or not _is_digits(count):
            raise ConfigError(f"--shard {text!r}: expected INDEX/COUNT, e.g. 0/2")
        return cls(int(index), int(count))

    def owns(self, engine: EngineConfig) -> bool:
        if engine.shard is not None:
            return engine.shard == self.index
        return zlib.crc32(engine.name.encode()) % self.count == self.index

    def select(self, engines: Iterable[EngineConfig]) -> list[EngineConfig]:
        """This shard's engines; the whole list when there is one shard, whatever the pins."""
        engines = list(engines)
        if self.count == 1:
            return engines
        for engine in engines:
            if engine.shard is not None and engine.shard >= self.count:
                raise ConfigError(
                    f"engine {engine.name!r} is pinned to shard {engine.shard}, "
                    f"but there are {self.count} shards"
                )
        return [engine for engine in engines if self.owns(engine)]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_engine_flag(text: str) -> EngineConfig:
    """``NAME=tcp://host:port[,replay=tcp://...][,topic=T][,dp=N][,shard=I][,key=K]`` (dp: ranks
    0..N-1; shard: the ``--shard`` index that follows it; key: its CURVE public key, a
    certificate file or the z85 key, which has no comma)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ConfigError(f"--engine {text!r}: expected NAME=ENDPOINT[,replay=...,topic=...,dp=N]")
    endpoint, *options = rest.split(",")
    settings: dict[str, str] = {}
    for option in options:
        label, sep, value = option.partition("=")
        if not sep or label not in _FLAG_OPTIONS:
            raise ConfigError(f"--engine {text!r}: unknown option {option!r}")
        settings[label] = value
    dp, shard, key = settings.get("dp"), settings.get("shard"), settings.get("key")
    where = f"--engine {text!r}"
    return EngineConfig(
        name=name,
        endpoint=endpoint,
        replay=settings.get("replay"),
        topic=settings.get("topic", ""),
        dp_ranks=None if dp is None else tuple(range(_integer(dp, f"{where}: dp", least=1))),
        shard=None if shard is None else _integer(shard, f"{where}: shard", least=0),
        public_key=None if key is None else _public_key(key, where, Path.cwd()),
    )


def parse_engine_flags(texts: Iterable[str]) -> list[EngineConfig]:
    return [parse_engine_flag(text) for text in texts if text.strip()]


def load_engines_file(path: Path) -> list[EngineConfig]:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from error
    except RecursionError as error:  # tomllib recurses into nested arrays and tables
        raise ConfigError(f"{path}: nested too deeply to read") from error
    entries = document.get("engines", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: 'engines' must be an array of tables ([[engines]])")
    return [_engine_from_table(path, index, entry) for index, entry in enumerate(entries)]


def check_unique(engines: list[EngineConfig]) -> list[EngineConfig]:
    """Names and worker ids must each be unique: a worker's records, tracking and resume point
    are keyed by its id, so two engines sharing one (``a`` with DP ranks and an ``a-dp1``, say)
    would corrupt each other's."""
    names = [engine.name for engine in engines]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"engine names must be unique: {', '.join(duplicates)}")
    clashes = _worker_clashes(engines)
    if clashes:
        raise ConfigError(f"worker ids must be unique: {'; '.join(clashes)}")
    return engines


def _worker_clashes(engines: list[EngineConfig]) -> list[str]:
    """Each worker id more than one engine gives, with those engines' names."""
    owners: dict[str, list[str]] = {}
    for engine in engines:
        for worker in engine.workers():
            owners.setdefault(worker.worker, []).append(engine.name)
    return sorted(
        f"{worker} (engines {', '.join(names)})"
        for worker, names in owners.items()
        if len(names) > 1
    )


def _engine_from_table(path: Path, index: int, entry: object) -> EngineConfig:
    where = f"{path}: engines[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table")
    known = {"name", "endpoint", "replay", "topic", "dp_ranks", "groups", "shard", "public_key"}
    unknown = set(entry) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    ranks = entry.get("dp_ranks")
    if ranks is not None and not (
        isinstance(ranks, list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
    ):
        raise ConfigError(f"{where}: dp_ranks must be a list of integers")
    shard = entry.get("shard")
    if shard is not None and (not isinstance(shard, int) or isinstance(shard, bool)):
        raise ConfigError(f"{where}: shard must be an integer")
    return EngineConfig(
        name=_string(entry, "name", where, required=True) or "",
        endpoint=_string(entry, "endpoint", where),
        replay=_string(entry, "replay", where),
        topic=_string(entry, "topic", where) or "",
        dp_ranks=None if ranks is None else tuple(ranks),
        groups=_groups(entry.get("groups", {}), where),
        shard=shard,
        public_key=_optional_key(entry, where, path.parent),
    )


def _optional_key(entry: dict[str, object], where: str, base: Path) -> bytes | None:
    spec = _string(entry, "public_key", where)
    return None if spec is None else _public_key(spec, f"{where}: public_key", base)


def _public_key(spec: str, where: str, base: Path) -> bytes:
    """A key or a certificate file; a relative path is relative to ``base``.

    ``producer.curve`` is imported here, not above: it needs zmq, which the bridge's pure core
    (and whatever reads its configuration) does not load otherwise.
    """
    from hmakv.producer.curve import CurveError, load_public_key

    path = base / spec
    try:
        return load_public_key(str(path) if path.is_file() else spec)
    except CurveError as error:
        raise ConfigError(f"{where}: {error}") from error


def _string(
    entry: dict[str, object], key: str, where: str, *, required: bool = False
) -> str | None:
    value = entry.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key} must be a string")
    return value


def _groups(table: object, where: str) -> dict[int, GroupSpec]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: groups must be a table of group index -> spec")
    groups = {}
    for key, spec in table.items():
        if not _is_digits(key) or int(key) > MAX_GROUP_IDX or not isinstance(spec, dict):
            raise ConfigError(
                f"{where}: groups.{key} must be a group index (at most {MAX_GROUP_IDX}) "
                "with a table"
            )
        unknown = sorted(set(spec) - set(GroupSpec.__struct_fields__))
        if unknown:  # a misspelt chunk_size would leave the consumer guessing the chunk
            allowed = ", ".join(GroupSpec.__struct_fields__)
            raise ConfigError(f"{where}: groups.{key}: unknown keys {unknown} (allowed: {allowed})")
        if spec.get("kind") not in GROUP_KINDS or not isinstance(spec.get("block_size"), int):
            raise ConfigError(f"{where}: groups.{key} needs a kind in {GROUP_KINDS} and block_size")
        try:
            # Converting checks what GroupSpec's annotations require: positive sizes, or a
            # hit rule would divide by zero or accept blocks the worker cannot have.
            groups[int(key)] = msgspec.convert(spec, GroupSpec)
        except msgspec.ValidationError as error:
            raise ConfigError(f"{where}: groups.{key}: {error}") from error
    return groups


def _integer(text: str, what: str, *, least: int) -> int:
    if not _is_digits(text) or int(text) < least:
        kind = "positive" if least == 1 else "non-negative"
        raise ConfigError(f"{what} must be a {kind} integer, not {text!r}")
    return int(text)


def _is_digits(text: str) -> bool:
    """What ``int`` reads: ``str.isdigit`` is also true of ``²`` and other non-ASCII digits."""
    return text.isascii() and text.isdigit()


def _tcp_addresses(endpoint: str) -> list[tuple[str, str]]:
    """The (host, port) pairs of a ``tcp://`` endpoint (``[source;]destination``, the
    destination last); none for other transports."""
    if not endpoint.startswith("tcp://"):
        return []
    parts = endpoint.removeprefix("tcp://").split(";")
    return [(host, port) for host, _, port in (part.rpartition(":") for part in parts)]
