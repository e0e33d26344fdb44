"""``/healthz``, ``/readyz`` and ``/metrics`` over aiohttp.

``/healthz`` answers while the process runs (a liveness probe restarts a hung bridge, nothing
else). ``/readyz`` answers 200 only while Kafka answers and every source is connected or has
explicitly failed (a bad endpoint will not get better by waiting), with the details as JSON, so
that "the bridge is up but forwards nothing" is visible to whoever deploys it. Served as the
index's API is (``kvlog.web.serve``): idle and half-sent connections closed after 10 s,
malformed requests logged once per 10 s. There is nothing to bound beyond that: every path is a
probe or a scrape, cheap and never refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


@dataclass(frozen=True)
class Readiness:
    started: bool  # resumed from the workers topic and every source created
    kafka_reachable: bool
    sources: dict[str, str]  # source name -> connecting | connected | failed

    @property
    def ready(self) -> bool:
        connecting = any(state == "connecting" for state in self.sources.values())
        return self.started and self.kafka_reachable and not connecting


def health_app(readiness: Callable[[], Readiness], registry: CollectorRegistry) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        state = readiness()
        body = {
            "ready": state.ready,
            "started": state.started,
            "kafka": state.kafka_reachable,
            "sources": state.sources,
        }
        return web.json_response(body, status=200 if state.ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
