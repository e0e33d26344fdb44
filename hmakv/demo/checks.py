"""The conditions the demo waits for, as polls: each answers True or False, never raises for a
service that is not there yet (that is what waiting is for)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hmakv.demo.client import Http, IndexClient, ServiceError
from hmakv.demo.monitor import BRIDGE
from hmakv.demo.promtext import MetricsPage

Check = Callable[[], Awaitable[bool]]


def answers(call: Callable[[], Awaitable[object]]) -> Check:
    async def check() -> bool:
        try:
            await call()
        except (ServiceError, OSError, TimeoutError):
            return False
        return True

    return check


def ready(http: Http, url: str) -> Check:
    async def check() -> bool:
        try:
            return await http.status_code(url) == 200
        except (ServiceError, OSError, TimeoutError):
            return False

    return check


def catalogs(index: IndexClient, names: set[str]) -> Check:
    async def check() -> bool:
        try:
            answer = await index.workers()
        except (ServiceError, OSError, TimeoutError):
            return False
        known = {view.worker for view in answer.workers if view.groups}
        return names <= known

    return check


def acknowledged(http: Http, bridge_url: str) -> Callable[[], Awaitable[dict[str, int]]]:
    """Each worker's last seq Kafka acknowledged, from the bridge's own gauge."""

    async def read() -> dict[str, int]:
        page = MetricsPage.parse(await http.text(f"{bridge_url}/metrics"))
        return {
            sample.labels["worker"]: int(sample.value)
            for sample in page.matching(f"{BRIDGE}_worker_last_seq")
            if "worker" in sample.labels
        }

    return read


def forwarded(http: Http, bridge_url: str, last_seqs: dict[str, int]) -> Check:
    read = acknowledged(http, bridge_url)

    async def check() -> bool:
        try:
            acknowledged = await read()
        except (ServiceError, OSError, TimeoutError):
            return False
        return all(acknowledged.get(name, -1) >= seq for name, seq in last_seqs.items())

    return check


def applied(index: IndexClient, last_seqs: dict[str, int]) -> Check:
    async def check() -> bool:
        try:
            answer = await index.workers()
        except (ServiceError, OSError, TimeoutError):
            return False
        applied = {view.worker: max(view.last_seq.values(), default=-1) for view in answer.workers}
        return answer.lag_records == 0 and all(
            applied.get(name, -1) >= seq for name, seq in last_seqs.items()
        )

    return check
