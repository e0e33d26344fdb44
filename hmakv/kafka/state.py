"""A broker that outlives the command that started it, and the file that remembers it.

``hmakv kafka start`` returns while the broker keeps running; ``status`` and ``stop`` are later,
separate processes. The state file is all they share, so it records everything needed to find,
stop and clean up the broker: its process group, address and data dir, and the broker process's
start time. The pid alone is not enough: once the broker is gone Linux may hand it to another
process, which may even lead a process group of its own, and ``stop`` must never signal that.
Records written before the start time was kept are checked by the broker's command line instead,
which names its address (Tansu) or its data dir (Apache).

``start`` and ``stop`` read the file, act, and write it: ``state_lock`` makes that one step, so
two concurrent starts cannot both find no broker and both start one, one of them unrecorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hmakv.kafka.jars import cache_dir
from hmakv.kafka.process import command_line, group_is_running, has_proc, start_time, stop_group

log = logging.getLogger(__name__)


class BrokerDist(StrEnum):
    """Which broker software: real Apache Kafka, or the memory-only Tansu."""

    APACHE = "apache"
    TANSU = "tansu"


def default_dist() -> BrokerDist:
    """``HMAKV_KAFKA_DIST``, else Tansu: it needs neither Java nor Maven and starts at once."""
    return BrokerDist(os.environ.get("HMAKV_KAFKA_DIST", BrokerDist.TANSU))


def state_file() -> Path:
    """One detached broker per cache dir; its record lives here."""
    return cache_dir() / "run" / "kafka.json"


class StateLockError(RuntimeError):
    """The state file's lock cannot be made or taken (an unwritable cache dir, say)."""


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Hold the exclusive lock on the state file (``kafka.lock`` beside it) while in the block.

    Waits for another holder, saying so, since an Apache start can hold it for minutes. An
    ``flock`` ends with its process, so a killed command never leaves the lock behind.
    """
    path = state_file().with_name("kafka.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.open("a")
    except OSError as error:
        raise StateLockError(f"cannot create the lock file {path}: {error}") from None
    with lock:
        _take(lock.fileno(), path)
        yield


def _take(fd: int, path: Path) -> None:
    """Lock ``fd`` exclusively, telling the user when it means waiting for another command."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for another `hmakv kafka start` or `stop` to finish (%s)", path)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as error:
        raise StateLockError(f"cannot lock {path}: {error}") from None


class StateFileError(ValueError):
    """The state file exists but is no broker record (empty, truncated, an older format).

    Not removed automatically: a broker it once described may still run, and only the user can
    tell; the message names the file and what to do.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"{path} is not a readable broker record ({reason}); stop any broker it may "
            f"describe by hand, then delete the file"
        )


@dataclass(frozen=True)
class DetachedBroker:
    """A running broker nobody holds a process handle for: stopped by its process group id."""

    pid: int
    dist: BrokerDist
    bootstrap: str
    data_dir: Path
    owns_data_dir: bool
    started: int | None = None  # the broker's start_time(); None in records from before it

    def is_running(self) -> bool:
        """Whether the recorded broker itself still runs, not a process that inherited its pid."""
        if not group_is_running(self.pid):
            return False
        if not has_proc():
            return True  # nothing to tell a pid's processes apart by: trust the group, as before
        if self.started is not None:
            return start_time(self.pid) == self.started
        command = command_line(self.pid) or ""
        return self.bootstrap in command or str(self.data_dir) in command

    def stop(self) -> None:
        """Stop the process group and remove the data dir if it was a temporary one."""
        stop_group(self.pid)
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def save(self, path: Path) -> None:
        """Write atomically, so a concurrent ``status`` never reads half a record."""
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.partial")
        staging.write_text(json.dumps(self._as_json(), indent=2) + "\n")
        staging.replace(path)

    @classmethod
    def load(cls, path: Path) -> DetachedBroker | None:
        """The recorded broker, or None when nothing was recorded; StateFileError if the file
        is there but cannot be read as a record."""
        try:
            fields = json.loads(path.read_text())
            started = fields.get("start_time")
            return cls(
                pid=int(fields["pid"]),
                dist=BrokerDist(fields["dist"]),
                bootstrap=str(fields["bootstrap"]),
                data_dir=Path(fields["data_dir"]),
                owns_data_dir=bool(fields["owns_data_dir"]),
                started=None if started is None else int(started),
            )
        except FileNotFoundError:
            return None
        except KeyError as missing:
            raise StateFileError(path, f"no {missing} field") from None
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise StateFileError(path, str(error) or type(error).__name__) from None

    def _as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "dist": str(self.dist),
            "bootstrap": self.bootstrap,
            "data_dir": str(self.data_dir),
            "owns_data_dir": self.owns_data_dir,
            "start_time": self.started,
        }
