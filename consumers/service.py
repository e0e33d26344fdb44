"""``hmakv index`` wired together: the follower, its snapshot store, the HTTP API and /metrics,
and the router port where one is configured.

The HTTP server starts before the follower restores its snapshot, so ``/healthz`` answers (and
``/readyz`` says 503) through a long restore instead of the process looking dead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from hmakv.consumers.api import ApiLimits, HashingDefaults, ScoreApi, build_app
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.router_port import RouterPort
from hmakv.consumers.snapshots import open_store
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.kafka_client import check_access
from hmakv.kvlog.web import serve

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8181


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``hmakv index`` is configured with; ``port=0`` picks a free port."""

    follower: FollowerConfig
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    snapshot_to: str = "kafka"
    hashing: HashingDefaults = field(default_factory=HashingDefaults)
    limits: ApiLimits = field(default_factory=ApiLimits)
    api_token: str | None = field(default=None, repr=False)  # never in a log line
    router_listen: tuple[str, int] | None = None  # the router port's host and port, if any


class IndexService:
    def __init__(self, config: ServiceConfig) -> None:
        follower_config = config.follower
        self.config = config
        self.follower = Follower(
            follower_config,
            open_store(
                config.snapshot_to,
                bootstrap=follower_config.bootstrap,
                topic=follower_config.topics.snapshots,
                follower_id=follower_config.follower_id,
                security=follower_config.security,
            ),
        )
        stats = ScoreStats()
        self.api = ScoreApi(
            self.follower,
            index_registry(self.follower, stats),
            stats,
            hashing=config.hashing,
            limits=config.limits,
        )
        self._app = build_app(self.api, token=config.api_token)
        self._runner: web.AppRunner | None = None
        self.router_port = (
            RouterPort(self.api, token=config.api_token) if config.router_listen else None
        )

    @property
    def url(self) -> str:
        """Where the API answers, once started."""
        assert self._runner is not None
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    @property
    def router_url(self) -> str:
        """Where the router port answers, once started."""
        assert self.router_port is not None
        host, port = self.router_port.address
        return f"http://{host}:{port}"

    async def start(self) -> None:
        idle = self.config.limits.idle_timeout
        self._runner = await serve(self._app, self.config.host, self.config.port, idle)
        if self.router_port is not None and self.config.router_listen is not None:
            await self.router_port.start(*self.config.router_listen)
            log.info("router port (/v1/score, /v1/routed) on %s", self.router_url)
        log.info(
            "index API on %s; snapshots: %s",
            self.url,
            self.follower.store.describe() if self.follower.store else "none",
        )
        # A refusal says why here, once; the follower's clients would only say "unreachable".
        await check_access(self.config.follower.bootstrap, self.config.follower.security)
        await self.follower.start()

    async def stop(self, *, final_snapshot: bool = True) -> None:
        try:
            await self.follower.stop(final_snapshot=final_snapshot)
        finally:
            if self.router_port is not None:
                await self.router_port.stop()
            if self._runner is not None:
                await self._runner.cleanup()

    async def run_until(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set (final snapshot) or the follower fails (no snapshot)."""
        following = asyncio.create_task(self._start_and_follow())
        stopping = asyncio.create_task(stop.wait())
        crashed = False
        try:
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            crashed = following.done()
            if crashed:
                following.result()
        finally:
            stopping.cancel()
            # Ends the wait in ``Follower.run`` only: its tasks (a periodic snapshot being
            # written among them) are left to ``stop``, which lets that snapshot finish first.
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await self.stop(final_snapshot=not crashed)

    async def _start_and_follow(self) -> None:
        """Returns only by raising: the follower runs until it is cancelled or fails."""
        await self.start()
        await self.follower.run()
