"""``services.json``: where a running demo's services listen and which process each one is.

Written into the workdir once everything answers, so that whoever wants to look while the demo
runs (a Prometheus, curl, a test checking that nothing outlives the demo) need not parse output.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

SERVICES_FILE = "services.json"


class Services(msgspec.Struct, kw_only=True):
    kafka: str
    topic_prefix: str
    broker_pid: int | None
    bridge: str
    index: str
    engines: dict[str, str]
    pids: dict[str, int]

    def all_pids(self) -> list[int]:
        """Every process the demo started (each leads its own process group)."""
        started = list(self.pids.values())
        return started if self.broker_pid is None else [*started, self.broker_pid]


def write_services(workdir: Path, services: Services) -> None:
    """Atomically: a reader never sees half a file."""
    staging = workdir / f".{SERVICES_FILE}.partial"
    staging.write_bytes(msgspec.json.format(msgspec.json.encode(services), indent=2) + b"\n")
    staging.replace(workdir / SERVICES_FILE)


def read_services(workdir: Path) -> Services | None:
    """The running demo's services, or None before they are all up."""
    try:
        return msgspec.json.decode((workdir / SERVICES_FILE).read_bytes(), type=Services)
    except FileNotFoundError:
        return None
