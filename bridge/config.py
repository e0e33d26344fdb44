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
    groups = { 2 = { kind = "chunked_local_attention", block_size = 16, chunk_size = 8192 } }
"""

from __future__ import annotations

import tomllib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bridge.records import worker_id
from producer.events import GROUP_KINDS, GroupSpec
from producer.publisher import offset_endpoint_port

_FLAG_OPTIONS = ("replay", "topic", "dp", "shard")


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

    def __post_init__(self) -> None:
        try:
            worker_id(self.name, None)
        except ValueError as error:
            raise ConfigError(f"engine {self.name!r}: {error}") from error
        for endpoint in (self.endpoint, self.replay):
            if endpoint is not None and "://" not in endpoint:
                raise ConfigError(f"engine {self.name!r}: {endpoint!r} is not a ZMQ endpoint")
        if self.dp_ranks is not None and (not self.dp_ranks or min(self.dp_ranks) < 0):
            raise ConfigError(f"engine {self.name!r}: dp_ranks must be non-negative, not empty")
        try:
            self.workers()  # each DP rank's endpoints: vLLM offsets TCP ports by rank
        except ValueError as error:
            raise ConfigError(f"engine {self.name!r}: {error}") from error
        if self.shard is not None and self.shard < 0:
            raise ConfigError(f"engine {self.name!r}: shard must be non-negative")

    def workers(self) -> list[WorkerAddress]:
        """One worker per DP rank, with the endpoints vLLM gives that rank."""
        if self.dp_ranks is None:
            return [WorkerAddress(self.name, None, self.endpoint, self.replay)]
        return [
            WorkerAddress(
                worker_id(self.name, rank),
                rank,
                offset_endpoint_port(self.endpoint, rank),
                offset_endpoint_port(self.replay, rank),
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
        if not sep or not index.isdigit() or not count.isdigit():
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
    """``NAME=tcp://host:port[,replay=tcp://...][,topic=T][,dp=N][,shard=I]`` (dp: ranks
    0..N-1; shard: the ``--shard`` index that follows it)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ConfigError(f"--engine {text!r}: expected NAME=ENDPOINT[,replay=...,topic=...,dp=N]")
    endpoint, *options = rest.split(",")
    settings: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _FLAG_OPTIONS:
            raise ConfigError(f"--engine {text!r}: unknown option {option!r}")
        settings[key] = value
    dp, shard = settings.get("dp"), settings.get("shard")
    where = f"--engine {text!r}"
    return EngineConfig(
        name=name,
        endpoint=endpoint,
        replay=settings.get("replay"),
        topic=settings.get("topic", ""),
        dp_ranks=None if dp is None else tuple(range(_integer(dp, f"{where}: dp", least=1))),
        shard=None if shard is None else _integer(shard, f"{where}: shard", least=0),
    )


def parse_engine_flags(texts: Iterable[str]) -> list[EngineConfig]:
    return [parse_engine_flag(text) for text in texts if text.strip()]


def load_engines_file(path: Path) -> list[EngineConfig]:
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from error
    entries = document.get("engines", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: 'engines' must be an array of tables ([[engines]])")
    return [_engine_from_table(path, index, entry) for index, entry in enumerate(entries)]


def check_unique(engines: list[EngineConfig]) -> list[EngineConfig]:
    names = [engine.name for engine in engines]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"engine names must be unique: {', '.join(duplicates)}")
    return engines


def _engine_from_table(path: Path, index: int, entry: object) -> EngineConfig:
    where = f"{path}: engines[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table")
    unknown = set(entry) - {"name", "endpoint", "replay", "topic", "dp_ranks", "groups", "shard"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    ranks = entry.get("dp_ranks")
    if ranks is not None and not (
        isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)
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
    )


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
        if not key.isdigit() or not isinstance(spec, dict):
            raise ConfigError(f"{where}: groups.{key} must be a group index with a table")
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
    if not text.isdigit() or int(text) < least:
        kind = "positive" if least == 1 else "non-negative"
        raise ConfigError(f"{what} must be a {kind} integer, not {text!r}")
    return int(text)
