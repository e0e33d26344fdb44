"""A broker that outlives the command that started it, and the file that remembers it.

``hmakv kafka start`` returns while the broker keeps running; ``status`` and ``stop`` are later,
separate processes. The state file is all they share, so it records everything needed to find,
stop and clean up the broker: its process group, address and data dir.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hmakv.kafka.jars import cache_dir
from hmakv.kafka.process import group_is_running, stop_group


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


@dataclass(frozen=True)
class DetachedBroker:
    """A running broker nobody holds a process handle for: stopped by its process group id."""

    pid: int
    dist: BrokerDist
    bootstrap: str
    data_dir: Path
    owns_data_dir: bool

    def is_running(self) -> bool:
        return group_is_running(self.pid)

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
        """The recorded broker, or None when nothing was recorded."""
        try:
            fields = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(
            pid=int(fields["pid"]),
            dist=BrokerDist(fields["dist"]),
            bootstrap=str(fields["bootstrap"]),
            data_dir=Path(fields["data_dir"]),
            owns_data_dir=bool(fields["owns_data_dir"]),
        )

    def _as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "dist": str(self.dist),
            "bootstrap": self.bootstrap,
            "data_dir": str(self.data_dir),
            "owns_data_dir": self.owns_data_dir,
        }
