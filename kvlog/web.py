"""The HTTP side both services serve (the bridge's health and metrics, the index's API): how
an aiohttp app is served so that no caller can hold it up.

aiohttp's defaults leave three things open: an idle or half-sent connection is kept for an hour
(``keepalive_timeout``, 3630 s), a flood of requests queues without bound in front of the event
loop that also does the service's work, and every malformed request logs a traceback on
``aiohttp.server``. ``serve`` closes idle connections after ``idle_timeout`` (a request whose
headers never complete included), ``concurrency_gate`` answers 429 past ``max_concurrent``
requests in progress, except for probes and scrapes, and ``ServerLogFilter`` keeps one line of
each kind of ``aiohttp.server`` message per interval. A request aiohttp's parser refuses (not
HTTP at all, a broken header, a line too long) never reaches the app or its middlewares, and
aiohttp answers it in plain text; ``serve`` answers it with the apps' JSON body
``{"error": "..."}`` like every other error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection
from http import HTTPStatus

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from hmakv.kvlog.logs import Throttle

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
_SERVER_LOGGER = "aiohttp.server"


DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_MAX_CONCURRENT = 64


def concurrency_gate(
    max_concurrent: int,
    too_many: Callable[[str], web.Response],
    exempt: Collection[str] = PROBES,
) -> Middleware:
    """A middleware: past ``max_concurrent`` requests in progress, ``too_many(message)`` at once,
    with ``Retry-After``. Probes and scrapes (``exempt``) are neither refused nor counted: a
    liveness probe refused under load would have a busy process restarted."""
    in_progress = 0

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal in_progress
        if request.path in exempt:
            return await handler(request)
        if in_progress >= max_concurrent:
            response = too_many(f"{max_concurrent} requests in progress; retry shortly")
            response.headers["Retry-After"] = "1"
            return response
        in_progress += 1
        try:
            return await handler(request)
        finally:
            in_progress -= 1

    return gate


class ServerLogFilter(logging.Filter):
    """At most one record of each message per ``interval`` seconds, the next one saying how many
    were held back: anyone can send malformed requests, each of which aiohttp logs with its
    traceback."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._throttle = Throttle(interval, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        held = self._throttle.passes(str(record.msg))  # aiohttp's templates: a handful
        if held is None:
            return False
        if held:
            interval = self._throttle.interval
            record.msg = f"{record.msg} ({held} more like it in the last {interval:g} s)"
        return True


def quiet_server_log() -> None:
    """Put one ``ServerLogFilter`` on ``aiohttp.server`` (once per process)."""
    logger = logging.getLogger(_SERVER_LOGGER)
    if not any(isinstance(each, ServerLogFilter) for each in logger.filters):
        logger.addFilter(ServerLogFilter())


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses as JSON."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once a reply is out
        error = message if message and status != 500 else HTTPStatus(status).phrase
        response = web.json_response({"error": error}, status=status)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorRunner(web.AppRunner):
    """An ``AppRunner`` whose connections are ``_JsonErrorHandler``s: aiohttp has no public
    hook for the answer to a request its parser refused."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # the same server, one method different
        return server


async def serve(
    app: web.Application, host: str, port: int, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
) -> web.AppRunner:
    """Start serving ``app``, closing a connection that waits ``idle_timeout`` seconds for its
    next complete request head; the caller stops with ``runner.cleanup()``."""
    quiet_server_log()
    runner = _JsonErrorRunner(app, access_log=None, keepalive_timeout=idle_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
